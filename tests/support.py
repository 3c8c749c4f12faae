"""Builders and checks that test modules share across subjects: tiny models and configs, a run's
logged losses, the scripts that record what ranks hold (reduce_ranks.py, gossip_ranks.py), saved
checkpoints, Hugging Face directories, corpora, the sample a run prints. A test module imports them
from here, never from another test module; conftest.py keeps the fixtures every test may use and
the launchers."""

import importlib
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from minimal_fsdp.__main__ import COMMANDS
from minimal_fsdp.checkpoint import checkpointer, safe_load
from minimal_fsdp.config.flags import one_line_errors, parse_args
from minimal_fsdp.config.parser import parse
from minimal_fsdp.hf import read
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.models.llama import LlamaConfig
from minimal_fsdp.parallel import gossip, plan
from minimal_fsdp.parallel.accum_adamw import AccumAdamW
from minimal_fsdp.parallel.gossip import exchange_for, exp_distances, mixing_matrix
from minimal_fsdp.parallel.parallelize import init_weights

import reference as plain
import tokenizer_dirs
from conftest import ROOT, TINY_MODEL, make_text, mpiexec


def _transformers():
    """transformers, imported where a Hugging Face builder runs (the modules that use one skip
    themselves without it), its logging quiet."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


# --- plans ---
CONFIG = GPTConfig(vocab_size=64, seq_length=16, num_layers=3, num_heads=2, embed_size=16)


NUM_PARAMS = GPT(CONFIG).num_params(non_embedding=False)


def plain_plan(**fields):
    base = dict(
        strategy="fsdp-block",
        sharding="full-shard",
        mesh_shape=(2,),
        shard_ranks=2,
        reshard_after_forward=True,
        precision="bf16",
        fp8=None,
        cpu_offload=False,
        meta_init=False,
        activation_checkpoints=False,
        recompute="full",
        compile=False,
        cuda_graphs=False,
        num_params=NUM_PARAMS,
    )
    # an fp8 plan's blocks are float8 unless the fields say otherwise (--fp8_layers all)
    base.update({"fp8_blocks": bool(fields.get("fp8")), **fields})
    return plan.ParallelPlan(**base)


# --- strategies against the reference; reduced gradients ---
STEPS = 6


def run_dirs(work):
    """A run's data, logs and checkpoints in folders of `work`, as training flags."""
    return [
        "--data_dir",
        work / "data",
        "--log_dir",
        work / "logs",
        "--checkpoint_dir",
        work / "checkpoints",
    ]


def train_args(corpus, run_name, extra=()):
    work = corpus.parent
    return [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *run_dirs(work),
        *TINY_MODEL,
        "--max_steps",
        STEPS,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--run_name",
        run_name,
        "--lr",
        "3e-3",
        "--warmup_steps",
        2,
        "--dropout",
        "0.0",
        *extra,
    ]


def reference(args, world, device="cpu", steps=STEPS):
    """The same training in one process, plain PyTorch (reference.py): whole model, all ranks'
    batches concatenated. Initial weights are drawn on `device` (CPU and CUDA generators differ), so
    compare on the same kind."""
    _, _, model, losses = plain.train(args, world, device, steps)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def logged_rows(work, run_name):
    """Every row of a run's metrics.jsonl under work/logs (the jobs of a resumed run append to one
    file)."""
    path = Path(work) / "logs" / run_name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_losses(cwd, run_name):
    return [r["loss"] for r in logged_rows(cwd, run_name) if "loss" in r]


def host_run_args(work, run_name, steps, *extra, eval_interval=None):
    """The tiny run the tests on virtual hosts train (test_multihost.py, test_slurm.py): on
    work/corpus.txt, its folders in `work`, evaluated at its last step unless eval_interval says."""
    return [
        "--dataset",
        "text",
        "--input_file",
        work / "corpus.txt",
        *run_dirs(work),
        *TINY_MODEL,
        "--max_steps",
        steps,
        "--log_interval",
        1,
        "--eval_interval",
        steps if eval_interval is None else eval_interval,
        "--run_name",
        run_name,
        "--lr",
        "3e-3",
        "--warmup_steps",
        2,
        "--dropout",
        "0.0",
        *extra,
    ]


def chain_flags(corpus, steps, *extra):
    """The run the job chains train (test_job_chain.py's SLURM ones, test_pbs_chain.py's PBS
    ones): the tiny model with dropout, `steps` steps, each logged, named chain; `extra` after the
    steps."""
    return [
        "--dataset",
        "text",
        "--input_file",
        str(corpus),
        *TINY_MODEL,
        "--dropout",
        "0.1",
        "--warmup_steps",
        "1",
        "--max_steps",
        str(steps),
        *extra,
        "--eval_interval",
        "0",
        "--log_interval",
        "1",
        "--run_name",
        "chain",
        "--no-tensorboard",
    ]


def trained_in_one_launch(tmp_path_factory, flags_of, corpus_name="corpus.txt", ranks=2):
    """A job chain's reference: the run of `flags_of(corpus)` trained in one launch of `ranks`
    ranks, in a folder of its own (returned), on the test corpus written as `corpus_name`."""
    from conftest import launch

    work = tmp_path_factory.mktemp("straight")
    (work / corpus_name).write_text(make_text())
    launch(flags_of(work / corpus_name), ranks=ranks, cwd=work)
    return work


def run_reduce_ranks(out, ranks):
    """What reduce_ranks.py records on each of `ranks` ranks: each strategy's gradients, reduced in
    fp32 and bf16."""
    cmd = [
        mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        str(ROOT / "tests" / "reduce_ranks.py"),
        str(out),
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(ranks)]


REDUCE_CASES = {
    "full-shard": "fsdp-block",
    "grad-shard": "fsdp-block",
    "hybrid-full-shard": "fsdp-block",
    "full-shard-bf16": "fsdp-block",
    "one-unit": "one-unit",
    "one-unit-hybrid": "one-unit",
    "one-unit-no-shard": "one-unit",
    "ddp": "ddp",
}


def check_reduce_precision(runs, case):
    assert all(
        run[reduce]["strategy"] == REDUCE_CASES[case]
        for run in runs
        for reduce in ("float32", "bf16")
    )
    for reduce in ("float32", "bf16"):
        assert all(run[reduce]["grads"] == runs[0][reduce]["grads"] for run in runs), reduce
    fp32, bf16 = (
        {name: torch.tensor(g) for name, g in runs[0][reduce]["grads"].items()}
        for reduce in ("float32", "bf16")
    )
    assert all(torch.equal(g, g.bfloat16().float()) for g in bf16.values())
    assert not all(torch.equal(g, g.bfloat16().float()) for g in fp32.values())
    for name, exact in fp32.items():  # measured: at most 0.0093 of the largest gradient
        torch.testing.assert_close(
            bf16[name], exact, rtol=0, atol=2**-5 * exact.abs().max().item(), msg=name
        )


# --- gossip ---
def period(topology, world):
    """Steps after which a topology's sequence of mixing matrices repeats."""
    exp = max(1, len(exp_distances(world)))
    return {"exp": exp, "alternating-exp-ring": 2 * exp}.get(topology, 1)


def predicted_rate(topology, world, lr):
    """Per-step contraction of the distance to consensus for x <- W_t x - lr (x - b): the spectral
    radius of the period's product of (W_t - lr I) on the space orthogonal to consensus, to the
    power 1/period."""
    p = period(topology, world)
    eye = torch.eye(world, dtype=torch.float64)
    product = eye
    for step in range(p):
        product = (mixing_matrix(topology, world, step) - lr * eye) @ product
    off_consensus = eye - torch.full((world, world), 1 / world, dtype=torch.float64)
    radius = torch.linalg.eigvals(product @ off_consensus).abs().max().item()
    return radius ** (1 / p), p


def run_gossip_ranks(ranks, out):
    """tests/gossip_ranks.py on `ranks` MPI ranks; returns its JSON result."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [
        mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        str(ROOT / "tests" / "gossip_ranks.py"),
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


def check_mixing(ranks_result, topology):
    world = ranks_result["world"]
    run = ranks_result["mixing"][topology]
    for step, record in enumerate(run["steps"]):
        before = torch.tensor(record["before"], dtype=torch.float64)
        after = torch.tensor(record["after"], dtype=torch.float64)
        torch.testing.assert_close(
            after, mixing_matrix(topology, world, step) @ before, atol=1e-6, rtol=1e-6
        )
        # average kept
        torch.testing.assert_close(after.mean(0), before.mean(0), atol=1e-6, rtol=1e-6)
        if topology == "complete":  # exactly the network average on every rank
            torch.testing.assert_close(after, before.mean(0).expand_as(after), atol=1e-6, rtol=1e-6)
        consensus = (after - after.mean(0)).square().sum(1).mean().item()
        assert record["consensus"] == pytest.approx(consensus, rel=1e-4, abs=1e-9)
    # One fp32 message per peer per step: what a rank sent over the run.
    nbytes = run["numel"] * 4
    expected = (
        sum(len(exchange_for(topology, 0, world, s).send_to) for s in range(len(run["steps"])))
        * nbytes
    )
    if topology == "complete":
        expected = len(run["steps"]) * round(2 * (world - 1) / world * nbytes)
    assert run["bytes_sent"] == expected


def check_quadratic(ranks_result, topology):
    world, lr = ranks_result["world"], ranks_result["lr"]
    distances = ranks_result["quadratic"][topology]
    rate, p = predicted_rate(topology, world, lr)
    assert 0 < rate < 1
    measured = (distances[-1] / distances[-1 - p]) ** (1 / (2 * p))  # distances are squared norms
    assert measured == pytest.approx(rate, rel=0.02), (distances, rate)
    assert distances[-1] < 1e-6 * distances[0]


# --- decentralized training ---
DECENTRALIZED = ["--data_parallel", "decentralized", "--topology", "alternating-exp-ring"]


def alternating_exp_ring(world, step):
    """W_t of --topology alternating-exp-ring, from gossip.py's docstring: even steps are exp steps
    (x_i <- (x_i + x_{i-d}) / 2, d = 2^(t/2 mod ceil(log2 n))), odd steps ring steps (x_i <- mean of
    x_{i-1}, x_i, x_{i+1})."""
    w = torch.zeros(world, world)
    for i in range(world):
        if step % 2 == 0:
            d = 2 ** (step // 2 % math.ceil(math.log2(world)))
            w[i, i] += 0.5
            w[i, (i - d) % world] += 0.5
        else:
            for j in (i - 1, i, i + 1):
                w[i, j % world] += 1 / 3
    return w


def decentralized_reference(args, world, steps, hosts=None):
    """Decentralized training on stacked replicas in one process: each replica's gradient at x^t on
    its rank's batch, then X <- W_t X, then each replica's clipped AccumAdamW step (the optimizer
    test_accum_adamw checks against torch's AdamW). hosts: each host's ranks, for host-aware
    gossip's W_t (default: every rank its own peer, the topology over the ranks). Returns each
    step's (mean loss, consensus distance) and the final replicas."""
    cfg = parse_args([str(a) for a in args])
    data = plain.PreparedTokens(cfg.data_dir)
    replicas = [plain.build(cfg, data.vocab_size, "cpu") for _ in range(world)]
    optimizers = [
        AccumAdamW(
            plain.param_groups(m, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, 0.98),
            accum_steps=cfg.accum_steps,
        )
        for m in replicas
    ]
    lr = plain.schedule(cfg, plain.run_length(cfg, world, len(data.tokens["train"])))

    def stacked():  # one row per replica: its parameters, flattened
        return torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()) for m in replicas])

    rows = []
    for step in range(steps):
        losses = []
        for rank, model in enumerate(replicas):
            loss = model(
                *data.batch("train", step, rank, world, cfg.batch_size, cfg.seq_length, cfg.seed)
            )
            loss.backward()
            losses.append(loss.item())
        with torch.no_grad():
            w = (
                alternating_exp_ring(world, step)
                if hosts is None
                else gossip.rank_mixing_matrix("alternating-exp-ring", hosts, step).float()
            )
            for model, mixed in zip(replicas, w @ stacked()):
                torch.nn.utils.vector_to_parameters(mixed, model.parameters())
        for model, optimizer in zip(replicas, optimizers):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = lr(step)
            optimizer.step()
            optimizer.zero_grad()
        x = stacked().detach()
        rows.append((sum(losses) / world, (x - x.mean(dim=0)).square().sum(dim=1).mean().item()))
    return rows, [{k: v.detach() for k, v in m.state_dict().items()} for m in replicas]


# --- float8 ---
EMULATED = ROOT / "tests" / "fp8_emulated.py"


def losses_of(work, run_name):
    rows = [
        json.loads(line)
        for line in (work / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def check_close_to_bf16(fp8_losses, bf16_losses, first=5e-3, every=3e-2):
    """FP8 tolerance: the first step's loss (forward alone) within `first`, every later one (the
    trajectory, through the float8 gradients) within `every`, relative; and not identical (float8
    did run)."""
    steps = sorted(bf16_losses)
    assert sorted(fp8_losses) == steps
    assert fp8_losses[steps[0]] == pytest.approx(bf16_losses[steps[0]], rel=first)
    assert [fp8_losses[s] for s in steps] == pytest.approx(
        [bf16_losses[s] for s in steps], rel=every
    ), (fp8_losses, bf16_losses)
    assert fp8_losses != bf16_losses and fp8_losses[steps[-1]] < 0.9 * fp8_losses[steps[0]]


# --- checkpoints ---
TINY = GPTConfig(vocab_size=8, seq_length=4, num_layers=2, num_heads=1, embed_size=4)


def tiny(seed=0):
    """A two-block GPT (a model meta.json can describe) and an AdamW that has taken one step (so it
    has moments), both seeded."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    sum((p * torch.randn_like(p)).sum() for p in model.parameters()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def weights(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def moments(optimizer):
    return [state["exp_avg"].clone() for state in optimizer.state.values()]


def save_three(root):
    """A run with steps 1..3 (val losses 3, 2, none), a tokenizer file in each: (run, its weights,
    tokenizer)."""
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    (tokenizer / "vocab.txt").write_text("not a tokenizer.* file: not copied")
    model, optimizer = tiny()
    for step, val_loss in [(1, 3.0), (2, 2.0), (3, None)]:
        state = {
            "schedule": {"lr_decay_steps": 10, "last_step": 100 if step == 3 else None},
            "data": {"train_blocks_seen": 4 * step},
        }
        checkpointer.save(
            root / "run",
            step,
            model,
            optimizer,
            {
                "format": 2,
                "val_loss": val_loss,
                "state": state,
                "model_type": "gpt",
                "model": TINY.to_dict(),
                "config": {"batch_size": 4},
            },
            tokenizer_dir=tokenizer,
        )
    return root / "run", weights(model), tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory, one_rank_group):
    """save_three's run, saved once; tests that damage it copy it first (run)."""
    return save_three(tmp_path_factory.mktemp("saved"))


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "run")
    return tmp_path / "run"


def meta_of(path):
    return json.loads((Path(path) / "meta.json").read_text())


def flip_a_byte(file, at=-1):
    data = bytearray(Path(file).read_bytes())
    data[at] ^= 0xFF
    Path(file).write_bytes(bytes(data))


def recompute_checksums(step):
    """What a forger does: meta.json's sizes and CRC-32s made to match the files as they are now."""
    meta = meta_of(step)
    for name in meta["files"]:
        data = (step / name).read_bytes()
        meta["files"][name] = [len(data), zlib.crc32(data)]
    (step / "meta.json").write_text(json.dumps(meta))


def scramble_a_tensor(step):
    """Random bytes over the start of one tensor's record in the shard: no check before loading can
    tell."""
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn == "model.wte.weight")
    info = metadata.storage_data[index]
    data = bytearray((step / info.relative_path).read_bytes())
    data[info.offset : info.offset + 64] = os.urandom(64)
    (step / info.relative_path).write_bytes(bytes(data))
    recompute_checksums(step)


class Console(io.StringIO):
    """A stream that remembers what had been flushed to it: a message that is not flushed can sit in
    a buffer while the process hangs or dies."""

    flushed = ""

    def flush(self):
        self.flushed = self.getvalue()


@pytest.fixture
def console(monkeypatch):
    """Call it in the test's body (pytest sets its own sys.stdout and sys.stderr for each phase of a
    test)."""

    def install():
        out, err = Console(), Console()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        return out, err

    return install


class MakeDirectory:
    """A pickle that, if unpickled by plain pickle, creates a directory: evidence that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def state_of(model, optimizer):
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


# --- meta.json ---
def edited(path, edit):
    meta = meta_of(path)
    edit(meta)
    (Path(path) / "meta.json").write_text(json.dumps(meta))


# The hostile edits of a saved meta.json (each was a traceback or a hang), and what verify
# says of each.
HOSTILE_META = {
    "no config": (lambda m: m.pop("config"), "meta.json has no config"),
    "no model": (lambda m: m.pop("model"), "meta.json has no model"),
    "state a string": (lambda m: m.update(state="x"), 'meta.json: state is "x", not an object'),
    "step a string": (
        lambda m: m.update(step="3"),
        'meta.json: step is "3", not a whole number >= 0',
    ),
    "val_loss a string": (
        lambda m: m.update(val_loss="low"),
        'meta.json: val_loss is "low", not a number or null',
    ),
    "position a string": (
        lambda m: m["state"]["data"].update(train_blocks_seen="12"),
        'meta.json: state.data.train_blocks_seen is "12", not a whole number >= 0',
    ),
    "position negative": (
        lambda m: m["state"]["data"].update(train_blocks_seen=-1),
        "meta.json: state.data.train_blocks_seen is -1, not a whole number >= 0",
    ),
    "stream of strings": (
        lambda m: m["state"].update(data={"stream": [["a", 0, 0]]}),
        "meta.json: state.data.stream is not a list of [file, document, token] positions",
    ),
    "config a list": (lambda m: m.update(config=[1]), "meta.json: config is [1], not an object"),
    "schedule a number": (
        lambda m: m["state"].update(schedule=5),
        "meta.json: state.schedule is 5, not an object",
    ),
    "files entry short": (
        lambda m: m["files"].update({"rng_0.pt": [5]}),
        'meta.json: files.rng_0.pt is [5], not [size, CRC-32]',
    ),
    "files entry a device": (
        lambda m: m["files"].update({"/dev/zero": [5, 1]}),
        'meta.json: files names "/dev/zero", not a plain file name inside the checkpoint',
    ),
    "files entry outside": (
        lambda m: m["files"].update({"../step_2/meta.json": [5, 1]}),
        'meta.json: files names "../step_2/meta.json", not a plain file name inside the checkpoint',
    ),
    "absurd layers": (
        lambda m: m["model"].update(num_layers=10**9),
        "meta.json: model.num_layers is 1000000000, not a whole number in [1, 4096]",
    ),
    "layers the shards lack": (
        lambda m: m["model"].update(num_layers=300),
        "meta.json describes 300 layers, the shards hold 2",
    ),
    "another width": (
        lambda m: m["model"].update(embed_size=8, num_heads=2),
        "meta.json's model gives wte.weight the shape [8, 8], the shards hold [8, 4]",
    ),
    "zero heads": (
        lambda m: m["model"].update(num_heads=0),
        "meta.json: model.num_heads is 0, not a whole number in [1, 4096]",
    ),
    "heads not dividing": (
        lambda m: m["model"].update(num_heads=3),
        "meta.json: model: embed size 4 is not divisible by 3 heads",
    ),
    "unknown model field": (
        lambda m: m["model"].update(colour=1),
        "meta.json: model.colour is not a field of a gpt model",
    ),
    "model type": (
        lambda m: m.update(model_type="bert"),
        'meta.json: model_type is "bert", not one of gpt, llama, qwen2',
    ),
    "model type a list": (
        lambda m: m.update(model_type=["gpt"]),
        'meta.json: model_type is ["gpt"], not one of gpt, llama, qwen2',
    ),
    "format": (
        lambda m: m.update(format=7),
        "meta.json: format 7 is not one this version reads (1 or 2)",
    ),
    "world size": (
        lambda m: m.update(world_size=10**9),
        "meta.json: world_size is 1000000000, not a whole number in [1, 16777216]",
    ),
}


# --- flags ---
def one_error_line(capsys, call, *args):
    """Bad input as the user sees it (flags.one_line_errors): exit code 2 and one `error:` line on
    stderr."""
    with pytest.raises(SystemExit) as exited:
        one_line_errors(call)(*args)
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def named(line, word):
    """`line` names `word` (a flag, a file's section.key, a package) as a whole word:
    --lr_decay_steps does not name --lr."""
    return re.search(rf"(?<![\w-]){re.escape(str(word))}(?![\w-])", line) is not None


def names(line, *words):
    missing = [w for w in words if not named(line, w)]
    assert not missing, f"{line!r} does not name {missing}"
    return line


def refused(capsys, argv, *words):
    """parse_args(argv) is bad input, in one line naming each of `words`."""
    return names(one_error_line(capsys, parse_args, [str(a) for a in argv]), *words)


# --- documents ---
def make_documents(count=200, seed=0):
    rng = random.Random(seed)
    return [make_text(rng.randint(100, 600), seed=seed * 10_000 + i) for i in range(count)]


def write_jsonl(directory, documents, files=2):
    """The documents over `files` .jsonl files (file names sort in document order), blank lines
    between some."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(documents) // files)
    for f in range(files):
        lines = [
            json.dumps({"text": text}) + ("\n\n" if i % 7 == 0 else "\n")
            for i, text in enumerate(documents[f * per_file : (f + 1) * per_file])
        ]
        (directory / f"part{f}.jsonl").write_text("".join(lines))
    return directory


def command(name, *argv, one_line=True):
    """`minimal-fsdp NAME ARGV...` in this process, as minimal_fsdp.__main__ runs it: the flags
    parsed once, then the main of the command's module in commands/, whose return value comes
    back. Bad input ends it with one `error:` line and exit 2, or with one_line=False is raised
    (ConfigError)."""
    flags, module, _ = COMMANDS[name]
    main = importlib.import_module(module).main

    def run():
        return main(parse(flags, [str(a) for a in argv], f"minimal-fsdp {name}"))

    return one_line_errors(run)() if one_line else run()


def run_cli(*args, num_proc=1):
    return command("prepare", *args, "--num_proc", num_proc)


# --- Hugging Face models ---
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
    "rope_theta": 500000.0,
}


def hf_gpt2(directory, **kw):
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **dict(dict(n_layer=2, n_head=4, n_embd=32, n_positions=24, vocab_size=53), **kw)
    )
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    return model.eval()


def hf_llama(directory, **kw):
    transformers = _transformers()
    torch.manual_seed(0)
    fields = dict(
        hidden_size=48,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=53,
        max_position_embeddings=24,
        rms_norm_eps=1e-5,
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(fields, **kw)))
    model.save_pretrained(directory)
    return model.eval()


def ours_from(directory, seq_length=None):
    model_type, config = read.read_config(directory, seq_length)
    model = MODELS[model_type](config).eval()
    read.load_weights(model, directory, model_type)
    return model


@torch.no_grad()
def assert_same_logits(ours, theirs, vocab_size, length):
    idx = torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    expected = theirs(idx).logits
    # ours: last position only
    got = torch.stack([ours(idx[:, :t]) for t in range(1, length + 1)], dim=1)
    assert (got - expected).abs().max().item() < 1e-4
    loss = torch.nn.functional.cross_entropy(
        expected[:, :-1].reshape(-1, vocab_size), idx[:, 1:].reshape(-1)
    )
    assert ours(idx[:, :-1], idx[:, 1:]).item() == pytest.approx(loss.item(), abs=1e-5)


HF_GPT = GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32)


HF_LLAMA = LlamaConfig(
    vocab_size=53,
    seq_length=24,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    embed_size=48,
    intermediate_size=72,
)


def gpt2_config(**kw):
    transformers = _transformers()
    return transformers.GPT2Config(
        **dict(dict(n_layer=2, n_head=4, n_embd=32, n_positions=24, vocab_size=53), **kw)
    )


def llama_config(**kw):
    transformers = _transformers()
    return transformers.LlamaConfig(
        **dict(
            dict(
                hidden_size=48,
                intermediate_size=72,
                num_hidden_layers=2,
                num_attention_heads=6,
                num_key_value_heads=2,
                vocab_size=53,
                max_position_embeddings=24,
            ),
            **kw,
        )
    )


def save_config(directory, config_dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict))
    return directory


def ours(model_type, config=None, seed=0):
    model = MODELS[model_type](config or {"gpt": HF_GPT, "llama": HF_LLAMA}[model_type]).eval()
    init_weights(model, seed, torch.device("cpu"))
    return model


def bare(model_type):
    """The fields without which there is no model: transformers' defaults fill in the rest."""
    if model_type == "gpt2":
        return {
            "model_type": "gpt2",
            "vocab_size": 53,
            "n_positions": 24,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
        }
    return {
        "model_type": "llama",
        "vocab_size": 53,
        "max_position_embeddings": 24,
        "hidden_size": 48,
        "intermediate_size": 72,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
    }


# --- Hugging Face configs ---
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


# --- document masks ---
def spans(ends, T=30):
    """(start, stop) of each document of a window whose end-of-text tokens are at `ends`."""
    starts = [0] + [e + 1 for e in ends]
    return [(a, b) for a, b in zip(starts, [e + 1 for e in ends] + [T]) if a < b]


def documents(path, n=300):
    """A .jsonl corpus of short documents (a few BPE tokens to a few dozen): several per 32-token
    window."""
    text = tokenizer_dirs.training_text().split("\n\n")
    path.write_text("".join(json.dumps({"text": t.strip()}) + "\n" for t in text[:n] if t.strip()))
    return path


def reference_losses(args, world, eot, steps):
    """tests/reference.py's single-process training, its loss summed over every document of each
    window run alone (the plain model knows no document masks)."""
    cfg = plain.parse_args([str(a) for a in args])
    data = plain.PreparedTokens(cfg.data_dir)
    model = plain.build(cfg, data.vocab_size, torch.device("cpu"))
    optimizer = plain.adamw(model, cfg)
    lr = plain.schedule(cfg, cfg.max_steps)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        x, y = data.global_batch("train", step, world, cfg.batch_size, cfg.seq_length, cfg.seed)
        total = 0
        for row in range(x.size(0)):
            ends = (x[row] == eot).nonzero().flatten().tolist()
            for start, stop in spans(ends, cfg.seq_length):
                total = total + model(
                    x[row : row + 1, start:stop], y[row : row + 1, start:stop]
                ) * (stop - start)
        loss = total / x.numel()
        loss.backward()
        plain.apply_gradients(model, optimizer, cfg)
        losses.append(loss.item())
    return losses


# --- job scripts' variables ---
def kubelet_expand(text, pod_env):
    """$(NAME) -> the pod's variable; kubelet leaves a reference to an unset variable as it is."""
    return re.sub(r"\$\((\w+)\)", lambda m: pod_env.get(m[1], m[0]), text)


def envsubst(text, values):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], ""), text)


# --- samples ---
SAMPLE = "-" * 40


def sample_of(stdout):
    return stdout.split(SAMPLE + "\n", 1)[1].rsplit("\n" + SAMPLE, 1)[0]


def sample_of_each(stdout):
    """Every sample in a launch's stdout, in order: several runs of one launch
    (conftest.launch_runs) print one each. A sample is the lines between a pair of SAMPLE lines (its
    text holds no such line: no '-' in the tiny corpus)."""
    lines = stdout.split("\n")
    marks = [i for i, line in enumerate(lines) if line == SAMPLE]
    assert len(marks) % 2 == 0, stdout[-3000:]
    return ["\n".join(lines[a + 1 : b]) for a, b in zip(marks[::2], marks[1::2])]

"""--device xla (xla.py): the tiny GPT and Llama trained by torch_xla SPMD (FSDPv2) on 4 XLA:CPU
devices match one CPU rank of the ordinary path; checkpoints move between XLA and CPU runs both
ways; generation from them; the flag's errors. Runs where torch_xla is installed
(docs/parallelism.md: torch 2.9 + torch_xla 2.9); the config checks, and the run's wiring under a
stand-in torch_xla (fake_torch_xla.py: one device, the CPU), run everywhere."""

import dataclasses
import importlib.util
import io
import json
import os
import pickle
import shutil
import sys

import pytest
import torch

from minimal_fsdp.backends import default
from minimal_fsdp.checkpoint.safe_load import tensor_names
from minimal_fsdp.config.checks import validate_world
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.config.sections import Backend, Checkpoint, Optimizer
from minimal_fsdp.launch.environment import DistEnv
from minimal_fsdp.models.gpt import GPTConfig
from minimal_fsdp.parallel.plan import make_plan

import fake_torch_xla
from conftest import ROOT, TINY_MODEL, launch, launch_runs, make_text
from support import sample_of, sample_of_each

no_torch_xla = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla"
)
# One process drives 4 virtual XLA:CPU devices; mpiexec -n 1 also takes the MPI discovery path.
XLA = dict(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="2")
DEVICES = 4
MODELS = {
    "gpt": [],
    # grouped-query attention, and an MLP of 51 rows: uneven over 4 devices
    "llama": ["--model", "llama", "--num_heads", 4, "--num_kv_heads", 2, "--intermediate_size", 51],
}


def run_args(corpus, model, steps, *extra):
    return [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        *MODELS[model],
        "--max_steps",
        steps,
        "--lr_decay_steps",
        20,
        "--warmup_steps",
        5,
        "--log_interval",
        1,
        "--eval_interval",
        10,
        "--no-tensorboard",
        *extra,
    ]


def train_xla(args, cwd, batch_size=2):
    """--batch_size per device: 4 x 2 rows are exactly the 8 rows of one CPU rank with --batch_size
    8."""
    return launch([*args, "--device", "xla", "--batch_size", batch_size], ranks=1, cwd=cwd, env=XLA)


def train_cpu(args, cwd):
    return launch([*args, "--batch_size", 2 * DEVICES], ranks=1, cwd=cwd)


def logged(cwd, key):
    """{step: value} of one metric in the run's metrics.jsonl."""
    rows = [
        json.loads(line)
        for line in (cwd / "logs" / "corpus" / "metrics.jsonl").read_text().splitlines()
    ]
    return {row["step"]: row[key] for row in rows if key in row}


def assert_same_run(run, reference, steps):
    for key in ("loss", "grad_norm", "val_loss"):
        ours, theirs = logged(run, key), logged(reference, key)
        wanted = [step for step in theirs if step in steps]
        assert wanted and [ours[s] for s in wanted] == pytest.approx(
            [theirs[s] for s in wanted], rel=1e-5, abs=1e-6
        ), key


@pytest.mark.xla
@no_torch_xla
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_fsdpv2_on_4_devices_matches_one_cpu_rank(tmp_path, corpus, model):
    # Llama also recomputes its blocks (torch_xla's activation checkpointing): the same numbers. Its
    # --seed -1 is one torch_xla's RNG takes only wrapped into [0, 2**64) (parallelize.seed64).
    seed = ["--seed", -1] if model == "llama" else []
    extra = ["--activation_checkpoints"] if model == "llama" else []
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    xla.mkdir(), cpu.mkdir()
    out = train_xla(run_args(corpus, model, 20, *seed, *extra), xla)
    train_cpu(run_args(corpus, model, 20, *seed), cpu)
    assert "mesh fsdp=4 (FSDPv2)" in out.stdout
    # 20 x 4 devices x 2 rows x 32 tokens
    assert "this launch trained 20 steps (5,120 tokens)" in out.stdout
    assert_same_run(xla, cpu, range(1, 21))
    assert logged(cpu, "loss")[20] < logged(cpu, "loss")[1]


@pytest.mark.xla
@no_torch_xla
def test_checkpoints_move_between_xla_and_cpu_and_generate(tmp_path, corpus):
    dirs = {name: tmp_path / name for name in ("cpu", "xla", "xla_then_cpu", "cpu_then_xla")}
    for d in dirs.values():
        d.mkdir()
    args = lambda steps, *extra: run_args(corpus, "gpt", steps, "--num_tokens", 0, *extra)  # noqa: E731
    train_cpu(args(20), dirs["cpu"])  # the reference: 20 steps at once
    # XLA: 10 steps, then resumed to 20 from its own checkpoint.
    train_xla(args(10), dirs["xla"])
    shutil.copytree(dirs["xla"] / "checkpoints", dirs["xla_then_cpu"] / "checkpoints")
    sample = ["--num_tokens", 40, "--prompt", "KING:"]  # --seed would change the data order too
    resumed = train_xla(args(20, *sample), dirs["xla"])
    assert "resuming from checkpoints/corpus/step_10" in resumed.stdout
    assert_same_run(dirs["xla"], dirs["cpu"], range(1, 21))
    # A CPU run resumes the XLA checkpoint (weights, AdamW moments, data position, LR horizon) ...
    train_cpu(args(20), dirs["xla_then_cpu"])
    assert_same_run(dirs["xla_then_cpu"], dirs["cpu"], range(11, 21))
    # ... and an XLA run resumes a CPU one.
    train_cpu(args(10), dirs["cpu_then_xla"])
    train_xla(args(20), dirs["cpu_then_xla"])
    assert_same_run(dirs["cpu_then_xla"], dirs["cpu"], range(11, 21))

    # The XLA run's sample (generated on the host from its last checkpoint) is the one that 2 CPU
    # ranks, and --device xla, generate from that checkpoint, and the one the CPU reference's
    # weights give.
    generate = ["--run_name", "corpus", "--max_epochs", -1, *sample]
    after_training = sample_of(resumed.stdout)
    assert after_training.startswith("KING:") and len(after_training) == len("KING:") + 40
    assert sample_of(launch(generate, ranks=2, cwd=dirs["xla"]).stdout) == after_training
    assert (
        sample_of(launch([*generate, "--device", "xla"], ranks=1, cwd=dirs["xla"], env=XLA).stdout)
        == after_training
    )
    assert sample_of(launch(generate, ranks=1, cwd=dirs["cpu"]).stdout) == after_training


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.xla
@no_torch_xla
def test_xla_loading_unpickles_no_code(tmp_path, monkeypatch):
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from minimal_fsdp.backends import xla

    monkeypatch.chdir(tmp_path)
    state = {"optim.param_groups.0.lr": 0.0}  # xla.load hands DCP a flat dict
    planner = xla.SafeLoadPlanner()
    planner.set_up_planner(state, None, True)
    item = ReadItem(
        LoadItemType.BYTE_IO,
        MetadataIndex("optim.param_groups.0.lr"),
        torch.Size([0]),
        MetadataIndex("optim.param_groups.0.lr"),
        torch.Size([0]),
        torch.Size([0]),
    )
    benign = io.BytesIO()
    torch.save(3e-4, benign)
    benign.seek(0)
    planner.load_bytes(item, benign)
    assert state["optim.param_groups.0.lr"] == 3e-4
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, io.BytesIO(pickle.dumps(Exploit())))
    assert not (tmp_path / "pwned").exists()


# ---- the flag's checks: need no torch_xla ----


def test_device_xla_without_torch_xla_is_one_clear_error(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "torch_xla" else find_spec(name)
    )
    with pytest.raises(
        ConfigError, match=r"--device xla needs torch_xla: pip install -e '\.\[xla\]'"
    ):
        parse_args(["--device", "xla"])


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--sharding", "grad-shard"], "sharding"),
        (["--shard_group_size", 2], "shard_group_size"),
        (["--cpu_offload"], "cpu_offload"),
        (["--compile"], "compile"),
        (["--meta_init"], "meta_init"),
        (["--data_parallel", "decentralized"], "data_parallel"),
        (["--activation_checkpoints", "--recompute", "selective"], "recompute"),
        (["--reduce_precision", "bf16"], "reduce_precision"),
    ],
)
def test_flags_xla_does_not_take_are_refused(monkeypatch, flags, refused):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if installed
    with pytest.raises(ConfigError, match=f"^--{refused} is not available with --device xla"):
        parse_args(["--device", "xla", *flags])


def test_xla_wants_one_process_per_host(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    cfg = parse_args(["--device", "xla"])
    validate_world(cfg, world_size=2, local_world_size=1)  # two hosts, one rank each
    with pytest.raises(ConfigError, match="one process per host"):
        validate_world(cfg, world_size=4, local_world_size=4)


@no_torch_xla
@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 1337, 2**63 - 1])
def test_every_seed_gives_torch_xla_a_seed_it_takes(seed):
    """torch_xla's set_rng_state takes [0, 2**64) only: --seed -1 or a seed near 2**63 ended in a
    TypeError."""
    # what xla.py seeds torch_xla with: seed64(seed * 1_000_003 + step)
    from minimal_fsdp.parallel.parallelize import seed64

    seeds = [seed64(seed * 1_000_003 + step) for step in (0, 1, 1000)]
    # each launch's own dropout masks
    assert all(0 <= s < 2**64 for s in seeds) and len(set(seeds)) == 3
    assert seed64(seed * 1_000_003 + 1000) == (seed * 1_000_003 + 1000) % 2**64
    import torch_xla.core.xla_model as xm

    for s in seeds:
        xm.set_rng_state(s)
        assert xm.get_rng_state() == s


# ---- the one wiring, under a stand-in torch_xla (fake_torch_xla.py): runs everywhere ----


def fake_xla_runs(flag_lists, cwd):
    """Runs of the entry point one after the other in one launch of 1 rank (conftest.launch_runs),
    with fake_torch_xla's modules installed first, as `python tests/fake_torch_xla.py` does: a run
    with --device xla gets its one device (the CPU), the others never import torch_xla."""
    entry = cwd / "fake_xla_runs.py"
    entry.write_text(
        f"import runpy, sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\nimport fake_torch_xla\n"
        f"fake_torch_xla.install()\nrunpy.run_path({str(ROOT / 'tests' / 'several_runs.py')!r}, "
        "run_name='__main__')\n"
    )
    return launch_runs(flag_lists, ranks=1, cwd=cwd, entry=entry)


def in_dir(name, args):
    """A run's flags with its checkpoints and logs under `name` (runs of one launch share its
    working directory)."""
    return [*args, "--checkpoint_dir", f"{name}/checkpoints", "--log_dir", f"{name}/logs"]


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory):
    """Under the stand-in, in 2 launches: the CPU reference (20 steps at once); an XLA run of 10
    steps (2 rows per device, as the CPU run's 2 rows), its checkpoints copied for a CPU run to
    resume; then the XLA run resumed to 20 steps with a sample at the end, the CPU run resumed from
    the XLA checkpoint, and a generation from the XLA run's checkpoint on one CPU rank."""
    work = tmp_path_factory.mktemp("fake_xla")
    corpus = work / "corpus.txt"
    corpus.write_text(make_text())
    args = lambda steps, *extra: [  # noqa: E731
        *run_args(corpus, "gpt", steps, "--num_tokens", 0, *extra),
        "--batch_size",
        2,
    ]
    xla = ["--device", "xla"]
    sample = ["--num_tokens", 40, "--prompt", "KING:"]  # --seed would change the data order too
    first = fake_xla_runs([in_dir("cpu", args(20)), in_dir("xla", [*args(10), *xla])], work)
    shutil.copytree(work / "xla" / "checkpoints", work / "xla_then_cpu" / "checkpoints")
    second = fake_xla_runs(
        [
            in_dir("xla", [*args(20, *sample), *xla]),
            in_dir("xla_then_cpu", args(20)),
            in_dir("xla", ["--run_name", "corpus", "--max_epochs", -1, *sample]),
        ],
        work,
    )
    return work, first.stdout, second.stdout


@pytest.mark.slow  # a launch; the quick tier keeps the in-process check of the wiring
def test_xla_trains_through_the_one_wiring(fake_runs):
    """--device xla runs xla.py's parts (the FSDPv2-wrapped model, device batches, the step's sync,
    its checkpointer and banner) through run.train_model, train.build_optimizer and train.train:
    what it computes is one CPU rank's (AdamW unfused there: within rel 1e-5), and its checkpoint is
    xla.Checkpointer's."""
    work, first, _ = fake_runs
    xla, cpu = work / "xla", work / "cpu"
    # xla.XLA.banner: the XLA run's, not the CPU one's
    assert first.count("torch_xla SPMD, mesh fsdp=1 (FSDPv2)") == 1
    # 10 x 1 device x 2 rows x 32 tokens
    assert "this launch trained 10 steps (640 tokens)" in first
    assert_same_run(xla, cpu, range(1, 11))
    assert logged(xla, "loss")[10] < logged(xla, "loss")[1]
    # Saved by xla.Checkpointer under checkpoint/checkpointer.py's names (FSDPv2's wrappers left
    # out): the CPU run's tensors.
    saved = [tensor_names(d / "checkpoints" / "corpus" / "step_20", prefix="") for d in (xla, cpu)]
    assert saved[0] == saved[1] and any(
        name.startswith("optim.state.blocks.0.") for name, _, _ in saved[0]
    )


@pytest.mark.slow
def test_xla_checkpoints_resume_both_ways_and_sample_through_the_one_wiring(fake_runs):
    """Under the stand-in: an XLA run resumed from its own checkpoint, and a CPU run from the XLA
    checkpoint, equal the uninterrupted CPU run; the sample after XLA training comes from its
    checkpoint, generated on the host."""
    work, _, second = fake_runs
    assert "resuming from xla/checkpoints/corpus/step_10" in second  # the XLA run's own checkpoint
    assert_same_run(work / "xla", work / "cpu", range(1, 21))
    assert "resuming from xla_then_cpu/checkpoints/corpus/step_10" in second
    assert_same_run(work / "xla_then_cpu", work / "cpu", range(11, 21))
    # the resumed XLA run's, then the generation's
    after_training, generated = sample_of_each(second)
    assert after_training.startswith("KING:") and len(after_training) == len("KING:") + 40
    assert generated == after_training


@pytest.fixture
def fake_xla(monkeypatch):
    """minimal_fsdp.backends.xla imported over fake_torch_xla's modules, in this process; gone again
    after the test."""
    import minimal_fsdp

    for name, module in fake_torch_xla.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules.pop("minimal_fsdp.backends.xla", None)
    yield importlib.import_module("minimal_fsdp.backends.xla")
    sys.modules.pop("minimal_fsdp.backends.xla", None)
    vars(minimal_fsdp).pop("xla", None)


def public(cls):
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_plan_decides_the_xla_backend_and_train_builds_its_optimizer(fake_xla):
    """--device xla: the plan (decided once) says xla and FSDPv2's per-block layout, with no torch
    mesh; the XLA backend offers every part default.Torch does; the optimizer is
    train.build_optimizer's AdamW (the same groups and settings as on CPU, without fused kernels):
    xla.py keeps no copy. Generation plans stay on the host."""
    from minimal_fsdp.train import build_optimizer

    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=2, num_heads=2, embed_size=8)
    cfg = parse_args(["--device", "xla", "--weight_decay", 0.3, "--lr", 0.02])
    plan = make_plan(cfg, env, config)
    assert (plan.backend, plan.strategy, plan.mesh) == ("xla", "fsdp-block", None)
    assert (
        make_plan(parse_args(["--device", "xla", "--max_epochs", -1]), env, config).backend
        == "torch"
    )
    assert make_plan(parse_args([]), env, config).backend == "torch"
    assert public(fake_xla.XLA) == public(default.Torch) and not hasattr(
        fake_xla, "build_optimizer"
    )
    parts = fake_xla.XLA(Backend.of(cfg), Checkpoint.of(cfg), dataclasses.asdict(cfg), env, plan)
    assert (parts.ranks, parts.local_ranks) == (1, 1)  # the stand-in's one device
    model = parts.build_model(config)
    optimizer = build_optimizer(model, Optimizer.of(cfg), plan)
    cpu = parse_args(["--weight_decay", 0.3, "--lr", 0.02])
    on_cpu = build_optimizer(model, Optimizer.of(cpu), make_plan(cpu, env, config))
    assert type(optimizer) is type(on_cpu) is torch.optim.AdamW
    assert not optimizer.defaults["fused"] and on_cpu.defaults["fused"]
    settings = lambda opt: [  # noqa: E731
        (
            {k: v for k, v in g.items() if k not in ("params", "fused")},
            [p.shape for p in g["params"]],
        )
        for g in opt.param_groups
    ]
    assert settings(optimizer) == settings(on_cpu)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.3, 0.0]

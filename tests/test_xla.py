"""--device xla (xla.py): the tiny GPT and Llama trained by torch_xla SPMD (FSDPv2) on 4 XLA:CPU devices match one
CPU rank of the ordinary path; checkpoints move between XLA and CPU runs both ways; generation from them; the
flag's errors. Runs where torch_xla is installed (docs/xla.md: torch 2.9 + torch_xla 2.9); the config checks run
everywhere."""
import importlib.util
import io
import json
import os
import pickle
import shutil

import pytest

from conftest import TINY_MODEL, launch
from test_end_to_end import sample_of
from minimal_fsdp.config import ConfigError, parse_args, validate_world

no_torch_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla")
# One process drives 4 virtual XLA:CPU devices; mpiexec -n 1 also takes the MPI discovery path.
XLA = dict(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="2")
DEVICES = 4
MODELS = {"gpt": [],
          # grouped-query attention, and an MLP of 51 rows: uneven over 4 devices
          "llama": ["--model", "llama", "--num_heads", 4, "--num_kv_heads", 2, "--intermediate_size", 51]}


def run_args(corpus, model, steps, *extra):
    return ["--dataset", "text", "--input_file", corpus, *TINY_MODEL, *MODELS[model], "--max_steps", steps,
            "--lr_decay_steps", 20, "--warmup_steps", 5, "--log_interval", 1, "--eval_interval", 10,
            "--no-tensorboard", *extra]


def train_xla(args, cwd, batch_size=2):
    """--batch_size per device: 4 x 2 rows are exactly the 8 rows of one CPU rank with --batch_size 8."""
    return launch([*args, "--device", "xla", "--batch_size", batch_size], ranks=1, cwd=cwd, env=XLA)


def train_cpu(args, cwd):
    return launch([*args, "--batch_size", 2 * DEVICES], ranks=1, cwd=cwd)


def logged(cwd, key):
    """{step: value} of one metric in the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (cwd / "logs" / "shakespeare" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row[key] for row in rows if key in row}


def assert_same_run(run, reference, steps):
    for key in ("loss", "grad_norm", "val_loss"):
        ours, theirs = logged(run, key), logged(reference, key)
        wanted = [step for step in theirs if step in steps]
        assert wanted and [ours[s] for s in wanted] == pytest.approx([theirs[s] for s in wanted], rel=1e-5, abs=1e-6), key


@pytest.mark.xla
@no_torch_xla
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_fsdpv2_on_4_devices_matches_one_cpu_rank(tmp_path, corpus, model):
    # Llama also recomputes its blocks (torch_xla's activation checkpointing): the same numbers. Its --seed -1 is
    # one torch_xla's RNG takes only wrapped into [0, 2**64) (parallelize.seed64).
    seed = ["--seed", -1] if model == "llama" else []
    extra = ["--activation_checkpoints"] if model == "llama" else []
    xla, cpu = tmp_path / "xla", tmp_path / "cpu"
    xla.mkdir(), cpu.mkdir()
    out = train_xla(run_args(corpus, model, 20, *seed, *extra), xla)
    train_cpu(run_args(corpus, model, 20, *seed), cpu)
    assert "mesh fsdp=4 (FSDPv2)" in out.stdout
    assert "this launch trained 20 steps (5,120 tokens)" in out.stdout  # 20 x 4 devices x 2 rows x 32 tokens
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
    assert "resuming from checkpoints/shakespeare/step_10" in resumed.stdout
    assert_same_run(dirs["xla"], dirs["cpu"], range(1, 21))
    # A CPU run resumes the XLA checkpoint (weights, AdamW moments, data position, LR horizon) ...
    train_cpu(args(20), dirs["xla_then_cpu"])
    assert_same_run(dirs["xla_then_cpu"], dirs["cpu"], range(11, 21))
    # ... and an XLA run resumes a CPU one.
    train_cpu(args(10), dirs["cpu_then_xla"])
    train_xla(args(20), dirs["cpu_then_xla"])
    assert_same_run(dirs["cpu_then_xla"], dirs["cpu"], range(11, 21))

    # The XLA run's sample (generated on the host from its last checkpoint) is the one that 2 CPU ranks, and
    # --device xla, generate from that checkpoint, and the one the CPU reference's weights give.
    generate = ["--max_epochs", -1, *sample]
    after_training = sample_of(resumed.stdout)
    assert after_training.startswith("KING:") and len(after_training) == len("KING:") + 40
    assert sample_of(launch(generate, ranks=2, cwd=dirs["xla"]).stdout) == after_training
    assert sample_of(launch([*generate, "--device", "xla"], ranks=1, cwd=dirs["xla"], env=XLA).stdout) == after_training
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
    from minimal_fsdp import xla

    monkeypatch.chdir(tmp_path)
    state = {"optim.param_groups.0.lr": 0.0}  # xla.load hands DCP a flat dict
    planner = xla.SafeLoadPlanner()
    planner.set_up_planner(state, None, True)
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("optim.param_groups.0.lr"), torch.Size([0]),
                    MetadataIndex("optim.param_groups.0.lr"), torch.Size([0]), torch.Size([0]))
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
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torch_xla" else find_spec(name))
    with pytest.raises(ConfigError, match=r"--device xla needs torch_xla: pip install -e '\.\[xla\]'"):
        parse_args(["--device", "xla"])


@pytest.mark.parametrize("flags, refused", [
    (["--sharding", "grad-shard"], "sharding"), (["--shard_group_size", 2], "shard_group_size"),
    (["--cpu_offload"], "cpu_offload"), (["--compile"], "compile"), (["--meta_init"], "meta_init"),
    (["--data_parallel", "decentralized"], "data_parallel"),
    (["--activation_checkpoints", "--recompute", "selective"], "recompute")])
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
@pytest.mark.parametrize("seed", [-2**63, -1, 0, 1337, 2**63 - 1])
def test_every_seed_gives_torch_xla_a_seed_it_takes(seed):
    """torch_xla's set_rng_state takes [0, 2**64) only: --seed -1 or a seed near 2**63 ended in a TypeError."""
    from minimal_fsdp.parallelize import seed64  # what xla.py seeds torch_xla with: seed64(seed * 1_000_003 + step)
    seeds = [seed64(seed * 1_000_003 + step) for step in (0, 1, 1000)]
    assert all(0 <= s < 2**64 for s in seeds) and len(set(seeds)) == 3  # each launch's own dropout masks
    assert seed64(seed * 1_000_003 + 1000) == (seed * 1_000_003 + 1000) % 2**64
    import torch_xla.core.xla_model as xm
    for s in seeds:
        xm.set_rng_state(s)
        assert xm.get_rng_state() == s

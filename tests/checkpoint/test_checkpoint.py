"""checkpoint/checkpointer.py: what a save writes (every file with its size and CRC-32, meta.json,
the tokenizer, `latest` and `best`, pruning, a step saved again), how a failed save is reported (one
line on every rank, the partial directory removed, `latest` untouched), decentralized replicas, the
RNG states; and through real training on 2 ranks, a complete checkpoint whose resume restores
weights, moments, step and data position, and a logged throughput that leaves out evaluation and
saving. In this process where it can be (fast, and what mutation testing can see). Reading a
checkpoint without running code is test_safe_load.py's; verifying one and finding the one to start
from, test_checkpoint_find.py's."""

import dataclasses
import errno
import json
import random
import shutil
import threading
import zlib
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from minimal_fsdp import files, metrics, train
from minimal_fsdp.checkpoint import checkpointer, find, safe_load
from minimal_fsdp.checkpoint.dirs import crc32
from minimal_fsdp.checkpoint.meta import read_meta
from minimal_fsdp.checkpoint.rng import rng_bytes
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.config.sections import Checkpoint, Optimizer
from minimal_fsdp.launch import run_lock
from minimal_fsdp.launch.environment import DistEnv
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync
from minimal_fsdp.parallel.plan import make_plan
from minimal_fsdp.run import RunSections
from minimal_fsdp.train import build_optimizer

from conftest import TINY_MODEL, launch, make_text
from faults import launch_with_faults
from support import console, meta_of, moments, run, same, save_three, saved, state_of, tiny, weights  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_rank_group")


def train_args(corpus, work, *extra):
    return [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--max_steps",
        4,
        "--checkpoint_interval",
        2,
        "--eval_interval",
        0,
        "--log_interval",
        1,
        "--checkpoint_dir",
        work / "checkpoints",
        "--log_dir",
        work / "logs",
        *extra,
    ]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A 2-rank, 4-step run that saves at steps 2 and 4."""
    work = tmp_path_factory.mktemp("four_steps")
    corpus = work / "corpus.txt"
    corpus.write_text(make_text())
    launch(train_args(corpus, work), ranks=2, cwd=work)
    return work, corpus


def all_tensors(path):
    """Every tensor of a checkpoint (model weights, optimizer moments and step counts), read in this
    process."""
    return safe_load.read_tensors(
        path, [name for name, _, _ in safe_load.tensor_names(path, "")], ""
    )


def test_save_writes_complete_checkpoint_and_latest(four_steps):
    work, _ = four_steps
    run = work / "checkpoints" / "corpus"
    # no temporary leftovers
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_2", "step_4"]
    assert find.latest(run) == run / "step_4"
    meta = read_meta(run / "step_4")
    assert (
        meta["format"] == 2
        and json.loads((run / "step_4" / "meta.json").read_text())["format"] == 2
    )
    assert (
        meta["step"] == 4 and meta["model"]["num_layers"] == 2 and meta["config"]["max_steps"] == 4
    )
    assert meta["world_size"] == 2 and meta["state"]["schedule"] == {
        "lr_decay_steps": 4,
        "last_step": 4,
    }
    assert meta["state"]["data"] == {"train_blocks_seen": 4 * 2 * 4}  # steps x ranks x batch
    assert {"rng_0.pt", "rng_1.pt"} <= {p.name for p in (run / "step_4").iterdir()}
    assert (run / "step_4" / "tokenizer.json").exists()
    state = safe_load.load_full_model_state(run / "step_4")
    assert state["wte.weight"].shape == (meta["model"]["vocab_size"], 32)


@pytest.mark.slow
def test_resume_restores_weights_moments_step_and_data_position(four_steps):
    """A run whose newest checkpoint is step_2 resumes from it: the live model and optimizer equal
    the files right after loading, and its step_4 equals the uninterrupted run's bitwise, in every
    weight, Adam moment and step count (so steps 3 and 4 also read the same batches)."""
    work, corpus = four_steps
    whole, resumed = work / "checkpoints" / "corpus", work / "resumed" / "checkpoints" / "corpus"
    resumed.mkdir(parents=True)
    shutil.copytree(whole / "step_2", resumed / "step_2")
    (resumed / "latest").write_text("step_2\n")
    report = work / "load.json"
    out = launch_with_faults(train_args(corpus, work / "resumed"), cwd=work, check_load=report)
    assert "resuming from" in out.stdout and "step_2" in out.stdout
    verdict = json.loads(report.read_text())
    assert (
        verdict["checked"] > 50
        and verdict["only_live"] == verdict["only_saved"] == verdict["different"] == []
    )

    expected, got = all_tensors(whole / "step_4"), all_tensors(resumed / "step_4")
    assert expected.keys() == got.keys() and any(k.endswith("exp_avg_sq") for k in got)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert all(got[k].item() == 4 for k in got if k.endswith(".step"))
    for key in ("step", "state"):
        read = read_meta
        assert read(resumed / "step_4")[key] == read(whole / "step_4")[key], key
    logged = (work / "resumed" / "logs" / "corpus" / "metrics.jsonl").read_text().splitlines()
    assert [row["step"] for row in map(json.loads, logged) if "loss" in row] == [3, 4]


ONE_RANK_MODEL = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)


@pytest.fixture
def one_rank(one_rank_group):
    """A tiny sharded model on this process's one-rank process group: enough to save, damage and
    load."""
    cfg = parse_args([])
    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    plan = make_plan(cfg, env, ONE_RANK_MODEL, fsdp_on_one_rank=True)
    model = build_model(GPT, ONE_RANK_MODEL, plan, env, cfg.seed)
    return model, build_optimizer(model, Optimizer.of(cfg), plan)


def save_steps(run, model, optimizer, val_losses, keep_last=0):
    meta = {
        "format": 2,
        "model_type": "gpt",
        "model": model.config.to_dict(),
        "config": {},
        "state": {"schedule": {}, "data": {"train_blocks_seen": 0}},
    }
    for step, val_loss in enumerate(val_losses, start=1):
        checkpointer.save(
            run, step, model, optimizer, dict(meta, val_loss=val_loss), keep_last=keep_last
        )


def test_keep_last_prunes_older_checkpoints_but_spares_best(one_rank, tmp_path):
    run = tmp_path / "run"
    save_steps(run, *one_rank, [3.0, 2.0, 2.5, None, 2.7], keep_last=2)
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_2", "step_4", "step_5"]
    assert (run / "latest").read_text().strip() == "step_5" and (
        run / "best"
    ).read_text().strip() == "step_2"
    assert find.resolve(run / "best") == run / "step_2"
    assert (
        find.find(Checkpoint.of(parse_args(["--restart_checkpoint_file", str(run / "best")])))
        == run / "step_2"
    )


def test_damaged_checkpoints_are_reported_in_one_line_and_skipped(one_rank, tmp_path, capsys):
    run = tmp_path / "run"
    save_steps(run, *one_rank, [None] * 5)
    (run / ".tmp-step_6").mkdir()  # a save that died before its rename
    (run / ".tmp-step_6" / "__0_0.distcp").write_bytes(b"half")
    rng = run / "step_5" / "rng_0.pt"
    rng.write_bytes(rng.read_bytes()[:1000])
    shard = run / "step_4" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    metadata = run / "step_3" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    (run / "step_2" / "meta.json").write_text('{"step": 2, "mod')
    capsys.readouterr()
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run"])
    assert find.find(Checkpoint.of(cfg)) == run / "step_1"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    assert "step_5: rng_0.pt is missing or unreadable" in lines[0]
    assert "step_4: __0_0.distcp is truncated (100 of" in lines[1]
    assert "step_3: .metadata is missing or unreadable" in lines[2]
    assert "step_2: meta.json is not JSON" in lines[3]
    with pytest.raises(
        ConfigError, match="--restart_checkpoint_file .*step_4 is not a complete checkpoint"
    ):
        find.find(Checkpoint.of(parse_args(["--restart_checkpoint_file", str(run / "step_4")])))


def test_rng_states_come_back(one_rank, tmp_path):
    run = tmp_path / "run"
    save_steps(run, *one_rank, [None])
    expected = (torch.rand(4), np.random.rand(4), random.random())
    assert checkpointer.restore_rng(run / "step_1", rank=0, world_size=1, seed=0)
    again = (torch.rand(4), np.random.rand(4), random.random())
    assert (
        torch.equal(expected[0], again[0])
        and np.array_equal(expected[1], again[1])
        and expected[2] == again[2]
    )
    # Written by one rank, resumed on two: no stream is "this rank's", so reseed rather than replay.
    assert not checkpointer.restore_rng(run / "step_1", rank=0, world_size=2, seed=0)
    assert not torch.equal(torch.rand(4), expected[0])


def test_resume_never_refuses_a_run_that_has_checkpoints(tmp_path):
    args = ["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--resume", "never"]
    assert find.find(Checkpoint.of(parse_args(args))) is None
    (tmp_path / "run" / "step_3").mkdir(parents=True)
    with pytest.raises(ConfigError, match="--resume never, but .*run already holds checkpoints"):
        find.find(Checkpoint.of(parse_args(args)))


class RandomTokens:
    """Random tokens for training, with the data interface of tokens.TokenData."""

    directory = None

    def steps_per_epoch(self):
        return 1000

    def train_batches(self, step):
        tokens = torch.randint(16, (2, 9), generator=torch.Generator().manual_seed(step))
        return [(tokens[:, :-1], tokens[:, 1:])]

    def state_dict(self, step):
        return {}


def test_logged_throughput_leaves_out_evaluation_and_saving(one_rank, tmp_path, monkeypatch):
    """On a fake clock where a training step takes 1 s, an evaluation 100 s and a save 10 s, every
    logged step time is 1 s: the evaluations and saves inside each logging window are left out."""
    model, optimizer = one_rank
    clock = [0.0]

    def advance(seconds, then):
        def run(*args, **kwargs):
            clock[0] += seconds
            return then(*args, **kwargs)

        return run

    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(train, "train_step", advance(1.0, train.train_step))
    monkeypatch.setattr(train, "evaluate", advance(100.0, lambda *args: 1.0))
    saver = SimpleNamespace(
        save=advance(10.0, lambda *args: None),
        saving=nullcontext,
        poll=lambda: None,
        # synchronous saves
        wait=lambda: None,
        reports=lambda: [],
        restore_s=None,
    )
    cfg = dataclasses.replace(
        parse_args(
            [
                "--max_steps",
                "6",
                "--eval_interval",
                "1",
                "--log_interval",
                "2",
                "--checkpoint_interval",
                "3",
                "--batch_size",
                "2",
                "--log_dir",
                str(tmp_path / "logs"),
            ]
        ),
        tensorboard=False,
    )
    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    plan = make_plan(cfg, env, ONE_RANK_MODEL, fsdp_on_one_rank=True)
    stop = SimpleNamespace(agreed=lambda step=None: None, due=lambda step: False)
    parts = train.RunParts(
        model, optimizer, RandomTokens(), gradient_sync(model, plan), saver, ranks=1
    )
    train.train(parts, env, plan, stop, **RunSections.of(cfg).for_loop())
    rows = [
        json.loads(line)
        for line in (tmp_path / "logs" / cfg.run_name / "metrics.jsonl").read_text().splitlines()
    ]
    timed = [r for r in rows if "step_time" in r]
    assert [r["step"] for r in timed] == [2, 4, 6]
    assert [r["step_time"] for r in timed] == [1.0, 1.0, 1.0]


# ---- saving ----


def test_a_save_writes_every_file_with_its_size_and_crc32(tmp_path):
    # here, not in a fixture: mutation testing sees what a test calls
    run, model_weights, _ = save_three(tmp_path)
    step = run / "step_3"
    assert sorted(p.name for p in step.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "meta.json",
        "rng_0.pt",
        "tokenizer.json",
    ]
    assert (step / "tokenizer.json").read_text() == '{"vocab": ["a", "b"]}'
    meta = meta_of(step)
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "rng_0.pt", "tokenizer.json"]
    for name, (size, crc) in meta["files"].items():
        data = (step / name).read_bytes()
        assert (size, crc) == (len(data), zlib.crc32(data)), name
    assert (meta["step"], meta["world_size"], meta["format"], meta["val_loss"]) == (3, 1, 2, None)
    assert meta["state"]["schedule"] == {"lr_decay_steps": 10, "last_step": 100}
    # one key a line, for people who read it
    assert (step / "meta.json").read_text().startswith('{\n "')
    assert (run / "latest").read_text() == "step_3\n" and (run / "best").read_text() == "step_2\n"
    # keep all
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_1", "step_2", "step_3"]
    assert same(safe_load.load_full_model_state(step), model_weights)


def test_crc32_reads_a_file_in_chunks(tmp_path):
    data = bytes(range(256)) * 3
    (tmp_path / "f").write_bytes(data)
    assert crc32(tmp_path / "f", chunk=7) == crc32(tmp_path / "f") == zlib.crc32(data)


def test_best_moves_only_to_a_strictly_lower_val_loss(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    best = []
    for step, val_loss in enumerate([2.0, 2.0, None, 1.5, 1.5], start=1):
        checkpointer.save(run, step, model, optimizer, {"val_loss": val_loss})
        best.append((run / "best").read_text().strip())
    assert best == ["step_1", "step_1", "step_1", "step_4", "step_4"]


def test_best_resaved_without_a_val_loss_gives_way_to_the_next_validated_save(tmp_path):
    """A run restarted from an older checkpoint saves the step `best` names again, this time without
    a val loss."""
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpointer.save(run, 1, model, optimizer, {"val_loss": 1.0})
    checkpointer.save(run, 1, model, optimizer, {"val_loss": None})
    checkpointer.save(run, 2, model, optimizer, {"val_loss": 5.0})
    assert (run / "best").read_text() == "step_2\n"


def test_a_step_saved_again_replaces_the_old_one_whole(tmp_path):
    run = tmp_path / "run"
    first, optimizer = tiny(seed=1)
    checkpointer.save(run, 2, first, optimizer, {})
    second, optimizer = tiny(seed=2)
    checkpointer.save(run, 2, second, optimizer, {})
    assert same(safe_load.load_full_model_state(run / "step_2"), weights(second))
    # nothing of the old one left aside
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_2"]


def test_a_save_removes_what_a_crashed_save_left(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    (run / ".tmp-step_9").mkdir(parents=True)
    (run / ".tmp-step_9" / "__0_0.distcp").write_bytes(b"half")
    (run / ".tmp-old-step_4").mkdir()
    (run / ".tmp-stray").write_text("a file, which rmtree cannot remove: it does not stop the save")
    checkpointer.save(run, 1, model, optimizer, {})
    assert sorted(p.name for p in run.iterdir()) == [".tmp-stray", "latest", "step_1"]


def test_keep_last_prunes_quietly_even_when_best_is_damaged(tmp_path, console):
    out, err = console()
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpointer.save(run, 1, model, optimizer, {"val_loss": 1.0})
    (run / "best").write_bytes(b"\xff\xfe garbage")
    checkpointer.save(run, 2, model, optimizer, {"val_loss": None}, keep_last=1)
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_2"]
    checkpointer.save(run, 3, model, optimizer, {"val_loss": 2.0}, keep_last=1)
    assert (run / "best").read_text() == "step_3\n"
    assert err.getvalue() == ""  # a damaged `best` is replaced, not reported on every save


def test_markers_are_written_durably(tmp_path, monkeypatch):
    synced = []
    sync = files.sync
    monkeypatch.setattr(files, "sync", lambda path: synced.append(Path(path).name) or sync(path))
    model, optimizer = tiny()
    checkpointer.save(tmp_path / "run", 1, model, optimizer, {"val_loss": 1.0})
    # the marker's data, before its rename
    assert any(name.startswith(".latest.tmp") for name in synced)
    assert any(name.startswith(".best.tmp") for name in synced)
    assert synced.count("run") >= 3  # the checkpoint's rename and both markers' renames


def test_save_hands_dcp_the_callers_planner(tmp_path):
    class Recording(DefaultSavePlanner):
        used = False

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            Recording.used = True
            return super().set_up_planner(state_dict, storage_meta, is_coordinator)

    model, optimizer = tiny()
    checkpointer.save(tmp_path / "run", 1, model, optimizer, {}, planner=Recording())
    assert Recording.used


# ---- a failed save: one line on every rank, the partial directory removed, the previous checkpoint
# kept ----


def test_a_save_that_cannot_start_fails_in_one_line(tmp_path):
    model, optimizer = tiny()
    (tmp_path / "file").write_text("")
    run = tmp_path / "file" / "run"
    with pytest.raises(checkpointer.SaveError) as raised:
        checkpointer.save(run, 1, model, optimizer, {})
    assert str(raised.value) == (
        f"cannot start checkpoint {run}/step_1 (rank 0: Not a directory: {run}/.tmp-step_1); "
        "the previous checkpoint is untouched"
    )


def test_a_save_after_another_run_took_the_lock_writes_nothing(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpointer.save(run, 1, model, optimizer, {})
    # left by a save of step 2 that crashed: gone too, as the failed save's own
    (run / ".tmp-step_2").mkdir()
    lock = run_lock.RunLock({"--checkpoint_dir": run})
    lock.acquire()
    try:
        (run / ".lock").write_text(json.dumps({"token": "another run's"}))
        with pytest.raises(
            checkpointer.SaveError,
            match=rf"^cannot start checkpoint {run}/step_2 \(rank 0: "
            r"LockError: another run took over .*\); the previous",
        ):
            checkpointer.save(run, 2, model, optimizer, {})
    finally:
        lock.release()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "latest", "step_1"]


def test_a_full_disk_while_writing_fails_in_one_line_and_leaves_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpointer.save(run, 1, model, optimizer, {})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/scratch/__0_0.distcp")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(checkpointer.SaveError) as raised:
        checkpointer.save(run, 2, model, optimizer, {})
    assert str(raised.value) == (
        f"writing checkpoint {run}/step_2 failed (rank 0: No space left on device: "
        "/scratch/__0_0.distcp); the previous checkpoint is untouched"
    )
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_1"]
    assert (run / "latest").read_text() == "step_1\n"


def test_a_failure_that_cannot_be_pickled_is_still_reported(tmp_path, monkeypatch):
    class Stuck(RuntimeError):
        def __init__(self):
            super().__init__("the writer is stuck")
            # an exception is not always picklable: only its text travels
            self.lock = threading.Lock()

    def stuck(*args, **kwargs):
        raise Stuck()

    monkeypatch.setattr(dcp, "save", stuck)
    model, optimizer = tiny()
    with pytest.raises(checkpointer.SaveError, match=r"\(rank 0: Stuck: the writer is stuck\)"):
        checkpointer.save(tmp_path / "run", 1, model, optimizer, {})
    assert list((tmp_path / "run").iterdir()) == []


def test_a_save_that_fails_while_finishing_leaves_the_previous_checkpoint(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpointer.save(run, 1, model, optimizer, {})
    tokenizer = tmp_path / "tokenizer"
    (tokenizer / "tokenizer.d").mkdir(parents=True)  # unreadable as a file
    with pytest.raises(checkpointer.SaveError) as raised:
        checkpointer.save(run, 2, model, optimizer, {}, tokenizer_dir=tokenizer)
    assert str(raised.value) == (
        f"finishing checkpoint {run}/step_2 failed (rank 0: Is a directory: "
        f"{tokenizer}/tokenizer.d); the previous checkpoint is untouched"
    )
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_1"]


def test_failure_names_the_first_failing_rank_in_one_line():
    assert checkpointer._failure(OSError(errno.ENOSPC, "No space left on device", "/a/b"), 3) == (
        3,
        "No space left on device: /a/b",
    )
    assert checkpointer._failure(OSError(errno.EIO, "Input/output error"), 1) == (
        1,
        "Input/output error",
    )
    assert checkpointer._failure(OSError("no errno"), 2) == (2, "OSError: no errno")
    assert checkpointer._failure(ValueError("two\n   lines"), 0) == (0, "ValueError: two lines")
    assert checkpointer._failure(ValueError("x" * 400), 0) == (0, "ValueError: " + "x" * 300)
    both = CheckpointException(
        "save failed", {2: (ValueError("on two"), "traceback"), 1: OSError(errno.EIO, "EIO")}
    )
    assert checkpointer._failure(both, 0) == (1, "EIO")
    one = CheckpointException(
        "save failed", {2: (OSError(errno.ENOSPC, "full", "/x"), "traceback")}
    )
    assert checkpointer._failure(one, 0) == (2, "full: /x")
    assert checkpointer._failure(CheckpointException("nothing known", {}), 5) == (
        5,
        "CheckpointException: CheckpointException ranks:dict_keys([])",
    )


# ---- decentralized replicas ----


def test_save_replicas_keeps_this_ranks_replica_beside_the_average(tmp_path):
    model, optimizer = tiny()
    path = checkpointer.save_replicas(tmp_path / "run", 1, model, optimizer, {"val_loss": None})
    checkpointer.save_replicas(tmp_path / "run", 2, model, optimizer, {"val_loss": None})
    # keep_last: all
    assert path == tmp_path / "run" / "step_1" and (tmp_path / "run" / "step_2").is_dir()
    assert meta_of(path)["replicas"] == 1
    names = [name for name, _, _ in safe_load.tensor_names(path)]
    assert same(safe_load.read_tensors(path, names), weights(model))  # the average of one replica
    assert same(safe_load.read_tensors(path, names, prefix="replicas.0.model."), weights(model))
    moments_saved = [
        n for n, _, _ in safe_load.tensor_names(path, "replicas.0.optim.state.") if "exp_avg" in n
    ]
    assert len(moments_saved) == 2 * len(list(model.parameters()))
    path = checkpointer.save_replicas(
        tmp_path / "average", 1, model, optimizer, {}, average_only=True
    )
    assert meta_of(path)["replicas"] == 0
    assert safe_load.tensor_names(path, "replicas.") == []


def crafted_replicas(tmp_path, replicas):
    """A checkpoint whose average (model b) differs from this rank's replica (model a): one rank
    cannot make one by training, so it is written directly."""
    a, b = tiny(seed=1), tiny(seed=2)
    state = dict(state_of(*b), replicas={"0": state_of(*a)})
    path = checkpointer.save(tmp_path / "run", 1, None, None, {"replicas": replicas}, state=state)
    return path, a, b


def test_a_load_keeps_the_optimizers_own_kernels(tmp_path):
    """ClippedAdamW's checkpoint (its groups' fused: None, a compiled step) resumed by fused AdamW
    (a run without --compile, or on the CPU): the saved moments, and fused AdamW's own kernels."""
    from minimal_fsdp.parallel.clipped_adamw import ClippedAdamW

    from support import TINY

    torch.manual_seed(0)
    model = GPT(TINY)
    clipped = ClippedAdamW(model.parameters(), compile=False, lr=0.1)
    sum((p * torch.randn_like(p)).sum() for p in model.parameters()).backward()
    clipped.step()
    path = checkpointer.save(tmp_path / "run", 1, None, None, {}, state=state_of(model, clipped))
    model = GPT(TINY)
    fused = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    checkpointer.load(path, model, fused)
    assert clipped.param_groups[0]["fused"] is None and fused.param_groups[0]["fused"] is True
    assert all(torch.equal(x, y) for x, y in zip(moments(fused), moments(clipped)))
    assert len(moments(fused)) == len(list(model.parameters()))


def test_load_replicas_resumes_this_ranks_own_replica(tmp_path):
    path, (a, a_optimizer), _ = crafted_replicas(tmp_path, replicas=1)
    model, optimizer = tiny(seed=3)
    checkpointer.load_replicas(path, model, optimizer)
    assert same(weights(model), weights(a))
    assert all(torch.equal(x, y) for x, y in zip(moments(optimizer), moments(a_optimizer)))
    model, _ = tiny(seed=3)
    checkpointer.load_replicas(path, model)  # the model alone
    assert same(weights(model), weights(a))


@pytest.mark.parametrize("replicas", [2, 0, None])
def test_load_replicas_from_another_world_starts_from_the_average(tmp_path, console, replicas):
    out, err = console()
    path, _, (b, b_optimizer) = crafted_replicas(tmp_path, replicas)
    if replicas is None:  # an all-reduce run's checkpoint
        meta = meta_of(path)
        del meta["replicas"]
        (path / "meta.json").write_text(json.dumps(meta))
    model, optimizer = tiny(seed=3)
    checkpointer.load_replicas(path, model, optimizer)
    assert same(weights(model), weights(b))
    assert all(torch.equal(x, y) for x, y in zip(moments(optimizer), moments(b_optimizer)))
    said = out.flushed
    if replicas == 2:
        assert (
            said
            == f"{path} holds 2 replicas and this run has 1 ranks: every rank starts from their "
            f"average\n"
        )
    else:
        assert said == ""


def test_checkpointer_of_a_decentralized_run(tmp_path):
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--keep_last", "1"])
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    model, optimizer = tiny()
    saver = checkpointer.Checkpointer(
        Checkpoint.of(cfg), dataclasses.asdict(cfg), config, tokenizer, decentralized=True
    )
    saver.save(1, model, optimizer, 2.0, {"data": {"train_blocks_seen": 4}})
    path = saver.save(2, model, optimizer, 1.0, {"data": {"train_blocks_seen": 8}})
    assert sorted(p.name for p in path.parent.iterdir()) == ["best", "latest", "step_2"]
    meta = meta_of(path)
    assert (
        meta["replicas"],
        meta["val_loss"],
        meta["model_type"],
        meta["model"]["embed_size"],
    ) == (1, 1.0, "gpt", 8)
    assert meta["config"]["keep_last"] == 1 and meta["state"] == {"data": {"train_blocks_seen": 8}}
    assert (path / "tokenizer.json").read_text() == "{}"
    # step, exp_avg, exp_avg_sq of each parameter
    assert len(safe_load.tensor_names(path, "replicas.0.optim.state.")) == 3 * len(
        list(tiny()[0].parameters())
    )
    averaged = dataclasses.replace(cfg, run_name="avg", save_average=True)
    average_only = checkpointer.Checkpointer(
        Checkpoint.of(averaged), dataclasses.asdict(averaged), config, None, decentralized=True
    )
    assert meta_of(average_only.save(1, model, optimizer, None, {}))["replicas"] == 0


def test_checkpointer_restores_the_replica_only_for_a_decentralized_run(tmp_path):
    path, (a, _), (b, _) = crafted_replicas(tmp_path, replicas=1)
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run"])
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    for decentralized, expected in [(True, a), (False, b)]:
        model, optimizer = tiny(seed=3)
        checkpointer.Checkpointer(
            Checkpoint.of(cfg), dataclasses.asdict(cfg), config, None, decentralized
        ).restore(path, model, optimizer, seed=0)
        assert same(weights(model), weights(expected))


def test_checkpointer_saves_and_restores_model_optimizer_and_rng(tmp_path):
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--keep_last", "1"])
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.model").write_bytes(b"\x00\x01")
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    model, optimizer = tiny()
    saver = checkpointer.Checkpointer(
        Checkpoint.of(cfg), dataclasses.asdict(cfg), config, tokenizer, decentralized=False
    )
    saver.save(1, model, optimizer, 3.0, {"schedule": {"last_step": 9}})
    path = saver.save(2, model, optimizer, 2.0, {"schedule": {"last_step": 9}})
    expected = (weights(model), moments(optimizer), torch.rand(3))
    assert sorted(p.name for p in path.parent.iterdir()) == ["best", "latest", "step_2"]
    assert (path / "tokenizer.model").read_bytes() == b"\x00\x01"
    restored, restored_optimizer = tiny(seed=5)
    meta = saver.restore(path, restored, restored_optimizer, seed=0)
    assert (meta["step"], meta["val_loss"], meta["state"]) == (
        2,
        2.0,
        {"schedule": {"last_step": 9}},
    )
    assert same(weights(restored), expected[0])
    assert all(torch.equal(x, y) for x, y in zip(moments(restored_optimizer), expected[1]))
    assert torch.equal(torch.rand(3), expected[2])  # the RNG continues from the save


# ---- RNG states ----


def test_another_world_size_reseeds_each_rank_from_seed_rank_and_step(run):
    meta = meta_of(run / "step_3")
    (run / "step_3" / "meta.json").write_text(json.dumps(dict(meta, world_size=2)))
    streams = {}
    for seed, rank in [(7, 0), (7, 1), (8, 1)]:
        assert not checkpointer.restore_rng(run / "step_3", rank=rank, world_size=1, seed=seed)
        streams[seed, rank] = torch.rand(3)
        torch.manual_seed((seed * 1_000_003 + rank) * 1_000_000_007 + 3)
        assert torch.equal(streams[seed, rank], torch.rand(3))
    assert not torch.equal(streams[7, 0], streams[7, 1]) and not torch.equal(
        streams[7, 1], streams[8, 1]
    )
    for seed in (10**6, -(10**6)):  # past what torch.manual_seed takes once multiplied out
        assert not checkpointer.restore_rng(run / "step_3", rank=0, world_size=1, seed=seed)
    model, optimizer = tiny()
    cfg = parse_args(["--checkpoint_dir", str(run.parent), "--run_name", "run"])
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    checkpointer.Checkpointer(
        Checkpoint.of(cfg), dataclasses.asdict(cfg), config, None, False
    ).restore(run / "step_3", model, optimizer, seed=7)
    assert torch.equal(torch.rand(3), streams[7, 0])


def test_cuda_rng_state_is_saved_and_restored_where_cuda_is(run, monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda: torch.tensor([7, 8, 9], dtype=torch.uint8)
    )
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    (run / "step_2" / "rng_0.pt").write_bytes(rng_bytes())
    assert checkpointer.restore_rng(run / "step_2", rank=0, world_size=1, seed=0)
    assert len(restored) == 1 and restored[0].tolist() == [7, 8, 9]
    # saved without CUDA
    assert checkpointer.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    assert len(restored) == 1


def test_rng_states_of_numpy_and_python_come_back(run):
    assert checkpointer.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    expected = (np.random.rand(3), random.random(), random.gauss(0, 1))
    np.random.rand(5), random.random()
    assert checkpointer.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    assert np.array_equal(np.random.rand(3), expected[0])
    assert (random.random(), random.gauss(0, 1)) == expected[1:]

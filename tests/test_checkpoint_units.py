"""checkpoint.py and its readers (checkpoint_find, checkpoint_meta, safe_load) in this process (fast, and what mutation
testing can see): what a save writes (every file with its size and CRC-32, meta.json, the tokenizer, `latest` and
`best`, pruning, a step saved again), how a failed save is reported (one line, the partial directory removed,
`latest` untouched), decentralized replicas, the RNG states, what verify() finds wrong with a damaged or crafted
checkpoint (each hostile field of meta.json, files that are not regular or lie outside the checkpoint, a model the
shards do not hold), the markers and the order checkpoints are tried in, resolve(), find() as one rank of two, the
format-1 meta.json, the `progress` command line, and that loading never runs code from the files (the metadata
unpickler's allow-list, torch.load with weights_only even where the environment asks torch for the unsafe default).
test_checkpoint.py runs the same through real training, several ranks and injected faults."""
import dataclasses
import errno
import io
import json
import os
import pickle
import random
import shutil
import sys
import threading
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from minimal_fsdp import checkpoint, checkpoint_find, checkpoint_meta, environment, files, safe_load
from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_rank_group")


TINY = GPTConfig(vocab_size=8, seq_length=4, num_layers=2, num_heads=1, embed_size=4)


def tiny(seed=0):
    """A two-block GPT (a model meta.json can describe) and an AdamW that has taken one step (so it has moments),
    both seeded."""
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
    """A run with steps 1..3 (val losses 3, 2, none), a tokenizer file in each: (run, its weights, tokenizer)."""
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')
    (tokenizer / "vocab.txt").write_text("not a tokenizer.* file: not copied")
    model, optimizer = tiny()
    for step, val_loss in [(1, 3.0), (2, 2.0), (3, None)]:
        state = {"schedule": {"lr_decay_steps": 10, "last_step": 100 if step == 3 else None},
                 "data": {"train_blocks_seen": 4 * step}}
        checkpoint.save(root / "run", step, model, optimizer, {"format": 2, "val_loss": val_loss, "state": state,
                                                               "model_type": "gpt", "model": TINY.to_dict(),
                                                               "config": {"batch_size": 4}},
                        tokenizer_dir=tokenizer)
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


class Console(io.StringIO):
    """A stream that remembers what had been flushed to it: a message that is not flushed can sit in a buffer
    while the process hangs or dies."""
    flushed = ""

    def flush(self):
        self.flushed = self.getvalue()


@pytest.fixture
def console(monkeypatch):
    """Call it in the test's body (pytest sets its own sys.stdout and sys.stderr for each phase of a test)."""
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


# ---- saving ----

def test_a_save_writes_every_file_with_its_size_and_crc32(tmp_path):
    run, model_weights, _ = save_three(tmp_path)  # here, not in a fixture: mutation testing sees what a test calls
    step = run / "step_3"
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp", "meta.json", "rng_0.pt",
                                                      "tokenizer.json"]
    assert (step / "tokenizer.json").read_text() == '{"vocab": ["a", "b"]}'
    meta = meta_of(step)
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "rng_0.pt", "tokenizer.json"]
    for name, (size, crc) in meta["files"].items():
        data = (step / name).read_bytes()
        assert (size, crc) == (len(data), zlib.crc32(data)), name
    assert (meta["step"], meta["world_size"], meta["format"], meta["val_loss"]) == (3, 1, 2, None)
    assert meta["state"]["schedule"] == {"lr_decay_steps": 10, "last_step": 100}
    assert (step / "meta.json").read_text().startswith('{\n "')  # one key a line, for people who read it
    assert (run / "latest").read_text() == "step_3\n" and (run / "best").read_text() == "step_2\n"
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_1", "step_2", "step_3"]  # keep all
    assert same(safe_load.load_full_model_state(step), model_weights)


def test_crc32_reads_a_file_in_chunks(tmp_path):
    data = bytes(range(256)) * 3
    (tmp_path / "f").write_bytes(data)
    assert checkpoint_find.crc32(tmp_path / "f", chunk=7) == checkpoint_find.crc32(tmp_path / "f") == zlib.crc32(data)


def test_best_moves_only_to_a_strictly_lower_val_loss(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    best = []
    for step, val_loss in enumerate([2.0, 2.0, None, 1.5, 1.5], start=1):
        checkpoint.save(run, step, model, optimizer, {"val_loss": val_loss})
        best.append((run / "best").read_text().strip())
    assert best == ["step_1", "step_1", "step_1", "step_4", "step_4"]


def test_best_resaved_without_a_val_loss_gives_way_to_the_next_validated_save(tmp_path):
    """A run restarted from an older checkpoint saves the step `best` names again, this time without a val loss."""
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpoint.save(run, 1, model, optimizer, {"val_loss": 1.0})
    checkpoint.save(run, 1, model, optimizer, {"val_loss": None})
    checkpoint.save(run, 2, model, optimizer, {"val_loss": 5.0})
    assert (run / "best").read_text() == "step_2\n"


def test_a_step_saved_again_replaces_the_old_one_whole(tmp_path):
    run = tmp_path / "run"
    first, optimizer = tiny(seed=1)
    checkpoint.save(run, 2, first, optimizer, {})
    second, optimizer = tiny(seed=2)
    checkpoint.save(run, 2, second, optimizer, {})
    assert same(safe_load.load_full_model_state(run / "step_2"), weights(second))
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_2"]  # nothing of the old one left aside


def test_a_save_removes_what_a_crashed_save_left(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    (run / ".tmp-step_9").mkdir(parents=True)
    (run / ".tmp-step_9" / "__0_0.distcp").write_bytes(b"half")
    (run / ".tmp-old-step_4").mkdir()
    (run / ".tmp-stray").write_text("a file, which rmtree cannot remove: it does not stop the save")
    checkpoint.save(run, 1, model, optimizer, {})
    assert sorted(p.name for p in run.iterdir()) == [".tmp-stray", "latest", "step_1"]


def test_keep_last_prunes_quietly_even_when_best_is_damaged(tmp_path, console):
    out, err = console()
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpoint.save(run, 1, model, optimizer, {"val_loss": 1.0})
    (run / "best").write_bytes(b"\xff\xfe garbage")
    checkpoint.save(run, 2, model, optimizer, {"val_loss": None}, keep_last=1)
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_2"]
    checkpoint.save(run, 3, model, optimizer, {"val_loss": 2.0}, keep_last=1)
    assert (run / "best").read_text() == "step_3\n"
    assert err.getvalue() == ""  # a damaged `best` is replaced, not reported on every save


def test_markers_are_written_durably(tmp_path, monkeypatch):
    synced = []
    sync = files.sync
    monkeypatch.setattr(files, "sync", lambda path: synced.append(Path(path).name) or sync(path))
    model, optimizer = tiny()
    checkpoint.save(tmp_path / "run", 1, model, optimizer, {"val_loss": 1.0})
    assert any(name.startswith(".latest.tmp") for name in synced)  # the marker's data, before its rename
    assert any(name.startswith(".best.tmp") for name in synced)
    assert synced.count("run") >= 3  # the checkpoint's rename and both markers' renames


def test_save_hands_dcp_the_callers_planner(tmp_path):
    class Recording(DefaultSavePlanner):
        used = False

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            Recording.used = True
            return super().set_up_planner(state_dict, storage_meta, is_coordinator)

    model, optimizer = tiny()
    checkpoint.save(tmp_path / "run", 1, model, optimizer, {}, planner=Recording())
    assert Recording.used


# ---- a failed save: one line on every rank, the partial directory removed, the previous checkpoint kept ----

def test_a_save_that_cannot_start_fails_in_one_line(tmp_path):
    model, optimizer = tiny()
    (tmp_path / "file").write_text("")
    run = tmp_path / "file" / "run"
    with pytest.raises(checkpoint.SaveError) as raised:
        checkpoint.save(run, 1, model, optimizer, {})
    assert str(raised.value) == (f"cannot start checkpoint {run}/step_1 (rank 0: Not a directory: {run}/.tmp-step_1); "
                                 "the previous checkpoint is untouched")


def test_a_save_after_another_run_took_the_lock_writes_nothing(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpoint.save(run, 1, model, optimizer, {})
    (run / ".tmp-step_2").mkdir()  # left by a save of step 2 that crashed: gone too, as the failed save's own
    lock = files.RunLock({"--checkpoint_dir": run})
    lock.acquire()
    try:
        (run / ".lock").write_text(json.dumps({"token": "another run's"}))
        with pytest.raises(checkpoint.SaveError, match=rf"^cannot start checkpoint {run}/step_2 \(rank 0: "
                                                       r"LockError: another run took over .*\); the previous"):
            checkpoint.save(run, 2, model, optimizer, {})
    finally:
        lock.release()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "latest", "step_1"]


def test_a_full_disk_while_writing_fails_in_one_line_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpoint.save(run, 1, model, optimizer, {})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/scratch/__0_0.distcp")
    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(checkpoint.SaveError) as raised:
        checkpoint.save(run, 2, model, optimizer, {})
    assert str(raised.value) == (f"writing checkpoint {run}/step_2 failed (rank 0: No space left on device: "
                                 "/scratch/__0_0.distcp); the previous checkpoint is untouched")
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_1"]
    assert (run / "latest").read_text() == "step_1\n"


def test_a_failure_that_cannot_be_pickled_is_still_reported(tmp_path, monkeypatch):
    class Stuck(RuntimeError):
        def __init__(self):
            super().__init__("the writer is stuck")
            self.lock = threading.Lock()  # an exception is not always picklable: only its text travels

    def stuck(*args, **kwargs):
        raise Stuck()
    monkeypatch.setattr(dcp, "save", stuck)
    model, optimizer = tiny()
    with pytest.raises(checkpoint.SaveError, match=r"\(rank 0: Stuck: the writer is stuck\)"):
        checkpoint.save(tmp_path / "run", 1, model, optimizer, {})
    assert list((tmp_path / "run").iterdir()) == []


def test_a_save_that_fails_while_finishing_leaves_the_previous_checkpoint(tmp_path):
    model, optimizer = tiny()
    run = tmp_path / "run"
    checkpoint.save(run, 1, model, optimizer, {})
    tokenizer = tmp_path / "tokenizer"
    (tokenizer / "tokenizer.d").mkdir(parents=True)  # unreadable as a file
    with pytest.raises(checkpoint.SaveError) as raised:
        checkpoint.save(run, 2, model, optimizer, {}, tokenizer_dir=tokenizer)
    assert str(raised.value) == (f"finishing checkpoint {run}/step_2 failed (rank 0: Is a directory: "
                                 f"{tokenizer}/tokenizer.d); the previous checkpoint is untouched")
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_1"]


def test_failure_names_the_first_failing_rank_in_one_line():
    assert checkpoint._failure(OSError(errno.ENOSPC, "No space left on device", "/a/b"), 3) == \
        (3, "No space left on device: /a/b")
    assert checkpoint._failure(OSError(errno.EIO, "Input/output error"), 1) == (1, "Input/output error")
    assert checkpoint._failure(OSError("no errno"), 2) == (2, "OSError: no errno")
    assert checkpoint._failure(ValueError("two\n   lines"), 0) == (0, "ValueError: two lines")
    assert checkpoint._failure(ValueError("x" * 400), 0) == (0, "ValueError: " + "x" * 300)
    both = CheckpointException("save failed", {2: (ValueError("on two"), "traceback"), 1: OSError(errno.EIO, "EIO")})
    assert checkpoint._failure(both, 0) == (1, "EIO")
    one = CheckpointException("save failed", {2: (OSError(errno.ENOSPC, "full", "/x"), "traceback")})
    assert checkpoint._failure(one, 0) == (2, "full: /x")
    assert checkpoint._failure(CheckpointException("nothing known", {}), 5) == (
        5, "CheckpointException: CheckpointException ranks:dict_keys([])")


# ---- decentralized replicas ----

def state_of(model, optimizer):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def test_save_replicas_keeps_this_ranks_replica_beside_the_average(tmp_path):
    model, optimizer = tiny()
    path = checkpoint.save_replicas(tmp_path / "run", 1, model, optimizer, {"val_loss": None})
    checkpoint.save_replicas(tmp_path / "run", 2, model, optimizer, {"val_loss": None})
    assert path == tmp_path / "run" / "step_1" and (tmp_path / "run" / "step_2").is_dir()  # keep_last: all
    assert meta_of(path)["replicas"] == 1
    names = [name for name, _, _ in safe_load.tensor_names(path)]
    assert same(safe_load.read_tensors(path, names), weights(model))  # the average of one replica
    assert same(safe_load.read_tensors(path, names, prefix="replicas.0.model."), weights(model))
    moments_saved = [n for n, _, _ in safe_load.tensor_names(path, "replicas.0.optim.state.") if "exp_avg" in n]
    assert len(moments_saved) == 2 * len(list(model.parameters()))
    path = checkpoint.save_replicas(tmp_path / "average", 1, model, optimizer, {}, average_only=True)
    assert meta_of(path)["replicas"] == 0
    assert safe_load.tensor_names(path, "replicas.") == []


def crafted_replicas(tmp_path, replicas):
    """A checkpoint whose average (model b) differs from this rank's replica (model a): one rank cannot make
    one by training, so it is written directly."""
    a, b = tiny(seed=1), tiny(seed=2)
    state = dict(state_of(*b), replicas={"0": state_of(*a)})
    path = checkpoint.save(tmp_path / "run", 1, None, None, {"replicas": replicas}, state=state)
    return path, a, b


def test_load_replicas_resumes_this_ranks_own_replica(tmp_path):
    path, (a, a_optimizer), _ = crafted_replicas(tmp_path, replicas=1)
    model, optimizer = tiny(seed=3)
    checkpoint.load_replicas(path, model, optimizer)
    assert same(weights(model), weights(a))
    assert all(torch.equal(x, y) for x, y in zip(moments(optimizer), moments(a_optimizer)))
    model, _ = tiny(seed=3)
    checkpoint.load_replicas(path, model)  # the model alone
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
    checkpoint.load_replicas(path, model, optimizer)
    assert same(weights(model), weights(b))
    assert all(torch.equal(x, y) for x, y in zip(moments(optimizer), moments(b_optimizer)))
    said = out.flushed
    if replicas == 2:
        assert said == f"{path} holds 2 replicas and this run has 1 ranks: every rank starts from their average\n"
    else:
        assert said == ""


def test_checkpointer_of_a_decentralized_run(tmp_path):
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--keep_last", "1"])
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    model, optimizer = tiny()
    saver = checkpoint.Checkpointer(cfg, config, tokenizer, decentralized=True)
    saver.save(1, model, optimizer, 2.0, {"data": {"train_blocks_seen": 4}})
    path = saver.save(2, model, optimizer, 1.0, {"data": {"train_blocks_seen": 8}})
    assert sorted(p.name for p in path.parent.iterdir()) == ["best", "latest", "step_2"]
    meta = meta_of(path)
    assert (meta["replicas"], meta["val_loss"], meta["model_type"], meta["model"]["embed_size"]) == (1, 1.0, "gpt", 8)
    assert meta["config"]["keep_last"] == 1 and meta["state"] == {"data": {"train_blocks_seen": 8}}
    assert (path / "tokenizer.json").read_text() == "{}"
    # step, exp_avg, exp_avg_sq of each parameter
    assert len(safe_load.tensor_names(path, "replicas.0.optim.state.")) == 3 * len(list(tiny()[0].parameters()))
    average_only = checkpoint.Checkpointer(dataclasses.replace(cfg, run_name="avg", save_average=True), config,
                                           None, decentralized=True)
    assert meta_of(average_only.save(1, model, optimizer, None, {}))["replicas"] == 0


def test_checkpointer_restores_the_replica_only_for_a_decentralized_run(tmp_path):
    path, (a, _), (b, _) = crafted_replicas(tmp_path, replicas=1)
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run"])
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    for decentralized, expected in [(True, a), (False, b)]:
        model, optimizer = tiny(seed=3)
        checkpoint.Checkpointer(cfg, config, None, decentralized).restore(path, model, optimizer, seed=0)
        assert same(weights(model), weights(expected))


def test_checkpointer_saves_and_restores_model_optimizer_and_rng(tmp_path):
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--keep_last", "1"])
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.model").write_bytes(b"\x00\x01")
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    model, optimizer = tiny()
    saver = checkpoint.Checkpointer(cfg, config, tokenizer, decentralized=False)
    saver.save(1, model, optimizer, 3.0, {"schedule": {"last_step": 9}})
    path = saver.save(2, model, optimizer, 2.0, {"schedule": {"last_step": 9}})
    expected = (weights(model), moments(optimizer), torch.rand(3))
    assert sorted(p.name for p in path.parent.iterdir()) == ["best", "latest", "step_2"]
    assert (path / "tokenizer.model").read_bytes() == b"\x00\x01"
    restored, restored_optimizer = tiny(seed=5)
    meta = saver.restore(path, restored, restored_optimizer, seed=0)
    assert (meta["step"], meta["val_loss"], meta["state"]) == (2, 2.0, {"schedule": {"last_step": 9}})
    assert same(weights(restored), expected[0])
    assert all(torch.equal(x, y) for x, y in zip(moments(restored_optimizer), expected[1]))
    assert torch.equal(torch.rand(3), expected[2])  # the RNG continues from the save


# ---- RNG states ----

def test_another_world_size_reseeds_each_rank_from_seed_rank_and_step(run):
    meta = meta_of(run / "step_3")
    (run / "step_3" / "meta.json").write_text(json.dumps(dict(meta, world_size=2)))
    streams = {}
    for seed, rank in [(7, 0), (7, 1), (8, 1)]:
        assert not checkpoint.restore_rng(run / "step_3", rank=rank, world_size=1, seed=seed)
        streams[seed, rank] = torch.rand(3)
        torch.manual_seed((seed * 1_000_003 + rank) * 1_000_000_007 + 3)
        assert torch.equal(streams[seed, rank], torch.rand(3))
    assert not torch.equal(streams[7, 0], streams[7, 1]) and not torch.equal(streams[7, 1], streams[8, 1])
    for seed in (10**6, -10**6):  # past what torch.manual_seed takes once multiplied out
        assert not checkpoint.restore_rng(run / "step_3", rank=0, world_size=1, seed=seed)
    model, optimizer = tiny()
    cfg = parse_args(["--checkpoint_dir", str(run.parent), "--run_name", "run"])
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    checkpoint.Checkpointer(cfg, config, None, False).restore(run / "step_3", model, optimizer, seed=7)
    assert torch.equal(torch.rand(3), streams[7, 0])


def test_cuda_rng_state_is_saved_and_restored_where_cuda_is(run, monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7, 8, 9], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    (run / "step_2" / "rng_0.pt").write_bytes(checkpoint._rng_bytes())
    assert checkpoint.restore_rng(run / "step_2", rank=0, world_size=1, seed=0)
    assert len(restored) == 1 and restored[0].tolist() == [7, 8, 9]
    assert checkpoint.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)  # saved without CUDA
    assert len(restored) == 1


def test_rng_states_of_numpy_and_python_come_back(run):
    assert checkpoint.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    expected = (np.random.rand(3), random.random(), random.gauss(0, 1))
    np.random.rand(5), random.random()
    assert checkpoint.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    assert np.array_equal(np.random.rand(3), expected[0])
    assert (random.random(), random.gauss(0, 1)) == expected[1:]


# ---- loading never runs code from the files ----

@pytest.fixture
def unsafe_default(monkeypatch):
    """torch.load's default made unsafe (weights_only=False), as a user may set it for their own files: the
    checkpoint's loads must say weights_only=True themselves."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def test_rng_files_are_read_without_running_code(run, tmp_path, unsafe_default):
    evidence = tmp_path / "code-ran"
    buffer = io.BytesIO()
    torch.save(MakeDirectory(evidence), buffer)
    (run / "step_3" / "rng_0.pt").write_bytes(buffer.getvalue())
    assert checkpoint_find.verify(run / "step_3") == "rng_0.pt is missing or unreadable (UnpicklingError)"
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    assert not evidence.exists()


def test_optimizer_entries_are_read_without_running_code(tmp_path, unsafe_default):
    evidence = tmp_path / "code-ran"
    model, optimizer = tiny()
    state = state_of(model, optimizer)
    state["optim"]["param_groups"][0]["lr"] = MakeDirectory(evidence)
    state["replicas"] = {"0": state_of(model, optimizer)}
    state["replicas"]["0"]["optim"]["param_groups"][0]["lr"] = MakeDirectory(evidence)
    path = checkpoint.save(tmp_path / "run", 1, None, None, {"replicas": 1}, state=state)
    for load in (checkpoint.load, checkpoint.load_replicas):
        with pytest.raises(CheckpointException):
            load(path, *tiny(seed=2))
        assert not evidence.exists()


def test_the_allow_list_holds_what_dcp_metadata_refers_to_and_nothing_that_runs_code(saved):
    allowed = safe_load._allowed_globals()
    metadata = "torch.distributed.checkpoint.metadata"
    assert {(metadata, name) for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                                          "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                          "_MEM_FORMAT_ENCODING")} <= allowed
    assert {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
            ("torch", "Size"), ("torch.serialization", "_get_layout"), ("builtins", "set"), ("builtins", "frozenset"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
            ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # where Python 3.13 pickles them
            ("torch", "float32"), ("torch", "bfloat16"), ("torch", "strided"),
            ("torch", "contiguous_format")} <= allowed
    for module, name in allowed:  # classes, torch's dtype/layout/memory-format values, and one torch function
        if module == "pathlib._local" and sys.version_info < (3, 13):
            continue
        value = getattr(__import__(module, fromlist=[name]), name)
        assert isinstance(value, (type, torch.dtype, torch.layout, torch.memory_format)) or \
            (module, name) == ("torch.serialization", "_get_layout"), (module, name)
        if module == metadata:
            assert value.__module__ == metadata
    assert not {("builtins", "getattr"), ("builtins", "eval"), ("os", "system"), ("posix", "system"),
                ("torch", "load"), ("builtins", "__import__")} & allowed
    referred = set()

    class Recording(safe_load._MetadataUnpickler):
        def find_class(self, module, name):
            referred.add((module, name))
            return super().find_class(module, name)
    with open(saved[0] / "step_3" / ".metadata", "rb") as f:
        Recording(f).load()
    assert referred - {("builtins", "getattr")} <= allowed and ("torch", "Size") in referred


def load_pickle(data, tmp_path):
    (tmp_path / ".metadata").write_bytes(data)
    return safe_load.read_dcp_metadata(tmp_path / ".metadata")


def test_metadata_may_not_change_a_class(tmp_path):
    with pytest.raises(pickle.UnpicklingError, match="^checkpoint metadata tries to modify a class$"):
        load_pickle(b"ccollections\nOrderedDict\n}S'move_to_end'\nNsb.", tmp_path)
    assert OrderedDict.move_to_end is not None


def test_metadata_may_read_only_enum_members(tmp_path):
    with pytest.raises(pickle.UnpicklingError,
                       match="^checkpoint metadata reads an attribute of <class 'collections.OrderedDict'>, which is "
                             "not allowed$"):
        load_pickle(b"cbuiltins\ngetattr\n(ccollections\nOrderedDict\nS'fromkeys'\ntR.", tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="reads an attribute of"):
        load_pickle(b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
                    b"S'__init__'\ntR.", tmp_path)
    member = load_pickle(b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
                         b"S'TORCH_CONTIGUOUS_FORMAT'\ntR.", tmp_path)
    assert member.name == "TORCH_CONTIGUOUS_FORMAT"


def test_metadata_may_not_hold_persistent_ids(tmp_path):
    with pytest.raises(pickle.UnpicklingError,
                       match="^checkpoint metadata holds a persistent id, which is not allowed$"):
        load_pickle(b"P0\n.", tmp_path)


def test_safe_reader_reads_a_ranks_metadata_and_tags_it_with_its_load_id(run):
    step = run / "step_3"
    os.replace(step / ".metadata", step / "__0.metadata")
    reader = safe_load.SafeReader(str(step))
    metadata = reader.read_metadata(rank=0)
    assert metadata.storage_meta.load_id == reader.load_id is not None
    with pytest.raises(FileNotFoundError):
        reader.read_metadata()
    bare = dcp.metadata.Metadata(state_dict_metadata={})
    (step / ".metadata").write_bytes(pickle.dumps(bare))
    assert reader.read_metadata().storage_meta is None
    (step / ".metadata").write_bytes(pickle.dumps({}))  # not DCP's Metadata at all: returned for DCP to reject
    assert reader.read_metadata() == {}


# ---- reading tensors in one process ----

def test_tensor_names_lists_the_models_tensors(saved):
    step = saved[0] / "step_3"
    assert safe_load.tensor_names(step) == [(name, p.shape, torch.float32) for name, p in tiny()[0].named_parameters()]
    assert [name for name, _, _ in safe_load.tensor_names(step, "optim.state.ln_f.")] == [
        "weight.step", "weight.exp_avg", "weight.exp_avg_sq", "bias.step", "bias.exp_avg", "bias.exp_avg_sq"]
    assert safe_load.tensor_names(step, "optim.param_groups.") == []  # not tensors


def test_read_tensors_keeps_each_tensors_dtype_and_shape(tmp_path):
    state = {"model": {"half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                       "ints": torch.tensor([5, 6], dtype=torch.int32)}}
    path = checkpoint.save(tmp_path / "run", 1, None, None, {}, state=state)
    got = safe_load.read_tensors(path, ["ints", "half"])
    assert list(got) == ["ints", "half"]
    for name, tensor in got.items():
        assert tensor.dtype == state["model"][name].dtype and torch.equal(tensor, state["model"][name])
    assert same(safe_load.load_full_model_state(path), state["model"])


def test_read_tensors_reads_any_part_of_the_checkpoint(saved):
    model, optimizer = tiny()
    got = safe_load.read_tensors(saved[0] / "step_3", ["weight.exp_avg", "bias.exp_avg_sq"], prefix="optim.state.ln_f.")
    assert torch.equal(got["weight.exp_avg"], optimizer.state[model.ln_f.weight]["exp_avg"])
    assert torch.equal(got["bias.exp_avg_sq"], optimizer.state[model.ln_f.bias]["exp_avg_sq"])


def test_load_restores_the_model_alone_or_with_its_optimizer(saved):
    model, optimizer = tiny(seed=4)
    checkpoint.load(saved[0] / "step_3", model)
    assert same(weights(model), saved[1])
    model, optimizer = tiny(seed=4)
    checkpoint.load(saved[0] / "step_3", model, optimizer)
    assert same(weights(model), saved[1])
    assert all(torch.equal(x, y) for x, y in zip(moments(optimizer), moments(tiny()[1])))


def test_read_tensors_needs_no_other_rank(saved, monkeypatch):
    """Export and inspection read a checkpoint in one process, also inside a running job: no collectives."""
    def collective(*args, **kwargs):
        raise AssertionError("read_tensors called a collective")
    for name in ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "barrier",
                 "all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, collective)
    assert same(safe_load.read_tensors(saved[0] / "step_3", ["ln_f.bias"]), {"ln_f.bias": saved[1]["ln_f.bias"]})


def test_read_tensors_silences_only_dcps_single_process_notice(saved, monkeypatch):
    read_metadata = safe_load.SafeReader.read_metadata

    def warns(self, *args, **kwargs):
        warnings.warn("something else", FutureWarning)
        return read_metadata(self, *args, **kwargs)
    monkeypatch.setattr(safe_load.SafeReader, "read_metadata", warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safe_load.read_tensors(saved[0] / "step_3", ["ln_f.bias"])
    assert [str(w.message) for w in caught] == ["something else"]


# ---- verify: one line on what is wrong ----

def test_verify_names_what_is_wrong_with_meta_json(run):
    assert checkpoint_find.verify(run / "step_9") == "no such directory"
    meta = run / "step_3" / "meta.json"
    for text, problem in [("[1, 2]", "meta.json holds a JSON list, not an object"), ("{}", "meta.json has no step"),
                          ('{"step": "3"}', 'meta.json: step is "3", not a whole number >= 0'),
                          ('{"step": 3, "wor', "meta.json is not JSON (JSONDecodeError: Unterminated string")]:
        meta.write_text(text)
        assert checkpoint_find.verify(run / "step_3").startswith(problem)
    meta.unlink()
    assert checkpoint_find.verify(run / "step_3") == "meta.json is missing or unreadable"


def edited(path, edit):
    meta = meta_of(path)
    edit(meta)
    (Path(path) / "meta.json").write_text(json.dumps(meta))


# The hostile edits of a saved meta.json (each was a traceback or a hang), and what verify says of each.
HOSTILE_META = {
    "no config": (lambda m: m.pop("config"), "meta.json has no config"),
    "no model": (lambda m: m.pop("model"), "meta.json has no model"),
    "state a string": (lambda m: m.update(state="x"), 'meta.json: state is "x", not an object'),
    "step a string": (lambda m: m.update(step="3"), 'meta.json: step is "3", not a whole number >= 0'),
    "val_loss a string": (lambda m: m.update(val_loss="low"), 'meta.json: val_loss is "low", not a number or null'),
    "position a string": (lambda m: m["state"]["data"].update(train_blocks_seen="12"),
                          'meta.json: state.data.train_blocks_seen is "12", not a whole number >= 0'),
    "position negative": (lambda m: m["state"]["data"].update(train_blocks_seen=-1),
                          "meta.json: state.data.train_blocks_seen is -1, not a whole number >= 0"),
    "stream of strings": (lambda m: m["state"].update(data={"stream": [["a", 0, 0]]}),
                          "meta.json: state.data.stream is not a list of [file, document, token] positions"),
    "config a list": (lambda m: m.update(config=[1]), "meta.json: config is [1], not an object"),
    "schedule a number": (lambda m: m["state"].update(schedule=5), "meta.json: state.schedule is 5, not an object"),
    "files entry short": (lambda m: m["files"].update({"rng_0.pt": [5]}),
                          'meta.json: files.rng_0.pt is [5], not [size, CRC-32]'),
    "files entry a device": (lambda m: m["files"].update({"/dev/zero": [5, 1]}),
                             'meta.json: files names "/dev/zero", not a plain file name inside the checkpoint'),
    "files entry outside": (lambda m: m["files"].update({"../step_2/meta.json": [5, 1]}),
                            'meta.json: files names "../step_2/meta.json", not a plain file name inside the '
                            'checkpoint'),
    "absurd layers": (lambda m: m["model"].update(num_layers=10**9),
                      "meta.json: model.num_layers is 1000000000, not a whole number in [1, 4096]"),
    "layers the shards lack": (lambda m: m["model"].update(num_layers=300),
                               "meta.json describes 300 layers, the shards hold 2"),
    "another width": (lambda m: m["model"].update(embed_size=8, num_heads=2),
                      "meta.json's model gives wte.weight the shape [8, 8], the shards hold [8, 4]"),
    "zero heads": (lambda m: m["model"].update(num_heads=0),
                   "meta.json: model.num_heads is 0, not a whole number in [1, 4096]"),
    "heads not dividing": (lambda m: m["model"].update(num_heads=3),
                           "meta.json: model: embed size 4 is not divisible by 3 heads"),
    "unknown model field": (lambda m: m["model"].update(colour=1),
                            "meta.json: model.colour is not a field of a gpt model"),
    "model type": (lambda m: m.update(model_type="bert"), 'meta.json: model_type is "bert", not one of gpt, llama'),
    "model type a list": (lambda m: m.update(model_type=["gpt"]),
                          'meta.json: model_type is ["gpt"], not one of gpt, llama'),
    "format": (lambda m: m.update(format=7), "meta.json: format 7 is not one this version reads (1 or 2)"),
    "world size": (lambda m: m.update(world_size=10**9),
                   "meta.json: world_size is 1000000000, not a whole number in [1, 16777216]"),
}


@pytest.mark.parametrize("case", HOSTILE_META)
def test_a_hostile_meta_json_makes_its_checkpoint_damaged_in_one_line(run, console, case):
    edit, problem = HOSTILE_META[case]
    edited(run / "step_3", edit)
    assert checkpoint_find.verify(run / "step_3") == problem
    out, err = console()
    assert checkpoint_find.latest(run) == run / "step_2"  # the newest good one instead, with one line
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"
    checkpoint_find.main(["progress", "--checkpoint_dir", str(run.parent), "--run_name", run.name])
    assert out.getvalue() == "2 none\n"


def test_a_deeply_nested_or_oversized_meta_json_is_refused_unread(run):
    meta = run / "step_3" / "meta.json"
    meta.write_text('{"step": 3, "model": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert checkpoint_find.verify(run / "step_3") == "meta.json nests deeper than 32 levels"
    meta.write_text('{"step": 3, "x": "' + "[" * 200_000 + '"}')  # brackets in a string do not nest
    assert checkpoint_find.verify(run / "step_3") == "meta.json has no model"
    with open(meta, "r+b") as f:
        f.truncate(checkpoint_meta.MAX_BYTES + 1)  # sparse: no disk used
    assert checkpoint_find.verify(run / "step_3") == (
        f"meta.json is missing or unreadable ({checkpoint_meta.MAX_BYTES + 1} bytes, over {checkpoint_meta.MAX_BYTES})")


def test_a_deeply_nested_tokenizer_json_makes_its_checkpoint_damaged(run):
    (run / "step_3" / "tokenizer.json").write_text('{"vocab": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert checkpoint_find.verify(run / "step_3", checksums=False) == "tokenizer.json nests deeper than 32 levels"


def bounded(function, seconds=60):
    """function() in a thread: its result, or a failure if it is still running after `seconds` (a hang)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    return result[0]


@pytest.mark.parametrize("name", ["meta.json", ".metadata", "__0_0.distcp", "rng_0.pt", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["fifo", "link to a device", "link inside"])
def test_files_that_are_not_regular_are_never_read(run, name, kind):
    step = run / "step_3"
    file = step / name
    file.rename(step / "moved")
    if kind == "fifo":
        os.mkfifo(file)  # opening it for reading would wait for a writer forever
    else:
        file.symlink_to("/dev/zero" if kind == "link to a device" else step / "moved")
    problem = bounded(lambda: checkpoint_find.verify(step))
    assert problem is not None and "regular file" in problem, problem
    assert bounded(lambda: checkpoint_find.latest(run)) == run / "step_2"


def test_metadata_naming_a_shard_outside_the_checkpoint_is_refused(run):
    step = run / "step_3"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data = {index: dataclasses.replace(info, relative_path="../step_2/__0_0.distcp")}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    assert checkpoint_find.verify(step, checksums=False) == (".metadata names a shard '../step_2/__0_0.distcp' that is "
                                                             "not a plain file name inside the checkpoint")


def test_verify_reports_crafted_metadata_in_one_bounded_line(run):
    step = run / "step_3"
    (step / ".metadata").write_bytes(pickle.dumps(MakeDirectory(run / "code-ran")))
    assert checkpoint_find.verify(step) == (".metadata is missing or unreadable (UnpicklingError: checkpoint metadata "
                                            "refers to posix.mkdir, which is not allowed)")
    (step / ".metadata").write_bytes(b"c" + b"m" * 200 + b"\nx\n.")
    problem = checkpoint_find.verify(step)
    assert problem == ".metadata is missing or unreadable (UnpicklingError: " + (
        "checkpoint metadata refers to " + "m" * 200)[:120] + ")"
    assert not (run / "code-ran").exists()


def test_verify_finds_a_truncated_shard_whatever_order_the_metadata_lists_it_in(run):
    step = run / "step_3"
    shard = step / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-1])
    assert checkpoint_find.verify(step) == f"__0_0.distcp is truncated ({size - 1} of {size} bytes)"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    metadata.storage_data = dict(reversed(list(metadata.storage_data.items())))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    assert checkpoint_find.verify(step, checksums=False) == f"__0_0.distcp is truncated ({size - 1} of {size} bytes)"
    shard.unlink()
    assert checkpoint_find.verify(step) == "__0_0.distcp is missing"


def test_verify_needs_no_bytes_for_an_empty_byte_range(run):
    step = run / "step_3"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data = {index: dataclasses.replace(info, relative_path="__9_0.distcp", offset=0, length=0)}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    (step / "__9_0.distcp").write_bytes(b"")
    assert checkpoint_find.verify(step, checksums=False) is None


def test_verify_checks_every_ranks_rng_file(run):
    (run / "step_3" / "rng_0.pt").unlink()
    assert checkpoint_find.verify(run / "step_3") == "rng_0.pt is missing or unreadable (FileNotFoundError)"


def test_verify_checks_sizes_and_checksums_unless_told_not_to(run):
    step = run / "step_3"
    flip_a_byte(step / "__0_0.distcp")
    problem = "__0_0.distcp does not match its checksum: the file was damaged after it was saved"
    assert checkpoint_find.verify(step) == problem
    assert checkpoint_find.verify(step, checksums=False) is None
    # The reading shared by two processes: sorted names .metadata, __0_0.distcp, rng_0.pt, tokenizer.json.
    assert checkpoint_find.verify(step, share=(0, 2)) is None and checkpoint_find.verify(step, share=(1, 2)) == problem
    step = run / "step_2"
    size = (step / "tokenizer.json").stat().st_size
    with open(step / "tokenizer.json", "a") as f:
        f.write(" ")
    assert checkpoint_find.verify(step) == f"tokenizer.json has {size + 1} bytes, {size} when saved"
    (step / "tokenizer.json").unlink()
    assert checkpoint_find.verify(step) == "tokenizer.json: No such file or directory"
    assert checkpoint_find.verify(step, checksums=False) is None


def test_verify_accepts_a_checkpoint_from_before_checksums_and_world_size(run):
    step = run / "step_3"
    meta = meta_of(step)
    (step / "meta.json").write_text(json.dumps({"step": 3, "val_loss": meta["val_loss"], "model": meta["model"],
                                                "config": meta["config"]}))  # format 1
    (step / "rng_0.pt").unlink()
    flip_a_byte(step / "__0_0.distcp")
    assert checkpoint_find.verify(step) is None


# ---- markers, the order checkpoints are tried in ----

def test_step_dirs_are_numbered_directories_newest_first(tmp_path):
    for name in ["step_9", "step_10", "step_2", "step_x", "step_3.old"]:
        (tmp_path / name).mkdir()
    (tmp_path / "step_11").write_text("a file")
    assert checkpoint_find.step_dirs(tmp_path) == [tmp_path / "step_10", tmp_path / "step_9", tmp_path / "step_2"]


def test_candidates_start_at_latest_then_older_then_newer(tmp_path):
    for step in range(1, 5):
        (tmp_path / f"step_{step}").mkdir()
    assert checkpoint_find.candidates(tmp_path) == [tmp_path / f"step_{s}" for s in (4, 3, 2, 1)]
    (tmp_path / "latest").write_text("step_2\n")
    assert checkpoint_find.candidates(tmp_path) == [tmp_path / f"step_{s}" for s in (2, 1, 4, 3)]


def test_a_bad_marker_is_ignored_with_one_flushed_warning(tmp_path, console):
    out, err = console()
    marker = tmp_path / "latest"
    for data in [b"\xff\xfe\n", b"../other_run/step_3\n", b"step_3 and more"]:
        marker.write_bytes(data)
        assert checkpoint_find.marker(tmp_path, "latest") is None
        assert err.flushed == f"warning: ignoring {marker}: it does not name a step_<N> checkpoint of this run\n"
        assert out.getvalue() == ""
        err.seek(0), err.truncate(), err.flush()
    marker.write_text("  step_3\n")
    assert checkpoint_find.marker(tmp_path, "latest") == tmp_path / "step_3"
    assert checkpoint_find.marker(tmp_path, "best") is None
    assert err.getvalue() == ""


def test_latest_skips_damaged_checkpoints_with_a_line_each(run, console):
    out, err = console()
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    assert checkpoint_find.latest(run) == run / "step_2"
    assert err.flushed == (f"warning: skipping checkpoint {run / 'step_3'}: __0_0.distcp does not match its "
                                  "checksum: the file was damaged after it was saved\n")
    assert checkpoint_find.newest_complete(run, checksums=False) == run / "step_3"
    for step in (1, 2):
        (run / f"step_{step}" / "rng_0.pt").unlink()
    assert checkpoint_find.latest(run) is None
    assert checkpoint_find.latest(run.parent / "no_such_run") is None


def test_resolve_accepts_a_checkpoint_a_marker_or_a_run(run, console):
    out, err = console()
    assert checkpoint_find.resolve(run / "step_2") == run / "step_2"
    assert checkpoint_find.resolve(run / "best") == run / "step_2"
    assert checkpoint_find.resolve(run) == run / "step_3"
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    assert checkpoint_find.resolve(run) == run / "step_3"  # the cheap checks: the caller verifies the checksums
    (run / "step_3" / "rng_0.pt").unlink()
    assert checkpoint_find.resolve(run) == run / "step_2"
    (run / "latest").unlink()
    assert checkpoint_find.resolve(run) == run / "step_2"
    assert checkpoint_find.resolve(run.parent / "nothing") == run.parent / "nothing"
    (run.parent / "empty").mkdir()
    assert checkpoint_find.resolve(run.parent / "empty") == run.parent / "empty"
    shutil.copytree(run / "step_1", run / "step_2" / "step_1")  # meta.json makes a checkpoint, whatever else is there
    (run / "step_2" / "latest").write_text("step_1\n")
    assert checkpoint_find.resolve(run / "step_2") == run / "step_2"


def test_resolve_refuses_a_file_that_is_not_a_marker_in_one_line(run, console):
    out, err = console()
    (run / "notes.txt").write_text("step 3 was good")
    with pytest.raises(ConfigError) as raised:
        checkpoint_find.resolve(run / "notes.txt")
    assert str(raised.value) == (f"{run / 'notes.txt'} is a file but not a checkpoint marker (one line naming a "
                                 "step_<N> directory beside it): pass a step_<N> directory, a run directory or its "
                                 "latest/best marker")
    assert err.getvalue() == ""


def test_resolve_of_a_run_with_nothing_complete_says_why_and_returns_the_run(tmp_path, console):
    out, err = console()
    (tmp_path / "latest").write_text("step_4\n")
    assert checkpoint_find.resolve(tmp_path) == tmp_path
    assert err.getvalue() == f"warning: skipping checkpoint {tmp_path / 'step_4'}: no such directory\n"


# ---- find: the checkpoint a run starts from ----

def args_for(run, *extra):
    return parse_args(["--checkpoint_dir", str(run.parent), "--run_name", run.name, *extra])


def test_find_skips_a_checkpoint_whose_checksums_fail(run, console):
    out, err = console()
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    assert checkpoint_find.find(args_for(run)) == run / "step_2"
    assert err.getvalue() == (f"warning: skipping checkpoint {run / 'step_3'}: __0_0.distcp does not match "
                                     "its checksum: the file was damaged after it was saved\n")


def test_find_refuses_a_damaged_restart_checkpoint_in_one_line(run):
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    with pytest.raises(ConfigError) as raised:
        checkpoint_find.find(args_for(run, "--restart_checkpoint_file", str(run / "latest")))
    assert str(raised.value) == (f"--restart_checkpoint_file {run / 'latest'} is damaged: {run / 'step_3'}: "
                                 "__0_0.distcp does not match its checksum: the file was damaged after it was saved")
    (run / "step_2" / "rng_0.pt").unlink()
    with pytest.raises(ConfigError) as raised:
        checkpoint_find.find(args_for(run, "--restart_checkpoint_file", str(run / "step_2")))
    assert str(raised.value) == (f"--restart_checkpoint_file {run / 'step_2'} is not a complete checkpoint: "
                                 f"{run / 'step_2'}: rng_0.pt is missing or unreadable (FileNotFoundError)")


def test_resume_never_refuses_a_run_with_checkpoints_in_one_line(run):
    with pytest.raises(ConfigError) as raised:
        checkpoint_find.find(args_for(run, "--resume", "never"))
    assert str(raised.value) == (f"--resume never, but {run} already holds checkpoints: pick another --run_name, "
                                 "move that directory away, or resume from it with --resume auto")


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
def test_find_in_one_process_reads_every_checksum(run, monkeypatch, damaged):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    step = run / "step_3"
    if damaged == ".metadata":  # still readable, but not the bytes that were saved
        (step / ".metadata").write_bytes(pickle.dumps(safe_load.read_dcp_metadata(step / ".metadata"), protocol=2))
    else:
        flip_a_byte(step / damaged)
    assert checkpoint_find.find(args_for(run)) == run / "step_2"


@pytest.mark.parametrize("damaged,rank_0_reads_it", [("__0_0.distcp", False), ("rng_0.pt", True)])
def test_find_as_rank_1_of_2_reads_its_share_and_takes_rank_0s_list(run, monkeypatch, console, damaged,
                                                                    rank_0_reads_it):
    """Rank 0 lists the candidates and passes them on (run_on_main); each rank reads every other file's checksum
    (rank 1: the 2nd and 4th of .metadata, __0_0.distcp, rng_0.pt, tokenizer.json); the verdicts are gathered."""
    out, err = console()
    flip_a_byte(run / "step_3" / damaged)
    listed, sent = [], []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def run_on_main(fn, *args):
        listed.append(fn(*args))
        return listed[-1]

    checked, verify = [], checkpoint_find.verify

    def verify_noting(path, *args, **kwargs):
        checked.append(path)
        return verify(path, *args, **kwargs)

    def all_gather_object(out, mine):  # rank 0's verdict on its share of the checkpoint being checked, then ours
        sent.append(mine)
        out[:] = [verify(checked[-1], share=(0, 2)), mine]
    monkeypatch.setattr(checkpoint_find, "verify", verify_noting)
    monkeypatch.setattr(environment, "run_on_main", run_on_main)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert checkpoint_find.find(args_for(run)) == run / "step_2"
    assert listed == [[str(run / f"step_{s}") for s in (3, 2, 1)]]
    problem = f"{damaged} does not match its checksum: the file was damaged after it was saved"
    assert sent == ([None, None] if rank_0_reads_it else [problem, None])
    assert err.getvalue() == ""  # rank 0 reports it


# ---- format-1 meta.json (before "format" existed) ----

def read_meta(tmp_path, meta):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return checkpoint_meta.read_meta(tmp_path)


def test_read_meta_keeps_the_current_format_as_it_is(tmp_path):
    meta = {"format": 2, "step": 3, "lr_decay_steps": 5, "state": {"x": 1}}
    assert read_meta(tmp_path, meta) == meta
    with pytest.raises(checkpoint_meta.MetaError, match="^meta.json holds a JSON list, not an object$"):
        read_meta(tmp_path, [1, 2])


def test_read_meta_moves_format_1s_state_into_place(tmp_path):
    meta = {"step": 7, "world_size": 2, "config": {"batch_size": 3, "grad_accum_steps": 5}, "lr_decay_steps": 90,
            "last_step": 100, "val_loss": 1.5, "data_position": {"train_blocks_seen": 11}}
    assert read_meta(tmp_path, meta) == dict(meta, format=2, model_type="gpt", state={
        "schedule": {"lr_decay_steps": 90, "last_step": 100}, "data": {"train_blocks_seen": 11}})
    assert read_meta(tmp_path, dict(meta, model_type="llama"))["model_type"] == "llama"


def test_read_meta_counts_format_1s_train_position_from_what_it_kept(tmp_path):
    def seen(**meta):
        return read_meta(tmp_path, meta)["state"]["data"]
    config = {"batch_size": 3, "grad_accum_steps": 5}
    assert seen(step=7, world_size=2, train_batches=11, config=config) == {"train_blocks_seen": 2 * 3 * 11}
    assert seen(step=7, world_size=2, config=config) == {"train_blocks_seen": 2 * 3 * 7 * 5}
    assert seen(step=7, config=None) == {"train_blocks_seen": 7}
    assert seen(step=7) == {"train_blocks_seen": 7}
    with pytest.raises(checkpoint_meta.MetaError, match="^meta.json has no step$"):
        seen()
    with pytest.raises(checkpoint_meta.MetaError, match='^meta.json: config.batch_size is "3", not a whole number'):
        seen(step=7, world_size=2, config={"batch_size": "3"})
    assert read_meta(tmp_path, {"step": 7})["state"]["schedule"] == {"lr_decay_steps": None, "last_step": None}


# ---- `python -m minimal_fsdp.checkpoint progress` (the job chains) ----

@pytest.mark.parametrize("argv", [[], ["status"], ["--run_name", "x"]])
def test_main_without_progress_prints_usage(argv, monkeypatch):
    with pytest.raises(SystemExit) as raised:
        checkpoint_find.main(argv)
    assert raised.value.code == "usage: python -m minimal_fsdp.checkpoint progress [the run's training flags]"
    monkeypatch.setattr(sys, "argv", ["checkpoint.py", *argv])
    with pytest.raises(SystemExit):
        checkpoint_find.main()


def test_main_prints_step_and_last_step_of_the_newest_complete_checkpoint(run, console, monkeypatch):
    out, err = console()
    flags = ["--checkpoint_dir", str(run.parent), "--run_name", run.name]
    flip_a_byte(run / "step_3" / "__0_0.distcp")  # only the cheap checks: the chains ask often
    checkpoint_find.main(["progress", *flags])
    (run / "step_3" / "rng_0.pt").unlink()
    monkeypatch.setattr(sys, "argv", ["checkpoint.py", "progress", *flags])
    checkpoint_find.main()
    checkpoint_find.main(["progress", "--checkpoint_dir", str(run.parent), "--run_name", "other"])
    meta = meta_of(run / "step_2")
    del meta["format"], meta["state"]
    (run / "step_2" / "meta.json").write_text(json.dumps(dict(meta, last_step=50)))  # format 1
    checkpoint_find.main(["progress", *flags])
    assert out.getvalue() == "3 100\n2 none\n0 none\n2 50\n"

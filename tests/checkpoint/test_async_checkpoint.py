"""checkpoint/background.py and checkpoint/writer.py: saves written beside training
(--checkpoint_mode async) and the checksums every save takes as it writes. In this process, on a
one-rank group: the checksums equal a re-read's and no file of the checkpoint is read back, and the
shards of an asynchronous save are written by the rank's writer process (or, with
MINIMAL_FSDP_ASYNC_WRITER=thread, by DCP's threads here); an asynchronous save returns before its
files are written and holds the values of its own step while training changes them; later saves
reuse the first one's plan; a second save waits for the one in flight; the writer process ignores
SIGTERM, a dead one fails the save in one line, and it dies with its rank; the choice of mode, the
staging memory in the planner and the banner. Through the real entry point on two ranks (faults.py):
kill -9 during the background write leaves the previous checkpoint, from which the run resumes bit
for bit (the same losses as an uninterrupted synchronous run); a save in flight at SIGTERM is
committed before the exit 0; a failed background write ends the run with one line and keeps the last
good checkpoint."""

import builtins
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlanner

from minimal_fsdp.backends import banner
from minimal_fsdp.checkpoint import checkpointer, find, safe_load
from minimal_fsdp.checkpoint.background import (
    Background,
    DefaultSavePlanner,
    choose_mode,
    staging_bytes,
)
from minimal_fsdp.checkpoint.writer import ChecksummingWriter
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.config.sections import Checkpoint
from minimal_fsdp.models.families import make_config
from minimal_fsdp.models.gpt import GPTConfig
from minimal_fsdp.models.size import count_parameters
from minimal_fsdp.tools import model_size

from conftest import TINY_MODEL, make_text
from faults import launch_with_faults

HANG_GUARD = 120  # seconds; only a broken save waits this long


def tiny(seed=0):
    """A two-layer model and an AdamW that has taken one step (so it has moments)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model, optimizer):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def values(model, optimizer):
    """Every weight and AdamW moment, by its name in the checkpoint."""
    found = {f"model.{name}": p.detach().clone() for name, p in model.state_dict().items()}
    names = dict(zip((id(p) for p in model.parameters()), (n for n, _ in model.named_parameters())))
    for param, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            found[f"optim.state.{names[id(param)]}.{key}"] = state[key].clone()
    return found


def saved_values(path):
    names = [name for name, _, _ in safe_load.tensor_names(path, "")]
    return safe_load.read_tensors(
        path,
        [n for n in names if n.startswith(("model.", "optim.state.")) and not n.endswith(".step")],
        "",
    )


@pytest.fixture
def background(one_rank_group, monkeypatch):
    monkeypatch.setenv("MINIMAL_FSDP_ASYNC_WRITER", "process")
    made = Background(torch.device("cpu"), HANG_GUARD)
    yield made
    made.close()


# the writer process's case takes seconds (a second Python): the full tier
@pytest.mark.parametrize("writer", [pytest.param("process", marks=pytest.mark.slow), "thread"])
def test_checksums_are_taken_while_writing_and_equal_a_reread(
    one_rank_group, tmp_path, monkeypatch, writer
):
    monkeypatch.setenv("MINIMAL_FSDP_ASYNC_WRITER", writer)
    reads, writes = [], []
    for module in (builtins, io):  # Path.open and DCP's streams open through io.open
        real = module.open

        def recording(file, mode="r", *args, _real=real, **kwargs):
            if isinstance(file, (str, Path)) and "step_" in str(file):
                (reads if "r" in mode else writes).append(
                    Path(file).parent.name + "/" + Path(file).name
                )
            return _real(file, mode, *args, **kwargs)

        monkeypatch.setattr(module, "open", recording)
    model, optimizer = tiny()
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"a": 1}')
    made = Background(torch.device("cpu"), HANG_GUARD)
    assert (made.writer is None) == (writer == "thread")
    try:
        sync = checkpointer.save(
            tmp_path / "run", 1, model, optimizer, {"val_loss": None}, tokenizer
        )
        asynchronous = checkpointer.save(
            tmp_path / "run", 2, model, optimizer, {"val_loss": None}, tokenizer, background=made
        )
        made.wait()
    finally:
        made.close()
    assert reads == []  # no file of either checkpoint was read while it was saved
    # The asynchronous save's shard is written by the rank's writer process (not this one) or by
    # DCP's thread here.
    assert (
        (".tmp-step_2/__0_0.distcp" in writes) == (writer == "thread")
    ) and ".tmp-step_1/__0_0.distcp" in writes
    monkeypatch.undo()
    for path in (sync, asynchronous):
        recorded = json.loads((path / "meta.json").read_text())["files"]
        on_disk = {p.name: p.read_bytes() for p in path.iterdir() if p.name != "meta.json"}
        assert (
            sorted(recorded)
            == sorted(on_disk)
            == [".metadata", "__0_0.distcp", "rng_0.pt", "tokenizer.json"]
        )
        assert recorded == {name: [len(data), zlib.crc32(data)] for name, data in on_disk.items()}


@pytest.mark.slow  # a writer process: seconds
def test_an_async_save_returns_before_writing_and_keeps_the_values_of_its_step(
    background, tmp_path, monkeypatch
):
    release = threading.Event()
    write_data = ChecksummingWriter.write_data

    def held(writer, plan, planner):
        release.wait(HANG_GUARD)
        return write_data(writer, plan, planner)

    monkeypatch.setattr(ChecksummingWriter, "write_data", held)
    model, optimizer = tiny()
    expected = values(model, optimizer)
    run = tmp_path / "run"
    path = checkpointer.save(run, 1, model, optimizer, {"val_loss": None}, background=background)
    assert background.pending is not None and not background.pending.done()
    assert (run / ".tmp-step_1").is_dir() and not path.exists() and not (run / "latest").exists()
    # training goes on: every weight and moment changes while the save is written
    train_step(model, optimizer)
    changed = values(model, optimizer)
    assert all(not torch.equal(changed[name], expected[name]) for name in expected)
    release.set()
    background.wait()
    assert find.marker(run, "latest") == path
    saved = saved_values(path)
    assert sorted(saved) == sorted(expected)
    assert all(torch.equal(saved[name], expected[name]) for name in expected), (
        "not the values of the save's step"
    )


@pytest.mark.slow  # a writer process: seconds
def test_later_saves_reuse_the_first_ones_plan_and_hold_their_own_values(
    background, tmp_path, monkeypatch
):
    plans = []
    make_plan = DefaultSavePlanner._create_global_plan
    monkeypatch.setattr(
        DefaultSavePlanner,
        "_create_global_plan",
        lambda planner, all_plans: plans.append(1) or make_plan(planner, all_plans),
    )
    for cache in [name for name, value in vars(SavePlanner).items() if name.startswith("_cached_")]:
        # DCP's plan caches start empty: no earlier test's plan
        monkeypatch.setattr(SavePlanner, cache, {})
    model, optimizer = tiny()
    run = tmp_path / "run"
    for step in (1, 2, 3):
        expected = values(model, optimizer)
        path = checkpointer.save(
            run, step, model, optimizer, {"val_loss": None}, background=background
        )
        background.wait()
        saved = saved_values(path)
        assert sorted(saved) == sorted(expected)
        assert all(torch.equal(saved[name], expected[name]) for name in expected), step
        train_step(model, optimizer)
    assert plans == [1]  # planned once, at the first save


def test_a_save_waits_for_the_one_in_flight_so_two_never_overlap(
    one_rank_group, tmp_path, monkeypatch
):
    first_writes, release, second_waits = threading.Event(), threading.Event(), threading.Event()
    started, active, most = [], [0], [0]
    write_data = ChecksummingWriter.write_data

    def counted(writer, plan, planner):
        started.append(Path(writer.path).name)
        active[0] += 1
        most[0] = max(most[0], active[0])
        try:
            if len(started) == 1:
                first_writes.set()
                release.wait(HANG_GUARD)
            return write_data(writer, plan, planner)
        finally:
            active[0] -= 1

    monkeypatch.setattr(ChecksummingWriter, "write_data", counted)
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--keep_last", "0"])
    config = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)
    saver = checkpointer.Checkpointer(
        Checkpoint.of(cfg), dataclasses.asdict(cfg), config, None, decentralized=False
    )
    saver.background = Background(torch.device("cpu"), HANG_GUARD)  # what a GPU run gets (for_run)
    wait = saver.background.wait

    def announced():
        second_waits.set()
        return wait()

    model, optimizer = tiny()
    with saver.saving():
        saver.save(1, model, optimizer, None, {})
        monkeypatch.setattr(saver.background, "wait", announced)
        second = threading.Thread(target=saver.save, args=(2, model, optimizer, None, {}))
        second.start()
        assert first_writes.wait(HANG_GUARD) and second_waits.wait(HANG_GUARD)
        assert started == [".tmp-step_1"]  # the second save waits, and has not begun to write
        release.set()
        second.join(HANG_GUARD)
        saver.wait()
    assert started == [".tmp-step_1", ".tmp-step_2"] and most[0] == 1
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_1", "step_2"]
    assert find.marker(run, "latest") == run / "step_2"
    reports = saver.reports()
    ended = [r for r in reports if r.total_s is not None]
    assert [r.step for r in reports if r.total_s is None] == [1, 2] and [r.step for r in ended] == [
        1,
        2,
    ]
    assert all(0 <= r.blocking_s <= r.total_s for r in ended if r.step == 1)
    # the first save's write, then its own
    assert ended[1].waited_s > 0 and ended[1].blocking_s > ended[1].waited_s


@pytest.mark.slow  # a writer process: seconds
def test_the_writer_process_ignores_sigterm_and_a_dead_one_fails_the_save_in_one_line(
    background, tmp_path
):
    model, optimizer = tiny()
    run = tmp_path / "run"
    first = checkpointer.save(run, 1, model, optimizer, {"val_loss": None}, background=background)
    background.wait()
    # A stop's SIGTERM, sent to every process of the job, leaves the writer writing: the save in
    # flight completes.
    os.kill(background.writer.process.pid, signal.SIGTERM)
    second = checkpointer.save(run, 2, model, optimizer, {"val_loss": None}, background=background)
    background.wait()
    assert find.marker(run, "latest") == second
    recorded = json.loads((second / "meta.json").read_text())["files"]
    assert (
        recorded
        == {
            p.name: [len(p.read_bytes()), zlib.crc32(p.read_bytes())]
            for p in second.iterdir()
            if p.name != "meta.json"
        }
        and "__0_0.distcp" in recorded
    )
    os.kill(background.writer.process.pid, signal.SIGKILL)  # the writer lost (the OOM killer, say)
    background.writer.process.wait(HANG_GUARD)
    checkpointer.save(run, 3, model, optimizer, {"val_loss": None}, background=background)
    with pytest.raises(checkpointer.SaveError) as failed:
        background.wait()
    assert str(failed.value) == (
        f"writing checkpoint {run / 'step_3'} failed (rank 0: the checkpoint writer process "
        f"ended (exit code -9): {run / '.tmp-step_3'}); the previous checkpoint is untouched"
    )
    assert (
        find.marker(run, "latest") == second
        and first.is_dir()
        and not (run / ".tmp-step_3").exists()
    )


RANK_WITH_A_WRITER = """
import os, sys, time, torch, torch.distributed as dist
from minimal_fsdp.checkpoint.background import Background
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
background = Background(torch.device("cpu"), 60)
print("writer", background.writer.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a second Python with a process group and a writer process
def test_the_writer_process_dies_with_its_rank(tmp_path):
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_WITH_A_WRITER],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(
            os.environ,
            PYTHONPATH=str(Path(__file__).resolve().parents[2]),
            MINIMAL_FSDP_ASYNC_WRITER="process",
        ),
    )
    try:
        line = rank.stdout.readline()
        # torch 2.9's Gloo prints its connections on stdout
        while line and not line.startswith("writer "):
            line = rank.stdout.readline()
        writer = int(line.split()[1])
        os.kill(rank.pid, signal.SIGKILL)  # kill -9: no cleanup of the rank's runs
        rank.wait(HANG_GUARD)
        deadline = time.monotonic() + HANG_GUARD
        while _alive(writer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(writer), "the writer process outlived its rank"
    finally:
        rank.kill()
        rank.wait()


def _alive(pid):
    """Whether process `pid` runs (not a zombie: it is not our child, so nobody here reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_auto_is_async_on_gpus_and_sync_on_cpus_and_a_short_host_saves_in_sync():
    gb = 10**9
    choose = choose_mode
    assert choose("auto", "cuda", 9 * gb, 2, 100 * gb) == ("async", None)
    assert choose("auto", "cpu", 9 * gb, 2, 100 * gb) == ("sync", None)
    assert choose("sync", "cuda", 9 * gb, 2, 100 * gb) == ("sync", None)
    assert choose("async", "cpu", 9 * gb, 2, 100 * gb) == ("async", None)
    # unknown memory: not refused
    assert choose("async", "cuda", 9 * gb, 2, None) == ("async", None)
    # 36 GB of 40 free: over the 80% allowed
    mode, note = choose("auto", "cuda", 9 * gb, 4, 40 * gb)
    assert mode == "sync" and note == (
        "warning: asynchronous checkpoint saves would keep 36.0 GB of host memory "
        "on this node (9.0 GB per rank) and 40.0 GB is free: saving synchronously "
        "(--checkpoint_mode sync says so in advance)"
    )
    assert "\n" not in note


def test_staging_memory_is_the_ranks_weights_and_moments_in_the_planner_and_the_banner():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 23 parameters
    assert staging_bytes(model) == 23 * 12
    # each replica and the average
    assert staging_bytes(model, decentralized=True) == 23 * 24
    assert staging_bytes(model, decentralized=True, average_only=True) == 23 * 12
    config = make_config("llama", "llama2-7b")
    total = count_parameters(config).total
    plan = dict(
        model_type="llama",
        config=config,
        batch_size=1,
        sharding="full-shard",
        world_size=8,
        shard_group_size=8,
        recompute="full",
        cpu_offload=False,
        precision="bf16",
    )
    synchronous = model_size.estimate(**plan, checkpoint_mode="sync")
    asynchronous = model_size.estimate(**plan, checkpoint_mode="async")
    assert asynchronous["host"] - synchronous["host"] == asynchronous["staging"] == 12 * total / 8
    assert asynchronous["gpu"] == synchronous["gpu"] and synchronous["staging"] == 0
    env = SimpleNamespace(device=torch.device("cuda"))
    line = banner.saving("auto", env, SimpleNamespace(mode="async", staging=9.4e9))
    assert line.startswith(
        "checkpoints: asynchronous (--checkpoint_mode auto): training waits while a save is "
        "copied into 9.4 GB of pinned host memory per rank"
    )
    assert "synchronous" in banner.saving("auto", env, SimpleNamespace(mode="sync", staging=0))


# ---- two ranks, through the real entry point ----

STEPS = 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("async")
    (work / "corpus.txt").write_text(make_text())
    return work


def args(run_name, *extra):
    return [
        "--dataset",
        "text",
        "--input_file",
        "corpus.txt",
        *TINY_MODEL,
        "--dropout",
        0.1,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--warmup_steps",
        2,
        "--lr_decay_steps",
        STEPS,
        "--max_steps",
        STEPS,
        "--checkpoint_interval",
        2,
        "--checkpoint_mode",
        "async",
        "--run_name",
        run_name,
        *extra,
    ]


def rows(work, run_name):
    return [
        json.loads(line)
        for line in (work / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
def test_killed_during_a_background_write_resumes_bit_for_bit_from_the_previous_checkpoint(work):
    launch_with_faults(args("straight", "--checkpoint_mode", "sync"), cwd=work)
    straight = {r["step"]: r["loss"] for r in rows(work, "straight") if "loss" in r}
    run = work / "checkpoints" / "killed"
    # Rank 1 dies with the first bytes of its step-4 shard on disk, written in the background.
    crashed = launch_with_faults(args("killed"), faults="kill_in_write@4:1", cwd=work, check=False)
    assert crashed.returncode != 0
    assert "step 4: training waited" in crashed.stdout  # the save went to the background...
    assert (run / ".tmp-step_4" / "__1_0.distcp").stat().st_size > 0  # ...and died while writing
    assert not (run / "step_4").exists() and find.latest(run) == run / "step_2"
    resumed = launch_with_faults(args("killed"), cwd=work)
    assert "resuming from checkpoints/killed/step_2 (restored in" in resumed.stdout
    assert find.latest(run) == run / f"step_{STEPS}" and not list(run.glob(".tmp-*"))
    logged = rows(work, "killed")
    losses = [(r["step"], r["loss"]) for r in logged if "loss" in r]
    assert sorted({step for step, _ in losses}) == list(range(1, STEPS + 1))
    # the crashed launch's and the resumed one's, against the synchronous run's
    for step, loss in losses:
        assert loss == straight[step], (step, loss, straight[step])
    assert [r["step"] for r in logged if "restore_s" in r] == [2] and all(
        r["restore_s"] > 0 for r in logged if "restore_s" in r
    )
    saves = [r for r in logged if "save_total_s" in r]
    # the crashed launch's step 2, the resumed launch's
    assert [r["step"] for r in saves] == [2, 4, 6, 8]
    assert all(
        0 <= r["save_waited_s"] < r["save_blocking_s"] and r["save_total_s"] > 0 for r in saves
    )


@pytest.mark.slow
def test_a_save_in_flight_at_sigterm_is_committed_before_the_exit(work):
    run = work / "checkpoints" / "term"
    # Step 2's files start to be written only once the SIGTERM of step 3 has been sent.
    term = launch_with_faults(args("term"), faults="slow_write@2,sigterm@3", cwd=work)
    lines = term.stdout.splitlines()
    background = lines.index(
        next(line for line in lines if line.startswith("step 2: training waited"))
    )
    committed = lines.index(
        next(line for line in lines if line.startswith("step 2: saved checkpoints/term/step_2"))
    )
    stopped = lines.index(
        next(line for line in lines if line.startswith("step 3: SIGTERM received; saved"))
    )
    assert background < committed < stopped
    assert [p.name for p in find.step_dirs(run)] == ["step_3", "step_2"]
    assert all(find.verify(run / name) is None for name in ("step_2", "step_3"))
    assert find.latest(run) == run / "step_3" and not list(run.glob(".tmp-*"))


@pytest.mark.slow
def test_a_failed_background_write_ends_the_run_in_one_line_and_keeps_the_last_good_checkpoint(
    work,
):
    run = work / "checkpoints" / "full"
    failed = launch_with_faults(args("full"), faults="enospc_in_write@4:1", cwd=work, check=False)
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "error: writing checkpoint checkpoints/full/step_4 failed (rank 1: No space left on "
        "device: checkpoints/full/.tmp-step_4); the previous checkpoint is untouched"
    ], failed.stderr
    assert "Traceback" not in failed.stderr
    assert sorted(p.name for p in run.iterdir() if p.name != ".lock") == [
        "best",
        "latest",
        "step_2",
    ]
    assert find.latest(run) == run / "step_2"

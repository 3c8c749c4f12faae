"""resilience.py in one process: how ranks combine their stop requests (another rank's contribution
is simulated by a stand-in for all_reduce). The same behaviour across real ranks: test_resume.py.
Then Ctrl-C as users press it: under `| tee` (whose end closes stdout's pipe) and twice, with the
run locks removed however the run ends."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from minimal_fsdp.launch import resilience, run_lock
from minimal_fsdp.launch.resilience import StopRequests

from conftest import ROOT, TINY_MODEL, mpiexec
from fake_launchers import session_processes


@pytest.fixture
def peer(monkeypatch):
    """all_reduce over this rank and one simulated other rank holding `peer.code` (0: nothing to
    report)."""

    class Peer:
        code = 0
        pace = 0.0  # its seconds per step since the last look

    ops = {
        dist.ReduceOp.MAX: torch.maximum,
        dist.ReduceOp.SUM: torch.add,
        dist.ReduceOp.MIN: torch.minimum,
    }

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        tensor.copy_(
            ops[op](tensor, torch.tensor([Peer.code, Peer.pace][: len(tensor)], dtype=tensor.dtype))
        )

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return Peer


def test_a_signal_on_another_rank_stops_this_one(peer):
    stop = StopRequests()
    assert stop.agreed() is None and stop.reason is None
    peer.code = int(signal.SIGTERM)
    assert stop.agreed() == "SIGTERM received" == stop.reason


def test_two_ranks_with_different_signals_agree_on_one(peer):
    stop = StopRequests()
    stop.received = int(signal.SIGUSR1)  # what the handler records
    peer.code = int(signal.SIGTERM)
    assert stop.agreed() == "SIGTERM received"


def test_time_limit_on_another_rank_wins_over_a_signal_here(peer):
    stop = StopRequests(time_limit_seconds=60)
    stop.received = int(signal.SIGUSR1)
    peer.code = resilience._TIME_LIMIT
    assert stop.agreed() == "--time_limit of 60s reached"


def test_time_limit_is_reached_at_exactly_its_length(peer, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(resilience, "monotonic", lambda: clock[0])
    stop = StopRequests(time_limit_seconds=10)
    clock[0] = 109.5
    assert stop.agreed() is None
    clock[0] = 110.0
    assert stop.agreed() == "--time_limit of 10s reached"


def test_looks_come_within_the_latency_bound_at_the_slowest_ranks_pace(peer, monkeypatch):
    """Besides logging steps, the ranks look at a stop request at steps every rank derives alike
    from the agreed (slowest) pace: about STOP_LATENCY seconds apart, at least every step when a
    step is longer."""
    clock = [0.0]
    monkeypatch.setattr(resilience, "monotonic", lambda: clock[0])
    stop = StopRequests()
    assert stop.due(1)  # nothing measured yet: look after the first step
    stop.agreed(1)
    assert stop.due(2)  # one look gives no pace yet
    clock[0] = 0.5
    stop.agreed(2)  # 0.5 s a step here
    assert stop.next_look == 2 + int(resilience.STOP_LATENCY / 0.5) and not stop.due(
        stop.next_look - 1
    )
    peer.pace = 2.0  # the other rank is slower: its pace decides, for both
    clock[0] = 0.5 + 20 * 0.5
    stop.agreed(22)
    assert stop.next_look == 22 + int(resilience.STOP_LATENCY / 2.0)
    peer.pace = 60.0  # steps longer than the bound: look after every step
    clock[0] += 60
    stop.agreed(23)
    assert stop.next_look == 24


def exiting(exits):
    """os._exit as a test sees it: the code noted, SystemExit raised (the process goes on)."""

    def exit_now(code):
        exits.append(code)
        raise SystemExit(code)

    return exit_now


def test_ctrl_c_is_a_stop_request_and_a_second_one_exits_at_once(peer, monkeypatch):
    assert signal.SIGINT in resilience.STOP_SIGNALS
    exits, said = [], []
    monkeypatch.setattr(resilience.os, "_exit", exiting(exits))
    monkeypatch.setattr(resilience, "_say", said.append)
    stop = StopRequests()
    stop.agreed(1)  # a step has finished
    stop._record(signal.SIGINT, None)
    assert exits == [] and stop.agreed(2) == "SIGINT received"
    # at once
    assert said == ["SIGINT (Ctrl-C): stop requested: will save after the step in flight"]
    with pytest.raises(SystemExit):
        stop._record(signal.SIGINT, None)
    assert (
        exits == [130] and said[-1] == "error: interrupted again: exiting at once, without saving"
    )


def test_a_stop_before_the_first_step_exits_at_once_and_leaves_no_lock(tmp_path, monkeypatch):
    """Nothing is saved before the first step, so there is nothing to wait for: one line, exit, and
    the run's lock is gone (a later run would have to take it over)."""

    exits, said = [], []
    monkeypatch.setattr(resilience.os, "_exit", exiting(exits))
    monkeypatch.setattr(resilience, "_say", said.append)
    lock = run_lock.RunLock({"--checkpoint_dir": tmp_path / "run"})
    lock.acquire()
    try:
        with pytest.raises(SystemExit):
            StopRequests()._record(signal.SIGINT)
        assert said == [
            "SIGINT (Ctrl-C): stopping before the first step: nothing to save"
        ] and exits == [130]
        assert not (tmp_path / "run" / ".lock").exists()
    finally:
        lock.release()
    said.clear()
    stop = StopRequests()
    # a scheduler's: the first step is saved, so a chain of jobs goes on
    stop._record(signal.SIGTERM)
    assert stop.received == signal.SIGTERM and said == [
        "SIGTERM: stop requested: will save after the step in flight"
    ]


def test_a_ctrl_c_before_the_first_step_on_another_rank_leaves_rank_0_to_speak(monkeypatch):
    """Under mpiexec the first rank to exit has the launcher end the rest: a rank other than 0 waits
    for rank 0 (which got the same Ctrl-C) to say why and exit first. Still alive after that, rank
    0 never got it: this rank says it, naming itself, and exits 130 all the same."""
    exits, said, waits = [], [], []
    monkeypatch.setattr(resilience.os, "_exit", exiting(exits))
    monkeypatch.setattr(
        resilience, "_say", lambda line, every_rank=False: said.append((line, every_rank))
    )
    monkeypatch.setattr(resilience, "sleep", waits.append)
    monkeypatch.setattr(resilience, "rank_hint", lambda: 1)
    with pytest.raises(SystemExit):
        StopRequests()._record(signal.SIGINT)
    line = "SIGINT (Ctrl-C): stopping before the first step: nothing to save"
    assert waits == [resilience.SPEAK_FIRST] and exits == [130]
    assert said[0] == (line + " (rank 1)", True)


def test_a_rank_the_launcher_ends_while_it_waits_for_rank_0_exits_unheard(monkeypatch):
    """A launcher that ends the other ranks with SIGTERM once rank 0 has exited (torchrun, Open
    MPI): the waiting rank reads it from the signal pipe and exits 130 without a line of its own.
    Without it, it says its line once the wait is over."""
    exits, said = [], []
    monkeypatch.setattr(resilience.os, "_exit", exiting(exits))
    monkeypatch.setattr(resilience, "_say", lambda line, every_rank=False: said.append(every_rank))
    monkeypatch.setattr(resilience, "rank_hint", lambda: 1)
    monkeypatch.setattr(resilience, "SPEAK_FIRST", 0.2)
    for arrives, heard in ((bytes([signal.SIGTERM]), [False]), (b"", [True, False])):
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, arrives)  # as set_wakeup_fd writes it
            stop = StopRequests()
            stop.wakeup = read_end
            exits.clear(), said.clear()
            with pytest.raises(SystemExit):
                stop._record(signal.SIGINT)
            assert exits == [130] and said == heard
        finally:
            os.close(read_end), os.close(write_end)


def test_a_signal_is_acted_on_while_the_main_thread_waits_in_a_system_call(peer, monkeypatch):
    """A long first step (compiling) never returns to Python's signal handler: the Ctrl-C used to be
    heard only after it. Here the main thread blocks in a read that the stop request itself ends
    (restarted on signals); a timer ends it too, so that a broken watcher fails the test instead of
    hanging it."""
    import os
    import threading

    read_end, write_end = os.pipe()
    said = []
    monkeypatch.setattr(
        resilience, "_say", lambda line: (said.append(line), os.write(write_end, b"x"))
    )
    stop = StopRequests()
    stop.agreed(1)
    guard = threading.Timer(60, os.write, (write_end, b"t"))
    guard.start()
    try:
        with stop.listening():
            os.kill(os.getpid(), signal.SIGINT)
            woken_by = os.read(read_end, 1)
    finally:
        guard.cancel()
        os.close(read_end)
        os.close(write_end)
    assert woken_by == b"x" and said == [
        "SIGINT (Ctrl-C): stop requested: will save after the step in flight"
    ]
    assert stop.received == signal.SIGINT


# --- Ctrl-C under `| tee`, and twice: the run saves, or at least leaves no lock behind ---

HOLD_LOCK = """import sys
from minimal_fsdp.launch import run_lock
lock = run_lock.RunLock({"--checkpoint_dir": sys.argv[1], "--log_dir": sys.argv[2]})
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


def gone_within(paths, seconds=60):
    """Whether every path is gone within `seconds` (a bound on a hang only)."""
    deadline = time.monotonic() + seconds
    while any(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(p.exists() for p in paths)


def test_a_lock_holder_killed_outright_leaves_no_lock(tmp_path):
    """A Ctrl-C twice under mpiexec (or mpiexec killed by SIGPIPE) ends rank 0 with SIGKILL: no
    code of it runs. Its locks used to stay, for the next run to take over with a warning each; a
    watcher outside its session removes them."""
    dirs = [tmp_path / "checkpoints" / "run", tmp_path / "logs" / "run"]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, *map(str, dirs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert holder.stdout.readline() == "held\n"
    locks = [d / run_lock.LOCK_NAME for d in dirs]
    assert all(lock.exists() for lock in locks)
    holder.kill()
    holder.wait()
    assert gone_within(locks)
    # A lock another run holds now is never removed by the old run's watcher: it names its token.
    lock = run_lock.RunLock({"--checkpoint_dir": dirs[0]})
    lock.acquire()
    watcher = lock.watcher
    (dirs[0] / run_lock.LOCK_NAME).write_text('{"token": "another run"}')
    lock.release()
    assert watcher.returncode == 0 and (dirs[0] / run_lock.LOCK_NAME).exists()


def test_a_closed_pipe_stops_the_printing_not_the_run(tmp_path):
    """`python basic_training.py | tee log` and Ctrl-C: tee is gone, and the next line used to raise
    BrokenPipeError, which ended the run unsaved."""
    read_end, write_end = os.pipe()
    stream = resilience.PipeSafe(open(write_end, "w", buffering=1))
    os.close(read_end)  # the reader is gone
    assert stream.write("step 9/100: loss 3.5\n") == len("step 9/100: loss 3.5\n")
    stream.flush()
    stream.write("more\n")  # the descriptor now points at /dev/null
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
    stream.stream.close()


def test_after_a_ctrl_c_a_piped_stdout_follows_stderr(tmp_path):
    """Under `mpiexec ... | tee log` the Ctrl-C ends tee: a rank's next stdout line, forwarded by
    mpiexec into the closed pipe, killed mpiexec (SIGPIPE, exit 141) and the ranks before the save.
    After a Ctrl-C a piped stdout goes where stderr goes; a file stays as it is."""
    saved = os.dup(1), os.dup(2)
    out_read, out_write = os.pipe()
    err = open(tmp_path / "err", "w")
    try:
        os.dup2(out_write, 1)
        os.dup2(err.fileno(), 2)
        resilience.stdout_follows_stderr()
        os.write(1, b"after the Ctrl-C\n")
        assert os.path.samestat(os.fstat(1), os.fstat(2))
        os.dup2(err.fileno(), 1)  # a file: stays
        resilience.stdout_follows_stderr()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, out_read, out_write):
            os.close(fd)
        err.close()
    assert (tmp_path / "err").read_text() == "after the Ctrl-C\n"


def training_command(corpus, run_name):
    return [
        sys.executable,
        str(ROOT / "basic_training.py"),
        "--dataset",
        "text",
        "--input_file",
        str(corpus),
        *TINY_MODEL,
        "--max_steps",
        "100000",
        "--eval_interval",
        "0",
        "--log_interval",
        "1",
        "--num_tokens",
        "0",
        "--run_name",
        run_name,
    ]


def interrupted(cmd, work, run_name, times):
    """cmd (a shell line) in a session of its own, sent SIGINT `times` times (as Ctrl-C sends it to
    the terminal's foreground group: the shell, the launcher, tee) once training has logged two
    steps (after the first, the ranks have looked at stop requests together: there is something to
    save); returns once every process of it has ended."""
    process = subprocess.Popen(
        ["bash", "-c", cmd],
        cwd=work,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = work / "logs" / run_name / "metrics.jsonl"
    deadline = time.monotonic() + 400  # bounds on a hang only
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "training never started"
        time.sleep(0.2)
    for _ in range(times):
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.5)
    try:
        process.wait(timeout=300)
        deadline = time.monotonic() + 120
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_processes(process.pid)
    finally:
        for pid in session_processes(process.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_under_tee_saves_and_removes_the_locks(tmp_path, corpus):
    """`python basic_training.py | tee log`, Ctrl-C: tee ends with it; the run still saves, says
    so on stderr, and removes its locks."""
    cmd = " ".join(training_command(corpus, "tee")) + " 2>err | tee log"
    interrupted(cmd, tmp_path, "tee", times=1)
    run = tmp_path / "checkpoints" / "tee"
    assert list(run.glob("step_*")), (tmp_path / "err").read_text()[-3000:]
    err = (tmp_path / "err").read_text()
    assert "SIGINT received; saved a checkpoint and stopping" in err and "Traceback" not in err
    assert gone_within([run / run_lock.LOCK_NAME, tmp_path / "logs" / "tee" / run_lock.LOCK_NAME])


@pytest.mark.slow
def test_ctrl_c_twice_under_mpiexec_removes_the_locks(tmp_path, corpus):
    """The README says a second Ctrl-C removes the run's locks; under mpiexec they used to stay
    (the launcher kills the ranks), and the next run took each over with a warning."""
    cmd = f"{mpiexec()} -n 2 " + " ".join(training_command(corpus, "twice")) + " >log 2>&1"
    interrupted(cmd, tmp_path, "twice", times=2)
    locks = [tmp_path / d / "twice" / run_lock.LOCK_NAME for d in ("checkpoints", "logs")]
    assert gone_within(locks), (tmp_path / "log").read_text()[-3000:]

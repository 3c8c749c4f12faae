"""How a failure ends the job: every rank stops with one line, none is left waiting. Ranks that
failed alike agree and rank 0 speaks for all; a rank that fails alone ends the job (exit_on_error).
Bad input (ConfigError) exits 2; a bug exits 1 with its traceback. Also the process-wide hook that
aborts an MPI job on an uncaught exception, and a deadline for the steps before any timeout of
torch's applies (MPI discovery)."""

import gc
import os
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import NamedTuple

import torch.distributed as dist

from minimal_fsdp.config.choices import RANK_VARIABLES, ConfigError

FAILED_KEY = "minimal_fsdp/failed"
# how long a failing rank waits for the others to fail alike before it ends the job itself
AGREE_SECONDS = 10

# MPI: a duplicate of COMM_WORLD used only to agree on errors, so it is never busy
_error_comm = None
_setup_started = False
_known_world = None  # the world size, once discovered
# seconds already spent waiting for the other ranks since this rank failed (hangs.gathered): one
# budget of AGREE_SECONDS covers that and the wait to agree, so a rank that never answers costs it
# once, not twice
_waited_for_others = 0.0


class MainRankFailed(Exception):
    """run_on_main's function failed on rank 0 with an unexpected exception (a bug, not bad input):
    rank 0 has printed its traceback; every rank raises this and exits 1."""


def setup_started():
    global _setup_started
    _setup_started = True


def world_known(world):
    global _known_world
    _known_world = world


def waited_for_others(seconds):
    """This rank, failing, has waited `seconds` for the others already (their hang reports):
    exit_on_error waits that much less for them to fail alike."""
    global _waited_for_others
    _waited_for_others += seconds


def agree_through(comm):
    """Under MPI: agree on failures through `comm`, a communicator nothing else uses."""
    global _error_comm
    _error_comm = comm


def abort_job_on_uncaught_exception():
    """Process-wide (sys.excepthook): an uncaught exception on one MPI rank must end the whole job,
    not leave the others in a collective. Installed by environment.setup before MPI is
    initialized."""

    def hook(kind, value, tb):
        # Written straight to the process's stderr: torch's own hook (which init_process_group wraps
        # around this one) buffers what it wraps, and the buffer would die with the Abort below.
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.__stderr__.write(
            "".join(f"[rank{rank_hint()}]: {line}" for line in text.splitlines(True))
        )
        if "timed out" in str(value).lower():
            print(
                f"error: rank {rank_hint()} waited longer than --collective_timeout in a "
                "collective: another rank has died or hangs",
                file=sys.__stderr__,
            )
        sys.__stderr__.flush()
        time.sleep(1)  # let the launcher forward the traceback before Abort tears the job down
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def raise_gathered(problems):
    """Every rank's problem (a line, or None), gathered alike on all ranks: raise one ConfigError,
    the same on every rank, if any rank has one; a problem all ranks share is said once, else the
    first rank's is named."""
    failed = [(rank, p) for rank, p in enumerate(problems) if p]
    if failed and len(failed) == len(problems) and len(set(problems)) == 1:
        raise ConfigError(problems[0])
    if failed:
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise ConfigError(f"rank {failed[0][0]}: {failed[0][1]}{more}")


@contextmanager
def deadline(seconds, what, grace=0):
    """End this process with one line if the block has not finished within `seconds`: for steps that
    can wait on another rank before any timeout of torch's applies (MPI_Init, MPI's collectives). A
    stopped or hung rank then cannot keep the others waiting; the launcher sees a rank killed and
    ends the rest of the job. The watch is a separate small process, because MPI_Init holds the GIL
    while it waits (no thread of ours would run); it reads a pipe from us, so it also ends, doing
    nothing, when this process ends otherwise. grace: seconds more before the kill, so that the
    block's own bounded waits say their more precise line first."""
    line = (
        f"error: rank {rank_hint()}: {what} did not finish within {seconds:.0f}s "
        "(--collective_timeout): another rank has stopped, hangs or never started"
    )
    watch = 'read -t "$1" _; if [ $? -gt 128 ]; then echo "$2" >&2; kill -KILL "$3"; fi'
    watcher = subprocess.Popen(
        ["bash", "-c", watch, "deadline", str(int(seconds + grace)), line, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        watcher.stdin.close()
        watcher.wait()


def end_process_groups():
    """Destroy every process group while the interpreter is fully alive; gc first, so that groups
    held only by garbage (cycles through FSDP or DTensor state) are gone with them."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def _failed_alike(timeout=AGREE_SECONDS):
    """Whether every rank has failed too (within `timeout` seconds): then rank 0 speaks for all."""
    if not _setup_started or _known_world == 1:
        return True  # before setup only the flags can be wrong, and every rank parses the same ones
    if _error_comm is not None:
        # only failing ranks enter it; nobody else uses this communicator
        request = _error_comm.Ibarrier()
        deadline_at = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline_at:
                return False
            time.sleep(0.01)
        return True
    if dist.is_initialized():  # srun, torchrun: count the failures in the rendezvous store
        # On a thread: a store request over a link that went down waits for good (the store's
        # timeout does not cover it), and this rank must still speak and end.
        verdict = []
        counting = threading.Thread(
            target=lambda: verdict.append(_all_failed_in_store(timeout)), daemon=True
        )
        counting.start()
        counting.join(timeout + 5)
        return bool(verdict and verdict[0])
    return False  # failed in the rendezvous, which is this rank's own


def _all_failed_in_store(timeout):
    try:
        store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
        store.add(FAILED_KEY, 1)
        deadline_at = time.monotonic() + timeout
        while store.add(FAILED_KEY, 0) < dist.get_world_size():
            if time.monotonic() > deadline_at:
                return False
            time.sleep(0.05)
        return True
    except dist.DistError:  # rank 0, which holds the store, is gone
        return False


# What gloo's and NCCL's errors say when the rank at the other end died, stopped or its link went
# down; a timed-out gloo pair is closed, and every later collective on it fails at once with "pair
# closure" (inside a checkpoint save: DCP's gather, then the save's own all_gather_object).
PEER_GONE = (
    "timed out",
    "application timeout",
    "pair closure",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
)


def _chain(error):
    """`error`, the exceptions it was raised from or during (innermost last), and those a DCP
    CheckpointException gathered from the ranks."""
    seen, found, todo = set(), [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return found


class LostPeer(NamedTuple):
    """A collective failed because another rank or its host is gone. detail: the first failure's
    words (clipped); timed_out: whether it waited past --collective_timeout (then the hang line,
    hangs.timeout_line, can say where the ranks waited) rather than finding the peer gone."""

    detail: str
    timed_out: bool

    @property
    def line(self):
        waited = "waited longer than --collective_timeout" if self.timed_out else "failed"
        return (
            f"a collective {waited}: another rank or its host has died, hangs or cannot be "
            f"reached ({self.detail})"
        )


def lost_peer(error):
    """A LostPeer for a collective that failed because another rank or its host is gone (gloo's or
    NCCL's texts, DistError, also raised inside a checkpoint save), or None for any other error (a
    bug, whose traceback stays)."""
    if not isinstance(error, RuntimeError) and type(error).__name__ != "CheckpointException":
        return None
    matched = []
    for e in _chain(error):
        text = str(e).strip()
        detail = text.splitlines()[0].split("] ", 1)[-1] if text else type(e).__name__
        if isinstance(e, dist.DistError) or any(m in detail.lower() for m in PEER_GONE):
            matched.append(detail)
    if not matched:
        return None
    timed_out = any(m in d.lower() for d in matched for m in ("timed out", "timeout"))
    # the innermost cause: what the first failed collective said (a later one only says the pair
    # is closed)
    return LostPeer(clipped(matched[-1]), timed_out)


def exit_on_error(error, code):
    """Print `error: ...` once and end the process with `code`. Ranks that failed alike exit cleanly
    and rank 0 speaks for all; a rank that failed alone prints its own line and ends the job,
    because the other ranks would wait for it in a collective (MPI: Abort; srun --kill-on-bad-exit
    and torchrun stop the rest)."""
    # at least a second: ranks that failed alike and posted their reports at once still agree
    if _failed_alike(max(AGREE_SECONDS - _waited_for_others, 1)):
        if rank_hint() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        end_process_groups()
        sys.exit(code)
    print(f"error: rank {rank_hint()}: {error}", file=sys.stderr, flush=True)
    if _error_comm is not None:
        time.sleep(1)  # let the launcher forward the line first
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    # skip interpreter shutdown, which would wait for the peers in process-group teardown
    os._exit(code)


def run_on_main(fn, *args):
    """Run fn on rank 0 only (e.g. preparing data) while the others wait; every rank returns its
    result or raises its error, so a failure on rank 0 can never leave the others waiting forever.
    The error keeps its class: bad input (ConfigError) is raised as ConfigError everywhere; anything
    else is a bug: rank 0 prints its traceback, and every rank raises MainRankFailed."""
    outcome = [None, None, None]  # result, error message, whether it is bad input
    if dist.get_rank() == 0:
        try:
            outcome[0] = fn(*args)
        except ConfigError as e:
            outcome[1:] = [str(e), True]
        except Exception as e:
            traceback.print_exc()
            outcome[1:] = [f"rank 0 failed: {type(e).__name__}: {e}", False]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise (ConfigError if outcome[2] else MainRankFailed)(outcome[1])
    return outcome[0]


def clipped(text, limit=160):
    """`text` on one line, at most about `limit` characters, cut between words (with '...'), never
    inside one."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def rank_hint():
    """This process's global rank, also before (or without) torch.distributed: for printing errors
    once."""
    if dist.is_initialized():
        return dist.get_rank()
    # MPI's rank, over another launcher's variables
    if _error_comm is not None and _error_comm.Get_size() > 1:
        return _error_comm.Get_rank()
    for name in RANK_VARIABLES:
        if name in os.environ and os.environ[name].isdigit():
            return int(os.environ[name])
    return 0

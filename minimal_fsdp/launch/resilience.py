"""Ending a run on purpose: preemption signals, Ctrl-C and --time_limit become one agreed stop.

PBS and SLURM send SIGTERM (or SIGUSR1, e.g. SLURM's --signal=USR1@120) some time before they kill a
job, not necessarily to every rank; Ctrl-C sends SIGINT (under mpiexec, to every rank). A handler
just records the signal; all ranks combine what they know in one tiny all_reduce(MAX) at every
logging step (--log_interval) and, so that a stop waits for no more than about STOP_LATENCY seconds
(or one step, if a step is longer), at steps spaced by the step time they measured and agreed on.
Every rank computes the same steps from the same agreed numbers, so they all look at the same step,
stop there together, save a checkpoint and exit 0. Checking only then keeps the ranks' hosts from
waiting for each other every step. A rank never stops alone, so no rank is left waiting in a
collective. A second Ctrl-C ends the process at once, without saving.

A signal is acted on at once by a thread that watches for it (signal.set_wakeup_fd), whatever the
main thread waits in (a long first step that compiles, a collective): rank 0 says it was heard; a
Ctrl-C before the first step has finished finds nothing to save, so every rank that got it exits at
once.

`mpiexec ... | tee log`: the Ctrl-C ends tee too, and mpiexec's next write of a rank's line into the
closed pipe kills it (SIGPIPE, exit 141) and every rank with it, before the save. So after a Ctrl-C
a rank's stdout, where it is a pipe, goes where its stderr goes (the terminal); and while training,
a write to a closed pipe (a plain `python ... | tee log`) stops the printing, never the run.
"""

import os
import select
import signal
import stat
import sys
import threading
from contextlib import contextmanager
from time import monotonic, sleep

import torch
import torch.distributed as dist

from minimal_fsdp.launch import run_lock
from minimal_fsdp.launch.failures import rank_hint

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_TIME_LIMIT = 1000  # above every signal number, so MAX of the codes stays meaningful
# seconds: the longest a stop request waits for the ranks to look at it (unless a step is longer)
STOP_LATENCY = 10.0
# seconds a rank other than 0 waits, after a Ctrl-C before the first step, for rank 0 to say why and
# exit first: the first rank to exit has the launcher end the others, maybe before rank 0 has spoken
SPEAK_FIRST = 2.0


class StopRequests:
    """Created when the run starts (the --time_limit clock starts then); `agreed()` is called at
    every logging step (every --log_interval steps), before every save, and at every step where
    `due(step)` says so."""

    def __init__(self, time_limit_seconds=None):
        self.start = monotonic()
        self.time_limit_seconds = time_limit_seconds
        self.received = 0  # the stop signal the watcher thread acted on
        # the same, as the main thread's Python-level handler saw it (at its next bytecode)
        self.noted = 0
        # whether the ranks have looked at stop requests together (after the first step)
        self.looked = False
        self.reason = None  # set once every rank has agreed to stop
        # the step all ranks look at next (besides logging steps); None: the first step
        self.next_look = None
        self.last_look = None  # (step, time) of the last look
        self.wakeup = None  # the signal pipe's read end, while the watcher thread reads it

    def due(self, step):
        """Whether the ranks look at this step (collective-safe: every rank has agreed on
        next_look)."""
        return self.next_look is None or step >= self.next_look

    @contextmanager
    def listening(self):
        """Catch the stop signals only while training: elsewhere there is nothing to save, and the
        default action (exit) is the right one. Python runs a handler only between the main thread's
        bytecodes, which a step that compiles for minutes does not reach: the C-level handler writes
        the signal's number into a pipe, and a thread acts on it (_record) at once."""
        previous = {sig: signal.signal(sig, self._noted) for sig in STOP_SIGNALS}
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = PipeSafe(sys.stdout), PipeSafe(sys.stderr)
        for sig in STOP_SIGNALS:
            # restart interrupted system calls (a collective's socket waits)
            signal.siginterrupt(sig, False)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        watcher = threading.Thread(
            target=self._watch, args=(read_end,), daemon=True, name="stop-requests"
        )
        watcher.start()
        try:
            yield self
        finally:
            sys.stdout, sys.stderr = streams
            signal.set_wakeup_fd(wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(write_end)  # the watcher reads the end of the pipe and returns
            watcher.join(timeout=5)
            os.close(read_end)

    def _noted(self, signum, frame):
        """The Python-level handler: a flag (the watcher thread acts on the signal); after a Ctrl-C
        also stdout_follows_stderr, here too because this runs before the main thread's next line
        of Python, so no line of its own can go to a pipe whose reader the Ctrl-C has ended."""
        if signum == signal.SIGINT:
            stdout_follows_stderr()
        self.noted = signum

    def _watch(self, fd):
        self.wakeup = fd
        while True:
            numbers = os.read(fd, 64)
            if not numbers:
                return
            for signum in numbers:
                if signum in STOP_SIGNALS:
                    self._record(signum)

    def _record(self, signum, frame=None):
        """A stop signal, as it arrives: a flag that all ranks act on after the step in flight, said
        at once on rank 0; a Ctrl-C before the first step has finished, or a second one, is an exit
        at once."""
        # Ctrl-C again: the user will not wait for the save
        if signum == signal.SIGINT and self.received:
            _exit_at_once("error: interrupted again: exiting at once, without saving", 130)
        # no step has finished: nothing to save, or wait for
        if signum == signal.SIGINT and not self.looked:
            line = f"{_name(signum)}: stopping before the first step: nothing to save"
            # Ctrl-C reaches every rank at once, and rank 0's exit has the launcher end this one;
            # still here, rank 0 never got it (`kill -INT` of one rank): this rank says it
            if rank_hint() != 0 and not self._ended_while_waiting():
                _say(f"{line} (rank {rank_hint()})", every_rank=True)
            _exit_at_once(line, 130)
        # (A scheduler's SIGTERM then still waits for the first step and saves it: the job exits 0,
        # and a chain of jobs goes on.)
        if signum == signal.SIGINT:
            stdout_follows_stderr()
        # only a flag: the step in flight finishes, then all ranks decide together
        self.received = signum
        _say(f"{_name(signum)}: stop requested: will save after the step in flight")

    def _ended_while_waiting(self):
        """Wait up to SPEAK_FIRST seconds for rank 0 to speak and exit; True if the launcher began
        to end this rank meanwhile (its SIGTERM: torchrun's, Open MPI's), so it exits unheard. Runs
        on the watcher thread, so it reads the signal pipe itself."""
        if self.wakeup is None:
            sleep(SPEAK_FIRST)
            return False
        deadline = monotonic() + SPEAK_FIRST
        while (left := deadline - monotonic()) > 0:
            if select.select([self.wakeup], [], [], left)[0]:
                numbers = os.read(self.wakeup, 64)
                if not numbers or signal.SIGTERM in numbers:
                    return True
        return False

    def agreed(self, step=None):
        """Collective: the reason every rank stops after step `step`, or None to go on. Also agrees
        on the step of the next look: STOP_LATENCY seconds on at the slowest rank's pace since the
        last look."""
        now = monotonic()
        self.looked = True
        code = self.received or self.noted
        if (
            not code
            and self.time_limit_seconds is not None
            and now - self.start >= self.time_limit_seconds
        ):
            code = _TIME_LIMIT
        pace = 0.0  # seconds per step since the last look
        if step is not None and self.last_look is not None and step > self.last_look[0]:
            pace = (now - self.last_look[1]) / (step - self.last_look[0])
        # a CPU tensor (gloo): no wait for the GPU
        flag = torch.tensor([code, pace], dtype=torch.float64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code, pace = int(flag[0].item()), float(flag[1].item())
        if step is not None:
            self.last_look = (step, now)
            self.next_look = step + (max(1, int(STOP_LATENCY / pace)) if pace > 0 else 1)
        if code == _TIME_LIMIT:
            self.reason = f"--time_limit of {self.time_limit_seconds}s reached"
        elif code:
            self.reason = signal.Signals(code).name + " received"
        return self.reason


def _name(signum):
    return signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")


def _say(line, every_rank=False):
    """One line on rank 0's stderr (or this rank's), written at once (no buffer the main thread
    may hold)."""
    if every_rank or rank_hint() == 0:
        try:
            os.write(2, (line + "\n").encode())
        except OSError:  # stderr's reader is gone too (`|& tee`): the run goes on unheard
            pass


def stdout_follows_stderr():
    """After a Ctrl-C: this process's stdout, if it is a pipe, goes where its stderr goes. Under
    `mpiexec ... | tee log` (or `python ... | tee log`) the Ctrl-C has ended tee as well; a line
    written into its pipe would kill mpiexec (SIGPIPE) and the ranks with it, before the save. A
    file or a terminal stays as it is."""
    try:
        if stat.S_ISFIFO(os.fstat(1).st_mode) or stat.S_ISSOCK(os.fstat(1).st_mode):
            sys.stdout.flush()
            os.dup2(2, 1)
    except (OSError, ValueError):
        pass


class PipeSafe:
    """A text stream whose reader may go away (`| tee`, `| head`): a write or flush into a closed
    pipe points the stream's file descriptor at /dev/null (Python's own advice for SIGPIPE), so the
    printing stops and the training goes on; without it, BrokenPipeError ends the run unsaved."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._silence()

    def _silence(self):
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _exit_at_once(line, code):
    """End this process now: the run's locks removed (a later run need not take them over), no
    `finally` run."""
    _say(line)
    run_lock.drop_held_locks()
    os._exit(code)

"""Ending a run on purpose: preemption signals, Ctrl-C and --time_limit become one agreed stop, and a diverged
loss stops the run with the step that broke it.

PBS and SLURM send SIGTERM (or SIGUSR1, e.g. SLURM's --signal=USR1@120) some time before they kill a job,
not necessarily to every rank; Ctrl-C sends SIGINT (under mpiexec, to every rank). A handler just records the
signal; all ranks combine what they know in one tiny all_reduce(MAX) at every logging step (--log_interval)
and, so that a stop waits for no more than about STOP_LATENCY seconds (or one step, if a step is longer), at
steps spaced by the step time they measured and agreed on. Every rank computes the same steps from the same
agreed numbers, so they all look at the same step, stop there together, save a checkpoint and exit 0. Checking
only then keeps the ranks' hosts from waiting for each other every step. A rank never stops alone, so no rank
is left waiting in a collective. A second Ctrl-C ends the process at once, without saving.
"""
import math
import os
import signal
from contextlib import contextmanager
from time import monotonic

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_TIME_LIMIT = 1000  # above every signal number, so MAX of the codes stays meaningful
STOP_LATENCY = 10.0  # seconds: the longest a stop request waits for the ranks to look at it (unless a step is longer)


class Diverged(RuntimeError):
    """The loss blew up. Raised on every rank at the same step: the grad norm it is decided on is all-reduced."""


class StopRequests:
    """Created when the run starts (the --time_limit clock starts then); `agreed()` is called at every logging
    step (every --log_interval steps), before every save, and at every step where `due(step)` says so."""

    def __init__(self, time_limit_seconds=None):
        self.start = monotonic()
        self.time_limit_seconds = time_limit_seconds
        self.received = 0
        self.reason = None  # set once every rank has agreed to stop
        self.next_look = None  # the step all ranks look at next (besides logging steps); None: the first step
        self.last_look = None  # (step, time) of the last look

    def due(self, step):
        """Whether the ranks look at this step (collective-safe: every rank has agreed on next_look)."""
        return self.next_look is None or step >= self.next_look

    @contextmanager
    def listening(self):
        """Catch the stop signals only while training: elsewhere there is nothing to save, and the default
        action (exit) is the right one."""
        previous = {sig: signal.signal(sig, self._record) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.siginterrupt(sig, False)  # restart interrupted system calls (a collective's socket waits)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _record(self, signum, frame):
        if signum == signal.SIGINT and self.received:  # Ctrl-C again: the user will not wait for the save
            os.write(2, b"error: interrupted again: exiting at once, without saving\n")
            os._exit(130)
        self.received = signum  # only a flag: the step in flight finishes, then all ranks decide together

    def agreed(self, step=None):
        """Collective: the reason every rank stops after step `step`, or None to go on. Also agrees on the
        step of the next look: STOP_LATENCY seconds on at the slowest rank's pace since the last look."""
        now = monotonic()
        code = self.received
        if not code and self.time_limit_seconds is not None and now - self.start >= self.time_limit_seconds:
            code = _TIME_LIMIT
        pace = 0.0  # seconds per step since the last look
        if step is not None and self.last_look is not None and step > self.last_look[0]:
            pace = (now - self.last_look[1]) / (step - self.last_look[0])
        flag = torch.tensor([code, pace], dtype=torch.float64)  # a CPU tensor (gloo): no wait for the GPU
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


class NonFiniteGuard:
    """Stops the run at a NaN/Inf grad norm, naming the step.

    With --skip_nonfinite N > 0 every step is checked before its update (train_step skips a non-finite one),
    which makes the host wait for the device once per step. With N = 0 (the default) the check is deferred:
    grad norms stay on the device and are looked at whenever the loop syncs anyway (logging) and before any
    checkpoint is written, so a poisoned model is never saved and the hot path never waits."""

    def __init__(self, allowed, warn=None):
        self.allowed = allowed
        self.warn = warn  # prints a warning line on rank 0 (around its progress bar); None elsewhere
        self.skipped = 0
        self.pending = []  # (step, grad norm on the device, loss) not yet looked at

    def check(self, step, grad_norm, loss):
        """True if the step's update counts. grad_norm is the all-reduced one, so every rank agrees."""
        if not self.allowed:
            self.pending.append((step, grad_norm, loss))
            return True
        return self._verdict(step, float(grad_norm), loss)

    def flush(self):
        """Look at the deferred grad norms (one wait for the device); raises Diverged at the first bad one."""
        pending, self.pending = self.pending, []
        if pending and not bool(torch.stack([torch.as_tensor(n).float() for _, n, _ in pending]).isfinite().all()):
            for step, norm, loss in pending:
                self._verdict(step, float(norm), loss)

    def _verdict(self, step, grad_norm, loss):
        if math.isfinite(grad_norm):
            return True
        self.skipped += 1
        if self.skipped > self.allowed:
            raise Diverged(f"step {step}: the grad norm is {grad_norm} (loss {float(loss):.4g} on rank 0): the run "
                           "diverged and stops here; its last checkpoint is untouched. Lower --lr or raise "
                           "--warmup_steps, or let --skip_nonfinite N skip up to N such steps")
        if self.warn:
            self.warn(f"warning: step {step}: grad norm {grad_norm}; update skipped "
                      f"({self.skipped} of --skip_nonfinite {self.allowed})")
        return False

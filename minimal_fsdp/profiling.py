"""--profile START:END and --memory_snapshot: what a training run records of its own steps for a
user to open (docs/performance.md, "Profiling a run").

- --profile: a torch.profiler trace of the steps START to END-1 (0-based, as `range`; the log's
  rows count steps done, so 10:12 is the rows 11 and 12), one file per rank,
  <log_dir>/<run_name>/profile/rank<R>.steps<START>-<END>.pt.trace.json: Chrome trace JSON, which
  Perfetto (ui.perfetto.dev) and chrome://tracing open, and which TensorBoard's profiler plugin
  finds by its .pt.trace.json ending (`tensorboard --logdir <log_dir>/<run_name>/profile`). Each
  step is a `ProfilerStep#<step>` range, as torch.profiler's own schedule names them.
- --memory_snapshot (CUDA only): the CUDA caching allocator's history from the first recorded step
  and its state at the end, <log_dir>/<run_name>/memory_snapshot_rank<R>.pickle, for
  pytorch.org/memory_viz. It records the --profile range if one is given, else the launch's first
  SNAPSHOT_STEPS steps.

Off (the default) nothing is created: around_steps yields None and the loop checks only that.

Every run, also: what the training log reports of the device (peak_memory_gb, peak_flops for the
MFU) and the CUDA caching allocator's retries, the one warning a run near the card's memory gets.
Nothing here imports torch at import time: the flags' checks run before it loads.
"""

import resource
from contextlib import contextmanager
from pathlib import Path

from minimal_fsdp.config.checks import profile_range
from minimal_fsdp.config.choices import PEAK_FLOPS

SNAPSHOT_STEPS = 3  # steps a --memory_snapshot records without --profile
SNAPSHOT_ENTRIES = 100_000  # allocator events kept (torch's example value); older ones drop out


class StepProfiler:
    """Starts and stops the profiler and the allocator's history at step boundaries; `at(step)` is
    called before each step, `close()` after the loop (a range past the run's end ends there)."""

    def __init__(self, profiling, env, run_dir, warn):
        """profiling: config.sections.Profiling."""
        self.env, self.run_dir, self.rank = env, Path(run_dir), env.rank
        self.range = profile_range(profiling.profile) if profiling.profile else None
        cuda = env.device.type == "cuda"
        self.snapshot = profiling.memory_snapshot and cuda
        if profiling.memory_snapshot and not cuda and warn:
            warn(
                "warning: --memory_snapshot is CUDA-only (the CUDA allocator's snapshot); this "
                f"run is on {env.device.type}: no snapshot is written"
            )
        self.snapshot_range = None
        if self.snapshot:
            self.snapshot_range = self.range  # set at the first step without --profile
        self.profiler = self.step_range = None
        self.recording = False
        self.first = None

    def at(self, step):
        """Before step `step`: ends the last step's range, starts or stops what is due."""
        import torch

        if self.first is None:
            self.first = step
            if self.snapshot and self.snapshot_range is None:
                self.snapshot_range = (step, step + SNAPSHOT_STEPS)
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.range and step == self.range[1]:
            self._stop_trace()
        if self.snapshot_range and step == self.snapshot_range[1]:
            self._stop_snapshot()
        if self.snapshot and not self.recording and self._in(self.snapshot_range, step):
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
            self.recording = True
        if self.range and self.profiler is None and self._in(self.range, step):
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.env.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.start()
        if self.profiler is not None:
            self.step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.step_range.__enter__()

    def close(self):
        """After the loop: what is still recording is written (a range past the run's end)."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        self._stop_trace()
        self._stop_snapshot()

    @staticmethod
    def _in(span, step):
        return span is not None and span[0] <= step < span[1]

    def _synchronize(self):
        if self.env.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.env.device)  # the traced steps' kernels end in the trace

    def trace_file(self):
        start, end = self.range
        return self.run_dir / "profile" / f"rank{self.rank}.steps{start}-{end}.pt.trace.json"

    def snapshot_file(self):
        return self.run_dir / f"memory_snapshot_rank{self.rank}.pickle"

    def _stop_trace(self):
        if self.profiler is None:
            return
        self._synchronize()
        self.profiler.stop()
        path = self.trace_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(path))
        self.profiler = None

    def _stop_snapshot(self):
        if not self.recording:
            return
        import torch

        self._synchronize()
        path = self.snapshot_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False


@contextmanager
def around_steps(profiling, env, run_dir, warn=None):
    """The loop's StepProfiler if --profile or --memory_snapshot is set (in `profiling`,
    config.sections.Profiling), else None (nothing made). warn: rank 0's warning printer (others
    pass None)."""
    if not profiling.profile and not profiling.memory_snapshot:
        yield None
        return
    profiler = StepProfiler(profiling, env, run_dir, warn)
    try:
        yield profiler
    finally:
        profiler.close()


# ---- the device, as the training log reports it ----


def peak_flops(device):
    """The card's dense bf16 peak (config/choices.py's PEAK_FLOPS), None off CUDA: for the MFU."""
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def peak_memory_gb(device):
    """The most memory this process has held on `device` (the host's peak RSS off CUDA), in GB."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # this process's peak RSS (KB on Linux)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def allocator_retries(device):
    """How often the CUDA caching allocator found no room, freed its whole cache and asked the
    driver again (0 off CUDA). Each time the GPU stalls, and a run does not fail: it runs slower.
    A run this close to the card's memory can run at half speed with nothing else in its log
    (benchmarks/results/RESULTS.md, Llama 3 8B's other layouts)."""
    import torch

    return (
        torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0
    )


def memory_pressure(step, retries, peak_gb, device):
    """The one warning a run gets when the allocator starts retrying (allocator_retries)."""
    import torch

    total = (
        f" of {torch.cuda.get_device_properties(device).total_memory / 1e9:.1f}"
        if device.type == "cuda"
        else ""
    )
    return (
        f"memory: by step {step} the CUDA allocator ran out of room {retries} time(s) over the "
        f"ranks and freed its cache to retry (peak {peak_gb:.1f}{total} GB on rank 0); steps this "
        "close to the GPU's memory can run much slower. A smaller --batch_size, "
        "--activation_checkpoints, or full-shard gives room (minimal-fsdp plan plans it)"
    )

"""What a run tells you as it trains: the log of training (a progress bar on a terminal, plain
lines in a batch job's output), the metrics rank 0 writes, and a summary at the end. The startup
banner is backends/banner.py's.

<log_dir>/<run_name>/ holds metrics.jsonl (always: one JSON object per logged step), TensorBoard
event files (unless --no-tensorboard), and config.toml (the resolved flags, loadable with --config).
With --wandb the same scalars go to Weights & Biases (WANDB_MODE=offline writes them locally for a
later `wandb sync`).
"""

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from minimal_fsdp.config.flags import to_toml
from minimal_fsdp.launch import failures
from minimal_fsdp.profiling import allocator_retries, memory_pressure, peak_flops, peak_memory_gb

# JSONL field -> TensorBoard / wandb tag; grouped so the dashboards put loss, speed and
# memory apart.
TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time": "perf/step_time_s",
    "mfu": "perf/mfu",
    "peak_mem_gb": "perf/peak_mem_gb",
    "save_blocking_s": "checkpoint/save_blocking_s",
    "save_waited_s": "checkpoint/save_waited_s",
    "save_total_s": "checkpoint/save_total_s",
    "restore_s": "checkpoint/restore_s",
    "alloc_retries": "perf/alloc_retries",
}


class Metrics:
    """Rank 0 logs; the other ranks hold an inert object. Made by `open`, which is collective (every
    rank calls it), so a failure on rank 0, e.g. wandb refusing to start, stops every rank with the
    same error."""

    def __init__(self, logging):
        """logging: config.sections.Logging."""
        self.file = self.tensorboard = self.wandb = None
        self.dir = Path(logging.log_dir) / logging.run_name

    @classmethod
    def open(cls, logging, flags):
        """Collective: the run's log files opened on rank 0. flags: every resolved flag of the run,
        {name: value}, written as config.toml and given to wandb."""
        metrics = cls(logging)
        failures.run_on_main(metrics._open, logging, flags)
        return metrics

    def _open(self, logging, flags):
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.toml").write_text(to_toml(flags))
        self.file = open(self.dir / "metrics.jsonl", "a")  # a resumed run appends
        if logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.dir), flush_secs=30)
        if logging.wandb:
            import wandb  # validate() checked it is installed

            self.wandb = wandb.init(
                project=logging.wandb_project,
                name=logging.run_name,
                dir=str(self.dir),
                config=dict(flags),
            )

    def log(self, step, **scalars):
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, **scalars}) + "\n")
        self.file.flush()
        tagged = {TAGS.get(name, name): value for name, value in scalars.items()}
        if self.tensorboard:
            for tag, value in tagged.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log(tagged, step=step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.file = self.tensorboard = self.wandb = None


class TrainingLog:
    """What training reports, one object per launch. On rank 0 of a one-process run at a terminal: a
    progress bar; otherwise (a launcher, a batch job's output file) one plain line every
    --log_interval steps. Every logged step also goes to metrics.jsonl, TensorBoard and wandb. Time
    spent evaluating and saving is paused out, so tokens/s and MFU count training alone. Used as a
    context manager: the bar ends its line and the files close even when training fails."""

    @classmethod
    def open(cls, logging, flags, env, model, schedule, first_step, tokens_per_step, synchronize):
        """Collective: the log of a run whose files rank 0 opens (Metrics.open, given `logging` and
        `flags`)."""
        metrics = Metrics.open(logging, flags)
        return cls(logging, env, model, schedule, first_step, tokens_per_step, synchronize, metrics)

    def __init__(
        self, logging, env, model, schedule, first_step, tokens_per_step, synchronize, metrics
    ):
        """logging: config.sections.Logging; synchronize(): waits for the device's queued steps
        (the backend's); metrics: Metrics.open's."""
        self.metrics, self.synchronize = metrics, synchronize
        self.env, self.main, self.run_name = env, env.is_main, logging.run_name
        self.first_step, self.last_step, self.tokens_per_step = (
            first_step,
            schedule.last_step,
            tokens_per_step,
        )
        self.flops_per_token, self.peak = model.flops_per_token(), peak_flops(env.device)
        self.log_dir = Path(logging.log_dir) / logging.run_name
        self.bar, self.retries_warned = None, False
        # A bar only for a plain `python basic_training.py` at a terminal: under a launcher stdout
        # may be a pty (Open MPI gives each rank one) while the job's output goes to a file.
        if self.main and sys.stdout.isatty() and env.launcher == "single":
            self.bar = tqdm(
                total=schedule.last_step,
                initial=first_step,
                dynamic_ncols=True,
                desc="train",
                mininterval=1.0,
            )
        self.start = time.perf_counter()
        self.window_start, self.window_first, self.paused_time = self.start, first_step, 0.0
        self.losses, self.last_val, self.best_val, self.checkpoint, self.done = (
            [],
            None,
            None,
            None,
            first_step,
        )
        # at start: a restore's or compile's retries are not training's
        self.retries = allocator_retries(env.device)
        self.print(
            f"training {schedule.length}" + (f", from step {first_step}" if first_step else "")
        )

    def print(self, text, stream=None):
        if not self.main:
            return
        stream = stream or sys.stdout
        if self.bar is not None:
            self.bar.write(text, file=stream)
        else:
            print(text, file=stream, flush=True)

    def warn(self, text):
        self.print(text, sys.stderr)

    def step(self, loss):
        """After every step: its loss (a device tensor), or None for a step whose update was
        skipped."""
        self.done += 1
        if loss is not None:
            self.losses.append(loss)
        if self.bar is not None:
            self.bar.update(1)

    def row(self, step, lr, grad_norm, **extra):
        """Collective: log the mean loss of the steps since the last row (this waits for the
        device). Steps whose update was skipped have no loss; a window of only those has no row."""
        if not self.losses:
            return
        loss, retries = sum_across_ranks(
            sum(self.losses) / len(self.losses), allocator_retries(self.env.device) - self.retries
        )
        loss /= dist.get_world_size()
        elapsed = time.perf_counter() - self.window_start - self.paused_time
        steps, self.losses = max(1, step - self.window_first), []
        tok_s = self.tokens_per_step * steps / elapsed
        row = dict(
            loss=loss,
            lr=lr,
            grad_norm=float(grad_norm),
            tokens_per_s=tok_s,
            step_time=elapsed / steps,
            peak_mem_gb=peak_memory_gb(self.env.device),
            **extra,
        )
        if self.peak:
            row["mfu"] = self.flops_per_token * tok_s / (self.peak * self.env.world_size)
        if retries:
            row["alloc_retries"] = retries = int(retries)
            if not self.retries_warned:
                self.retries_warned = True
                self.warn(memory_pressure(step, retries, row["peak_mem_gb"], self.env.device))
        self.metrics.log(step, **row)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        else:
            mfu = f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
            self.print(
                f"step {step}/{self.last_step}: loss {loss:.4f}, lr {lr:.3g}, {tok_s:,.0f} "
                f"tokens/s, {1000 * elapsed / steps:.1f} ms/step{mfu}, {row['peak_mem_gb']:.2f} GB "
                f"peak"
            )
        self.window_start, self.window_first, self.paused_time = time.perf_counter(), step, 0.0

    @contextmanager
    def paused(self):
        """Evaluation and saving: the device finishes the queued training steps first, and the time
        inside is left out of the next row's tokens/s."""
        self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.paused_time += time.perf_counter() - start

    def consensus(self, step, distance):
        """A decentralized run's consensus distance (gossip.consensus_distance), measured at
        evaluation steps."""
        self.metrics.log(step, consensus=distance)

    def validation(self, step, val_loss):
        if val_loss is None:
            return
        self.metrics.log(step, val_loss=val_loss)
        self.last_val = (step, val_loss)
        if self.best_val is None or val_loss < self.best_val[1]:
            self.best_val = (step, val_loss)
        self.print(f"step {step}: val loss {val_loss:.4f}")

    def saved(self, saves):
        """Saves begun or ended (background.Saved): one line for a save that goes on in the
        background, one when a save is committed, whose seconds (blocking, of which waited for the
        save before, total) also go to metrics.jsonl at its step."""
        for save in saves:
            before = (
                f" ({save.waited_s:.2f} s of it for the save before)"
                if save.waited_s >= 0.01
                else ""
            )
            if save.total_s is None:
                self.print(
                    f"step {save.step}: training waited {save.blocking_s:.2f} s{before} to save "
                    f"{save.path}; "
                    "its files are being written in the background"
                )
                continue
            self.checkpoint = save.path
            self.metrics.log(
                save.step,
                save_blocking_s=save.blocking_s,
                save_waited_s=save.waited_s,
                save_total_s=save.total_s,
            )
            self.print(
                f"step {save.step}: saved {save.path} in {save.total_s:.2f} s; training waited "
                f"{save.blocking_s:.2f} s{before}"
            )

    def restored(self, step, seconds):
        """The restore at start (checkpointer.Checkpointer.restore timed it, the banner printed it)
        to metrics.jsonl."""
        if seconds is not None:
            self.metrics.log(step, restore_s=seconds)

    def stopped(self, step, reason):
        self.print(
            f"step {step}: {reason}; saved a checkpoint and stopping. Run the same command again "
            f"to resume."
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.metrics.close()

    def summary(self):
        """Rank 0's last lines: what was trained, where it went, how to sample from it."""
        minutes, seconds = divmod(round(time.perf_counter() - self.start), 60)
        trained = self.done - self.first_step
        # A finished run resumed with a smaller --max_steps is past its last step: not 'step 600
        # of 20'.
        where = (
            f"step {self.done} of {self.last_step}"
            if self.done <= self.last_step
            else f"step {self.done}, already past this launch's last step ({self.last_step})"
        )
        lines = [
            f"done: {where}; this launch trained {trained} steps "
            f"({trained * self.tokens_per_step:,} tokens) in {minutes}m{seconds:02d}s"
        ]
        if self.last_val:
            best = (
                f" (best {self.best_val[1]:.4f} at step {self.best_val[0]})"
                if self.best_val != self.last_val
                else ""
            )
            lines.append(f"val loss {self.last_val[1]:.4f} at step {self.last_val[0]}{best}")
        if self.checkpoint:
            lines.append(f"checkpoint: {self.checkpoint}; logs: {self.log_dir}")
            lines.append(
                f"sample from it: minimal-fsdp sample {self.checkpoint.parent} --prompt \"...\""
            )
        return "\n".join(lines)


def sum_across_ranks(*values):
    """Each number or one-element tensor summed over the ranks, in one all-reduce (on any device; an
    XLA one cannot take part in the ranks' collective itself, so it comes to the host first)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return t.tolist()


def mean_across_ranks(value):
    """The mean over the ranks of a number or a one-element tensor (gloo has no AVG: a sum)."""
    return sum_across_ranks(value)[0] / dist.get_world_size()

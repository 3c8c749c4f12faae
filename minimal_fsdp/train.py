"""The training loop and its parts: AdamW, the run's length and learning-rate schedule, one
optimizer step (accumulation, clipping), evaluation, the guard that stops a diverged run at its
NaN/Inf grad norm, and the loop that ties them to logging, evaluation and checkpoints. The loop is
the same for every backend: run.train_model hands it the backend's parts (RunParts)."""

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from minimal_fsdp import profiling
from minimal_fsdp.eval.harness import TrainingTasks
from minimal_fsdp.launch import hangs
from minimal_fsdp.metrics import TrainingLog, mean_across_ranks
from minimal_fsdp.parallel.accum_adamw import AccumAdamW
from minimal_fsdp.parallel.clipped_adamw import ClippedAdamW
from minimal_fsdp.parallel.whole_unit import LocalAdamW


def build_optimizer(model, optimizer, plan=None):
    """AdamW (optimizer: sections.Optimizer) with decay on matrices only (not biases, norms); fused
    kernels. Decentralized runs use AccumAdamW and beta2 0.98 by default, as the decentralized GPT-2
    reference does. plan: the run's; under its one-unit strategy AdamW steps the shards' local
    tensors (without it, torch's AdamW: the same numbers); where the plan's backend has no fused
    kernels (XLA), torch's AdamW without them."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optimizer.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    o = optimizer
    decentralized = o.data_parallel == "decentralized"
    betas = (o.beta1, o.beta2 if o.beta2 is not None else 0.98 if decentralized else 0.95)
    if decentralized:
        return AccumAdamW(groups, lr=o.lr, betas=betas, accum_steps=o.accum_steps)
    if plan is not None and not plan.fused_optimizer:
        return torch.optim.AdamW(groups, lr=o.lr, betas=betas)
    if plan is not None and plan.compiled_optimizer:
        # compiled with the clip folded in: a step's fewest passes over memory (clipped_adamw.py)
        # one GPU: its gradients are those of the bf16 copies the model computes with
        weights = getattr(model, "bf16_weights", None)
        return ClippedAdamW(groups, lr=o.lr, betas=betas, weights=weights)
    # Fused: one kernel over all tensors on GPU; on CPU (laptops, --cpu_offload) several times
    # faster than foreach (benchmarks/results/RESULTS.md#levers-kept). whole_unit.py's model steps
    # it on its shards' local tensors (LocalAdamW), as a small model's step needs.
    adamw = LocalAdamW if plan is not None and plan.strategy == "one-unit" else torch.optim.AdamW
    return adamw(groups, lr=o.lr, betas=betas, fused=True)


@dataclass
class RunParts:
    """What the loop trains and with what, built by run.train_model from the backend's builders
    (backends/default.py for CUDA and CPU, xla.py for --device xla)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    # steps_per_epoch(), train_batches(step), val_batch(i), state_dict(step) (and tokenizer)
    data: object
    sync: object  # the gradient sync: parallelize.gradient_sync's for the plan, or xla.StepSync
    checkpointer: object  # checkpointer.Checkpointer, or xla.Checkpointer
    # how many take --batch_size sequences of every micro-batch: the ranks, or XLA's devices
    ranks: int
    # waits for the device's queued steps (the backend's synchronize)
    synchronize: object = lambda: None


@dataclass
class Schedule:
    """The run's length and its learning rate at every step: linear warmup to --lr, cosine decay to
    --min_lr at decay_steps, then flat. The horizon belongs to the run, not to one launch: a
    checkpoint keeps it (state_dict), so a resumed run decays on the schedule it began with even if
    its length changed."""

    peak_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    last_step: int  # the run trains steps [0, last_step)
    length: str  # how last_step was decided, for the startup line

    @classmethod
    def for_run(cls, schedule, steps_per_epoch, saved=None):
        """schedule: sections.LrSchedule; saved: the schedule's state_dict from the checkpoint being
        resumed, if any."""
        s = schedule
        last_step, length = run_length(s, steps_per_epoch)
        decay_steps = s.lr_decay_steps or (saved or {}).get("lr_decay_steps") or last_step
        if decay_steps != last_step and not s.lr_decay_steps:
            length += (
                f"; the LR schedule spans {decay_steps} steps, as when the run began "
                "(--lr_decay_steps changes it)"
            )
        min_lr = s.lr / 10 if s.min_lr is None else s.min_lr
        return cls(s.lr, min_lr, s.warmup_steps, decay_steps, last_step, length)

    def apply(self, optimizer, step):
        """Sets every parameter group's learning rate for `step`; returns it."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def lr_at(self, step):
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (
            1 + math.cos(math.pi * min(1.0, progress))
        )

    def state_dict(self):
        return {"lr_decay_steps": self.decay_steps, "last_step": self.last_step}


def run_length(schedule, steps_per_epoch):
    """(last step, why) of a sections.LrSchedule: --max_steps alone sets it, --max_epochs alone sets
    it, and with both the first reached ends the run. steps_per_epoch is None for a stream, whose
    length is unknown."""
    max_steps, max_epochs = schedule.max_steps, schedule.max_epochs
    if steps_per_epoch is None:
        return max_steps, f"{max_steps} steps (--max_steps; a stream has no epochs)"

    def epochs(n):
        return f"{n:.3g} epoch{'' if n == 1 else 's'} of {steps_per_epoch} steps"

    if max_epochs is None or max_steps and max_steps < max_epochs * steps_per_epoch:
        return (
            max_steps,
            f"{max_steps} steps = {epochs(max_steps / steps_per_epoch)} (--max_steps)",
        )
    last = max_epochs * steps_per_epoch
    return last, f"{last} steps = {epochs(max_epochs)} (--max_epochs)"


def _to_device(batch, device):
    """Host batches go through pinned memory so the copy overlaps with compute. Contiguous first:
    inputs and targets are strided views of one block of tokens, and torch copies a strided host
    tensor to the GPU from a pageable temporary, which the CUDA driver may stage by waiting for the
    stream (the host then cannot run ahead)."""
    if device.type == "cuda":
        return [
            t.contiguous().pin_memory().to(device, non_blocking=True)
            if t.device.type == "cpu"
            else t
            for t in batch
        ]
    return batch


def train_step(
    model, optimizer, micro_batches, sync, grad_clip, device, step=0, skip_nonfinite=False
):
    """One optimizer step over a list of (inputs, targets) micro-batches; returns the mean loss and
    the global grad norm, both device tensors (the norm the same on every rank). sync synchronizes
    and clips gradients: parallelize.gradient_sync's (by the plan's strategy), or xla.py's. With
    skip_nonfinite an update with a NaN/Inf grad norm is not applied (it would poison every weight);
    that check waits for the device, so it is made only when asked for. sync.after_step() ends the
    step: the weight scales of --precision fp8's float8 all-gather, or the traced step under XLA."""
    # CUDA graphs only; its first call imports inductor, ~10 s of a CPU run's start
    if device.type == "cuda":
        # --cuda_graphs: the last step's graph outputs may be reused
        torch.compiler.cudagraph_mark_step_begin()
    sync.start(step)  # gossip: parameters travel to the neighbours while forward and backward run
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        x, y = _to_device(batch, device)
        sync.micro_step(last=i == len(micro_batches) - 1)
        loss = model(x, y)
        if len(micro_batches) > 1:  # not / 1: a kernel each way for nothing
            loss = loss / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    # gossip: parameters <- the neighbours' weighted average; this step's update lands on it
    sync.finish()
    # ClippedAdamW clips as it steps: the sync only measures the norm
    in_step = isinstance(optimizer, ClippedAdamW)
    grad_norm = sync.clip_grad_norm(model.parameters(), 0 if in_step else grad_clip)
    if not skip_nonfinite or torch.isfinite(grad_norm):
        optimizer.step(grad_norm=grad_norm, max_norm=grad_clip) if in_step else optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync.after_step()
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, data, batches, device):
    """Mean loss over the first `batches` validation batches of every rank (one wait for the
    device)."""
    model.eval()
    losses = torch.stack([model(*_to_device(data.val_batch(i), device)) for i in range(batches)])
    model.train()
    return mean_across_ranks(losses.float().mean())


GC_INTERVAL = 50  # steps between the loop's own collections of Python's young objects


@contextmanager
def collections_in_step():
    """Python's automatic garbage collection off while training; the loop collects on every rank at
    the same step instead: everything after the first step (torch.compile's objects) and after each
    save, the young generations every GC_INTERVAL steps. Left automatic, a full collection (tens of
    milliseconds with compile's objects alive) pauses one rank at a time, and every other rank waits
    for it at the next collective, so a steady multi-GPU run loses whole timing windows to it."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class Due:
    """What the step just done is due for; every rank computes the same from the step and the
    flags."""

    final: bool  # the schedule's last step
    logs: bool  # a row every --log_interval steps
    saves: bool  # every --checkpoint_interval steps, and the last
    evaluates: bool  # every --eval_interval steps, and every save

    @classmethod
    def after(cls, done, loop, last_step):
        """loop: sections.Loop, whose intervals say what is due."""
        final = done == last_step
        saves = final or bool(loop.checkpoint_interval) and done % loop.checkpoint_interval == 0
        evaluates = saves or bool(loop.eval_interval) and done % loop.eval_interval == 0
        return cls(final, done % loop.log_interval == 0 or final, saves, evaluates)


def collect_garbage(done, first):
    """The loop's own collections (collections_in_step), at the same steps on every rank."""
    # the first step compiled: its objects go to the old generation now, at once
    if done == first + 1:
        gc.collect()
    elif done % GC_INTERVAL == 0:
        gc.collect(1)


def evaluate_and_save(parts, eval_batches, env, plan, log, done, due, stopping, run_state):
    """The validation loss (over eval_batches batches) where due (and a decentralized run's
    consensus distance: two all-reduces of the replica, so only here, off the training steps), then
    the save where due or when stopping; run_state(done): what the checkpoint keeps besides the
    model and optimizer."""
    val_loss = (
        evaluate(parts.model, parts.data, eval_batches, env.device) if due.evaluates else None
    )
    log.validation(done, val_loss)
    if due.evaluates and plan.decentralized:
        log.consensus(done, parts.sync.consensus_distance())
    if due.saves or stopping:
        # after the one in flight
        parts.checkpointer.save(done, parts.model, parts.optimizer, val_loss, run_state(done))
        log.saved(parts.checkpointer.reports())
        gc.collect()  # what outlived the young collections; a save takes seconds anyway


def run_tasks(tasks, log, checkpointer, done, due, stop_reason):
    """Between a logging step's row and its evaluation: a save written in the background is reported
    (or its failure raised) at the first logging step after it ended (collective); the harness's
    tasks (--eval_tasks) run, timed apart, before the save that records their scores."""
    if due.logs and not due.saves:
        checkpointer.poll()
        log.saved(checkpointer.reports())
    if tasks and tasks.due(done, due.final, due.saves) and not stop_reason:
        with log.paused():
            tasks.run(done, log)


class Diverged(RuntimeError):
    """The loss blew up. Raised on every rank at the same step: the grad norm it is decided on is
    all-reduced."""


class NonFiniteGuard:
    """Stops the run at a NaN/Inf grad norm, naming the step.

    With --skip_nonfinite N > 0 every step is checked before its update (train_step skips a
    non-finite one), which makes the host wait for the device once per step. With N = 0 (the
    default) the check is deferred: grad norms stay on the device and are looked at whenever the
    loop syncs anyway (logging) and before any checkpoint is written, so a poisoned model is never
    saved and the hot path never waits."""

    def __init__(self, allowed, warn=None):
        self.allowed = allowed
        # prints a warning line on rank 0 (around its progress bar); None elsewhere
        self.warn = warn
        self.skipped = 0
        self.pending = []  # (step, grad norm on the device, loss) not yet looked at

    def check(self, step, grad_norm, loss):
        """True if the step's update counts. grad_norm is the all-reduced one, so every rank
        agrees."""
        if not self.allowed:
            self.pending.append((step, grad_norm, loss))
            return True
        return self._verdict(step, float(grad_norm), loss)

    def flush(self):
        """Look at the deferred grad norms (one wait for the device); raises Diverged at the first
        bad one."""
        pending, self.pending = self.pending, []
        if pending and not bool(
            torch.stack([torch.as_tensor(n).float() for _, n, _ in pending]).isfinite().all()
        ):
            for step, norm, loss in pending:
                self._verdict(step, float(norm), loss)

    def _verdict(self, step, grad_norm, loss):
        if math.isfinite(grad_norm):
            return True
        self.skipped += 1
        if self.skipped > self.allowed:
            raise Diverged(
                f"step {step}: the grad norm is {grad_norm} (loss {float(loss):.4g} on rank 0): "
                "the run diverged and stops here; its last checkpoint is untouched. Lower --lr or "
                "raise --warmup_steps, or let --skip_nonfinite N skip up to N such steps"
            )
        if self.warn:
            self.warn(
                f"warning: step {step}: grad norm {grad_norm}; update skipped "
                f"({self.skipped} of --skip_nonfinite {self.allowed})"
            )
        return False


def train(
    parts, env, plan, stop, saved=None, *, lr_schedule, loop, evaluation, logging, profile, flags
):
    """Train parts (RunParts) from step 0, or from `saved` (the meta.json of the checkpoint just
    restored), to the schedule's last step. Evaluates every --eval_interval steps; saves every
    --checkpoint_interval steps, at the end, and when all ranks agree to stop (stop:
    resilience.StopRequests, asked at logging steps and when due). Returns the last step done and
    the log, which holds the run's summary. The sections it reads (config.sections): lr_schedule
    (LrSchedule), loop (Loop), evaluation (Evaluation: the harness's tasks), logging (Logging),
    profile (Profiling); flags: every flag's value, the record metrics writes as config.toml."""
    model, data, checkpointer = parts.model, parts.data, parts.checkpointer
    schedule = Schedule.for_run(
        lr_schedule, data.steps_per_epoch(), saved and saved["state"]["schedule"]
    )
    first = done = saved["step"] if saved else 0
    tokenizer = getattr(data, "tokenizer", None)
    tasks = TrainingTasks.for_run(evaluation, env, tokenizer, model, saved)
    tokens_per_step = (
        parts.ranks * loop.batch_size * loop.grad_accum_steps * model.config.seq_length
    )
    log = TrainingLog.open(logging, flags, env, model, schedule, first, tokens_per_step,
                           parts.synchronize)  # fmt: skip
    guard = NonFiniteGuard(loop.skip_nonfinite, log.warn if env.is_main else None)
    step_with = (parts.sync, loop.grad_clip, env.device)  # train_step's arguments after the batches

    def run_state(step):  # what a checkpoint keeps besides the model and optimizer
        tasks_state = {"eval_tasks": tasks.state_dict(step)} if tasks else {}
        return {"schedule": schedule.state_dict(), "data": data.state_dict(step), **tasks_state}

    model.train()
    # --profile / --memory_snapshot: None when neither is set
    # --profile's and --memory_snapshot's files go beside the run's logs
    run_dir, warn = Path(logging.log_dir) / logging.run_name, (lambda text: log.warn(text))
    profiler = profiling.around_steps(profile, env, run_dir, warn if env.is_main else None)
    # a save in flight ends before return
    with log, collections_in_step(), checkpointer.saving(), profiler as profiler:
        log.restored(first, checkpointer.restore_s)
        for step in range(first, schedule.last_step):
            hangs.at_step(step + 1)  # named by the line a collective timeout ends with
            if profiler:
                profiler.at(step)
            lr = schedule.apply(parts.optimizer, step)
            batches = data.train_batches(step)
            loss, grad_norm = train_step(model, parts.optimizer, batches, *step_with, step,
                                         skip_nonfinite=loop.skip_nonfinite > 0)  # fmt: skip
            done = step + 1
            log.step(loss if guard.check(done, grad_norm, loss) else None)
            collect_garbage(done, first)
            due = Due.after(done, loop, schedule.last_step)
            if due.logs or due.saves:  # the host waits for the device here, and only here
                guard.flush()  # raises Diverged at a NaN/Inf grad norm, before anything is saved
            if due.logs:
                log.row(done, lr, grad_norm)
            # Collective, at steps every rank agrees on: logging steps, saves, and often enough to
            # act on a stop request within seconds (StopRequests.due); all ranks stop at one step.
            stop_reason = stop.agreed(done) if due.logs or due.saves or stop.due(done) else None
            run_tasks(tasks, log, checkpointer, done, due, stop_reason)
            if due.evaluates or stop_reason:
                with log.paused():  # evaluation and saving are timed apart from the training steps
                    evaluate_and_save(parts, loop.eval_batches, env, plan, log, done, due,
                                      bool(stop_reason), run_state)  # fmt: skip
            if stop_reason:
                log.stopped(done, stop_reason)
                break
        checkpointer.wait()  # the last save is committed before the process ends
        log.saved(checkpointer.reports())
    return done, log

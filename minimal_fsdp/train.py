"""The training loop: AdamW, warmup + cosine schedule, clipping, accumulation, evaluation, logging, saving."""
import json
import math
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import checkpoint

# Dense bf16 tensor-core peaks; MFU is always relative to these (as nanoGPT and PaLM report it).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def build_optimizer(model, cfg):
    """AdamW with decay on matrices only (not biases, norms); fused kernels on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    on_cuda = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=on_cuda)


def lr_at(step, cfg, total_steps):
    """Linear warmup to --lr, then cosine decay to --min_lr at the last step. A pure function of the step,
    so a resumed run needs nothing but the step to continue the schedule."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def steps_per_epoch(cfg, world_size, train_tokens, seq_length):
    tokens_per_step = world_size * cfg.batch_size * cfg.grad_accum_steps * seq_length
    return max(1, train_tokens // tokens_per_step)


def total_steps(cfg, per_epoch):
    if per_epoch is None:  # a stream of unknown length: --max_steps alone sets the run's length
        return cfg.max_steps
    steps = cfg.max_epochs * per_epoch
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def mean_across_ranks(value, device):
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, data, cfg, env, seq_length):
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = data.get_batch("val", i, env.rank, env.world_size, cfg.batch_size, seq_length, cfg.seed)
        losses.append(model(x.to(env.device), y.to(env.device)).item())
    model.train()
    return mean_across_ranks(sum(losses) / len(losses), env.device)


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # host RSS (KB on Linux)


class MetricsLog:
    """Rank 0 appends one JSON object per log line to <log_dir>/<run_name>/metrics.jsonl."""

    def __init__(self, cfg, env):
        self.file = None
        if env.is_main:
            path = Path(cfg.log_dir) / cfg.run_name / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")

    def write(self, **row):
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()


def _to_device(batch, device):
    """Host batches go through pinned memory so the copy overlaps with compute."""
    if device.type == "cuda":
        return [t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else t for t in batch]
    return batch


def train_step(model, optimizer, micro_batches, grad_clip, device):
    """One optimizer step over a list of (inputs, targets) micro-batches; returns the mean loss (a device
    tensor, so the host does not wait for it) and the global grad norm."""
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        x, y = _to_device(batch, device)
        # Reduce gradients only on the last micro-step of an accumulation.
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = model(x, y) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def train(model, optimizer, data, cfg, env, run_dir, meta, start_step=0):
    """Train from start_step to the end; saves at every epoch end (and every --checkpoint_interval).
    Returns the final step."""
    seq_length = model.config.seq_length
    train_tokens = data.num_tokens("train")  # None for a stream
    per_epoch = None if train_tokens is None else steps_per_epoch(cfg, env.world_size, train_tokens, seq_length)
    last = total_steps(cfg, per_epoch)
    tokens_per_step = env.world_size * cfg.batch_size * cfg.grad_accum_steps * seq_length
    peak = peak_flops(env.device)
    log = MetricsLog(cfg, env)
    bar = tqdm(total=last, initial=start_step, disable=not env.is_main, dynamic_ncols=True, desc="train",
               mininterval=1.0)
    model.train()
    loss_sum, steps_since_log, t0 = 0.0, 0, time.perf_counter()
    for step in range(start_step, last):
        lr = lr_at(step, cfg, last)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [data.get_batch("train", step * cfg.grad_accum_steps + micro, env.rank, env.world_size,
                                        cfg.batch_size, seq_length, cfg.seed) for micro in range(cfg.grad_accum_steps)]
        loss, grad_norm = train_step(model, optimizer, micro_batches, cfg.grad_clip, env.device)
        loss_sum += loss
        steps_since_log += 1
        bar.update(1)
        done = step + 1
        if done % cfg.log_interval == 0 or done == last:
            loss_avg = mean_across_ranks(loss_sum / steps_since_log, env.device)  # also waits for the device
            elapsed = time.perf_counter() - t0
            tok_s = tokens_per_step * steps_since_log / elapsed
            row = dict(step=done, loss=loss_avg, lr=lr, grad_norm=float(_full(grad_norm)), tokens_per_s=tok_s,
                       step_time=elapsed / steps_since_log, peak_mem_gb=peak_memory_gb(env.device))
            if peak:
                row["mfu"] = model.flops_per_token() * tok_s / (peak * env.world_size)
            log.write(**row)
            bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{tok_s:,.0f}")
            loss_sum, steps_since_log = 0.0, 0
        if cfg.eval_interval and done % cfg.eval_interval == 0 or done == last:
            val = evaluate(model, data, cfg, env, seq_length)
            log.write(step=done, val_loss=val)
            if env.is_main:
                bar.write(f"step {done}: val loss {val:.4f}")
        epoch_end = per_epoch and done % per_epoch == 0
        if epoch_end or done == last or cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0:
            data_position = data.position(done * cfg.grad_accum_steps, env.world_size, cfg.batch_size)
            epoch = done // per_epoch if per_epoch else None
            checkpoint.save(run_dir, done, model, optimizer, dict(meta, epoch=epoch, data_position=data_position),
                            data.directory)
        if steps_since_log == 0:
            t0 = time.perf_counter()  # throughput counts training steps, not evaluation or saving
    bar.close()
    return last


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t

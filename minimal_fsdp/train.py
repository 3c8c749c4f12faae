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
from .accum_adamw import AccumAdamW
from .gossip import Gossip

# Dense bf16 tensor-core peaks; MFU is always relative to these (as nanoGPT and PaLM report it).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)


def build_optimizer(model, cfg):
    """AdamW with decay on matrices only (not biases, norms); fused kernels on CUDA. Decentralized runs use
    AccumAdamW and beta2 0.98 by default, as the decentralized GPT-2 reference does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    decentralized = cfg.data_parallel == "decentralized"
    betas = (cfg.beta1, cfg.beta2 if cfg.beta2 is not None else 0.98 if decentralized else 0.95)
    if decentralized:
        return AccumAdamW(groups, lr=cfg.lr, betas=betas, accum_steps=cfg.accum_steps)
    on_cuda = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=on_cuda)


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
        x, y = data.get_batch("val", i, env.rank, cfg.batch_size, seq_length, cfg.seed)
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


def train_step(model, optimizer, micro_batches, grad_clip, device, gossip=None, step=0):
    """One optimizer step over a list of (inputs, targets) micro-batches; returns the mean loss (a device
    tensor, so the host does not wait for it) and the global grad norm (a decentralized replica's own)."""
    if gossip is not None:
        gossip.start(step)  # parameters travel to the neighbours while forward and backward run
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        x, y = _to_device(batch, device)
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP; a decentralized replica never reduces grads
            # Reduce gradients only on the last micro-step of an accumulation.
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss = model(x, y) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    if gossip is not None:
        gossip.finish()  # parameters <- the neighbours' weighted average; this step's update lands on it
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def train(model, optimizer, data, cfg, env, run_dir, meta, start_step=0):
    """Train from start_step to the end; saves at every epoch end (and every --checkpoint_interval).
    Returns the final step."""
    seq_length = model.config.seq_length
    per_epoch = steps_per_epoch(cfg, env.world_size, data.num_tokens("train"), seq_length)
    last = total_steps(cfg, per_epoch)
    tokens_per_step = env.world_size * cfg.batch_size * cfg.grad_accum_steps * seq_length
    peak = peak_flops(env.device)
    log = MetricsLog(cfg, env)
    bar = tqdm(total=last, initial=start_step, disable=not env.is_main, dynamic_ncols=True, desc="train",
               mininterval=1.0)
    gossip = Gossip(model, cfg.topology) if cfg.data_parallel == "decentralized" else None
    model.train()
    loss_sum, steps_since_log, t0 = 0.0, 0, time.perf_counter()
    for step in range(start_step, last):
        lr = lr_at(step, cfg, last)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [data.get_batch("train", step * cfg.grad_accum_steps + micro, env.rank,
                                        cfg.batch_size, seq_length, cfg.seed) for micro in range(cfg.grad_accum_steps)]
        loss, grad_norm = train_step(model, optimizer, micro_batches, cfg.grad_clip, env.device, gossip, step)
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
            if gossip is not None:
                row["consensus"] = gossip.consensus_distance()  # mean squared distance of replicas to their mean
            log.write(**row)
            bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{tok_s:,.0f}")
            loss_sum, steps_since_log = 0.0, 0
        if cfg.eval_interval and done % cfg.eval_interval == 0 or done == last:
            val = evaluate(model, data, cfg, env, seq_length)
            log.write(step=done, val_loss=val)
            if env.is_main:
                bar.write(f"step {done}: val loss {val:.4f}")
        if done % per_epoch == 0 or done == last or cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0:
            if gossip is not None:
                checkpoint.save_replicas(run_dir, done, model, optimizer, dict(meta, epoch=done // per_epoch),
                                         data.directory, cfg.save_average)
            else:
                checkpoint.save(run_dir, done, model, optimizer, dict(meta, epoch=done // per_epoch), data.directory)
        if steps_since_log == 0:
            t0 = time.perf_counter()  # throughput counts training steps, not evaluation or saving
    bar.close()
    return last


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t

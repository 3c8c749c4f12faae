"""The training loop: AdamW, warmup + cosine schedule, clipping, accumulation, evaluation, logging, saving."""
import math
import resource
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import checkpoint
from .metrics import Metrics
from .resilience import NonFiniteGuard
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
    """AdamW with decay on matrices only (not biases, norms); fused kernels. Decentralized runs use
    AccumAdamW and beta2 0.98 by default, as the decentralized GPT-2 reference does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    decentralized = cfg.data_parallel == "decentralized"
    betas = (cfg.beta1, cfg.beta2 if cfg.beta2 is not None else 0.98 if decentralized else 0.95)
    if decentralized:
        return AccumAdamW(groups, lr=cfg.lr, betas=betas, accum_steps=cfg.accum_steps)
    # Fused: one kernel over all tensors on GPU; on CPU (laptops, --cpu_offload) about 7x faster than foreach.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)


def lr_at(step, cfg, decay_steps):
    """Linear warmup to --lr, then cosine decay to --min_lr at step decay_steps (then flat). A pure function of
    the step, so a resumed run needs only the step and the horizon, which the checkpoint keeps."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
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


def host_peak_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # this process's peak RSS (KB on Linux)


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return host_peak_gb()


def _to_device(batch, device):
    """Host batches go through pinned memory so the copy overlaps with compute."""
    if device.type == "cuda":
        return [t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else t for t in batch]
    return batch


def train_step(model, optimizer, micro_batches, grad_clip, device, skip_nonfinite=False, gossip=None, step=0):
    """One optimizer step over a list of (inputs, targets) micro-batches; returns the mean loss (a device
    tensor) and the global grad norm (a decentralized replica's own). With skip_nonfinite, an update with a
    NaN/Inf grad norm is not applied (it would poison every weight); the norm is all-reduced, so every rank
    skips the same steps."""
    if gossip is not None:
        gossip.start(step)  # parameters travel to the neighbours while forward and backward run
    loss_sum = 0.0
    for i, batch in enumerate(micro_batches):
        x, y = _to_device(batch, device)
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP; a decentralized replica never reduces grads
            # Reduce gradients only on the last micro-step of an accumulation (and reshard only then, where
            # parameters stay gathered from forward to backward: the next micro-step needs them again).
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            if model.stays_gathered:  # set by parallelize.shard
                model.set_reshard_after_backward(last)
        loss = model(x, y) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    if gossip is not None:
        gossip.finish()  # parameters <- the neighbours' weighted average; this step's update lands on it
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if not skip_nonfinite or torch.isfinite(_full(grad_norm)):  # the check waits for the device: only if asked
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def train(model, optimizer, data, cfg, env, run_dir, meta, saved=None, stop=None):
    """Train to the end, from the start or from `saved` (a checkpoint's meta.json). Saves at every epoch end,
    every --checkpoint_interval, at the end, and when `stop` (resilience.StopRequests) says all ranks agreed
    to stop (a signal or --time_limit). Returns the last step done."""
    seq_length = model.config.seq_length
    train_tokens = data.num_tokens("train")  # None for a stream
    per_epoch = None if train_tokens is None else steps_per_epoch(cfg, env.world_size, train_tokens, seq_length)
    last = total_steps(cfg, per_epoch)
    saved = saved or {}
    start_step = saved.get("step", 0)
    # The schedule belongs to the run, not to one launch: a resumed run keeps the horizon it started with,
    # even when --max_steps or the world size (hence the steps per epoch) changed.
    decay_steps = cfg.lr_decay_steps or saved.get("lr_decay_steps") or last
    if env.is_main and not cfg.lr_decay_steps and decay_steps != last:
        print(f"the LR schedule spans {decay_steps} steps, as when the run began (--lr_decay_steps changes it); "
              f"this launch stops at step {last}", flush=True)
    # Micro-batches drawn per rank so far: batches are a pure function of this index, so data order resumes.
    first_batch = saved.get("train_batches", start_step * cfg.grad_accum_steps)
    tokens_per_step = env.world_size * cfg.batch_size * cfg.grad_accum_steps * seq_length
    peak = peak_flops(env.device)
    metrics = Metrics(cfg)
    bar = tqdm(total=last, initial=start_step, disable=not env.is_main, dynamic_ncols=True, desc="train",
               mininterval=1.0)
    nonfinite = NonFiniteGuard(cfg.skip_nonfinite, bar if env.is_main else None)
    gossip = Gossip(model, cfg.topology) if cfg.data_parallel == "decentralized" else None
    model.train()
    loss_sum, steps_since_log, t0, paused = 0.0, 0, time.perf_counter(), 0.0
    done = start_step
    try:  # the bar ends its line and the metrics files close, also when a step or a save fails
        for step in range(start_step, last):
            lr = lr_at(step, cfg, decay_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = first_batch + (step - start_step) * cfg.grad_accum_steps
            micro_batches = [data.get_batch("train", batch + micro, env.rank, env.world_size, cfg.batch_size, seq_length,
                                            cfg.seed)
                             for micro in range(cfg.grad_accum_steps)]
            loss, grad_norm = train_step(model, optimizer, micro_batches, cfg.grad_clip, env.device,
                                         skip_nonfinite=cfg.skip_nonfinite > 0, gossip=gossip, step=step)
            done = step + 1
            norm = _full(grad_norm)
            if gossip is not None:  # each replica has its own norm: a sum is non-finite if any is, so ranks agree
                norm = norm.detach().clone()
                dist.all_reduce(norm)
            if nonfinite.check(done, norm, loss):
                loss_sum += loss
                steps_since_log += 1
            bar.update(1)
            if steps_since_log and (done % cfg.log_interval == 0 or done == last):
                nonfinite.flush()
                loss_avg = mean_across_ranks(loss_sum / steps_since_log, env.device)  # also waits for the device
                elapsed = time.perf_counter() - t0 - paused  # training steps only: no evaluation or saving
                tok_s = tokens_per_step * steps_since_log / elapsed
                row = dict(step=done, loss=loss_avg, lr=lr, grad_norm=float(_full(grad_norm)), tokens_per_s=tok_s,
                           step_time=elapsed / steps_since_log, peak_mem_gb=peak_memory_gb(env.device))
                if peak:
                    row["mfu"] = model.flops_per_token() * tok_s / (peak * env.world_size)
                if gossip is not None:
                    row["consensus"] = gossip.consensus_distance()  # mean squared distance of replicas to their mean
                metrics.log(**row)
                bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{tok_s:,.0f}")
                loss_sum, steps_since_log = 0.0, 0
            scheduled_save = (per_epoch and done % per_epoch == 0 or done == last
                              or cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0)
            val_loss = None
            evaluate_now = cfg.eval_interval and done % cfg.eval_interval == 0 or done == last or scheduled_save
            pause = _synced_clock(env.device) if evaluate_now else None
            # Every scheduled checkpoint carries its val loss, so `best` can be chosen among them.
            if evaluate_now:
                val_loss = evaluate(model, data, cfg, env, seq_length)
                metrics.log(step=done, val_loss=val_loss)
                if env.is_main:
                    bar.write(f"step {done}: val loss {val_loss:.4f}")
            stop_reason = stop.agreed() if stop else None  # collective: all ranks stop at the same step
            if scheduled_save or stop_reason:
                if pause is None:
                    pause = _synced_clock(env.device)
                nonfinite.flush()  # never save a model that a NaN update has poisoned
                next_batch = batch + cfg.grad_accum_steps
                progress = dict(epoch=done // per_epoch if per_epoch else None, lr_decay_steps=decay_steps,
                                last_step=last, val_loss=val_loss, train_batches=next_batch,
                                data_position=data.position(next_batch, env.world_size, cfg.batch_size))
                if gossip is not None:
                    checkpoint.save_replicas(run_dir, done, model, optimizer, dict(meta, **progress), data.directory,
                                             cfg.keep_last, cfg.save_average)
                else:
                    checkpoint.save(run_dir, done, model, optimizer, dict(meta, **progress), data.directory,
                                    cfg.keep_last)
            if pause is not None:
                paused += time.perf_counter() - pause
            if stop_reason:
                if env.is_main:
                    bar.write(f"step {done}: {stop_reason}; saved a checkpoint and stopping. Run the same command "
                              "again to resume.")
                break
            if steps_since_log == 0:
                t0, paused = time.perf_counter(), 0.0
    finally:
        bar.close()
        metrics.close()
    return done


def _synced_clock(device):
    """The host clock once the device has finished the queued training steps: evaluation and saving are timed
    apart from them, so logged tokens/s and MFU count training alone."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t

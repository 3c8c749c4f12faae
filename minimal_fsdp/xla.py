"""--device xla: the same GPT and Llama trained under PyTorch/XLA (TPUs; XLA:CPU in the tests) with SPMD
fully-sharded data parallel, torch_xla's FSDPv2.

One process per host drives all of the host's devices. Every parameter (and its AdamW moments) is sharded over
a one-axis mesh of all devices named "fsdp", each block in its own FSDPv2 wrapper (with torch_xla's activation
checkpointing under --activation_checkpoints); the XLA compiler inserts the gathers and reductions. Each host
feeds its own rows of the global batch: --batch_size counts sequences per device, as it counts them per rank
elsewhere, so 4 devices with --batch_size 2 see exactly the batches of one CPU rank with --batch_size 8.

Checkpoints have checkpoint.py's layout and parameter names, written and read by torch_xla's DCP planners, so
they load in CPU/CUDA runs and back. Generation runs on the host from the saved checkpoint (basic_training.py).
"""
import dataclasses
import datetime
import functools
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
# DCP's own flattening (private, as DefaultSavePlanner uses it); torch_xla's planners keep a copy from 2023 that
# saves optim.param_groups as one entry, where our layout has optim.param_groups.0.lr, ...
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from tqdm import tqdm

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.amp import autocast
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

from . import checkpoint, hf
from .config import ConfigError
from .metrics import Metrics, banner
from .parallelize import init_weights
from .resilience import NonFiniteGuard
from .train import lr_at, steps_per_epoch, total_steps

WRAPPED = "_orig_module."  # FSDPv2's attribute for the module it wraps; not part of a parameter's saved name
BF16_HARDWARE = ("TPU", "NEURON")  # where torch_xla's autocast runs bf16 (it ignores other devices)


@dataclasses.dataclass
class Devices:
    """This host's view of the SPMD world: the device, the one-axis mesh over every device of every host, and how
    many devices there are here and in all."""
    device: torch.device
    mesh: xs.Mesh
    local: int
    total: int

    @classmethod
    def discover(cls):
        total = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(total), (total,), ("fsdp",))
        return cls(torch_xla.device(), mesh, xr.addressable_runtime_device_count(), total)

    def batch(self, data, split, index, cfg, seq_length, env):
        """Micro-batch `index` as one global (inputs, targets) pair sharded by rows over the devices. This host
        reads only its own rows, --batch_size per local device (minibatch: torch_xla joins the hosts' rows)."""
        x, y = data.get_batch(split, index, env.rank, env.world_size, cfg.batch_size * self.local, seq_length,
                              cfg.seed)
        return xm.send_cpu_data_to_device([x, y], self.device,
                                          xs.ShardingSpec(self.mesh, ("fsdp", None), minibatch=True))


def setup(cfg, env):
    """SPMD over this host's devices; returns env with the host's process group. Hosts meet as elsewhere (mpiexec,
    torchrun, srun: one rank per host); on a TPU pod started with plain python on every host, through torch_xla's
    own rendezvous (xla://), where the TPU runtime knows the hosts."""
    xr.use_spmd()  # before any tensor reaches a device
    hosts = xr.process_count()
    if env.launcher == "single" and hosts > 1:
        dist.destroy_process_group()
        if os.environ.get("MASTER_ADDR") == "127.0.0.1":  # our one-process default: xla:// finds the first host
            del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        dist.init_process_group("gloo", init_method="xla://",
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout))
        env = dataclasses.replace(env, rank=dist.get_rank(), world_size=hosts, num_nodes=hosts, launcher="xla")
    elif hosts != env.world_size:
        raise ConfigError(f"torch_xla sees {hosts} host(s) but {env.world_size} rank(s) were launched: start one "
                          "rank per host")
    hardware = xr.device_type()
    if cfg.precision == "bf16" and hardware not in BF16_HARDWARE:
        raise ConfigError(f"--precision bf16 under --device xla needs a TPU or Trainium (torch_xla's autocast); "
                          f"this is XLA:{hardware}: use --precision float32")
    return env


# ---- the model and optimizer ----

def build_model(model_cls, model_config, cfg, mesh, hf_dir=None):
    """Built and initialized on the host exactly as on CPU (init_weights: the same values for any layout), given
    a Hugging Face model's weights if asked, then moved to the devices and sharded by FSDPv2: each block, then the
    rest. The model classes are untouched; their loss stays the plain model.cross_entropy."""
    model = model_cls(model_config)
    init_weights(model, cfg.seed, "cpu")
    if hf_dir:
        hf.load_weights(model, hf_dir, model_config.model_type)

    def wrap_block(block, *args, **kwargs):
        return FSDPv2(checkpoint_module(block) if cfg.activation_checkpoints else block, *args, **kwargs)

    # FSDPv2 hooks each wrapped module's backward; the root's inputs are token ids, which have no gradient.
    warnings.filterwarnings("ignore", "Full backward hook is firing when gradients are computed with respect to "
                            "module outputs")
    blocks = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={model_cls.block_type})
    # The root's output is the loss (or the last position's logits): nothing to shard.
    model = FSDPv2(model, mesh=mesh, shard_output=lambda output, mesh: None, auto_wrap_policy=blocks,
                   auto_wrapper_callable=wrap_block)
    if cfg.precision == "bf16":  # fp32 weights, bf16 matmuls
        model.forward = autocast(torch_xla.device(), dtype=torch.bfloat16)(model.forward)
    return model


def build_optimizer(model, cfg):
    """train.build_optimizer's AdamW (decay on matrices only, the same betas), without fused kernels: those are
    for CUDA and CPU, and XLA compiles the update into the step anyway."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, 0.95 if cfg.beta2 is None else cfg.beta2))


# ---- checkpoints: checkpoint.py's layout and names ----

class SafeLoadPlanner(SPMDLoadPlanner):
    """torch_xla's planner loads shards in place on the devices; non-tensor entries (optimizer hyperparameters)
    are read as checkpoint.SafeLoadPlanner reads them, with weights_only=True, never plain pickle."""
    load_bytes = checkpoint.SafeLoadPlanner.load_bytes


def _saved_name(name):
    return name.replace(WRAPPED, "")


def _optimizer_renamed(state, rename):
    return {"state": {rename(name): value for name, value in state["state"].items()},
            "param_groups": [dict(group, params=[rename(name) for name in group["params"]])
                             for group in state["param_groups"]]}


def _state(model, optimizer):
    """checkpoint._state's dict, with FSDPv2's wrappers left out of the names (model.blocks.0.attn.qkv.weight,
    optim.state.wte.weight.exp_avg, ...); its values are the live tensors, sharded on the devices. Flattened
    (flatten_state_dict) before it meets torch_xla's planners, so it is saved under checkpoint.py's keys."""
    state = {"model": {_saved_name(name): value for name, value in get_model_state_dict(model).items()}}
    if optimizer is not None:  # get_optimizer_state_dict creates the AdamW moments of a fresh optimizer
        state["optim"] = _optimizer_renamed(get_optimizer_state_dict(model, optimizer), _saved_name)
    return state


def save(run_dir, step, model, optimizer, meta, tokenizer_dir, keep_last):
    """checkpoint.save's directory protocol (temporary directory, rename, `latest`, `best`, --keep_last), each host
    writing its own shards."""
    return checkpoint.save(run_dir, step, model, optimizer, meta, tokenizer_dir, keep_last,
                           state=flatten_state_dict(_state(model, optimizer))[0], planner=SPMDSavePlanner())


def load(path, model, optimizer=None):
    """Load a checkpoint of any run (XLA, CPU or CUDA, any number of devices or ranks) into the sharded model
    and optimizer, in place."""
    flat, paths = flatten_state_dict(_state(model, optimizer))
    torch_xla.sync()  # materialize a fresh optimizer's moments, sharded as their parameters
    dcp.load(flat, storage_reader=checkpoint.SafeReader(str(path)), planner=SafeLoadPlanner())
    state = unflatten_state_dict(flat, paths)  # the tensors were loaded in place; the hyperparameters replaced
    if optimizer is not None:
        ours = {_saved_name(name): name for name, _ in model.named_parameters()}
        kernels = [{key: group[key] for key in ("fused", "foreach")} for group in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, _optimizer_renamed(state["optim"], ours.__getitem__))
        for group, own in zip(optimizer.param_groups, kernels):
            group.update(own)  # a CUDA or CPU run's fused kernels do not exist here
    torch_xla.sync()


# ---- training ----

def train_step(model, optimizer, micro_batches, cfg):
    """One optimizer step over (inputs, targets) micro-batches, traced and then run as one compiled graph; returns
    the mean loss and the grad norm (device tensors)."""
    loss_sum = 0.0
    for x, y in micro_batches:
        loss = model(x, y) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
    if not cfg.skip_nonfinite or torch.isfinite(grad_norm):  # the check waits for the device: only if asked
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, data, cfg, env, devices, seq_length):
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        losses.append(model(*devices.batch(data, "val", i, cfg, seq_length, env)))
        torch_xla.sync()
    model.train()
    return torch.stack(losses).mean().item()  # over every device's rows: no reduction across hosts needed


def train(model_cls, model_config, data, cfg, env, start, saved, hf_dir, meta, stop):
    """Build (or resume) the sharded model and train it to the end as train.train does: warmup + cosine LR,
    clipping, accumulation, evaluation, metrics, checkpoints at epoch ends, every --checkpoint_interval, at the
    end and on an agreed stop. Returns the last checkpoint written."""
    devices = Devices.discover()
    model = build_model(model_cls, model_config, cfg, devices.mesh, None if start else hf_dir)
    optimizer = build_optimizer(model, cfg)
    saved = saved or {}
    if start is not None:
        load(start, model, optimizer)
        checkpoint.restore_rng(start, env.rank, env.world_size, cfg.seed)
    xm.set_rng_state(cfg.seed * 1_000_003 + saved.get("step", 0))  # dropout masks, seeded per launch
    if env.is_main:
        print(_banner(cfg, env, devices, model, start), flush=True)
    with stop.listening():
        last = _loop(model, optimizer, data, cfg, env, devices, Path(cfg.checkpoint_dir) / cfg.run_name, meta,
                     saved, stop)
    return last or start  # nothing was left to train: the checkpoint it resumed


def _banner(cfg, env, devices, model, start):
    """metrics.banner with the XLA layout in its first line."""
    mesh = SimpleNamespace(mesh_dim_names=("fsdp",), shape=(devices.total,))
    text = banner(cfg, dataclasses.replace(env, device=devices.device), mesh, model, start).split("\n", 1)[1]
    return (f"launch: {env.world_size} host(s) x {devices.local} {xr.device_type()} device(s)/host, started by "
            f"{env.launcher}; torch_xla SPMD, mesh fsdp={devices.total} (FSDPv2)\n" + text)


def _loop(model, optimizer, data, cfg, env, devices, run_dir, meta, saved, stop):
    seq_length = model.config.seq_length
    train_tokens = data.num_tokens("train")  # None for a stream
    # Each device is one data-parallel "rank" of --batch_size sequences.
    per_epoch = None if train_tokens is None else steps_per_epoch(cfg, devices.total, train_tokens, seq_length)
    last = total_steps(cfg, per_epoch)
    start_step = saved.get("step", 0)
    decay_steps = cfg.lr_decay_steps or saved.get("lr_decay_steps") or last
    first_batch = saved.get("train_batches", start_step * cfg.grad_accum_steps)
    tokens_per_step = devices.total * cfg.batch_size * cfg.grad_accum_steps * seq_length
    metrics = Metrics(cfg)
    bar = tqdm(total=last, initial=start_step, disable=not env.is_main, dynamic_ncols=True, desc="train",
               mininterval=1.0)
    nonfinite = NonFiniteGuard(cfg.skip_nonfinite, bar if env.is_main else None)
    model.train()
    loss_sum, steps_since_log, t0, paused = 0.0, 0, time.perf_counter(), 0.0
    saved_to = None
    for step in range(start_step, last):
        lr = lr_at(step, cfg, decay_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr  # a Python number is passed to the compiled step as data: no recompilation
        batch = first_batch + (step - start_step) * cfg.grad_accum_steps
        micro_batches = [devices.batch(data, "train", batch + micro, cfg, seq_length, env)
                         for micro in range(cfg.grad_accum_steps)]
        loss, grad_norm = train_step(model, optimizer, micro_batches, cfg)
        done = step + 1
        if nonfinite.check(done, grad_norm, loss):
            loss_sum += loss
            steps_since_log += 1
        bar.update(1)
        if steps_since_log and (done % cfg.log_interval == 0 or done == last):
            nonfinite.flush()
            loss_avg = float(loss_sum / steps_since_log)  # waits for the device
            elapsed = time.perf_counter() - t0 - paused  # training steps only: no evaluation or saving
            tok_s = tokens_per_step * steps_since_log / elapsed
            metrics.log(step=done, loss=loss_avg, lr=lr, grad_norm=float(grad_norm), tokens_per_s=tok_s,
                        step_time=elapsed / steps_since_log)
            bar.set_postfix(loss=f"{loss_avg:.3f}", tok_s=f"{tok_s:,.0f}")
            loss_sum, steps_since_log = 0.0, 0
        scheduled_save = (per_epoch and done % per_epoch == 0 or done == last
                          or cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0)
        val_loss = None
        evaluate_now = cfg.eval_interval and done % cfg.eval_interval == 0 or scheduled_save
        pause = _synced_clock() if evaluate_now else None
        if evaluate_now:
            val_loss = evaluate(model, data, cfg, env, devices, seq_length)
            metrics.log(step=done, val_loss=val_loss)
            if env.is_main:
                bar.write(f"step {done}: val loss {val_loss:.4f}")
        stop_reason = stop.agreed() if stop else None  # collective over the hosts
        if scheduled_save or stop_reason:
            pause = pause or _synced_clock()
            nonfinite.flush()  # never save a model that a NaN update has poisoned
            next_batch = batch + cfg.grad_accum_steps
            progress = dict(epoch=done // per_epoch if per_epoch else None, lr_decay_steps=decay_steps,
                            val_loss=val_loss, train_batches=next_batch,
                            data_position=data.position(next_batch, devices.total, cfg.batch_size))
            saved_to = save(run_dir, done, model, optimizer, dict(meta, **progress), data.directory, cfg.keep_last)
        if stop_reason:
            if env.is_main:
                bar.write(f"step {done}: {stop_reason}; saved a checkpoint and stopping. Run the same command "
                          "again to resume.")
            break
        if pause is not None:
            paused += time.perf_counter() - pause
        if steps_since_log == 0:
            t0, paused = time.perf_counter(), 0.0
    bar.close()
    metrics.close()
    return saved_to


def _synced_clock():
    """The host clock once the devices have run the queued steps, so evaluation and saving are timed apart."""
    xm.wait_device_ops()
    return time.perf_counter()

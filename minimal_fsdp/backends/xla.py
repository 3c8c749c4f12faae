"""--device xla: the same GPT and Llama trained under PyTorch/XLA (TPUs; XLA:CPU in the tests) with
SPMD fully-sharded data parallel, torch_xla's FSDPv2.

One process per host drives all of the host's devices. Every parameter (and its AdamW moments) is
sharded over a one-axis mesh of all devices named "fsdp", each block in its own FSDPv2 wrapper (with
torch_xla's activation checkpointing under --activation_checkpoints); the XLA compiler inserts the
gathers and reductions. Each host feeds its own rows of the global batch: --batch_size counts
sequences per device, as it counts them per rank elsewhere, so 4 devices with --batch_size 2 see
exactly the batches of one CPU rank with --batch_size 8.

Checkpoints have checkpoint/checkpointer.py's layout and parameter names, written and read by
torch_xla's DCP planners, so they load in CPU/CUDA runs and back. The run is wired as every run is
(run.train_model, train.train's loop, train.build_optimizer's AdamW); this module's XLA gives the
wiring what is torch_xla's, as default.Torch does for CUDA and CPU: the sharded model, device
batches, a step that ends in torch_xla.sync() and the checkpointer. Generation runs on the host from
the saved checkpoint (run.py).
"""

import dataclasses
import datetime
import functools
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

# DCP's own flattening (private, as DefaultSavePlanner uses it); torch_xla's planners keep a copy
# from 2023 that saves optim.param_groups as one entry, where our layout has
# optim.param_groups.0.lr, ...
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch_xla.amp import autocast
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)

from minimal_fsdp.backends.banner import banner
from minimal_fsdp.checkpoint import checkpointer, safe_load
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.hf.read import load_weights
from minimal_fsdp.launch import hosts
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.parallel.parallelize import LocalSync, init_weights, seed64

# FSDPv2's attribute for the module it wraps; not part of a parameter's saved name
WRAPPED = "_orig_module."
BF16_HARDWARE = ("TPU", "NEURON")  # where torch_xla's autocast runs bf16 (it ignores other devices)


@dataclasses.dataclass
class Devices:
    """This host's view of the SPMD world: the device, the one-axis mesh over every device of every
    host, and how many devices there are here and in all."""

    device: torch.device
    mesh: xs.Mesh
    local: int
    total: int

    @classmethod
    def discover(cls):
        total = xr.global_runtime_device_count()
        mesh = xs.Mesh(np.arange(total), (total,), ("fsdp",))
        return cls(torch_xla.device(), mesh, xr.addressable_runtime_device_count(), total)

    def send(self, batch):
        """This host's rows (inputs, targets) as one global pair sharded by rows over every device
        (minibatch: torch_xla joins the hosts' rows)."""
        return xm.send_cpu_data_to_device(
            list(batch), self.device, xs.ShardingSpec(self.mesh, ("fsdp", None), minibatch=True)
        )


def setup(backend, env):
    """SPMD over this host's devices (backend: config.sections.Backend); returns env with the host's
    process group. Hosts meet as
    elsewhere (mpiexec, torchrun, srun: one rank per host); on a TPU pod started with plain python
    on every host, through torch_xla's own rendezvous (xla://), where the TPU runtime knows the
    hosts."""
    xr.use_spmd()  # before any tensor reaches a device
    host_count = xr.process_count()
    if env.launcher == "single" and host_count > 1:
        dist.destroy_process_group()
        # our one-process default: xla:// finds the first host
        if os.environ.get("MASTER_ADDR") == "127.0.0.1":
            del os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        with hosts.gloo_quiet():
            dist.init_process_group(
                "gloo",
                init_method="xla://",
                timeout=datetime.timedelta(seconds=backend.collective_timeout),
            )
        env = dataclasses.replace(
            env,
            rank=dist.get_rank(),
            world_size=host_count,
            num_nodes=host_count,
            launcher="xla",
            local_world_sizes=(1,) * host_count,
        )
    elif host_count != env.world_size:
        raise ConfigError(
            f"torch_xla sees {host_count} host(s) but {env.world_size} rank(s) were launched: "
            "start one rank per host"
        )
    hardware = xr.device_type()
    if backend.precision == "bf16" and hardware not in BF16_HARDWARE:
        raise ConfigError(
            f"--precision bf16 under --device xla needs a TPU or Trainium (torch_xla's autocast); "
            f"this is XLA:{hardware}: use --precision float32"
        )
    return env


# ---- the model ----


def build_model(model_cls, model_config, backend, mesh, hf_dir=None):
    """Built and initialized on the host exactly as on CPU (init_weights: the same values for any
    layout), given a Hugging Face model's weights if asked, then moved to the devices and sharded by
    FSDPv2: each block, then the rest. The model classes are untouched; their loss stays the plain
    layers.cross_entropy."""
    model = model_cls(model_config)
    init_weights(model, backend.seed, "cpu")
    if hf_dir:
        load_weights(model, hf_dir, model_config.model_type)

    def wrap_block(block, *args, **kwargs):
        return FSDPv2(
            checkpoint_module(block) if backend.activation_checkpoints else block, *args, **kwargs
        )

    # FSDPv2 hooks each wrapped module's backward; the root's inputs are token ids, which have
    # no gradient.
    warnings.filterwarnings(
        "ignore",
        "Full backward hook is firing when gradients are computed with respect to module outputs",
    )
    blocks = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={type(model.blocks[0])}
    )
    # The root's output is the loss (or the last position's logits): nothing to shard.
    model = FSDPv2(
        model,
        mesh=mesh,
        shard_output=lambda output, mesh: None,
        auto_wrap_policy=blocks,
        auto_wrapper_callable=wrap_block,
    )
    if backend.precision == "bf16":  # fp32 weights, bf16 matmuls
        model.forward = autocast(torch_xla.device(), dtype=torch.bfloat16)(model.forward)
    return model


# ---- checkpoints: checkpoint/checkpointer.py's layout and names ----


class SafeLoadPlanner(SPMDLoadPlanner):
    """torch_xla's planner loads shards in place on the devices; non-tensor entries (optimizer
    hyperparameters) are read as safe_load.SafeLoadPlanner reads them, with weights_only=True, never
    plain pickle."""

    load_bytes = safe_load.SafeLoadPlanner.load_bytes


def _saved_name(name):
    return name.replace(WRAPPED, "")


def _optimizer_renamed(state, rename):
    return {
        "state": {rename(name): value for name, value in state["state"].items()},
        "param_groups": [
            dict(group, params=[rename(name) for name in group["params"]])
            for group in state["param_groups"]
        ],
    }


def _state(model, optimizer):
    """checkpointer._state's dict, with FSDPv2's wrappers left out of the names
    (model.blocks.0.attn.qkv.weight, optim.state.wte.weight.exp_avg, ...); its values are the live
    tensors, sharded on the devices. Flattened (flatten_state_dict) before it meets torch_xla's
    planners, so it is saved under checkpoint/checkpointer.py's keys."""
    state = {
        "model": {_saved_name(name): value for name, value in get_model_state_dict(model).items()}
    }
    # get_optimizer_state_dict creates the AdamW moments of a fresh optimizer
    if optimizer is not None:
        state["optim"] = _optimizer_renamed(get_optimizer_state_dict(model, optimizer), _saved_name)
    return state


def load(path, model, optimizer=None):
    """Load a checkpoint of any run (XLA, CPU or CUDA, any number of devices or ranks) into the
    sharded model and optimizer, in place."""
    flat, paths = flatten_state_dict(_state(model, optimizer))
    torch_xla.sync()  # materialize a fresh optimizer's moments, sharded as their parameters
    dcp.load(flat, storage_reader=safe_load.SafeReader(str(path)), planner=SafeLoadPlanner())
    # the tensors were loaded in place; the hyperparameters replaced
    state = unflatten_state_dict(flat, paths)
    if optimizer is not None:
        ours = {_saved_name(name): name for name, _ in model.named_parameters()}
        # a CUDA or CPU run's fused kernels do not exist here: the optimizer keeps its own
        checkpointer.set_optimizer_state(
            model, optimizer, _optimizer_renamed(state["optim"], ours.__getitem__)
        )
    torch_xla.sync()


# ---- the parts train.train's loop takes from this backend ----


class DeviceData:
    """The run's data (tokens.TokenData or streaming.StreamingData), bound to this host's rows, with
    its batches sent to the devices: the data train.train reads."""

    def __init__(self, data, devices):
        self.data, self.devices = data, devices

    def steps_per_epoch(self):
        return self.data.steps_per_epoch()

    def train_batches(self, step):
        return [self.devices.send(batch) for batch in self.data.train_batches(step)]

    def val_batch(self, index):
        return self.devices.send(self.data.val_batch(index))

    def state_dict(self, step):
        return self.data.state_dict(step)


class StepSync(LocalSync):
    """train_step's gradient synchronization under SPMD: the compiler has put the reductions into
    the step, so there is nothing to do but run it, traced from forward to the AdamW update, as one
    compiled graph."""

    def after_step(self):
        torch_xla.sync()


class Checkpointer(checkpointer.Checkpointer):
    """checkpointer.Checkpointer (the same directory protocol, meta.json and keys), with the shards
    written and read on the devices by torch_xla's planners."""

    def __init__(self, checkpoint, flags, model_config, tokenizer_dir):
        super().__init__(checkpoint, flags, model_config, tokenizer_dir, decentralized=False)

    def write(self, step, model, optimizer, meta):
        return checkpointer.save(
            self.run_dir,
            step,
            model,
            optimizer,
            meta,
            self.tokenizer_dir,
            self.keep_last,
            state=flatten_state_dict(_state(model, optimizer))[0],
            planner=SPMDSavePlanner(),
        )

    def read(self, path, model, optimizer):
        load(path, model, optimizer)


class XLA:
    """plan.backend "xla": the parts run.train_model wires, as default.Torch gives them for CUDA and
    CPU. Each device is one data-parallel member of --batch_size sequences; this host feeds its own
    devices' rows."""

    # generation on the devices would compile a graph per token: the host samples instead
    samples_on_host = True

    def __init__(self, backend, checkpoint, flags, env, plan):
        """As backends.for_plan gives them."""
        self.settings, self.plan, self.devices = backend, plan, Devices.discover()
        self.checkpoint, self.flags = checkpoint, flags
        # the loop's batches go to the devices
        self.env = dataclasses.replace(env, device=self.devices.device)
        self.ranks, self.local_ranks = self.devices.total, self.devices.local

    def build_model(self, model_config, hf_dir=None):
        return build_model(
            MODELS[model_config.model_type], model_config, self.settings, self.devices.mesh, hf_dir
        )

    def checkpointer(self, model_config, tokenizer_dir, model):
        return Checkpointer(self.checkpoint, self.flags, model_config, tokenizer_dir)

    def batches(self, data):
        return DeviceData(data, self.devices)

    def gradient_sync(self, model):
        return StepSync()

    def synchronize(self):
        xm.wait_device_ops()  # the steps run asynchronously after torch_xla.sync()

    def seed(self, step):
        """torch_xla's generator (dropout masks), seeded per launch: resumed at step N, it is not
        step 0's."""
        xm.set_rng_state(seed64(self.settings.seed * 1_000_003 + step))

    def banner(self, model, start, checkpointer):
        """banner.banner with the XLA layout in its first line: every parameter sharded over every
        device."""
        xla_plan = dataclasses.replace(self.plan, shard_ranks=self.devices.total)
        text = banner(self.flags, self.env, xla_plan, model, start, checkpointer).split("\n", 1)[1]
        return (
            f"launch: {self.env.world_size} host(s) x {self.devices.local} {xr.device_type()} "
            f"device(s)/host, started by {self.env.launcher}; torch_xla SPMD, mesh "
            f"fsdp={self.devices.total} (FSDPv2)\n" + text
        )

"""A stand-in for torch_xla, for the tests of --device xla where torch_xla is not installed (it
pairs with torch 2.9 only): one XLA "device" that is the CPU, FSDPv2 a plain wrapper (its
`_orig_module` names kept, as xla.py saves without them), torch_xla's DCP planners DCP's own, sync()
a no-op. So minimal_fsdp/backends/xla.py runs unchanged, and a run with --device xla goes through
run.train_model and train.train as the real one does; it computes what one CPU rank computes. Run as
a script, it installs itself and runs basic_training.py with the command line's flags."""

import importlib.machinery
import runpy
import sys
import types
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

ROOT = Path(__file__).resolve().parents[1]


class FSDPv2(torch.nn.Module):
    """SpmdFullyShardedDataParallel's interface: wraps each block (auto_wrapper_callable), then the
    root."""

    def __init__(
        self,
        module,
        mesh=None,
        shard_output=None,
        auto_wrap_policy=None,
        auto_wrapper_callable=None,
    ):
        super().__init__()
        if auto_wrapper_callable is not None:
            for i, block in enumerate(module.blocks):
                module.blocks[i] = auto_wrapper_callable(block, mesh=mesh)
        self._orig_module = module

    def forward(self, *args, **kwargs):
        return self._orig_module(*args, **kwargs)

    # as torch_xla's wrapper: the wrapped module's attributes (config, ...)
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_module"], name)


def _module(name, **attributes):
    module = types.ModuleType(name)
    # importlib.util.find_spec finds it
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    return module


def modules():
    """{name: module} of every torch_xla module xla.py imports."""
    nothing = lambda *args, **kwargs: None  # noqa: E731
    return {
        "torch_xla": _module("torch_xla", device=lambda: torch.device("cpu"), sync=nothing),
        "torch_xla.core": _module("torch_xla.core"),
        "torch_xla.core.xla_model": _module(
            "torch_xla.core.xla_model",
            set_rng_state=nothing,
            wait_device_ops=nothing,  # the backend's synchronize: the CPU stand-in runs eagerly
            send_cpu_data_to_device=lambda data, device, spec: list(data),
        ),
        "torch_xla.distributed": _module("torch_xla.distributed"),
        "torch_xla.distributed.spmd": _module(
            "torch_xla.distributed.spmd",
            Mesh=lambda *args: "mesh",
            ShardingSpec=lambda *args, **kwargs: "rows",
        ),
        "torch_xla.runtime": _module(
            "torch_xla.runtime",
            use_spmd=nothing,
            process_count=lambda: 1,
            global_runtime_device_count=lambda: 1,
            addressable_runtime_device_count=lambda: 1,
            device_type=lambda: "CPU",
        ),
        "torch_xla.amp": _module("torch_xla.amp", autocast=nothing),
        "torch_xla.distributed.fsdp": _module(
            "torch_xla.distributed.fsdp", checkpoint_module=lambda module: module
        ),
        "torch_xla.distributed.fsdp.wrap": _module(
            "torch_xla.distributed.fsdp.wrap", transformer_auto_wrap_policy=nothing
        ),
        "torch_xla.experimental": _module("torch_xla.experimental"),
        "torch_xla.experimental.distributed_checkpoint": _module(
            "torch_xla.experimental.distributed_checkpoint",
            SPMDLoadPlanner=DefaultLoadPlanner,
            SPMDSavePlanner=DefaultSavePlanner,
        ),
        "torch_xla.experimental.spmd_fully_sharded_data_parallel": _module(
            "torch_xla.experimental.spmd_fully_sharded_data_parallel",
            SpmdFullyShardedDataParallel=FSDPv2,
        ),
    }


def install():
    sys.modules.update(modules())


if __name__ == "__main__":
    install()
    sys.argv[0] = str(ROOT / "basic_training.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

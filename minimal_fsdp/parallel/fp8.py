"""--precision fp8: bf16 compute as --precision bf16, plus torchao's float8 matmuls in the blocks'
large linear layers, on GPUs with float8 tensor cores (compute capability 8.9 or newer: H100, H200,
L40S).

Which layers: the output head's matmuls, part of the fused loss, which (tensorwise, on CUDA) makes
its logits and gradients in float8 itself (models/fused_loss.py). The blocks' layers where
--fp8_layers says (choose.float8_blocks: by default only in models at least 4096 wide, as narrower
ones measured slower than bf16): there, a block's nn.Linear whose in and out features are both
multiples of 16 (what float8 matmuls, torch._scaled_mm, accept) and both at least MIN_FEATURES,
which keeps out only the tiny layers, whose casts surely cost more than their faster matmul saves.
Never the embeddings.

Recipes (--fp8_recipe), torchao's:
  tensorwise  one scale per tensor, cuBLAS float8 matmuls. Under FSDP over more than one rank the
              weights are also all-gathered in float8 (half of bf16's bytes); their scales are
              computed after each optimizer step, for all weights in one all-reduce
              (FSDPSync.after_step), not one all-reduce per weight later, and each shard is cast to
              float8 in one compiled kernel (fused_shard_cast).
  rowwise     a scale per row: more accurate with outliers, slower kernels; weights all-gathered in
              bf16.

Master weights, gradients and AdamW state stay fp32 and checkpoints hold plain fp32 tensors under
the same names, so a run can switch between bf16 and fp8 when it resumes, and export is unchanged.
"""

import dataclasses
import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from minimal_fsdp.config.choices import ConfigError

# which layers --precision fp8 converts: in parallel/choose.py, torch-free, for the memory planner
from minimal_fsdp.parallel.choose import (  # noqa: E402,F401
    BLOCKS_MIN_WIDTH,
    MIN_FEATURES,
    NOT_CALLED,
    block_shapes,
    converts,
)
from minimal_fsdp.parallel.whole_unit import local_tensor


def convertible(model):
    """(name, layer) of every linear layer --precision fp8 turns into a float8 one."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and name.startswith("blocks.")
        and converts(name, m.in_features, m.out_features)
    ]


def check_device(device):
    """Refuse a device without float8 tensor cores; the same verdict on every rank of a homogeneous
    job."""
    if device.type != "cuda":
        raise ConfigError(
            f"--precision fp8 needs an NVIDIA GPU with float8 tensor cores (compute capability "
            f"8.9+: H100, H200, L40S); this run is on {device.type}: use --precision bf16"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(
            f"--precision fp8 needs compute capability 8.9 or newer (H100, H200, L40S); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
            "use --precision bf16"
        )


def gathers_in_float8(plan, layer):
    """Whether FSDP all-gathers this layer's weight in float8: tensorwise, sharded over more than
    one rank, not offloaded (the scale precompute would all-reduce CPU tensors), and evenly: torchao
    (0.17) cannot all-gather a float8 weight whose rows do not split evenly over the ranks
    (pytorch/ao#3982), so such a layer gathers in bf16 and casts after."""
    return plan.fp8_all_gather and layer.out_features % plan.shard_ranks == 0


def convert(model, plan, device):
    """Swap the convertible layers for torchao's Float8Linear, in place, before sharding
    (build_model); none where the blocks stay bf16 (plan.fp8_blocks)."""
    if not plan.fp8_blocks:
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layers = convertible(model)
    if not layers:
        raise ConfigError(
            f"--precision fp8 converts the blocks' linear layers whose sizes are multiples of 16 "
            f"and at least {MIN_FEATURES}; this model (embed size {model.config.embed_size}) has "
            "none: use a wider model or --precision bf16"
        )
    # On CPU (tests only: check_device refuses it) torchao emulates the float8 matmuls in
    # higher precision.
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(plan.fp8), emulate=device.type != "cuda"
    )
    gathered = {name for name, layer in layers if gathers_in_float8(plan, layer)}
    others = {name for name, _ in layers} - gathered
    if gathered:
        fuse_shard_cast()
        convert_to_float8_training(
            model,
            config=dataclasses.replace(config, enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda _, name: name in gathered,
        )
    if others:
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _, name: name in others
        )
    for name in gathered:
        model.get_submodule(name).register_state_dict_post_hook(_plain_weight)
    return model


def _plain_weight(layer, state_dict, prefix, local_metadata):
    """A float8-gathered layer's weight is torchao's WeightWithDynamicFloat8CastTensor around the
    fp32 shard; DCP would pickle that class into the checkpoint, which then only loads where torchao
    is installed. Hand DCP the fp32 tensor inside (the same memory, so a load writes into the
    parameter)."""
    key = prefix + "weight"
    weight = state_dict[key]
    plain = plain_tensor(weight).detach()
    if isinstance(weight, DTensor):
        plain = DTensor.from_local(
            plain,
            weight.device_mesh,
            weight.placements,
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )
    state_dict[key] = plain


def plain_tensor(tensor):
    """The plain tensor beneath a DTensor's local shard and torchao's float8 weight wrapper
    (WeightWithDynamicFloat8CastTensor around a float8-gathered weight's fp32 shard, and around
    whatever zeros_like makes of it: AdamW's moments), the same memory; any other tensor itself."""
    local = local_tensor(tensor)
    # the wrapper's only tensor (torchao's fsdp_utils.py)
    return getattr(local, "_tensor", local)


@functools.cache
def _float8_cast(dtype):
    """weight * scale, saturated to dtype's range, in dtype: one compiled kernel (any shape, no
    recompiles)."""
    limit = torch.finfo(dtype).max

    @torch.compile(dynamic=True)
    def cast(weight, scale):
        return (weight.float() * scale).clamp(-limit, limit).to(dtype)

    return cast


def fused_shard_cast(self, mesh):
    """torchao's WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather, the shard cast to float8
    before its all-gather, with the cast as one kernel. torchao (0.17) casts in three eager kernels
    (scale, clamp, copy), each reading and writing the whole fp32 shard; one kernel reads it once
    (benchmarks/results/RESULTS.md#fp8-shard-cast). The bits are the same
    (tests/parallel/test_fp8.py). Without a precomputed scale, torchao's own path."""
    scale = self._precomputed_scale
    if scale is None or isinstance(self._tensor, DTensor):
        return _TORCHAO_SHARD_CAST(self, mesh)
    return (_float8_cast(self._dtype)(self._tensor, scale),), (scale,)


_TORCHAO_SHARD_CAST = None


def fuse_shard_cast():
    """Make every float8-gathered weight cast its shard with fused_shard_cast (a class attribute of
    torchao's)."""
    global _TORCHAO_SHARD_CAST
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    if Weight.fsdp_pre_all_gather is not fused_shard_cast:
        _TORCHAO_SHARD_CAST = Weight.fsdp_pre_all_gather
        Weight.fsdp_pre_all_gather = fused_shard_cast


def scale_precompute(plan):
    """What runs after each optimizer step: torchao's precompute of the float8 all-gather's weight
    scales, or None. Once it has run, the all-gathers use its scales, so it must follow every step
    that changes weights."""
    if not plan.fp8_all_gather:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return precompute_float8_dynamic_scale_for_fsdp


def describe(plan, model, device):
    """The banner's line about fp8 (the fused loss, and with it the float8 head, is CUDA's)."""
    blocks = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.startswith("blocks.")
    ]
    in_head = plan.fp8_head and device.type == "cuda"
    head = " and in the output head's three matmuls" if in_head else ""
    peak = "; MFU is relative to the dense bf16 peak, as for bf16, so the two compare"
    if not plan.fp8_blocks:
        return (
            f"fp8: {plan.fp8} float8 matmuls in the output head's three matmuls only; the blocks' "
            f"{len(blocks)} linear layers stay bf16 (a model {model.config.embed_size} wide: "
            f"float8 blocks pay from {BLOCKS_MIN_WIDTH}; --fp8_layers all converts them){peak}"
        )
    layers = convertible(model)
    gathered = sum(gathers_in_float8(plan, layer) for _, layer in layers)
    gather = (
        f"{gathered} all-gathered in float8, scales computed after each optimizer step"
        if gathered
        else "each weight cast to float8 where it is used"
    )
    return (
        f"fp8: {plan.fp8} float8 matmuls in {len(layers)} of the blocks' {len(blocks)} linear "
        f"layers ({gather}){head}{peak}"
    )

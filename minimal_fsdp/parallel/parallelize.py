"""The plan applied: the model built, initialized, sharded (FSDP2 or whole_unit.py), compiled, and
its gradients synchronized, each as the run's ParallelPlan (plan.py) says; nothing here decides a
strategy again.

How each --sharding maps onto FSDP2's `fully_shard` over a DeviceMesh (plan.layout):
  full-shard          1-D mesh, params resharded after forward (ZeRO-3)
  grad-shard          1-D mesh, params kept gathered from forward to backward (ZeRO-2-like)
  no-shard            the whole model on every rank: torch's DDP, or whole_unit.py's unit over a
                      (world x 1) mesh; with --cpu_offload, FSDP2 over that (world x 1) mesh, as
                      offloading needs FSDP2
  hybrid-*-shard      2-D mesh (nodes x shard_group_size): replicate across groups, shard inside one
--precision fp8 adds torchao's float8 matmuls to bf16 compute (fp8.py): the layers are converted
before sharding.
"""

import functools
import zlib

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from minimal_fsdp.models.attention import KEPT_BY_SELECTIVE_RECOMPUTE
from minimal_fsdp.models.layers import KVCache
from minimal_fsdp.parallel import fp8
from minimal_fsdp.parallel.bf16_weights import BF16Weights
from minimal_fsdp.parallel.gossip import Gossip
from minimal_fsdp.parallel.whole_unit import WholeUnit

aten = torch.ops.aten
# --recompute selective keeps what is costly to recompute (matmuls, attention) and recomputes the
# cheap, memory-bound rest (norms, activations, residual adds), as torchtitan's op-level policy
# does. Float8 layers (fp8.py): the policy sees aten.mm on torchao's float8 tensors, which run
# aten._scaled_mm beneath (kept too, should a graph show it); and the amax (max) each float8 cast
# takes, a scalar, is kept rather than recomputed by another pass.
KEEP = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_mm.default,
    aten.max.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    # --document_mask's attention on CUDA: FlexAttention, varlen (attention.py)
    *KEPT_BY_SELECTIVE_RECOMPUTE,
}


def shard(model, plan):
    """fully_shard each block (the unit that is gathered, freed and overlapped), an untied model's
    input embedding and output head each as a unit of its own, then the root for the rest; or,
    under fsdp-whole, the root alone: the whole model is gathered at once.

    Units of their own because the root's gradients reduce only once the whole backward is done,
    and its parameters are the first a step gathers: with a large vocabulary (Llama 3's 128K: over
    a third of an 8-layer cut) the embedding and head held by the root made one all-gather and one
    reduce-scatter that nothing hid. The head, whose backward comes first, reduces beside the
    blocks' backward and is gathered while the blocks run forward. Neither the head nor the root
    reshards after forward (backward gathers them again at once, at the same peak: the activations
    peak there too); FSDP2 does that for its root only when not told otherwise."""
    mixed = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if plan.bf16 else None, reduce_dtype=plan.reduce_dtype
    )
    offload = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if plan.cpu_offload
        else OffloadPolicy()
    )
    unit = functools.partial(fully_shard, mesh=plan.mesh, mp_policy=mixed, offload_policy=offload)
    whole = plan.strategy == "fsdp-whole"
    reshard = plan.reshard_after_forward and not whole
    for i, block in enumerate([] if whole else model.blocks):
        unit(block, reshard_after_forward=reshard and i < len(model.blocks) - 1)
    if not whole and getattr(model, "lm_head", None) is not None:  # untied (Llama)
        unit(model.wte, reshard_after_forward=reshard)
        unit(model.lm_head, reshard_after_forward=False)
    unit(model, reshard_after_forward=False)
    return model


class LocalSync:
    """Gradient synchronization of a plain module on one rank: nothing to reduce or gather."""

    def start(self, step):
        pass

    def micro_step(self, last):
        pass

    def finish(self):
        pass

    def clip_grad_norm(self, parameters, max_norm):
        """The grad norm (a device tensor), after clipping the gradients to max_norm (0: no
        clipping, and no pass that multiplies them by 1)."""
        if not max_norm:
            return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)

    def after_step(self):
        """Once the step is done: nothing here (FSDPSync computes float8 scales, xla.py runs the
        traced step)."""


class BF16WeightsSync(LocalSync):
    """Gradient synchronization of one rank computing with bf16_weights.BF16Weights' copies: the
    gradients are the copies' (summed in fp32 over micro-steps); the fp32 parameters go back in
    the modules once backward is done."""

    def __init__(self, weights):
        self.weights = weights

    def micro_step(self, last):
        self.weights.accumulate()  # the previous micro-step's, if any

    def finish(self):
        self.weights.finish()

    def clip_grad_norm(self, parameters, max_norm):
        grads = [g for g in self.weights.grads() if g is not None]
        if sum(g.nbytes for g in grads) >= COMPILED_NORM_BYTES:
            total = _compiled_grad_norm()(grads)
        else:
            total = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).norm()
        clip_to(grads, total, max_norm)
        return total


# Gradients this large take the compiled norm. It reads them at about 1.6x _foreach_norm's speed
# (2.8B bf16 gradients: 1.53 against 2.49 ms on an H200) but launches a reduction per tensor, which
# a small model's short step pays for (recipe S, 10.75M parameters: 5.76 -> 6.19 ms a step).
COMPILED_NORM_BYTES = 2**30


@functools.cache
def _compiled_grad_norm():
    """The 2-norm of all gradients, summed in fp32 (inductor's reductions)."""
    return torch.compile(
        lambda grads: torch.stack([g.float().square().sum() for g in grads]).sum().sqrt()
    )


class DDPSync(LocalSync):
    """Gradient synchronization of a replicate()d module: DDP all-reduces (averages) the gradients
    in backward, on the last micro-step only. Every rank then holds the same full gradients, so
    LocalSync's clipping gives the global norm without another collective."""

    def __init__(self, model):
        self.model = model

    def micro_step(self, last):
        self.model.set_requires_gradient_sync(last)


def clip_to(grads, total, max_norm):
    """Gradients whose norm `total` is above max_norm scaled down to it, as torch's clip_grad_norm_
    scales them (0: no clipping, and no pass that multiplies them by 1)."""
    if max_norm:
        torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0).to(grads[0].dtype))


def clip_sharded(grads, max_norm, group):
    """The global grad norm (a plain tensor, the same on every rank) of gradients sharded over
    `group`, after clipping them to max_norm (0: no clipping): torch's clip_grad_norm_ formula on
    the local shards plus one all-reduce of the sum of squares. On DTensors torch's version costs
    DTensor dispatch for every parameter, milliseconds of host time a step that a small model's step
    cannot hide."""
    squares = torch.stack(torch._foreach_norm(grads)).float().square().sum()
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    clip_to(grads, total, max_norm)
    return total


class WholeUnitSync(LocalSync):
    """Gradient synchronization of a whole_unit.WholeUnit model: each micro-step's unsharded
    gradients are added in fp32 (as FSDP2 accumulates them); one reduce-scatter after the last gives
    the shards their mean."""

    def __init__(self, unit):
        self.unit = unit
        # views of the shards' one gradient tensor
        self.local_grads = [grad.to_local() for grad in unit.grads]

    def micro_step(self, last):
        self.unit.accumulate()  # the previous micro-step's, if any

    def finish(self):
        self.unit.reduce()

    def clip_grad_norm(self, parameters, max_norm):
        return clip_sharded(self.local_grads, max_norm, self.unit.shard_group)


class FSDPSync(LocalSync):
    """Gradient synchronization of an FSDP model over the micro-steps of one optimizer step:
    gradients are reduced on the last micro-step only; where parameters stay gathered from forward
    to backward anyway, they also stay gathered across micro-steps and are resharded only after the
    last one. After the optimizer step, the scales of weights all-gathered in float8 are computed
    for the next step (--precision fp8, tensorwise)."""

    def __init__(self, model, plan):
        self.model, self.stays_gathered = model, plan.stays_gathered
        self.shard_group = plan.mesh.get_group("shard")  # replicas hold the same reduced gradients
        self.precompute_scales = fp8.scale_precompute(plan)

    def micro_step(self, last):
        self.model.set_requires_gradient_sync(last)
        if self.stays_gathered:
            self.model.set_reshard_after_backward(last)

    def clip_grad_norm(self, parameters, max_norm):
        return clip_sharded(
            [p.grad.to_local() for p in parameters if p.grad is not None],
            max_norm,
            self.shard_group,
        )

    def after_step(self):
        """Once the step is done: torchao's float8 weight scales for the next all-gathers
        (--precision fp8)."""
        if self.precompute_scales:
            self.precompute_scales(self.model)


# How train_step synchronizes gradients under each strategy (plan.STRATEGIES). Five paths, each for
# a reason: FSDP2's hooks (per block or whole) reduce-scatter in backward; the one unit reduces once
# after backward, without FSDP2's per-step host work, which a small model's step cannot hide; DDP
# overlaps a large replica's all-reduce with its backward, which the one unit (one all-reduce after
# backward, and a gathered copy of the model) cannot; gossip averages parameters, not gradients; one
# rank has nothing to synchronize.
SYNCS = {
    "local": lambda model, plan: (
        BF16WeightsSync(model.bf16_weights) if plan.bf16_weights else LocalSync()
    ),
    "ddp": lambda model, plan: DDPSync(model),
    "one-unit": lambda model, plan: WholeUnitSync(model.whole_unit),
    "fsdp-whole": FSDPSync,
    "fsdp-block": FSDPSync,
    "gossip": lambda model, plan: Gossip(
        model,
        plan.topology,
        torch.bfloat16 if plan.gossip_dtype == "bf16" else torch.float32,
        global_average_every=plan.global_average_every,
    ),
}


def gradient_sync(model, plan):
    """The object train_step synchronizes this model's gradients with, as the plan's strategy
    says."""
    return SYNCS[plan.strategy](model, plan)


def bf16_all_reduce(group, bucket):
    """DDP's communication hook for --reduce_precision bf16: a bucket cast to bf16, divided by the
    world, summed over the ranks, and cast back. torch's bf16_compress_hook does the same, but DDP
    refuses it (by name) unless on CUDA with NCCL, and the CPU runs (gloo, which sums bf16 too) take
    this path as well."""
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(future):
        return bucket.buffer().copy_(future.value()[0])

    return work.get_future().then(decompress)


def seed64(value):
    """A seed derived from --seed, as every generator takes it: torch's take [-2**63, 2**64) (a
    negative one as its two's complement), torch_xla's only [0, 2**64); mod 2**64 keeps every seed
    that fitted and lets a large or negative --seed through."""
    return value % 2**64


@torch.no_grad()
def init_weights(model, seed, device):
    """Give every parameter its initial value, one full parameter at a time on `device`.

    Each parameter is drawn from its own generator seeded by (seed, name), so the values do not
    depend on the world size, the sharding, or whether the model was built on the meta device. A
    sharded (DTensor) parameter keeps only its local slice: no rank ever holds more than one full
    parameter.
    """
    for name, param in model.named_parameters():
        generator = torch.Generator(device=device).manual_seed(
            seed64(seed * 1_000_003 + zlib.crc32(name.encode()))
        )
        value = model.initial_value(name, param.shape, generator, device)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                value, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)


def keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def recomputed(forward, policy):
    """forward under activation checkpointing: only the block's input (full), or also its matmul and
    attention outputs (selective), are kept for backward; the rest is recomputed there. Inside
    FSDP's hooks, so the recompute runs on the parameters FSDP has already gathered for backward."""
    # Full recompute passes no context_fn at all: torch.compile (2.11) refuses the
    # default noop_context_fn.
    context = (
        dict(context_fn=functools.partial(create_selective_checkpoint_contexts, keep_matmuls))
        if policy == "selective"
        else {}
    )

    @functools.wraps(forward)
    def run(*args):
        # evaluation and generation keep nothing for backward anyway
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False, **context)

    return run


def compiled_unless_caching(function, mode=None):
    """torch.compile for training and evaluation; generation (a KVCache among the arguments) runs
    eagerly, as its growing cache position would make the compiler specialize on every new token."""
    compiled = torch.compile(function, mode=mode)

    @functools.wraps(function)
    def run(*args, **kwargs):
        caching = any(isinstance(a, KVCache) for a in (*args, *kwargs.values()))
        return (function if caching else compiled)(*args, **kwargs)

    return run


def build_model(model_cls, model_config, plan, env, seed):
    """Build, initialize (weights from `seed`), shard or not, and compile a model as the plan
    says."""
    with torch.device("meta" if plan.meta_init else env.device):
        model = model_cls(model_config)
    if model.num_params(non_embedding=False) != plan.num_params:
        raise ValueError(
            f"the plan was made for a model of {plan.num_params} parameters; this one has "
            f"{model.num_params(non_embedding=False)}: make_plan with this model's config"
        )
    if plan.fp8:
        # before sharding: FSDP sees the float8 layers' weights
        fp8.convert(model, plan, env.device)
    for block in model.blocks:
        # Wrapping forward (not the module) keeps FSDP's hooks outside and state-dict
        # keys unchanged.
        if plan.activation_checkpoints:
            block.forward = recomputed(block.forward, plan.recompute)
        # each block is its own graph between FSDP2's hooks
        if plan.compile and not plan.compiles_whole:
            block.forward = compiled_unless_caching(block.forward)
    if plan.compiles_whole:  # no hooks in the way: token ids to hidden states
        model.trunk = compiled_unless_caching(
            model.trunk, "reduce-overhead" if plan.cuda_graphs else None
        )
    if env.device.type == "cuda":
        # One Triton kernel turns the logits into the loss and, in place, their
        # gradient (fused_loss.py).
        from minimal_fsdp.models.fused_loss import linear_cross_entropy

        model.loss = (
            functools.partial(linear_cross_entropy, float8=True)
            if plan.fp8_head
            else linear_cross_entropy
        )
    elif plan.compile:
        # Compiled, the fp32 upcast, log-softmax and its backward fuse into a few passes over the
        # logits instead of materializing fp32 logits (the largest tensor of a GPT-2 step).
        model.loss = torch.compile(model.loss)
    # built with its values, or (meta) filled by init_weights once sharded
    if plan.strategy == "one-unit":
        if not plan.meta_init:
            init_weights(model, seed, env.device)
        model.whole_unit = WholeUnit(
            model, plan.mesh, plan.compute_dtype, env.device, plan.reduce_dtype
        )
        if plan.meta_init:
            init_weights(model, seed, env.device)
        return model
    if plan.meta_init and not plan.fsdp:
        model.to_empty(device=env.device)
    if not plan.meta_init or not plan.fsdp:
        init_weights(model, seed, env.device)
    if not plan.fsdp:
        if plan.bf16_weights:  # fp32 weights stepped, bf16 copies computed with
            model.bf16_weights = BF16Weights(model)
        elif plan.bf16:  # fp32 weights, bf16 matmuls: FSDP's mixed precision without FSDP
            model.forward = torch.autocast(env.device.type, dtype=torch.bfloat16)(model.forward)
        # gradients (fp32, as FSDP reduces them, or --reduce_precision) averaged in backward
        if plan.ddp:
            # Buffers (rotary tables, masks) are computed alike on every rank: no broadcast before
            # each forward. Gradients as views of DDP's buckets: no copy back from the buckets
            # after the all-reduce, which a small model's step, bound by host time, would pay for
            # every step.
            replicate(
                model, device_id=env.device, broadcast_buffers=False, gradient_as_bucket_view=True
            )
            if plan.reduce_precision == "bf16":
                model.register_comm_hook(None, bf16_all_reduce)
        return model
    shard(model, plan)
    if plan.meta_init:
        model.to_empty(device="cpu" if plan.cpu_offload else env.device)
        init_weights(model, seed, env.device)
    return model

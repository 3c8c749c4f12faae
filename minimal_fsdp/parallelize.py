"""How a model is sharded, initialized, checkpointed and compiled: FSDP2 `fully_shard` over a DeviceMesh.

Strategies map onto FSDP2 as:
  full-shard          1-D mesh, params resharded after forward (ZeRO-3)
  grad-shard          1-D mesh, params kept gathered from forward to backward (ZeRO-2-like)
  no-shard            2-D mesh (world x 1): replicate everywhere, shard over one rank (DDP semantics)
  hybrid-*-shard      2-D mesh (nodes x shard_group_size): replicate across groups, shard inside one
With --data_parallel decentralized there is no FSDP at all: each rank holds a plain, whole replica that
trains on its own and is averaged with its neighbours' by gossip.py.
"""
import functools
import zlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
# --recompute selective keeps what is costly to recompute (matmuls, attention) and recomputes the cheap,
# memory-bound rest (norms, activations, residual adds), as torchtitan's op-level policy does.
KEEP = {aten.mm.default, aten.addmm.default, aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


def build_mesh(cfg, env):
    if cfg.data_parallel == "decentralized":
        return None  # replicas are plain modules; gossip talks to peers directly
    kind = env.device.type
    if cfg.sharding in ("full-shard", "grad-shard"):
        return init_device_mesh(kind, (env.world_size,), mesh_dim_names=("shard",))
    group = 1 if cfg.sharding == "no-shard" else (cfg.shard_group_size or env.local_world_size)
    return init_device_mesh(kind, (env.world_size // group, group), mesh_dim_names=("replicate", "shard"))


def reshards_after_forward(sharding, shard_ranks):
    """Whether gathered params are freed after forward and gathered again in backward: pointless over a shard
    group of one rank. The last block never reshards (its backward comes right after forward)."""
    return sharding in ("full-shard", "hybrid-full-shard") and shard_ranks > 1


def shard(model, mesh, cfg):
    """fully_shard each block (the unit that is gathered, freed and overlapped), then the root for the rest."""
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.precision == "bf16" else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload else OffloadPolicy()
    reshard = reshards_after_forward(cfg.sharding, mesh["shard"].size() if mesh.ndim == 2 else mesh.size())
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard and i < len(model.blocks) - 1, mp_policy=mixed,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed, offload_policy=offload)
    # Without resharding after forward every parameter is gathered from forward to backward anyway; train_step
    # then keeps them gathered across the micro-steps of an accumulation too, instead of gathering them again.
    model.stays_gathered = not reshard
    return model


@torch.no_grad()
def init_weights(model, seed, device):
    """Give every parameter its initial value, one full parameter at a time on `device`.

    Each parameter is drawn from its own generator seeded by (seed, name), so the values do not depend on
    the world size, the sharding, or whether the model was built on the meta device. A sharded (DTensor)
    parameter keeps only its local slice: no rank ever holds more than one full parameter.
    """
    for name, param in model.named_parameters():
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        value = model.initial_value(name, param.shape, generator, device)
        if isinstance(param, DTensor):
            local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)


def keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def recomputed(forward, policy):
    """forward under activation checkpointing: only the block's input (full), or also its matmul and attention
    outputs (selective), are kept for backward; the rest is recomputed there. Inside FSDP's hooks, so the
    recompute runs on the parameters FSDP has already gathered for backward."""
    # Full recompute passes no context_fn at all: torch.compile (2.11) refuses the default noop_context_fn.
    context = dict(context_fn=functools.partial(create_selective_checkpoint_contexts, keep_matmuls)) \
        if policy == "selective" else {}

    @functools.wraps(forward)
    def run(*args):
        if not torch.is_grad_enabled():  # evaluation and generation keep nothing for backward anyway
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False, **context)
    return run


def build_model(model_cls, model_config, cfg, env, mesh):
    """Build, initialize and shard a model as the flags say; returns it ready for training or generation."""
    with torch.device("meta" if cfg.meta_init else env.device):
        model = model_cls(model_config)
    for block in model.blocks:
        # Wrapping forward (not the module) keeps FSDP's hooks outside and state-dict keys unchanged.
        if cfg.activation_checkpoints:
            block.forward = recomputed(block.forward, cfg.recompute)
        if cfg.compile:
            block.forward = torch.compile(block.forward)
    if env.device.type == "cuda":
        # One Triton kernel turns the logits into the loss and, in place, their gradient (fused_loss.py).
        from .fused_loss import linear_cross_entropy
        model.loss = linear_cross_entropy
    elif cfg.compile:
        # Compiled, the fp32 upcast, log-softmax and its backward fuse into a few passes over the logits
        # instead of materializing fp32 logits (the largest tensor of a GPT-2 step).
        model.loss = torch.compile(model.loss)
    if cfg.data_parallel == "decentralized":
        return replica(model, cfg, env)
    if not cfg.meta_init:
        init_weights(model, cfg.seed, env.device)
    shard(model, mesh, cfg)
    if cfg.meta_init:
        model.to_empty(device="cpu" if cfg.cpu_offload else env.device)
        init_weights(model, cfg.seed, env.device)
    return model


def replica(model, cfg, env):
    """A whole, unsharded model for decentralized training. init_weights depends only on the seed and names,
    so every rank starts from the same replica. bf16 runs under autocast: fp32 weights, bf16 matmuls."""
    if cfg.meta_init:
        model.to_empty(device=env.device)
    init_weights(model, cfg.seed, env.device)
    if cfg.precision == "bf16":
        model.forward = torch.autocast(env.device.type, dtype=torch.bfloat16)(model.forward)
    return model

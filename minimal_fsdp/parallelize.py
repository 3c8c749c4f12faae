"""How a model is laid out over the ranks, then sharded, initialized, checkpointed and compiled.

One ParallelPlan is made per run from the flags and the launch layout (make_plan); model building, the training
step, the startup banner and the memory planner all read it, and nobody decodes a mesh back into a strategy.

Strategies map onto FSDP2 `fully_shard` over a DeviceMesh as:
  full-shard          1-D mesh, params resharded after forward (ZeRO-3)
  grad-shard          1-D mesh, params kept gathered from forward to backward (ZeRO-2-like)
  no-shard            no FSDP: the whole model on every rank; a small one (--fsdp_unit) is whole_unit.py's unit
                      over a (world x 1) mesh, one all-reduce a step; a large one is a plain module whose
                      gradients torch's DDP all-reduces (replicate(), which keeps the module and its state-dict
                      keys); with --cpu_offload, FSDP over that (world x 1) mesh, as offloading needs FSDP
  hybrid-*-shard      2-D mesh (nodes x shard_group_size): replicate across groups, shard inside one
A model gathered whole (--fsdp_unit: small models) is sharded alike by whole_unit.py instead of FSDP2 (which
--cpu_offload and float8's all-gather still use): one all-gather into parameters that keep their addresses, so its
compiled graph can replay as CUDA graphs, and one reduce-scatter a step.
--precision fp8 adds torchao's float8 matmuls to bf16 compute (fp8.py): the layers are converted before sharding.
A world of one rank has nothing to shard: its model is a plain module (bf16 by autocast), the same numbers and
the same checkpoints without FSDP's per-step work (--cpu_offload still needs FSDP). With --data_parallel
decentralized there is no FSDP at all: each rank holds a plain, whole replica that trains on its own and is
averaged with its neighbours' by gossip.py.
"""
import dataclasses
import functools
import zlib

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import fp8
from .layers import KVCache
from .whole_unit import WholeUnit

SHARDING = ("full-shard", "grad-shard", "no-shard", "hybrid-full-shard", "hybrid-grad-shard")
PRECISION = ("float32", "bf16", "fp8")
DATA_PARALLEL = ("allreduce", "decentralized")
FSDP_UNITS = ("auto", "block", "model")
# --fsdp_unit auto: a model this small is one FSDP unit. Its step is bound by the host: FSDP2's hooks, gathers and
# reduce-scatters per block, and a compiled graph per block, cost more than overlapping its brief communication
# with compute saves (benchmarks/RESULTS.md, recipe S and GPT-2 124M on 2 H100), and gathering it whole costs
# little memory.
SMALL_MODEL = 200_000_000
# --cuda_graphs auto: a model this small replays its compiled graph as CUDA graphs where no FSDP hooks surround it
# (one rank, DDP). Its step is the host launching kernels: recipe S (10.7M) took 9-12 ms a step compiled, 6.4 ms
# replayed, on one H100 (benchmarks/LOG.md, seventh and eleventh sessions); GPT-2 124M at batch 32 is bound by the GPU
# (graphs would save nothing there). Where between the two the gain ends was not measured: 50M is a cautious bound.
GRAPHS_MODEL = 50_000_000

aten = torch.ops.aten
# --recompute selective keeps what is costly to recompute (matmuls, attention) and recomputes the cheap,
# memory-bound rest (norms, activations, residual adds), as torchtitan's op-level policy does. Float8 layers (fp8.py):
# the policy sees aten.mm on torchao's float8 tensors, which run aten._scaled_mm beneath (kept too, should a graph
# show it); and the amax (max) each float8 cast takes, a scalar, is kept rather than recomputed by another pass.
KEEP = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default, aten.max.default,
        aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch._higher_order_ops.flex_attention}  # --document_mask's attention on CUDA (attention.py)


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """Every decision about the model's layout, made once (make_plan)."""
    sharding: str  # as asked; what it means on this launch is below
    decentralized: bool  # whole replicas averaged by gossip.py
    fsdp: bool  # FSDP2 shards the model (False: a plain module: one rank, DDP or a decentralized replica)
    mesh_shape: tuple  # (ranks,) or (replica groups, ranks per shard group)
    shard_ranks: int  # ranks one parameter is spread over (1: every rank holds it whole)
    reshard_after_forward: bool  # gathered params are freed after forward and gathered again in backward
    precision: str
    cpu_offload: bool
    meta_init: bool  # built on the meta device, each rank initializing only its shard
    activation_checkpoints: bool
    recompute: str
    compile: bool
    cuda_graphs: bool  # the compiled whole model replays as CUDA graphs (replays_graphs); None: by size
    fp8: str = None  # --precision fp8: the float8 recipe (fp8.RECIPES); None otherwise
    ddp: bool = False  # no-shard over several ranks: DDP on a plain module, or a small model's unit (gathered_whole)
    fsdp_unit: str = "auto"  # --fsdp_unit: per block, the whole model, or by size (whole_model_unit)
    mesh: object = None  # the DeviceMesh (FSDP only), built by make_plan

    @property
    def bf16(self):
        """Matmuls in bf16 (fp8: those that are not float8), parameters all-gathered in bf16."""
        return self.precision in ("bf16", "fp8")

    @property
    def fp8_all_gather(self):
        """FSDP all-gathers the float8 layers' weights in float8 (fp8.gathers_in_float8 has the last word per layer)."""
        return self.fp8 == "tensorwise" and self.fsdp and self.shard_ranks > 1 and not self.cpu_offload

    @property
    def stays_gathered(self):
        """Params stay gathered from forward to backward anyway, so also across an accumulation's micro-steps."""
        return self.fsdp and not self.reshard_after_forward

    def whole_model_unit(self, num_params):
        """FSDP gathers the whole model at once (one unit, one compiled graph), not block by block."""
        return self.fsdp and one_unit(self.fsdp_unit, num_params)

    def gathered_whole(self, num_params):
        """The whole model is one unit of whole_unit.py: a small model under FSDP, not FSDP2 (which offloading and
        float8's all-gather need); and under no-shard over several ranks, not DDP, whose reducer's host work
        swung recipe S's step on 4 H100s: 6.83-7.65 ms against the unit's 6.63-6.71, one GPU's 6.45
        (benchmarks/LOG.md, fifteenth session)."""
        small = self.whole_model_unit(num_params) or self.ddp and one_unit(self.fsdp_unit, num_params)
        return small and not self.cpu_offload and not self.fp8

    def replays_graphs(self, num_params):
        """The compiled whole model replays as CUDA graphs (no FSDP2 hooks around it: one rank, DDP, whole_unit.py):
        asked for, or (auto) a model of at most GRAPHS_MODEL."""
        if self.fsdp and not self.gathered_whole(num_params):
            return False
        return self.cuda_graphs or self.cuda_graphs is None and num_params <= GRAPHS_MODEL

    def describe(self, num_params):
        if self.decentralized:
            return "no FSDP: a whole replica per rank, averaged with its neighbours' by gossip"
        graphs = ", replayed as CUDA graphs" if self.replays_graphs(num_params) else ""
        if self.ddp and self.gathered_whole(num_params):
            return "no sharding: the whole model on every rank as one unit, gradients averaged by one all-reduce " \
                "a step (no-shard)" + graphs
        if self.ddp:
            return "no FSDP: the whole model on every rank, gradients all-reduced by DDP (no-shard)" + graphs
        if not self.fsdp:
            return "no FSDP: one rank holds the whole model" + graphs
        dims = ("shard",) if len(self.mesh_shape) == 1 else ("replicate", "shard")
        units = "the whole model as one unit, one all-gather a step" if self.gathered_whole(num_params) else \
            "the whole model as one FSDP unit" if self.whole_model_unit(num_params) else "an FSDP unit per block"
        return "mesh " + " x ".join(f"{name}={size}" for name, size in zip(dims, self.mesh_shape)) + \
            f" ({self.sharding}), {units}{graphs}"


def one_unit(fsdp_unit, num_params):
    """--fsdp_unit's rule, for a model under FSDP: is the whole model one unit? (The planner applies it too.)"""
    return fsdp_unit == "model" or fsdp_unit == "auto" and num_params <= SMALL_MODEL


def layout(sharding, world_size, shard_group_size):
    """(mesh shape, ranks a parameter is sharded over, reshard after forward) of a strategy. The last is pointless
    over a shard group of one rank; the last block never reshards anyway (its backward comes right after)."""
    if sharding in ("full-shard", "grad-shard"):
        shape = (world_size,)
    else:
        group = 1 if sharding == "no-shard" else shard_group_size
        shape = (world_size // group, group)
    return shape, shape[-1], sharding in ("full-shard", "hybrid-full-shard") and shape[-1] > 1


def graphs_setting(cfg, device, auto):
    """--cuda_graphs: True, False, or None (by model size, ParallelPlan.replays_graphs) where graphs can replay the
    compiled model: on CUDA (and not inside FSDP2's hooks, which gather parameters at new addresses every step:
    replays_graphs). auto: the size rule may apply (not to gossip's replicas or float8 layers, which were not
    measured under graphs)."""
    if not cfg.compile or device.type != "cuda" or cfg.cuda_graphs is None and not auto:
        return False
    return cfg.cuda_graphs


def make_plan(cfg, env, loads_weights=False, fsdp_on_one_rank=False):
    """The plan for this launch. loads_weights: all weights will be loaded (a Hugging Face model, a model to
    sample from), so the model is built on the meta device and no rank ever holds more than its shard of it.
    fsdp_on_one_rank: use FSDP even for a world of one (tests and benchmarks compare the two).
    Generation alone (--max_epochs -1) with --precision fp8 runs in bf16: float8 pays in training's large matmuls."""
    decentralized = cfg.data_parallel == "decentralized"
    # no-shard has nothing to shard: one all-reduce a step, by DDP (or whole_unit.py: gathered_whole), with a
    # fraction of FSDP's host work per step.
    ddp = not decentralized and cfg.sharding == "no-shard" and env.world_size > 1 and not cfg.cpu_offload \
        and not fsdp_on_one_rank
    fsdp = not decentralized and not ddp and (env.world_size > 1 or cfg.cpu_offload or fsdp_on_one_rank)
    shape, shard_ranks, reshard = layout(cfg.sharding, env.world_size, cfg.shard_group_size or env.local_world_size)
    if not fsdp and not ddp:
        shape, shard_ranks, reshard = (env.world_size,), 1, False
    recipe = cfg.fp8_recipe if cfg.precision == "fp8" and not cfg.generate_only else None
    if recipe:
        fp8.check_device(env.device)
    plan = ParallelPlan(cfg.sharding, decentralized, fsdp, shape, shard_ranks, reshard, cfg.precision,
                        cfg.cpu_offload, cfg.meta_init or loads_weights, cfg.activation_checkpoints, cfg.recompute,
                        cfg.compile, graphs_setting(cfg, env.device, auto=not decentralized and not recipe),
                        recipe, ddp, cfg.fsdp_unit)
    if fsdp:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        plan = dataclasses.replace(plan, mesh=init_device_mesh(env.device.type, shape, mesh_dim_names=names))
    return plan


def shard(model, plan, whole):
    """fully_shard each block (the unit that is gathered, freed and overlapped), then the root for the rest; or,
    whole, the root alone: the whole model is gathered at once. The whole model stays gathered from forward to
    backward even under full-shard (as FSDP2 keeps its root unit): backward would gather it again at once, at the
    same peak (the activations peak there too), so resharding it would only cost a second all-gather."""
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if plan.bf16 else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if plan.cpu_offload else OffloadPolicy()
    reshard = plan.reshard_after_forward and not whole
    for i, block in enumerate([] if whole else model.blocks):
        fully_shard(block, mesh=plan.mesh, reshard_after_forward=reshard and i < len(model.blocks) - 1,
                    mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mesh=plan.mesh, reshard_after_forward=reshard, mp_policy=mixed, offload_policy=offload)
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
        """The grad norm (a device tensor), after clipping the gradients to max_norm (0: no clipping)."""
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm or float("inf"))

    def after_step(self):
        """Once the step is done: nothing here (FSDPSync computes float8 scales, xla.py runs the traced step)."""


class DDPSync(LocalSync):
    """Gradient synchronization of a replicate()d module: DDP all-reduces (averages) the gradients in backward,
    on the last micro-step only. Every rank then holds the same full gradients, so LocalSync's clipping gives
    the global norm without another collective."""

    def __init__(self, model):
        self.model = model

    def micro_step(self, last):
        self.model.set_requires_gradient_sync(last)


def clip_sharded(grads, max_norm, group):
    """The global grad norm (a plain tensor, the same on every rank) of gradients sharded over `group`, after
    clipping them to max_norm (0: no clipping): torch's clip_grad_norm_ formula on the local shards plus one
    all-reduce of the sum of squares. On DTensors torch's version costs DTensor dispatch for every parameter,
    milliseconds of host time a step that a small model's step cannot hide."""
    squares = torch.stack(torch._foreach_norm(grads)).float().square().sum()
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if max_norm:
        torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return total


class WholeUnitSync(LocalSync):
    """Gradient synchronization of a whole_unit.WholeUnit model: each micro-step's unsharded gradients are added
    in fp32 (as FSDP2 accumulates them); one reduce-scatter after the last gives the shards their mean."""

    def __init__(self, unit):
        self.unit = unit
        self.local_grads = [grad.to_local() for grad in unit.grads]  # views of the shards' one gradient tensor

    def micro_step(self, last):
        self.unit.accumulate()  # the previous micro-step's, if any

    def finish(self):
        self.unit.reduce()

    def clip_grad_norm(self, parameters, max_norm):
        return clip_sharded(self.local_grads, max_norm, self.unit.shard_group)

    def after_step(self):
        self.unit.changed()


class FSDPSync(LocalSync):
    """Gradient synchronization of an FSDP model over the micro-steps of one optimizer step: gradients are reduced
    on the last micro-step only; where parameters stay gathered from forward to backward anyway, they also stay
    gathered across micro-steps and are resharded only after the last one. After the optimizer step, the scales
    of weights all-gathered in float8 are computed for the next step (--precision fp8, tensorwise)."""

    def __init__(self, model, plan):
        whole = plan.whole_model_unit(model.num_params(non_embedding=False))  # gathered forward to backward too
        self.model, self.stays_gathered = model, plan.stays_gathered or whole
        self.shard_group = plan.mesh.get_group("shard")  # replicas hold the same reduced gradients
        self.precompute_scales = fp8.scale_precompute(plan)

    def micro_step(self, last):
        self.model.set_requires_gradient_sync(last)
        if self.stays_gathered:
            self.model.set_reshard_after_backward(last)

    def clip_grad_norm(self, parameters, max_norm):
        return clip_sharded([p.grad.to_local() for p in parameters if p.grad is not None], max_norm, self.shard_group)

    def after_step(self):
        """Once the step is done: torchao's float8 weight scales for the next all-gathers (--precision fp8)."""
        if self.precompute_scales:
            self.precompute_scales(self.model)


def gradient_sync(model, plan):
    """How train_step synchronizes this model's gradients (decentralized runs use gossip.Gossip instead)."""
    if hasattr(model, "whole_unit"):  # whole_unit.py shards it (build_model)
        return WholeUnitSync(model.whole_unit)
    return FSDPSync(model, plan) if plan.fsdp else DDPSync(model) if plan.ddp else LocalSync()


def seed64(value):
    """A seed derived from --seed, as every generator takes it: torch's take [-2**63, 2**64) (a negative one as
    its two's complement), torch_xla's only [0, 2**64); mod 2**64 keeps every seed that fitted and lets a large or
    negative --seed through."""
    return value % 2**64


@torch.no_grad()
def init_weights(model, seed, device):
    """Give every parameter its initial value, one full parameter at a time on `device`.

    Each parameter is drawn from its own generator seeded by (seed, name), so the values do not depend on
    the world size, the sharding, or whether the model was built on the meta device. A sharded (DTensor)
    parameter keeps only its local slice: no rank ever holds more than one full parameter.
    """
    for name, param in model.named_parameters():
        generator = torch.Generator(device=device).manual_seed(seed64(seed * 1_000_003 + zlib.crc32(name.encode())))
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


def compiled_unless_caching(function, mode=None):
    """torch.compile for training and evaluation; generation (a KVCache among the arguments) runs eagerly, as
    its growing cache position would make the compiler specialize on every new token."""
    compiled = torch.compile(function, mode=mode)

    @functools.wraps(function)
    def run(*args, **kwargs):
        caching = any(isinstance(a, KVCache) for a in (*args, *kwargs.values()))
        return (function if caching else compiled)(*args, **kwargs)
    return run


def build_model(model_cls, model_config, plan, env, seed):
    """Build, initialize (weights from `seed`), shard or not, and compile a model as the plan says."""
    with torch.device("meta" if plan.meta_init else env.device):
        model = model_cls(model_config)
    if plan.fp8:
        fp8.convert(model, plan, env.device)  # before sharding: FSDP sees the float8 layers' weights
    num_params = model.num_params(non_embedding=False)
    whole = plan.whole_model_unit(num_params)
    for block in model.blocks:
        # Wrapping forward (not the module) keeps FSDP's hooks outside and state-dict keys unchanged.
        if plan.activation_checkpoints:
            block.forward = recomputed(block.forward, plan.recompute)
        if plan.compile and plan.fsdp and not whole:  # each block is its own graph between FSDP's hooks
            block.forward = compiled_unless_caching(block.forward)
    whole_graph = plan.compile and (not plan.fsdp or whole)  # no hooks in the way: token ids to hidden states
    graphs = whole_graph and plan.replays_graphs(num_params)
    if whole_graph:
        model.trunk = compiled_unless_caching(model.trunk, "reduce-overhead" if graphs else None)
    if env.device.type == "cuda":
        # One Triton kernel turns the logits into the loss and, in place, their gradient (fused_loss.py).
        from .fused_loss import linear_cross_entropy
        model.loss = linear_cross_entropy
    elif plan.compile:
        # Compiled, the fp32 upcast, log-softmax and its backward fuse into a few passes over the logits
        # instead of materializing fp32 logits (the largest tensor of a GPT-2 step).
        model.loss = torch.compile(model.loss)
    if plan.gathered_whole(num_params):  # built with its values, or (meta) filled by init_weights once sharded
        if not plan.meta_init:
            init_weights(model, seed, env.device)
        # no-shard's (replicas x 1) mesh is built here, for the small models that get the unit, not DDP
        mesh = plan.mesh if plan.mesh is not None else \
            init_device_mesh(env.device.type, plan.mesh_shape, mesh_dim_names=("replicate", "shard"))
        model.whole_unit = WholeUnit(model, mesh, torch.bfloat16 if plan.bf16 else torch.float32, env.device)
        if plan.meta_init:
            init_weights(model, seed, env.device)
        return model
    if plan.meta_init and not plan.fsdp:
        model.to_empty(device=env.device)
    if not plan.meta_init or not plan.fsdp:
        init_weights(model, seed, env.device)
    if not plan.fsdp:
        if plan.bf16:  # fp32 weights, bf16 matmuls: FSDP's mixed precision without FSDP
            model.forward = torch.autocast(env.device.type, dtype=torch.bfloat16)(model.forward)
        if plan.ddp:  # gradients (fp32, as FSDP reduces them) averaged over the ranks in backward
            # Buffers (rotary tables, masks) are computed alike on every rank: no broadcast before each forward.
            # Gradients as views of DDP's buckets: no copy back from the buckets after the all-reduce. Recipe S
            # (10.7M, graphs) on 4 H100s: 8.38 -> 6.46 ms a step (one GPU 6.28; benchmarks/LOG.md, 12th session).
            replicate(model, device_id=env.device, broadcast_buffers=False, gradient_as_bucket_view=True)
            if graphs:
                # One graph, not one per DDP bucket (Dynamo's DDPOptimizer cut recipe S's model into 3, each its
                # own replay and autograd node): host time is what a model this small waits on, and its all-reduce,
                # now after the backward instead of overlapping it, is brief. Recipe S, same call: 8.46 -> 6.80 ms
                # a step on 2 H100s, 9.29 -> 7.91 on 4 (one GPU 6.47; benchmarks/LOG.md, 13th session).
                torch._dynamo.config.optimize_ddp = False
        return model
    shard(model, plan, whole)
    if plan.meta_init:
        model.to_empty(device="cpu" if plan.cpu_offload else env.device)
        init_weights(model, seed, env.device)
    return model

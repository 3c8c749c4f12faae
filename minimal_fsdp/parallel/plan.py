"""The parallel plan: how a run lays its model out over the ranks, synchronizes its gradients,
compiles it and in which precision it computes, decided once (make_plan) from the flags, the launch
and the model's parameter count (counted from its config, before anything is built). Model building,
the gradient sync (parallelize.py), the optimizer (train.build_optimizer), the startup banner and
the memory planner (model_size.py, through strategy()) read the plan; none of them decides again.

plan.strategy is one of STRATEGIES:
  local       one rank: a plain module (bf16 by autocast, or compiled on CUDA by bf16 copies of its
              weights), nothing to shard or average
  ddp         no-shard over several ranks of a large model (or --fsdp_unit block, or float8 layers):
              a plain module whose gradients torch's DDP all-reduces (replicate(), which keeps the
              module and its state-dict keys)
  one-unit    a small model (the --fsdp_unit rule) over several ranks: whole_unit.py's one sharded
              unit, one all-gather into parameters that keep their addresses (so the compiled model
              can replay as CUDA graphs) and one reduce-scatter a step; under no-shard a (world x 1)
              mesh, so its one collective is an all-reduce
  fsdp-whole  FSDP2 with the whole model one unit: a small model with --cpu_offload or float8
              all-gathers, which need FSDP2's offload policy and torchao's FSDP2 extension
  fsdp-block  FSDP2, one unit per block (gathered, freed and overlapped with its neighbours'
              compute), then the root
  gossip      --data_parallel decentralized: a whole replica per rank, averaged with its neighbours'
              by gossip.py

plan.backend is one of BACKENDS: torch (CUDA or CPU through torch.distributed, backends/default.py)
or xla (--device xla's training under torch_xla, xla.py: FSDPv2 wraps each block, then the root,
over torch_xla's own mesh of every device: the strategy fsdp-block). run.train_model takes the run's
builders from it.
"""

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh

from minimal_fsdp.config.choices import GRAPHS_MODEL, SMALL_MODEL, ConfigError
from minimal_fsdp.models.size import count_parameters
from minimal_fsdp.parallel import fp8

# the pure choices, torch-free for the memory planner
from minimal_fsdp.parallel.choose import (
    BLOCKS_MIN_WIDTH,
    float8_blocks,
    layout,
    reduce_precision,
    strategy,
)

STRATEGIES = ("local", "ddp", "one-unit", "fsdp-whole", "fsdp-block", "gossip")
FSDP2 = ("fsdp-whole", "fsdp-block")  # the strategies where FSDP2's fully_shard wraps the model
# --compile: the whole trunk in one graph
WHOLE_GRAPH = ("local", "ddp", "one-unit", "fsdp-whole", "gossip")
# parameters keep their addresses: CUDA graphs can replay
REPLAYABLE = ("local", "ddp", "one-unit", "gossip")
BACKENDS = ("torch", "xla")


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """Every decision about the model's layout, sync, compilation and precision, made once
    (make_plan)."""

    strategy: str  # STRATEGIES
    # as asked (--sharding); what it means on this launch is the strategy and mesh_shape
    sharding: str
    mesh_shape: tuple  # (ranks,) or (replica groups, ranks per shard group)
    shard_ranks: int  # ranks one parameter is spread over (1: every rank holds it whole)
    # FSDP2 per block: gathered params are freed after forward, gathered again later
    reshard_after_forward: bool
    # the path the matmuls take: float32, bf16, or fp8 (training only; generation runs bf16)
    precision: str
    fp8: str  # --precision fp8: the float8 recipe (choices.FP8_RECIPES); None otherwise
    cpu_offload: bool
    meta_init: bool  # built on the meta device, each rank initializing only its shard
    activation_checkpoints: bool
    recompute: str
    compile: bool
    cuda_graphs: bool  # the compiled whole model replays as CUDA graphs
    num_params: int  # every parameter, embeddings included, counted once (tied weights too)
    topology: str = None  # gossip's (--topology)
    mesh: object = None  # the DeviceMesh (one-unit and FSDP2), built by make_plan
    backend: str = "torch"  # BACKENDS: what builds and steps the model in training
    # the dtype gradients are summed across ranks in (FSDP2, the one unit, DDP)
    reduce_precision: str = "float32"
    gossip_dtype: str = None  # gossip's wire (--gossip_dtype)
    global_average_every: int = 0  # gossip's all-replica average, every this many steps
    # AdamW's step compiled with the clip folded in (clipped_adamw.py): CUDA with --compile
    compiled_optimizer: bool = False
    # --precision fp8 converts the blocks' linear layers too, not just the head (--fp8_layers)
    fp8_blocks: bool = False

    @property
    def fused_optimizer(self):
        """AdamW's fused kernels are CUDA's and CPU's; torch_xla compiles the update into the step
        anyway."""
        return self.backend == "torch"

    @property
    def decentralized(self):
        return self.strategy == "gossip"

    @property
    def ddp(self):
        return self.strategy == "ddp"

    @property
    def fsdp(self):
        """FSDP2's fully_shard wraps the model."""
        return self.strategy in FSDP2

    @property
    def compiles_whole(self):
        """--compile compiles the whole trunk as one graph (FSDP2 per block: each block, between
        FSDP2's hooks)."""
        return self.compile and self.strategy in WHOLE_GRAPH

    @property
    def bf16(self):
        """Matmuls in bf16 (fp8: those that are not float8), parameters all-gathered in bf16."""
        return self.precision in ("bf16", "fp8")

    @property
    def bf16_weights(self):
        """One GPU computes with bf16 copies of its fp32 weights, which the compiled AdamW steps
        (bf16_weights.py); elsewhere one rank runs autocast."""
        return self.strategy == "local" and self.bf16 and self.compiled_optimizer

    @property
    def compute_dtype(self):
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def reduce_dtype(self):
        return torch.bfloat16 if self.reduce_precision == "bf16" else torch.float32

    @property
    def fp8_all_gather(self):
        """FSDP all-gathers the float8 layers' weights in float8 (fp8.gathers_in_float8 has the last
        word per layer)."""
        return (
            self.fp8 == "tensorwise"
            and self.fp8_blocks
            and self.fsdp
            and self.shard_ranks > 1
            and not self.cpu_offload
        )

    @property
    def fp8_head(self):
        """The output head's logits and both its gradients come from float8 matmuls (fused_loss.py):
        tensorwise only; rowwise keeps it in bf16 with everything else it does not convert."""
        return self.fp8 == "tensorwise"

    @property
    def stays_gathered(self):
        """FSDP2's params stay gathered from forward to backward anyway (the whole model as one
        unit, or no reshard after forward), so also across an accumulation's micro-steps."""
        return self.strategy == "fsdp-whole" or self.fsdp and not self.reshard_after_forward

    def describe(self):
        """The layout, in the words of the startup banner's first line."""
        graphs = ", replayed as CUDA graphs" if self.cuda_graphs else ""
        if self.strategy == "gossip":
            return (
                "no FSDP: a whole replica per rank, averaged with its neighbours' by gossip"
                + graphs
            )
        if self.strategy == "local":
            copies = ", computing with bf16 copies of its fp32 weights" if self.bf16_weights else ""
            return "no FSDP: one rank holds the whole model" + copies + graphs
        if self.strategy == "ddp":
            return (
                "no FSDP: the whole model on every rank, gradients all-reduced by DDP (no-shard)"
                + graphs
            )
        if self.strategy == "one-unit" and self.shard_ranks == 1 and self.sharding == "no-shard":
            return (
                "no sharding: the whole model on every rank as one unit, gradients averaged by one "
                "all-reduce a step (no-shard)" + graphs
            )
        dims = ("shard",) if len(self.mesh_shape) == 1 else ("replicate", "shard")
        units = {
            "one-unit": "the whole model as one unit, one all-gather a step",
            "fsdp-whole": "the whole model as one FSDP unit",
            "fsdp-block": "an FSDP unit per block",
        }
        return (
            "mesh "
            + " x ".join(f"{name}={size}" for name, size in zip(dims, self.mesh_shape))
            + f" ({self.sharding}), {units[self.strategy]}{graphs}"
        )


def cuda_graphs(parallel, device, strategy, num_params, float8):
    """Whether the compiled whole model replays as CUDA graphs: where --compile compiles it whole,
    on CUDA, and no FSDP2 hooks surround it (FSDP2 gathers the parameters at new addresses every
    step, which a replayed graph would not see). --cuda_graphs asks for it, and is refused where it
    cannot apply; unset, a model of at most GRAPHS_MODEL parameters replays (not gossip's replicas
    or float8 layers, which were not measured under graphs)."""
    if parallel.cuda_graphs:
        if device.type != "cuda":
            raise ConfigError(
                f"--cuda_graphs replays CUDA graphs; this run is on {device.type}: drop "
                f"--cuda_graphs"
            )
        if strategy not in REPLAYABLE:
            why = (
                "--cpu_offload"
                if parallel.cpu_offload
                else "--precision fp8's float8 all-gathers"
                if float8 and strategy == "fsdp-whole"
                else "--fsdp_unit block"
                if parallel.fsdp_unit == "block"
                else f"a model of over {SMALL_MODEL // 10**6}M parameters"
            )
            raise ConfigError(
                f"--cuda_graphs replays the compiled model where no FSDP2 hooks surround it; here "
                f"FSDP2 shards it ({why}, --sharding {parallel.sharding}) and gathers its "
                "parameters at new addresses every step: drop --cuda_graphs"
            )
    if (
        not parallel.compile
        or device.type != "cuda"
        or strategy not in REPLAYABLE
        or parallel.cuda_graphs is False
    ):
        return False
    if parallel.cuda_graphs:
        return True
    return strategy != "gossip" and not float8 and num_params <= GRAPHS_MODEL


def make_plan(parallel, env, model_config, loads_weights=False, fsdp_on_one_rank=False):
    """The plan for this launch and this model (model_config: its shape; only its parameter count
    matters here), from the flags of `parallel` (config.sections.Parallel). loads_weights: all
    weights will be loaded (a Hugging Face model, a model to sample from), so the model is built on
    the meta device and no rank ever holds more than its shard of it. fsdp_on_one_rank: shard even
    a world of one (tests and benchmarks compare the two). Generation alone (--max_epochs -1,
    sample, evaluate) with --precision fp8 runs in bf16: float8 pays in training's large matmuls.
    Raises ConfigError, alike on every rank, where an explicit flag cannot apply."""
    num_params = count_parameters(model_config).total
    recipe = (
        parallel.fp8_recipe if parallel.precision == "fp8" and not parallel.generate_only else None
    )
    blocks = bool(recipe) and float8_blocks(parallel.fp8_layers, model_config.embed_size)
    if recipe:
        fp8.check_device(env.device)
        if recipe != "tensorwise" and not blocks:  # the head is float8 in tensorwise only
            raise ConfigError(
                f"--precision fp8 --fp8_recipe {recipe} makes no layer of this model float8: "
                f"--fp8_layers {parallel.fp8_layers} leaves the blocks of a model "
                f"{model_config.embed_size} wide in bf16 (float8 blocks pay from "
                f"{BLOCKS_MIN_WIDTH} wide), and only tensorwise makes the head float8: use "
                "--fp8_layers all, --fp8_recipe tensorwise or --precision bf16"
            )
    # --device xla trains under torch_xla; generation (--max_epochs -1, the sample after training)
    # runs on the host.
    backend = "xla" if parallel.device == "xla" and not parallel.generate_only else "torch"
    chosen = (
        "fsdp-block"
        if backend == "xla"
        else strategy(
            parallel.sharding,
            env.world_size,
            num_params,
            parallel.fsdp_unit,
            parallel.cpu_offload,
            # fp8 keeps the FSDP2 strategies even with the head alone float8: the one unit was
            # never measured or tested with the float8 head
            recipe is not None,
            parallel.data_parallel == "decentralized",
            fsdp_on_one_rank,
        )
    )
    shape, shard_ranks, reshard = layout(
        parallel.sharding, env.world_size, parallel.shard_group_size or env.local_world_size
    )
    if chosen in ("local", "gossip"):
        shape, shard_ranks, reshard = (env.world_size,), 1, False
    plan = ParallelPlan(
        chosen,
        parallel.sharding,
        shape,
        shard_ranks,
        reshard,
        "bf16" if parallel.precision == "fp8" and not recipe else parallel.precision,
        recipe,
        parallel.cpu_offload,
        parallel.meta_init or loads_weights,
        parallel.activation_checkpoints,
        parallel.recompute,
        parallel.compile,
        cuda_graphs(parallel, env.device, chosen, num_params, recipe is not None),
        num_params,
        parallel.topology if chosen == "gossip" else None,
        backend=backend,
        reduce_precision=reduce_precision(
            parallel.reduce_precision, env.num_nodes, parallel.precision
        ),
        gossip_dtype=parallel.gossip_dtype if chosen == "gossip" else None,
        global_average_every=parallel.global_average_every if chosen == "gossip" else 0,
        # the one unit steps its shards' local tensors with LocalAdamW; offloaded state steps on
        # the CPU; gossip steps AccumAdamW
        compiled_optimizer=parallel.compile
        and env.device.type == "cuda"
        and backend == "torch"
        and chosen not in ("one-unit", "gossip")
        and not parallel.cpu_offload,
        fp8_blocks=blocks,
    )
    # torch_xla builds its own (xla.py)
    if backend == "torch" and (chosen in FSDP2 or chosen == "one-unit"):
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        plan = dataclasses.replace(
            plan, mesh=init_device_mesh(env.device.type, shape, mesh_dim_names=names)
        )
    return plan


def process_settings(plan):
    """The process-wide settings this plan needs (torch's own globals), applied once at the start of
    a run (apply_process_settings): {dotted name: value}.
    torch._dynamo.config.optimize_ddp off under DDP with CUDA graphs: one compiled graph, not one
    per DDP bucket (Dynamo's DDPOptimizer cuts the model at the buckets, each piece its own replay
    and autograd node). A model replayed as graphs waits on host time, and its all-reduce, after the
    backward instead of overlapping it, is brief.
    Inductor's mix-order reductions off for compiled float8 layers: that fusion puts a norm's
    backward (a row and a column reduction in one kernel) together with the float8 casts of the
    gradients around it, their transposed copies included, in one kernel of 512 programs; at Llama 3
    8B's shape those took 2.9 ms a block where the kernels apart take under 1 (benchmarks/results/
    LOG.md, 2026-11-30)."""
    settings = {}
    if plan.ddp and plan.cuda_graphs:
        settings["torch._dynamo.config.optimize_ddp"] = False
    if plan.fp8 and plan.compile and _has_mix_order_reduction():
        settings["torch._inductor.config.triton.mix_order_reduction"] = False
    return settings


def _has_mix_order_reduction():
    """Inductor's mix-order reduction (torch 2.10 and later), which fuses a norm's row and column
    reductions."""
    import torch._inductor.config

    return hasattr(torch._inductor.config.triton, "mix_order_reduction")


def apply_process_settings(plan):
    """Apply process_settings(plan): the plan's only changes to torch's process-wide
    configuration."""
    import torch._dynamo  # noqa: F401 (torch._dynamo.config)
    import torch._inductor.config  # noqa: F401

    for name, value in process_settings(plan).items():
        *path, attribute = name.split(".")[1:]
        owner = torch
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attribute, value)

"""The pure choices of a parallel plan, torch-free so the memory planner (`minimal-fsdp plan`)
answers without importing torch: the mesh layout of a sharding strategy, which strategy a launch
takes, the dtype gradients are reduced in, and which linear layers --precision fp8 converts.
parallel/plan.py and parallel/fp8.py use them (and re-export them under their old names)."""

from minimal_fsdp.config.choices import SMALL_MODEL

MIN_FEATURES = 256
# --fp8_layers auto converts the blocks' layers of a model at least this wide (its embed size), and
# always the output head (tensorwise, CUDA). Measured on one H200 (benchmarks/results/RESULTS.md,
# fp8-layers): GPT-2 124M (768 wide) and 355M (1024) are 5-6% slower than bf16 with their blocks in
# float8 and 1-3% faster with the head alone; Llama 3 8B's shape (4096) is 1.2-1.3x faster with the
# blocks. Between 1024 and 4096 nothing recent was measured (GPT-2 1.5B, 1600 wide, was 0.90-0.97x
# at the same batch on 4 GPUs on 2026-11-27, 1.04x only at a batch bf16 could not fit): auto keeps
# those in bf16, and --fp8_layers all is there where float8's memory saving is the point.
BLOCKS_MIN_WIDTH = 4096
# gpt.GPT multiplies slices of attn.qkv's weight with F.linear: a float8 layer there would never
# run its forward.
NOT_CALLED = ("attn.qkv",)


def converts(name, in_features, out_features):
    """Whether --precision fp8 turns the linear layer `name` (within a block) into a float8 one."""
    return (
        not name.endswith(NOT_CALLED)
        and in_features % 16 == 0
        and out_features % 16 == 0
        and min(in_features, out_features) >= MIN_FEATURES
    )


def float8_blocks(fp8_layers, width):
    """Whether --precision fp8 converts the blocks' layers (`converts` then says which) of a model
    `width` wide (its embed size), as --fp8_layers says; the output head is converted in any case
    (plan.fp8_head)."""
    return fp8_layers == "all" or fp8_layers == "auto" and width >= BLOCKS_MIN_WIDTH


def block_shapes(sizes, blocks=True):
    """(in, out) features of each linear layer of one block that --precision fp8 converts
    (models.size.Sizes); none where the blocks stay bf16 (float8_blocks)."""
    return tuple((i, o) for name, i, o in sizes.block_linears if blocks and converts(name, i, o))


def layout(sharding, world_size, shard_group_size):
    """(mesh shape, ranks a parameter is sharded over, reshard after forward) of a strategy. The
    last is pointless over a shard group of one rank; the last block never reshards anyway (its
    backward comes right after)."""
    if sharding in ("full-shard", "grad-shard"):
        shape = (world_size,)
    else:
        group = 1 if sharding == "no-shard" else shard_group_size
        shape = (world_size // group, group)
    return shape, shape[-1], sharding in ("full-shard", "hybrid-full-shard") and shape[-1] > 1


def small_model(fsdp_unit, num_params):
    """--fsdp_unit's rule: is the whole model gathered as one unit? auto: up to SMALL_MODEL
    parameters."""
    return fsdp_unit == "model" or fsdp_unit == "auto" and num_params <= SMALL_MODEL


def strategy(
    sharding,
    world_size,
    num_params,
    fsdp_unit="auto",
    cpu_offload=False,
    float8=False,
    decentralized=False,
    fsdp_on_one_rank=False,
):
    """The strategy (STRATEGIES) of a launch: pure, so the memory planner asks it without a launch.
    fsdp_on_one_rank: shard even a world of one (tests and benchmarks compare the two)."""
    if decentralized:
        return "gossip"
    replicas = (
        sharding == "no-shard" and world_size > 1 and not cpu_offload and not fsdp_on_one_rank
    )
    if not replicas and world_size == 1 and not cpu_offload and not fsdp_on_one_rank:
        return "local"  # nothing to shard: FSDP's per-step work would buy nothing
    small = small_model(fsdp_unit, num_params)
    # offloading and float8 all-gathers are FSDP2's features
    if small and not cpu_offload and not float8:
        return "one-unit"
    if replicas:  # one all-reduce a step, with a fraction of FSDP's host work
        return "ddp"
    return "fsdp-whole" if small else "fsdp-block"


def reduce_precision(asked, hosts, precision):
    """--reduce_precision's dtype on this launch. auto: bf16 across hosts where the matmuls run in
    bf16 (or fp8): the link, not the GPU, bounds such a step, and half the bytes cross it
    (benchmarks/results/RESULTS.md#side-by-side); within a host the fp32 sum costs nothing
    measurable. bf16 sums cost no
    measurable loss up to 8 ranks, so the rule does not depend on the rank count
    (benchmarks/results/RESULTS.md#loss-cpu)."""
    if asked != "auto":
        return asked
    return "bf16" if hosts > 1 and precision != "float32" else "float32"

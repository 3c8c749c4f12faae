"""How big is a model, and will it train here? Parameters, checkpoint size, and the per-GPU and
per-node host memory of every sharding strategy x activation checkpointing (none, full, selective) x
CPU offload; with --inter_node_gbps, each strategy's step time and tokens/s across hosts too
(step_time.py).

    minimal-fsdp plan --model_preset llama2-70b --gpus 16 --gpus_per_node 4 \\
        --gpu_memory 40GB --seq_length 4096 --batch_size 1
    # the run a training config describes
    minimal-fsdp plan --config configs/llama2_7b_4gpu.toml --gpus 4
    minimal-fsdp plan --model_preset gpt2 --vocab_size 50304 --batch_size 32 --precision bf16 \\
        --gpus 4 --gpus_per_node 2 --gpu_type H200 --inter_node_gbps 10

The estimate is analytic: every term below is a tensor that FSDP2, autograd or AdamW keeps alive at
the moment memory peaks, counted in bytes. It ignores what it cannot know (allocator fragmentation,
the CUDA context, NCCL buffers), which the fit check leaves room for.
"""

import re
from pathlib import Path

# Nothing imported here imports torch: the planner answers at once (tests/tools/test_model_size.py
# checks). count() is models/size.py's count from the shape, held equal to it by tests.
from minimal_fsdp.config.choices import SHARDING, ConfigError
from minimal_fsdp.config.sections import Model
from minimal_fsdp.models import counts
from minimal_fsdp.models.families import FAMILIES, config_from_flags
from minimal_fsdp.parallel import choose  # block_shapes: the layers fp8 converts
from minimal_fsdp.parallel.choose import layout, reduce_precision, strategy
from minimal_fsdp.tools.step_time import CARDS, print_step_times

GiB = 2**30
# A GPU "fits" when the estimate leaves this fraction free for the CUDA context, cuBLAS/NCCL
# workspaces and allocator fragmentation (none of which torch.cuda.max_memory_allocated counts).
GPU_HEADROOM = 0.15
# Host memory of one training process besides offloaded state: Python, torch and CUDA libraries,
# data.
HOST_PER_PROCESS = 3 * GiB


def activations_per_token(model_type, config, device_type="cuda"):
    """Elements that autograd saves for backward per token in one block (what checkpointing
    recomputes): the family's count (models/families)."""
    return FAMILIES[model_type].activations_per_token(config, device_type)


def float8_inputs_per_token(model_type, config):
    """Elements per token of the distinct inputs of one block's float8 layers (fp8.convertible), all
    among what activations_per_token counts. Compiled, a tensorwise float8 layer's backward reads
    its input only as the float8 cast (one scale serves both matmuls), so the partitioner saves that
    cast, 1 byte an element, not the bf16 input (torchao saves the bf16 input; eager keeps it).
    Measured on one H200, 8 of Llama 3 8B's blocks at T=8192 without recompute: one sequence more
    cost 10.4 GB compiled in fp8, 13.4 GB in bf16."""
    return FAMILIES[model_type].float8_inputs_per_token(config)


def kept_per_token(model_type, config):
    """Elements per token that --recompute selective keeps in one block: its input, and the outputs
    of every matmul and of attention (eager count; compiled blocks drop the few that backward never
    reads)."""
    return FAMILIES[model_type].kept_per_token(config)


def estimate(
    model_type,
    config,
    batch_size,
    sharding,
    world_size,
    shard_group_size,
    recompute,
    cpu_offload,
    precision,
    device_type="cuda",
    compile=False,
    grad_accum_steps=1,
    fp8_recipe="tensorwise",
    fp8_layers="auto",
    fsdp_unit="auto",
    checkpoint_mode="sync",
    reduce_precision="float32",
):
    """Peak bytes on one GPU and in one rank's host memory for one training step of grad_accum_steps
    micro-batches. recompute: "none" (no activation checkpointing), "full" or "selective"
    (--recompute). precision fp8 computes as bf16 does, with fp8_recipe's float8 layers where
    fp8_layers (--fp8_layers) puts them (see the fp8 terms below). fsdp_unit: as --fsdp_unit
    (plan.strategy): the whole model as one unit is gathered whole, and all its unsharded gradients
    wait for one reduce-scatter at the end of backward.
    reduce_precision: as --reduce_precision, the dtype of the copies gradients are reduced (and
    FSDP2 accumulates them) in."""
    sizes = counts.count(config)
    float8_layers = choose.block_shapes(
        sizes, precision == "fp8" and choose.float8_blocks(fp8_layers, config.embed_size)
    )
    _, shards, reshard = layout(sharding, world_size, shard_group_size)
    # make_plan's
    chosen = strategy(sharding, world_size, sizes.total, fsdp_unit, cpu_offload, precision == "fp8")
    # gathered whole; all its unsharded gradients wait for one reduce
    whole = chosen in ("one-unit", "fsdp-whole")
    keep_gathered = not reshard or whole
    # bytes of a gathered param, an activation, an unsharded grad
    compute = 4 if precision == "float32" else 2
    tokens = batch_size * config.seq_length
    L = config.num_layers

    # Sharded state, fp32 whatever the compute precision: master params (4), AdamW's two moments
    # (8), and the gradients (4) that exist from backward to the optimizer step. CPU offload keeps
    # all of it on the host.
    params_and_optimizer = 12 * sizes.total / shards
    grads = 4 * sizes.total / shards
    on_gpu = 0 if cpu_offload else 1

    # Gathered (unsharded) params in the compute dtype: the root unit (and an untied head, a unit of
    # its own) is never resharded; blocks are gathered one at a time plus one prefetched, or all of
    # them from forward to backward without resharding. An untied embedding, also a unit of its own,
    # reshards under full-shard like a block; counted here as gathered: a little over.
    gathered = compute * (sizes.root + (L if keep_gathered else 2) * sizes.per_block)
    float8_working = 0
    if precision == "fp8":
        # fp8.py: tensorwise over several ranks gathers a float8 layer's weight in 1 byte instead of
        # 2 (where its rows split evenly over the ranks). While a float8 layer runs, float8 copies
        # of its input, its output's gradient and (gathered in bf16) its weight exist; rowwise makes
        # two of each, scaled along either dimension, with an fp32 scale per row. Its saved
        # activations are bf16's; tensorwise scales are scalars.
        in_float8 = [
            (i, o)
            for i, o in float8_layers
            if fp8_recipe == "tensorwise" and shards > 1 and not cpu_offload and o % shards == 0
        ]
        gathered -= (L if keep_gathered else 2) * sum(i * o for i, o in in_float8)
        copies = 2 if fp8_recipe == "rowwise" else 1
        float8_working = (
            max(
                copies * (tokens * (i + o) + (0 if (i, o) in in_float8 else i * o))
                + (16 * tokens if fp8_recipe == "rowwise" else 0)
                for i, o in float8_layers
            )
            if float8_layers
            else 0
        )
    # Unsharded grads before their reduce-scatter: ~2 blocks' in flight, each with a copy to reduce
    # in where the reduce dtype is not the compute dtype; the root's wait in the compute dtype for
    # the end of backward, when it is reduced last (an untied head's reduce at its start: a little
    # over).
    reduce = 2 if reduce_precision == "bf16" else 4
    unsharded_grads = (
        compute * sizes.root
        + (compute + (reduce if reduce != compute else 0)) * (L if whole else 2) * sizes.per_block
    )

    layer = tokens * activations_per_token(model_type, config, device_type) * compute
    if precision == "fp8" and fp8_recipe == "tensorwise" and compile and float8_layers:
        layer -= tokens * float8_inputs_per_token(model_type, config)  # saved in 1 byte, not 2
    kept = {
        "none": layer,
        "full": tokens * config.embed_size * compute,
        "selective": tokens * kept_per_token(model_type, config) * compute,
    }[recompute]
    saved = L * kept
    final_norm = tokens * FAMILIES[model_type].final_norm_per_token(config, device_type) * compute
    # The loss. Fused on CUDA (fused_loss.py) or compiled with its output matmul (--compile): one
    # logits tensor in the compute dtype, then their gradient in its place. Eager in fp32: the saved
    # log-softmax, its gradient and the logits' gradient coexist at the start of backward (4 bytes
    # each per logit).
    per_logit = compute if device_type == "cuda" or compile else 12
    logits = per_logit * tokens * config.vocab_size
    if precision == "fp8" and fp8_recipe == "tensorwise" and device_type == "cuda":
        # the fused loss's float8 head: its backward also holds the logits' gradient in float8, in
        # both layouts, and the weight's float8 transpose (1 byte each)
        logits += (2 * tokens + config.embed_size) * config.vocab_size

    # Between the micro-steps of an accumulation FSDP2 keeps every parameter's unsharded gradient,
    # in the reduce dtype whatever the compute precision, and on the GPU even with CPU offload.
    accumulated = reduce * sizes.total if grad_accum_steps > 1 else 0
    # An fp32 copy of the gradients kept for the whole run: DDP's all-reduce buckets (no-shard over
    # several ranks), or the sharded gradients whole_unit.py reduces into (a small model's one
    # unit). Counted apart from the optimizer step's, so a little over (the step's are views of it).
    buckets = grads if chosen in ("ddp", "one-unit") else 0
    static = on_gpu * params_and_optimizer + gathered + accumulated + buckets
    loss_backward = static + saved + final_norm + logits + unsharded_grads + float8_working
    # With checkpointing, a block's activations are rebuilt during backward; the first block's last,
    # when the other blocks' sharded gradients have landed (the root's land after it).
    block_grads = grads * (L - 1) * sizes.per_block / sizes.total
    rebuilt = (
        static + saved + layer + unsharded_grads + on_gpu * block_grads + float8_working
        if recompute != "none"
        else 0
    )
    optimizer_step = on_gpu * (params_and_optimizer + grads) + buckets
    gpu = max(loss_backward, rebuilt, optimizer_step)
    # --checkpoint_mode async (auto on GPUs) keeps a host copy of the rank's fp32 weights and AdamW
    # moments to save from while training goes on (background.staging_bytes).
    staging = (
        params_and_optimizer
        if checkpoint_mode == "async" or checkpoint_mode == "auto" and device_type == "cuda"
        else 0
    )
    host = HOST_PER_PROCESS + (params_and_optimizer + grads) * (1 - on_gpu) + staging
    return {
        "gpu": gpu,
        "host": host,
        "state": on_gpu * (params_and_optimizer + grads),
        "activations": saved + final_norm + logits,
        "gathered": gathered,
        "staging": staging,
    }


def parse_memory(text, flag):
    """'40GB', '80GiB', '512G', '141' -> bytes. Binary units either way: a "40GB" GPU holds 40 GiB.
    A bare number is GB: `--gpu_memory 141` meant 141 bytes before, and every layout "did not
    fit"."""
    match = re.fullmatch(r"\s*(\d*\.?\d+)\s*(?:([KMGT])i?B?|(B))?\s*", text, re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise ConfigError(f"--{flag} {text!r} is not a size like 40GB or 80GiB")
    unit = match[2] or match[3] or "G"
    return float(match[1]) * 1024 ** "BKMGT".index(unit.upper())


def model_config(args):
    """(model type, config, name) from --hf_model's config.json or from --model / --model_preset."""
    if args.hf_model:
        # hf.read imports torch (it also reads weights); only --hf_model pays for it
        from minimal_fsdp.hf import read

        if not (Path(args.hf_model) / "config.json").exists():
            raise ConfigError(
                f"--hf_model {args.hf_model} has no config.json (the planner reads local "
                f"directories)"
            )
        model_type, config = read.read_config(args.hf_model, args.seq_length)
        return model_type, config, args.hf_model
    # as training makes it, from the model section: a shape flag added there (PlanFlags takes the
    # section whole) is planned with no edit here
    config = config_from_flags(Model.of(args))
    return config.model_type, config, args.model_preset


def print_plan(args):
    """`minimal-fsdp plan`'s tables on stdout, for its flags (PlanFlags)."""
    gpus_per_node = args.gpus_per_node or min(args.gpus, 8)
    group = args.shard_group_size or gpus_per_node
    for name in (
        "gpus",
        "batch_size",
        "grad_accum_steps",
        "seq_length",
        "vocab_size",
        "gpus_per_node",
        "shard_group_size",
        "inter_node_gbps",
        "log_interval",
    ):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name} must be positive")
    if args.gpus % gpus_per_node or args.gpus % group:
        raise ConfigError(
            f"--gpus {args.gpus} must be divisible by --gpus_per_node and --shard_group_size "
            f"(got {gpus_per_node} and {group})"
        )
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu} must be a fraction of the peak, in (0, 1]")
    if args.inter_node_gbps and args.precision == "float32" and args.mfu is None:
        raise ConfigError(
            "--inter_node_gbps: the step time comes from a bf16 throughput measured on one GPU; "
            "add --precision bf16, or --mfu (the float32 run's fraction of the bf16 peak)"
        )
    gpu_memory = parse_memory(args.gpu_memory or CARDS[args.gpu_type].memory, "gpu_memory")
    host_memory = parse_memory(args.host_memory, "host_memory") if args.host_memory else None
    family, config, name = model_config(args)
    sizes = counts.count(config)

    print(
        f"{family} {name}: {sizes.total:,} parameters ({sizes.total / 1e9:.2f} B); "
        f"{config.num_layers} blocks of {sizes.per_block:,}, {sizes.root:,} outside them"
    )
    print(
        f"checkpoint: {12 * sizes.total / GiB:.1f} GiB with optimizer state (fp32 params + AdamW "
        f"moments), {4 * sizes.total / GiB:.1f} GiB model only in fp32, "
        f"{2 * sizes.total / GiB:.1f} GiB in bf16"
    )
    accumulation = f" x {args.grad_accum_steps} micro-steps" if args.grad_accum_steps > 1 else ""
    fp8 = f" ({args.fp8_recipe}, --fp8_layers {args.fp8_layers})" if args.precision == "fp8" else ""
    print(
        f"{args.gpus} GPU(s) of {gpu_memory / GiB:.0f} GiB"
        f"{'' if args.gpu_memory else f' ({args.gpu_type})'}, {gpus_per_node} per node; batch "
        f"{args.batch_size} x {config.seq_length} tokens per GPU{accumulation}; {args.precision}"
        f"{fp8}; fits = estimate within "
        f"{1 - GPU_HEADROOM:.0%} of the GPU"
        + (f" and of {host_memory / GiB:.0f} GiB host" if host_memory else "")
    )
    header = (
        f"{'sharding':<19}{'recompute':<11}{'offload':<9}{'state':>9}{'activ.':>9}{'GPU GiB':>9}"
        f"{'host GiB/node':>15}  fits"
    )
    print(header + "\n" + "-" * len(header))
    for sharding in SHARDING:
        for recompute in ("none", "full", "selective"):
            for offload in (False, True):
                e = estimate(
                    family,
                    config,
                    args.batch_size,
                    sharding,
                    args.gpus,
                    group,
                    recompute,
                    offload,
                    args.precision,
                    grad_accum_steps=args.grad_accum_steps,
                    fp8_recipe=args.fp8_recipe,
                    fp8_layers=args.fp8_layers,
                    fsdp_unit=args.fsdp_unit,
                    checkpoint_mode=args.checkpoint_mode,
                    reduce_precision=reduce_precision(
                        args.reduce_precision, max(1, args.gpus // gpus_per_node), args.precision
                    ),
                )
                host = e["host"] * gpus_per_node
                fits = e["gpu"] <= (1 - GPU_HEADROOM) * gpu_memory and (
                    host_memory is None or host <= host_memory
                )
                print(
                    f"{sharding:<19}{recompute:<11}{'yes' if offload else 'no':<9}"
                    f"{e['state'] / GiB:>9.1f}{e['activations'] / GiB:>9.1f}{e['gpu'] / GiB:>9.1f}"
                    f"{host / GiB:>15.1f}  {'yes' if fits else 'no'}"
                )
    print(
        f"state: sharded fp32 params, grads and AdamW moments on the GPU; activ.: saved "
        f"activations and the loss's logit tensors; GPU: estimated peak; host: per node, "
        f"{HOST_PER_PROCESS / GiB:.0f} GiB per process included"
        + (
            ", and the copy of each rank's weights and AdamW moments that asynchronous checkpoint "
            "saves keep"
            if args.checkpoint_mode != "sync"
            else ""
        )
    )
    if args.inter_node_gbps:
        print_step_times(args, config, sizes, gpus_per_node, group, (*SHARDING, "decentralized"))

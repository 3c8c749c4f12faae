"""How long a training step takes across hosts, per strategy: the planner's estimate (`python -m
minimal_fsdp.tools.model_size --inter_node_gbps G`) from the model's FLOPs, one GPU's measured
throughput and the bytes each strategy sends over each host's link per step.

The model, in three parts (docs/performance.md sets it beside the measured steps):
- compute: tokens per GPU x FLOPs per token (6N + 12·L·C·T, what the training log's MFU counts) /
  (the card's bf16 peak x an MFU measured on one GPU, CARDS);
- the link: each host has one full-duplex link of --inter_node_gbps to a switch that does not block;
  NCCL over TCP carries the payload of its frames (PAYLOAD). Inside a host NVLink is taken as free:
  gathering GPT-2 124M over NVLink takes about a millisecond, sending it over a 10 Gbit/s link a
  hundred times that;
- overlap: the one unit (whole_unit.py) and FSDP2's whole-model unit gather before forward and
  reduce after backward, so their communication adds to compute; FSDP2's per-block units, DDP's
  buckets and gossip's exchange run beside compute, so the longer of the two counts.
Ranks are placed host by host (rank r on host r // gpus_per_host), as the launchers place them.
CPU ranks talk through gloo, which differs in all three (backend="gloo": GLOO_* below).
"""

import dataclasses
import functools
import statistics

# torch-free, as the planner must be
from minimal_fsdp.config.choices import PEAK_FLOPS, ConfigError
from minimal_fsdp.models import counts
from minimal_fsdp.parallel.choose import layout, reduce_precision, strategy
from minimal_fsdp.parallel.topology import exchange_for, exp_distances

# Of the bytes a shaped link passes, the TCP payload: 1448 of each 1500-byte frame (IP and TCP
# headers with timestamps). One TCP stream measured 9.71 Gbit/s through a 10 Gbit/s tbf and 0.96
# through 1 (96-97%).
PAYLOAD = 1448 / 1500
# Gloo over TCP between CPU ranks, where it is not NCCL (RESULTS.md#cpu16-hosts,
# benchmarks/results/side_by_side_cpu16.jsonl: 4 and 8 hosts of one rank, 100 Mbit/s and 1 Gbit/s,
# a 1.64M-parameter GPT in fp32 whose compute rows are 96.8 and 73.3 ms):
# - its reduce-scatter moves an all-reduce's bytes: between 4 virtual hosts at 100 Mbit/s (a 2-core
#   machine at load 4-5, 2026-11-29), 6.5 MB of fp32 took 841 ms to reduce-scatter, 853 to
#   all-reduce and 451 to all-gather (a ring's reduce-scatter: 407). Our full-shard's one unit
#   measured 1607.0 ms at 8 hosts, 100 Mbit/s: 96.8 + a ring's gather 475 + an all-reduce's 950
#   (1046 with a ring's reduce-scatter).
GLOO_REDUCE_SCATTER_PASSES = 2
# - all-reduces and gathers add to the compute: DDP at 8 hosts, 100 Mbit/s measured 1081.6 ms
#   (fp32) and 575.4 (bf16 hook) against 96.8 + 949 and 96.8 + 475. In that GPT the tied
#   embedding, 98% of the bytes, has its gradient only when backward ends, so these rows do not
#   tell gloo from the shape. Gossip's exchange still runs beside the compute (ours at 8 hosts,
#   100 Mbit/s: 311.5 ms, less than 96.8 + 271).
# - a fixed cost a step beyond the compute and the bytes: the median over those 32 rows of the
#   measured step less the two (63.5 ms; from 4 ms, DDP's bf16 hook at 8 hosts, 100 Mbit/s, to
#   205 ms, FSDP2 at 4 hosts, 100 Mbit/s). Part of it is the wait for the slowest rank: the compute
#   rows are one rank's own median, and on an idle 16-core CPU (the H200 machine's) 8 ranks of
#   that GPT stepping with one scalar all-reduce each took 135-137 ms against rank 0's own 111-118
#   (DDP over loopback: 151.6). A shaped link alone adds none: a 6.5 MB all-reduce between 4
#   virtual hosts at 1 Gbit/s took 87 ms after 100 ms idle as without (81 by the bytes; the 2-core
#   machine above).
GLOO_STEP_S = 0.0635
# the gradients' sums across ranks, in --reduce_precision's dtype
GRAD_BYTES = {"float32": 4, "bf16": 2}
# gossip's wire (--gossip_dtype); "flat-fp32" below: before hosts
GOSSIP_BYTES = {"bf16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Card:
    peak: float  # dense bf16 FLOP/s
    memory: str  # one card's memory, --gpu_memory's default (nvidia-smi's total)
    mfu_compiled: float = None  # achieved on one GPU: GPT-2 124M, batch 32, bf16, --compile
    mfu_eager: float = None  # the same without --compile


# The planner's calibration, measured on one GPU: GPT-2 124M at batch 32, 855.4 MFLOPs a token:
# H100 compiled 489,882 tok/s (42.4%), eager 347,827 tok/s (30.1%, measured before the fused loss);
# H200 compiled 503-507K tok/s (43.7%); H200 eager was not measured at batch 32: the H100's (the
# same peak). A larger model uses the GPU better (Llama-2-7B: 52%): give its MFU with --mfu. No
# A100 was measured: its step time needs --mfu. Memory: nvidia-smi's totals (MiB).
CARDS = {
    "A100-40GB": Card(PEAK_FLOPS["A100"], "40960MiB"),
    "A100-80GB": Card(PEAK_FLOPS["A100"], "81920MiB"),
    "H100": Card(PEAK_FLOPS["H100"], "81559MiB", 0.424, 0.301),
    "H200": Card(PEAK_FLOPS["H200"], "143771MiB", 0.437, 0.301),
}


def ring_share(ranks, per_host):
    """Of a ring all-gather's (or reduce-scatter's) whole tensor, the part that crosses each host's
    link each way: a ring over hosts placed in turn leaves every host once, and each of its edges
    carries (n-1)/n of the tensor."""
    return (ranks - 1) / ranks if ranks > per_host else 0.0


def all_reduce_share(hosts):
    """An all-reduce's bytes over each host's link each way, per byte reduced: 2(H-1)/H, a ring over
    the hosts after a reduction inside each (what hybrid sharding does itself, and NCCL's tree does
    between two hosts)."""
    return 2 * (hosts - 1) / hosts


def gossip_messages(topology, hosts, per_host, step, host_aware=True):
    """The most replicas any host sends or receives over its link at one gossip step
    (gossip.exchange_for's). Host-aware gossip (several ranks a host) sends each peer host one
    replica, split over the local ranks."""
    if host_aware and hosts > 1 and per_host > 1:
        return len(exchange_for(topology, 0, hosts, step).send_to)
    world = hosts * per_host
    out, into = [0] * hosts, [0] * hosts
    for rank in range(world):
        for peer in exchange_for(topology, rank, world, step).send_to:
            if peer // per_host != rank // per_host:
                out[rank // per_host] += 1
                into[peer // per_host] += 1
    return max(out + into)


def gossip_period(topology, world):
    """Steps after which a topology's exchanges repeat."""
    period = len(exp_distances(world)) or 1
    return {"exp": period, "alternating-exp-ring": 2 * period}.get(topology, 1)


def link_bytes(
    chosen,
    sharding,
    params,
    world,
    per_host,
    shard_group,
    compute_bytes,
    micro_steps=1,
    topology="alternating-exp-ring",
    log_interval=10,
    grad_bytes=4,
    gossip="bf16",
    reduce_scatter_passes=1,
):
    """(bytes a step waits for, bytes that run beside compute) over each host's link each way, under
    the strategy `chosen` (plan.strategy's). Gossip's second is the mean over a period of its
    topology's exchanges, in the wire's dtype (`gossip`: bf16, float32, or flat-fp32, the gossip
    before it knew hosts, whose first was the consensus distance of each logging step, an all-reduce
    of the replica spread over log_interval steps). reduce_scatter_passes: a ring's bytes (1) or an
    all-reduce's (2, gloo's)."""
    hosts = world // per_host
    if hosts == 1 or chosen == "local":
        return 0.0, 0.0
    if chosen == "gossip":
        flat = gossip == "flat-fp32"
        replica = (4 if flat else GOSSIP_BYTES[gossip]) * params
        consensus = all_reduce_share(hosts) * 4 * params / log_interval if flat else 0.0
        if topology == "complete":  # summed in fp32 whatever the wire (gossip.py)
            return consensus, all_reduce_share(hosts) * 4 * params
        period = gossip_period(topology, hosts if not flat and per_host > 1 else world)
        return consensus, replica * statistics.mean(
            gossip_messages(topology, hosts, per_host, t, not flat) for t in range(period)
        )
    _, shards, reshard = layout(sharding, world, shard_group)
    # Gathers a step: FSDP2's blocks twice a micro-step when resharded after forward; otherwise the
    # parameters stay gathered from the first forward to the last backward of the step.
    gathers = 2 * micro_steps if chosen == "fsdp-block" and reshard else 1
    total = gathers * ring_share(shards, per_host) * compute_bytes * params
    # reduce-scatter, after the last micro-step
    total += reduce_scatter_passes * ring_share(shards, per_host) * grad_bytes * params
    replicas = world // shards
    # each host holds min(shards, per_host) distinct shards; their replicas span world / max hosts
    if replicas > 1:
        total += (
            all_reduce_share(world // max(shards, per_host))
            * grad_bytes
            * params
            * min(shards, per_host)
            / shards
        )
    return (total, 0.0) if chosen in ("one-unit", "fsdp-whole") else (0.0, total)


def step_seconds(chosen, compute, waited, beside, rate, backend="nccl", world=1):
    """A step from its compute and its link bytes (link_bytes's pair, at `rate` bytes/s). NCCL:
    DDP's buckets all-reduce during backward, about two thirds of the compute, the other layouts
    that overlap run beside all of it. Gloo on CPU ranks: only gossip's exchange overlaps, and each
    step costs GLOO_STEP_S more."""
    if backend == "gloo":
        exchange = beside / rate if chosen == "gossip" else 0.0
        fixed = GLOO_STEP_S if world > 1 else 0.0
        return max(compute, exchange) + (waited + beside) / rate - exchange + fixed
    if chosen == "ddp":
        return compute / 3 + max(2 * compute / 3, beside / rate) + waited / rate
    return max(compute, beside / rate) + waited / rate


@dataclasses.dataclass
class StepTime:
    strategy: str  # plan.strategy's choice
    compute: float  # seconds
    link: float  # seconds on the link, waited for or not
    step: float
    tokens_per_s: float
    bytes_per_step: float  # over each host's link, each way


def estimate_step(
    sharding,
    params,
    flops_per_token,
    tokens_per_gpu,
    world,
    per_host,
    shard_group,
    gbps,
    flops,
    precision="bf16",
    micro_steps=1,
    fsdp_unit="auto",
    topology="alternating-exp-ring",
    log_interval=10,
    reduce_precision="float32",
    gossip="bf16",
    backend="nccl",
):
    """The step time of `sharding` (or "decentralized", gossip) for tokens_per_gpu tokens a step on
    each of world GPUs of per_host a host, each computing at `flops` FLOP/s, the hosts joined by
    links of `gbps` Gbit/s; backend "gloo": CPU ranks (GLOO_*)."""
    decentralized = sharding == "decentralized"
    chosen = strategy(
        "no-shard" if decentralized else sharding,
        world,
        params,
        fsdp_unit,
        float8=precision == "fp8",
        decentralized=decentralized,
    )
    waited, beside = link_bytes(
        chosen,
        sharding,
        params,
        world,
        per_host,
        shard_group,
        4 if precision == "float32" else 2,
        micro_steps,
        topology,
        log_interval,
        GRAD_BYTES[reduce_precision],
        gossip,
        GLOO_REDUCE_SCATTER_PASSES if backend == "gloo" else 1,
    )
    rate = gbps * 1e9 / 8 * PAYLOAD  # bytes/s
    compute = tokens_per_gpu * flops_per_token / flops
    step = step_seconds(chosen, compute, waited, beside, rate, backend, world)
    return StepTime(
        chosen,
        compute,
        (waited + beside) / rate,
        step,
        world * tokens_per_gpu / step,
        waited + beside,
    )


# The plain-PyTorch layouts the guide sets beside ours, as benchmarks/decentdp_side_by_side.py runs
# them: torch DDP (fp32 buckets, or bf16_compress_hook's bf16), DDP with PowerSGD (rank 4), FSDP2
# per block with bf16 sums, Decent-DP (fp32 replicas to its topology's peers, over the ranks).
REFERENCES = (
    "torch DDP",
    "torch DDP, bf16_compress_hook",
    "torch DDP, PowerSGD rank 4",
    "torch FSDP2, reduce bf16",
    "Decent-DP",
)
POWERSGD_RANK = 4
POWERSGD_MIN_COMPRESSION = 2  # PowerSGDState's min_compression_rate default


def powersgd_elements(shapes, rank=POWERSGD_RANK):
    """Elements PowerSGD all-reduces a step: P (rows x rank) and Q (cols x rank) for each gradient
    it compresses (viewed as shape[0] x the rest, compressed where that saves min_compression_rate
    times), the others whole (powerSGD_hook's _should_compress)."""
    total = 0
    for shape in shapes:
        rows = shape[0]
        cols = 1
        for n in shape[1:]:
            cols *= n
        compressed = (rows + cols) * rank
        if len(shape) > 1 and compressed * POWERSGD_MIN_COMPRESSION < rows * cols:
            total += compressed
        else:
            total += rows * cols
    return total


def reference_bytes(
    name, params, world, per_host, compute_bytes, shapes, topology, root_params=0,
    reduce_scatter_passes=1,
):  # fmt: skip
    """(strategy as the step overlaps it, bytes over each host's link each way a step) of a
    plain-PyTorch layout (REFERENCES). root_params: the parameters outside the blocks (FSDP2's root
    unit); reduce_scatter_passes as link_bytes's."""
    hosts = world // per_host
    if hosts == 1:
        return ("ddp" if name.startswith("torch DDP") else "fsdp-block"), 0.0
    if name == "Decent-DP":  # one fp32 replica a peer, over the ranks (it knows no hosts)
        period = gossip_period(topology, world)
        messages = statistics.mean(
            gossip_messages(topology, hosts, per_host, t, host_aware=False) for t in range(period)
        )
        return "gossip", 4 * params * messages
    if name == "torch FSDP2, reduce bf16":
        # each block's unit gathered for forward and again for backward, the root's once (FSDP2
        # keeps the root gathered after forward: fully_shard's reshard_after_forward); bf16 sums
        share = ring_share(world, per_host)
        gathered = compute_bytes * (2 * params - root_params)
        return "fsdp-block", share * (gathered + reduce_scatter_passes * 2 * params)
    elements = powersgd_elements(shapes) if "PowerSGD" in name else params
    wire = 2 if "bf16" in name else 4
    return "ddp", all_reduce_share(hosts) * wire * elements


def estimate_reference(
    name, params, shapes, flops_per_token, tokens_per_gpu, world, per_host, gbps, flops,
    precision="bf16", topology="alternating-exp-ring", backend="nccl", root_params=0,
):  # fmt: skip
    """A plain-PyTorch layout's StepTime, on the model of estimate_step (step_seconds): under NCCL
    DDP's buckets beside two thirds of the compute (the backward), FSDP2's blocks and Decent-DP's
    exchange beside all of it."""
    gloo = backend == "gloo"
    chosen, beside = reference_bytes(
        name, params, world, per_host, 4 if precision == "float32" else 2, shapes, topology,
        root_params, GLOO_REDUCE_SCATTER_PASSES if gloo else 1,
    )  # fmt: skip
    rate = gbps * 1e9 / 8 * PAYLOAD
    compute = tokens_per_gpu * flops_per_token / flops
    step = step_seconds(chosen, compute, 0.0, beside, rate, backend, world)
    return StepTime(chosen, compute, beside / rate, step, world * tokens_per_gpu / step, beside)


def guide(
    params, shapes, flops_per_token, tokens_per_gpu, world, per_host, gbps, flops,
    precision="bf16", topology="alternating-exp-ring", reduce="auto", backend="nccl",
    root_params=0, **options,
):  # fmt: skip
    """Every layout's estimate, ours (--sharding's and decentralized, sums as `reduce` resolves on
    these hosts) and the plain-PyTorch ones, fastest first: [(name, StepTime)]. root_params: the
    parameters outside the blocks (counts.Sizes.root)."""
    hosts = world // per_host
    rows = []
    for sharding in ("full-shard", "hybrid-full-shard", "no-shard", "decentralized"):
        rows.append(
            (
                f"ours, {sharding}",
                estimate_step(
                    sharding, params, flops_per_token, tokens_per_gpu, world, per_host, per_host,
                    gbps, flops, precision, topology=topology,
                    reduce_precision=reduce_precision(reduce, hosts, precision),
                    backend=backend, **options,
                ),
            )
        )  # fmt: skip
    for name in REFERENCES:
        rows.append(
            (
                name,
                estimate_reference(
                    name, params, shapes, flops_per_token, tokens_per_gpu, world, per_host, gbps,
                    flops, precision, topology, backend, root_params,
                ),
            )
        )  # fmt: skip
    return sorted(rows, key=lambda row: row[1].step)


# What the loss runs measured of the layouts that change the training's arithmetic: the guide names
# the fastest layout that does not, and the faster ones that do, with this. Steps to the same loss
# (benchmarks/results/RESULTS.md): gossip on 8 CPU ranks, 2,000 steps against all-reduce's 936
# (#cpu16-hosts), level on 2 ranks; PowerSGD on 2 GPUs, 550 against 293 (#powersgd-equal-loss).
LOSS_CAVEATS = {
    "ours, decentralized": "replicas gossip: up to 2.1x the steps to all-reduce's loss at 8 ranks",
    "Decent-DP": "replicas gossip: a higher loss at equal steps, as ours",
    "torch DDP, PowerSGD rank 4": "low rank: 1.9x the steps to all-reduce's loss at 2 ranks",
}


def pick(rows):
    """The guide's one line: the fastest layout that trains as all-reduce does, and any faster one
    that changes the arithmetic (with its cost)."""
    exact = next(name for name, _ in rows if name not in LOSS_CAVEATS)
    best = dict(rows)[exact]
    faster = [
        f"{name} {best.step / t.step:.2f}x ({LOSS_CAVEATS[name]})"
        for name, t in rows
        if name in LOSS_CAVEATS and t.step < best.step
    ]
    return f"pick: {exact} ({1000 * best.step:.1f} ms a step)" + (
        "; faster at equal steps: " + ", ".join(faster) if faster else ""
    )


HOST_COUNTS = (2, 4, 8, 16, 32, 64)
RATES_GBPS = (400, 200, 100, 50, 25, 10, 5, 2, 1, 0.5, 0.2, 0.1)


def gossip_gain(params, per_token, tokens_per_gpu, hosts, per_host, gbps, flops, **options):
    """Decentralized's tokens/s over the fastest all-reduce strategy's, on `hosts` hosts at
    `gbps`."""
    world = hosts * per_host
    step = functools.partial(
        estimate_step,
        params=params,
        flops_per_token=per_token,
        tokens_per_gpu=tokens_per_gpu,
        world=world,
        per_host=per_host,
        shard_group=per_host,
        gbps=gbps,
        flops=flops,
    )
    best = max(
        step(s, **options).tokens_per_s for s in ("full-shard", "hybrid-full-shard", "no-shard")
    )
    gossip = {k: v for k, v in options.items() if k != "reduce_precision"}
    return step("decentralized", **gossip).tokens_per_s / best


def where_gossip_pays(params, per_token, tokens_per_gpu, hosts, per_host, gbps, flops, **options):
    """One line: below which link rate (on these hosts) and from how many hosts (at this rate)
    decentralized training is faster than every all-reduce strategy, by the estimates above."""

    def gain(h, g):
        return gossip_gain(params, per_token, tokens_per_gpu, h, per_host, g, flops, **options)

    rates = [g for g in RATES_GBPS if gain(hosts, g) > 1]
    counts = [h for h in HOST_COUNTS if gain(h, gbps) > 1]
    here = gain(hosts, gbps)
    return (
        f"decentralized: {here:.2f}x the fastest all-reduce strategy here; on {hosts} host(s) it "
        f"is faster "
        + (
            f"at every rate from {RATES_GBPS[0]:g} Gbit/s down"
            if rates and rates[0] == RATES_GBPS[0]
            else f"at {rates[0]:g} Gbit/s and below"
            if rates
            else f"at no rate down to {RATES_GBPS[-1]:g} Gbit/s"
        )
        + f"; at {gbps:g} Gbit/s, "
        + (f"from {counts[0]} hosts" if counts else f"at no host count up to {HOST_COUNTS[-1]}")
    )


def flops_per_token(sizes, config):
    """Training FLOPs per token, as layers.Decoder.flops_per_token counts them (6N without the
    lookup-only embedding, plus attention), from the planner's parameter counts."""
    return (
        6 * (sizes.total - sizes.lookup)
        + 12 * config.num_layers * config.embed_size * config.seq_length
    )


def achieved_flops(gpu_type, mfu, compile, precision):
    """(FLOP/s one GPU achieves, the MFU it came from): --mfu, or the card's measured MFU for the
    run's compile."""
    card = CARDS[gpu_type]
    if mfu is None:
        mfu = card.mfu_compiled if compile else card.mfu_eager
    if mfu is None:
        raise ConfigError(
            f"--gpu_type {gpu_type}: no MFU was measured on this card, so the step time needs "
            f"--mfu (the fraction of its {card.peak / 1e12:.0f} TFLOP/s bf16 peak your runs "
            "reach: the training log's mfu)"
        )
    return card.peak * mfu, mfu


def print_step_times(args, config, sizes, per_host, shard_group, strategies):
    """The table `minimal-fsdp plan --inter_node_gbps G` adds below the memory table."""
    flops, mfu = achieved_flops(args.gpu_type, args.mfu, args.compile, args.precision)
    tokens_per_gpu = args.batch_size * args.grad_accum_steps * config.seq_length
    per_token = flops_per_token(sizes, config)
    hosts = args.gpus // per_host
    print(
        f"\nstep time: {hosts} host(s) x {per_host} GPU(s), {args.inter_node_gbps:g} Gbit/s "
        f"between hosts ({args.inter_node_gbps * PAYLOAD:.2f} of TCP payload), NVLink inside taken "
        f"as free; {args.gpu_type} at {mfu:.1%} MFU ({flops / 1e12:.0f} TFLOP/s, "
        f"{'compiled' if args.compile else 'eager'}), {per_token / 1e6:.1f} MFLOPs a token"
    )
    header = (
        f"{'strategy':<19}{'as':<12}{'GB/step':>9}{'compute ms':>12}{'link ms':>10}{'step ms':>10}"
        f"{'tokens/s':>13}"
    )
    print(header + "\n" + "-" * len(header))
    for sharding in strategies:
        t = estimate_step(
            sharding,
            sizes.total,
            per_token,
            tokens_per_gpu,
            args.gpus,
            per_host,
            shard_group,
            args.inter_node_gbps,
            flops,
            args.precision,
            args.grad_accum_steps,
            args.fsdp_unit,
            args.topology,
            args.log_interval,
            reduce_precision(args.reduce_precision, hosts, args.precision),
        )
        print(
            f"{sharding:<19}{t.strategy:<12}{t.bytes_per_step / 1e9:>9.2f}{1000 * t.compute:>12.1f}"
            f"{1000 * t.link:>10.1f}{1000 * t.step:>10.1f}{t.tokens_per_s:>13,.0f}"
        )
    print(
        where_gossip_pays(
            sizes.total,
            per_token,
            tokens_per_gpu,
            hosts,
            per_host,
            args.inter_node_gbps,
            flops,
            precision=args.precision,
            micro_steps=args.grad_accum_steps,
            fsdp_unit=args.fsdp_unit,
            topology=args.topology,
            log_interval=args.log_interval,
            reduce_precision=reduce_precision(args.reduce_precision, hosts, args.precision),
        )
    )
    rows = guide(
        sizes.total,
        counts.parameter_shapes(config),
        per_token,
        tokens_per_gpu,
        args.gpus,
        per_host,
        args.inter_node_gbps,
        flops,
        args.precision,
        args.topology,
        args.reduce_precision,
        root_params=sizes.root,
        micro_steps=args.grad_accum_steps,
        fsdp_unit=args.fsdp_unit,
        log_interval=args.log_interval,
    )
    print(f"\nbeside plain PyTorch, fastest first\n{'layout':<31}{'GB/step':>9}{'step ms':>10}")
    for name, t in rows:
        print(f"{name:<31}{t.bytes_per_step / 1e9:>9.2f}{1000 * t.step:>10.1f}")
    print(pick(rows))
    print(
        "as: how training runs it (plan.strategy); GB/step: over each host's link each way; link "
        "ms: time on the link; one-unit and fsdp-whole wait for it after compute, the others "
        "overlap it (docs/performance.md)"
    )

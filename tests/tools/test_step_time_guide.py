"""The planner's across-hosts guide (step_time.guide, `minimal-fsdp plan --inter_node_gbps G`):
ours and the plain-PyTorch layouts, each estimate checked against every step recorded in
benchmarks/results/*.jsonl (multihost.py's rows, training and side-by-side) within 25%; the rows it
misses are named below with the reason, so a new miss fails."""

import json
from pathlib import Path

import pytest

from minimal_fsdp.models import counts
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import make_config
from minimal_fsdp.models.size import count_parameters
from minimal_fsdp.tools import step_time

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# Rows measured before host-aware gossip (175af69): gossip sent fp32 replicas over the ranks and
# measured the consensus at each logging step (the planner's "flat-fp32").
FLAT_GOSSIP = {"d11c69d", "bf6c615", "646d7ce", "9fccc8a", "9753e42", "a0eb730", "a6c25bc"}
# Rows measured with NCCL's one socket a connection (before 9fccc8a set its socket threads)
ONE_SOCKET = {"d11c69d", "646d7ce", "9753e42"}
# Rows measured with --reduce_precision auto the default (12a38e5 on), before multihost.py recorded
# the dtype a row summed in: auto sums in bf16 across hosts under bf16 matmuls
AUTO_BF16 = {"7d627a8"}
# What NCCL itself moved over an unshaped veth (link_probe.py's all-reduce, Gbit/s over each host's
# link; link_probe_h200_*.jsonl): a veth has no rate of its own, one TCP stream is not NCCL's
UNSHAPED_NCCL = {("2x1", "9fccc8a"): 72.41, ("2x2", "bf6c615"): 88.0}
# gossip's exchange with one socket at 25 Gbit/s (link_probe_h200_2x1.jsonl, NCCL's defaults)
ONE_SOCKET_EXCHANGE = {25.0: 13.32}
# (file, commit, strategy, Gbit/s set): missed by more than 25%, and why
KNOWN_MISSES = {
    # compute-bound: the eager MFU is an H100's; this H200 step ran faster than it predicts (+38%)
    ("multihost_h200.jsonl", "bf6c615", "hybrid-full-shard", 0): "compute on an H200",
    # one socket on an unshaped veth: no probe measured its exchange rate (-46%)
    ("multihost_h200_2x1.jsonl", "646d7ce", "decentralized", 0): "one socket, unshaped",
    # --log_interval 10 measured as slow as every-step logging (349.5 against 347.3 ms): the
    # consensus all-reduce the planner spreads over ten steps was not what bounded it (-48%)
    ("multihost_h200_2x1.jsonl", "a0eb730", "decentralized", 25.0): "unexplained",
    # FSDP2's residual beyond compute and bytes is the largest at every rate (110-205 ms against
    # the gloo step's 63.5): its three units' per-unit work on CPU is not modelled (-26%)
    ("side_by_side_cpu16.jsonl", "80f3a3a", "torch FSDP2, reduce bf16", 1.0): "FSDP2 on CPU",
}
# multihost_cpu_8x1.jsonl: eight ranks on two shared cores; no compute was measured beside them
# (decentdp_side_by_side.py's "compute alone" row now is), so the planner has no compute part.
# side_by_side_h200_2x1.jsonl: DDP's bf16 hook and PowerSGD beside ours on 2 hosts x 1 GPU, run
# without a "compute alone" row (the device time left), so no compute part for them either.
NO_COMPUTE = {
    "multihost_cpu_8x1.jsonl",
    "side_by_side_h200_2x1.jsonl",
    "side_by_side_h200_4x1.jsonl",
    "straggler_cpu_4x1.jsonl",  # a straggler's pairs on the shared 2-core machine
}


def llama_1b():
    return MODELS["llama"].config_class(
        vocab_size=32000,
        seq_length=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        embed_size=2048,
        intermediate_size=8192,
    )


MODELS_RUN = {  # benchmarks/multihost.py's MODELS: (config, tokens a GPU a step)
    "gpt2": (make_config("gpt", "gpt2", vocab_size=50304), 32 * 1024),
    "llama-1b": (llama_1b(), 4 * 2048),
}


def training_estimate(name, row):
    """The planner's step (ms) for one of multihost.py's training rows."""
    config, tokens = MODELS_RUN[row["model"]]
    sizes = count_parameters(config)
    flops, _ = step_time.achieved_flops("H200", None, False, "bf16")  # eager, as the runs were
    sharding, topology = row["strategy"], "alternating-exp-ring"
    if sharding.startswith("decentralized-"):
        sharding, topology = "decentralized", sharding.split("-", 1)[1]
    layout = f"{row['hosts']}x{row['gpus_per_host']}"
    gbps = row["gbps_set"] or UNSHAPED_NCCL.get((layout, row["commit"]), row["link_gbps"])
    if sharding == "decentralized" and row["commit"] in ONE_SOCKET:
        gbps = ONE_SOCKET_EXCHANGE.get(row["gbps_set"], gbps)
    estimated = step_time.estimate_step(
        sharding,
        sizes.total,
        step_time.flops_per_token(sizes, config),
        tokens,
        row["hosts"] * row["gpus_per_host"],
        row["gpus_per_host"],
        row["gpus_per_host"],
        gbps,
        flops,
        log_interval=row.get("log_interval", 1),
        topology=topology,
        reduce_precision=row.get("reduce_precision")
        or ("bf16" if "bf16" in row.get("extra", "") or row["commit"] in AUTO_BF16 else "float32"),
        gossip="flat-fp32" if row["commit"] in FLAT_GOSSIP else "bf16",
    )
    return 1000 * estimated.step


def side_by_side_model(row):
    """(config, sizes, FLOPs per token, tokens a rank a step) of a side-by-side row's GPT."""
    config = MODELS["gpt"].config_class(
        vocab_size=row["vocab"], seq_length=row["seq"], num_layers=row["layers"],
        num_heads=row["heads"], embed_size=row["embed"],
    )  # fmt: skip
    sizes = count_parameters(config)
    return config, sizes, step_time.flops_per_token(sizes, config), row["batch"] * row["seq"]


def side_by_side_estimate(row, compute_ms):
    """The planner's step (ms) for a side-by-side row (decentdp_side_by_side.py through
    multihost.py --side_by_side), its compute part the launch's own "compute alone" row: CPU ranks
    have no card to take an MFU from; they talk through gloo."""
    config, sizes, per_token, tokens = side_by_side_model(row)
    flops = tokens * per_token / (compute_ms / 1000)
    world, per_host, gbps = row["ranks"], row["gpus_per_host"], row["gbps_set"] or row["link_gbps"]
    name = row["implementation"]
    precision = row.get("precision", "float32")
    backend = "gloo" if row.get("device", "cpu") == "cpu" else "nccl"
    if name.startswith("ours"):
        sharding = "decentralized" if "decentralized" in name else name.split(", ")[1].split()[0]
        estimated = step_time.estimate_step(
            sharding, sizes.total, per_token, tokens, world, per_host, per_host, gbps, flops,
            precision, topology=row["topology"], log_interval=10**9,
            reduce_precision="bf16" if row["wire"] == "bf16" else "float32",
            gossip=row["wire"] if sharding == "decentralized" else "bf16", backend=backend,
        )  # fmt: skip
    else:
        reference = "Decent-DP" if name.startswith("Decent-DP") else name
        estimated = step_time.estimate_reference(
            reference, sizes.total, counts.parameter_shapes(config), per_token, tokens, world,
            per_host, gbps, flops, precision, row["topology"], backend, sizes.root,
        )  # fmt: skip
    return 1000 * estimated.step


def recorded_rows():
    """(file, row, estimate ms or None) for every step row of every results file."""
    out = []
    for path in sorted(RESULTS.glob("*.jsonl")):
        if path.name.startswith(("link_probe", "loss_")):
            continue  # collectives alone, no step; loss runs: ranks of one host, no link between
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        computes = {
            (r.get("gbps_set"), r["ranks"]): r["step_ms"]
            for r in lines
            if r.get("implementation") == "compute alone" and r.get("step_ms")
        }
        # no collective in it, so no link: one rate's compute row serves the file's others
        computes |= {(None, ranks): ms for (_, ranks), ms in computes.items()}
        for row in lines:
            if not row.get("step_ms") or row.get("implementation") == "compute alone":
                continue
            if row.get("straggler_cores"):
                continue  # one host slowed on purpose (multihost.py --straggler): not modelled
            if "implementation" in row:
                compute = computes.get((row.get("gbps_set"), row["ranks"])) or computes.get(
                    (None, row["ranks"])
                )
                estimate = side_by_side_estimate(row, compute) if compute else None
            elif path.name in NO_COMPUTE:
                estimate = None
            else:
                estimate = training_estimate(path.name, row)
            out.append((path.name, row, estimate))
    return out


def key(name, row):
    return (name, row.get("commit"), row.get("strategy") or row.get("implementation"),
            row.get("gbps_set"))  # fmt: skip


def test_every_recorded_step_within_25_percent_or_a_named_miss():
    rows = recorded_rows()
    assert len(rows) >= 60  # the files are read
    misses, checked = {}, 0
    for name, row, estimate in rows:
        if estimate is None:
            assert name in NO_COMPUTE, (name, row)
            continue
        checked += 1
        ratio = estimate / row["step_ms"]
        if abs(ratio - 1) > 0.25:
            misses[key(name, row)] = ratio
    assert set(misses) == set(KNOWN_MISSES), misses
    assert checked >= 55


def gpt2_guide(hosts, gbps, precision="bf16"):
    config = make_config("gpt", "gpt2", vocab_size=50304)
    sizes = count_parameters(config)
    flops, _ = step_time.achieved_flops("H200", None, False, precision)
    return step_time.guide(
        sizes.total,
        counts.parameter_shapes(config),
        step_time.flops_per_token(sizes, config),
        32 * 1024,
        hosts,
        1,
        gbps,
        flops,
        precision,
    )


def test_the_guide_ranks_every_layout_and_names_one():
    rows = gpt2_guide(8, 1)
    names = [name for name, _ in rows]
    assert set(names) == {
        "ours, full-shard",
        "ours, hybrid-full-shard",
        "ours, no-shard",
        "ours, decentralized",
        *step_time.REFERENCES,
    }
    steps = [t.step for _, t in rows]
    assert steps == sorted(steps)
    line = step_time.pick(rows)
    # the pick trains as all-reduce does: never a layout that changes the arithmetic
    picked = line.split("pick: ")[1].split(" (")[0]
    assert picked not in step_time.LOSS_CAVEATS and picked in names


def test_reference_bytes_follow_their_wires():
    """Between 2 hosts of one GPU: DDP all-reduces 4 bytes a parameter each way (2 with the bf16
    hook), PowerSGD rank 4 far fewer; FSDP2 gathers bf16 and reduce-scatters bf16; Decent-DP sends
    one fp32 replica a step to its one peer."""
    config = make_config("gpt", "gpt2", vocab_size=50304)
    n = count_parameters(config).total
    shapes = counts.parameter_shapes(config)
    assert sum(map(lambda s: __import__("math").prod(s), shapes)) == n

    def sent(name):
        return step_time.reference_bytes(name, n, 2, 1, 2, shapes, "ring")[1]

    assert sent("torch DDP") == pytest.approx(4 * n)
    assert sent("torch DDP, bf16_compress_hook") == pytest.approx(2 * n)
    assert sent("torch DDP, PowerSGD rank 4") < 0.05 * 4 * n
    assert sent("torch FSDP2, reduce bf16") == pytest.approx(0.5 * (2 * 2 + 2) * n)
    assert sent("Decent-DP") == pytest.approx(4 * n)


def test_powersgd_compresses_only_where_it_saves():
    # a 768 x 768 matrix: rank 4 sends 4 x (768 + 768); a bias and a 3 x 2 matrix go whole
    assert step_time.powersgd_elements([(768, 768)]) == 4 * 1536
    assert step_time.powersgd_elements([(768,), (3, 2)]) == 768 + 6


def test_the_guide_on_cpu_ranks_orders_layouts_as_measured():
    """side_by_side_cpu16.jsonl's hosts and rates, the guide on gloo: at 100 Mbit/s it ranks the
    layouts both have as the steps measured (PowerSGD, then our gossip, ...), and at every rate its
    pick is the fastest measured layout that trains as all-reduce does."""
    lines = [json.loads(line) for line in (RESULTS / "side_by_side_cpu16.jsonl").open()]
    compute = {r["ranks"]: r["step_ms"] for r in lines if r["implementation"] == "compute alone"}
    first = lines[0]
    config, sizes, per_token, tokens = side_by_side_model(first)
    # the rows' names in the guide's (ours with fp32 sums: the guide's float32 run resolves to them)
    as_guide = {"Decent-DP 0.2.3": "Decent-DP", "ours, full-shard (one-unit)": "ours, full-shard"}
    cells = {(r["ranks"], r["gbps_set"]) for r in lines if r["implementation"] != "compute alone"}
    for hosts, gbps in sorted(cells):
        measured = {
            as_guide.get(r["implementation"], r["implementation"]): r["step_ms"]
            for r in lines
            if (r["ranks"], r["gbps_set"]) == (hosts, gbps)
            and r["implementation"] != "compute alone"
            and not (r["implementation"].startswith("ours, full") and r["wire"] == "bf16")
        }
        rows = step_time.guide(
            sizes.total, counts.parameter_shapes(config), per_token, tokens, hosts, 1, gbps,
            tokens * per_token / (compute[hosts] / 1000), "float32", first["topology"],
            backend="gloo", root_params=sizes.root,
        )  # fmt: skip
        ranked = [name for name, _ in rows if name in measured]
        assert set(ranked) == set(measured), (hosts, gbps)
        if gbps == 0.1:
            assert ranked == sorted(measured, key=measured.get), (hosts, gbps)
        exact = min((n for n in measured if n not in step_time.LOSS_CAVEATS), key=measured.get)
        assert step_time.pick(rows).startswith(f"pick: {exact} ("), (hosts, gbps)

"""Which strategy at which inter-node bandwidth, as a picture: tokens/s against the link's Gbit/s,
the measured runs of benchmarks/multihost.py (its JSON lines) as points and the planner's estimate
(minimal_fsdp.tools.step_time, what `minimal-fsdp plan --inter_node_gbps G` prints) as one line per
strategy.

    python benchmarks/plot_strategies.py  # docs/strategies.svg from the H200 runs
    python benchmarks/plot_strategies.py --results multihost.jsonl --gpu_type H100 \
        --out /tmp/strategies.svg

benchmarks/results/multihost_h200.jsonl holds the runs of RESULTS.md's "Across hosts" rows (2
virtual hosts x 2 H200, GPT-2 124M, batch 32 per GPU, bf16, eager), written in multihost.py's format
from the table there. The estimate takes the runs' setting: their hosts, GPUs per host and model,
the card's eager MFU (--compile for compiled runs), and --log_interval 1 (multihost.py logs every
step, which adds gossip's consensus all-reduce to each of its steps). Needs matplotlib (pip install
matplotlib, or pip install -e ".[plot]").
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minimal_fsdp.config.commands import PlanFlags  # noqa: E402
from minimal_fsdp.config.parser import parse as parse_flags  # noqa: E402
from minimal_fsdp.models.size import count_parameters  # noqa: E402
from minimal_fsdp.tools import (
    model_size,  # noqa: E402
    step_time,  # noqa: E402
)

# multihost.py's models, as the planner's flags (its "llama-1b" shape has no preset the
# planner takes)
PLANNER_FLAGS = {"gpt2": ["--model_preset", "gpt2", "--vocab_size", "50304", "--batch_size", "32"]}
STRATEGIES = ("full-shard", "hybrid-full-shard", "no-shard", "decentralized")
# color, line, marker: hybrid's and no-shard's estimates coincide between two hosts (both all-reduce
# fp32 gradients once, 4N bytes each way), so one is dashed
STYLES = {
    "full-shard": ("tab:blue", "-", "o"),
    "hybrid-full-shard": ("tab:green", "-", "s"),
    "no-shard": ("tab:orange", "--", "x"),
    "decentralized": ("tab:red", "-", "o"),
}
# Gbit/s: tbf's 32-bit rate tops out near here, so faster links were not shaped or measured
TBF_CEILING = 34


def parse():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--results",
        default=ROOT / "benchmarks" / "results" / "multihost_h200.jsonl",
        type=Path,
        help="multihost.py's JSON lines",
    )
    parser.add_argument("--model", default="gpt2", choices=tuple(PLANNER_FLAGS))
    parser.add_argument("--gpu_type", default="H200", choices=tuple(step_time.CARDS))
    parser.add_argument(
        "--compile", action="store_true", help="the runs were compiled: the compiled MFU"
    )
    parser.add_argument(
        "--log_interval", type=int, default=1, help="the runs' (multihost.py's --log_interval)"
    )
    parser.add_argument("--out", default=ROOT / "docs" / "strategies.svg", type=Path)
    return parser.parse_args()


def estimates(args, hosts, per_host, rates):
    """{strategy: [tokens/s at each rate]} from the planner, for the runs' setting."""
    planner = parse_flags(PlanFlags, PLANNER_FLAGS[args.model] + ["--precision", "bf16"])
    family, config, _ = model_size.model_config(planner)
    sizes = count_parameters(config)
    flops, _ = step_time.achieved_flops(args.gpu_type, None, args.compile, "bf16")
    per_token = step_time.flops_per_token(sizes, config)
    tokens = planner.batch_size * config.seq_length
    return {
        s: [
            step_time.estimate_step(
                s,
                sizes.total,
                per_token,
                tokens,
                hosts * per_host,
                per_host,
                per_host,
                g,
                flops,
                log_interval=args.log_interval,
                # as the runs drawn
                gossip="flat-fp32",
            ).tokens_per_s
            for g in rates
        ]
        for s in STRATEGIES
    }


def main():
    args = parse()
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(
            "error: plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
        )
    runs = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    runs = [
        r
        for r in runs
        if r.get("model") == args.model
        and r.get("tokens_per_s")
        and r.get("gbps_set")
        and r.get("log_interval", 1) == args.log_interval
    ]
    # A later run of the same setting supersedes an earlier one (a rerun after a change, e.g.
    # NCCL's sockets).
    runs = list({(r["gbps_set"], r["strategy"]): r for r in runs}.values())
    if not runs:
        sys.exit(f"error: {args.results} has no timed run of {args.model} on a shaped link")
    hosts, per_host = runs[0]["hosts"], runs[0]["gpus_per_host"]
    if any((r["hosts"], r["gpus_per_host"]) != (hosts, per_host) for r in runs):
        sys.exit(f"error: {args.results} mixes cluster shapes; give one shape's runs (--results)")
    rates = [0.5 * 1.1**i for i in range(60)]  # 0.5 to ~150 Gbit/s
    lines = estimates(args, hosts, per_host, rates)

    plt.rcParams["svg.hashsalt"] = "strategies"  # the same file for the same numbers
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in STRATEGIES:
        color, line, marker = STYLES[strategy]
        ax.plot(rates, lines[strategy], line, color=color, label=f"{strategy} (estimate)")
        measured = [(r["gbps_set"], r["tokens_per_s"]) for r in runs if r["strategy"] == strategy]
        if measured:
            ax.plot(
                *zip(*measured),
                marker,
                color=color,
                markersize=7,
                fillstyle="none" if marker == "s" else "full",
                linestyle="none",
                label=f"{strategy} (measured)",
            )
    ax.axvline(TBF_CEILING, color="gray", linestyle=":", linewidth=1)
    ax.text(
        TBF_CEILING * 1.05,
        min(min(v) for v in lines.values()),
        "tbf's ceiling",
        color="gray",
        fontsize=8,
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link between hosts, Gbit/s (set)")
    ax.set_ylabel(f"tokens/s, all {hosts * per_host} GPUs")
    ax.set_title(
        f"{args.model}, {hosts} hosts x {per_host} {args.gpu_type}, "
        f"{'compiled' if args.compile else 'eager'}: measured and the planner's estimate",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, metadata={"Date": None})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

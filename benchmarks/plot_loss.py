"""Loss against steps and against time per strategy, from decentdp_side_by_side.py's --loss_out rows
(each row's loss at every step, the mean over ranks), the time axis from a timing run's step times
(multihost.py --side_by_side rows at one link rate): a strategy's loss at step s is put at s x its
measured median step there. Smoothed over --window steps.

    python benchmarks/plot_loss.py --loss benchmarks/results/loss_cpu_8.jsonl \\
        --timing benchmarks/results/side_by_side_cpu.jsonl --hosts 8 --gbps 0.1 \\
        --out docs/loss-time-cpu.svg
"""

import argparse
import json
from pathlib import Path


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def label(row):
    wire = (
        {"bf16": ", bf16 sums"}.get(row["wire"], "")
        if row["implementation"].startswith("ours, full")
        else ""
    )
    return row["implementation"] + wire


def smooth(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", required=True, help="--loss_out rows")
    p.add_argument("--timing", help="multihost.py --side_by_side rows (step_ms per implementation)")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--gbps", type=float, default=0.1)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--out", default="loss-time.svg")
    p.add_argument("--note", default="", help="added to the time axis's title (e.g. the load)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [r for r in rows(args.loss) if r.get("losses")]
    step_ms = {}
    if args.timing:
        for r in rows(args.timing):
            if r.get("hosts") == args.hosts and r.get("gbps_set") == args.gbps and r.get("step_ms"):
                step_ms[r["implementation"], r["wire"]] = r["step_ms"]
    fig, axes = plt.subplots(1, 2 if step_ms else 1, figsize=(13 if step_ms else 7, 5))
    axes = axes if step_ms else [axes]
    for r in losses:
        curve = smooth(r["losses"], args.window)
        axes[0].plot(range(1, len(curve) + 1), curve, label=label(r))
        ms = step_ms.get((r["implementation"], r["wire"]))
        if step_ms and ms:
            axes[1].plot([ms * (i + 1) / 1000 for i in range(len(curve))], curve, label=label(r))
    ranks = losses[0]["ranks"]
    axes[0].set(
        xlabel="step",
        ylabel=f"training loss (mean of {ranks} ranks, {args.window}-step mean)",
        title=f"{ranks} ranks, Shakespeare characters, vocab "
        f"{next((r['vocab'] for r in losses if 'vocab' in r), '?')}",
    )
    if step_ms:
        axes[1].set(
            xlabel=f"seconds at the step time measured on {args.hosts} virtual hosts, "
            f"{args.gbps:g} Gbit/s",
            title="at equal time" + (f" ({args.note})" if args.note else ""),
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

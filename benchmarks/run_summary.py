"""One line about a finished basic_training.py run, from its metrics.jsonl: the median step time and
tokens/s of the logged windows after the first few (compilation and warm-up land there), MFU, and
the final and best val loss.

    python benchmarks/run_summary.py logs/RUN_NAME [--skip_steps 20]
"""

import argparse
import json
import statistics
from pathlib import Path


def summary(run_dir, skip_steps):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "step_time" in r and r["step"] > skip_steps]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    parts = [Path(run_dir).name]
    if steady:
        times = sorted(r["step_time"] * 1000 for r in steady)
        parts.append(
            f"step {statistics.median(times):.2f} ms (median of {len(steady)} windows after step "
            f"{skip_steps}; {times[0]:.2f} to {times[-1]:.2f})"
        )
        parts.append(f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s")
        if "mfu" in steady[0]:
            parts.append(f"MFU {statistics.median(r['mfu'] for r in steady):.1%}")
    if val:
        best = min(val, key=lambda sv: sv[1])
        parts.append(
            f"final val {val[-1][1]:.4f} at step {val[-1][0]}, best {best[1]:.4f} at step {best[0]}"
        )
    return "; ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="<log_dir>/<run_name> of each run")
    parser.add_argument(
        "--skip_steps", type=int, default=20, help="leave out the windows up to this step"
    )
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        print(summary(run_dir, args.skip_steps), flush=True)


if __name__ == "__main__":
    main()

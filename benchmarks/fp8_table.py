"""A markdown table of benchmarks/throughput.py's JSON rows (its --out file), each row with its
speed over the bf16 row of the same model, GPU count, batch and sequence length, as gpu_check.sh's
fp8 parts print it:

    python3 benchmarks/fp8_table.py gpu_out/fp8_7b.jsonl
"""

import json
import sys
from pathlib import Path


def table(rows):
    lines = [
        "| model | GPUs | precision | options | batch/GPU | seq | tok/s/GPU | MFU | step ms | peak "
        "GB | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def setting(row):
        return row["model"], row["gpus"], row["batch"], row["seq"]

    for row in rows:
        bf16 = next(
            (r for r in rows if r["precision"] == "bf16" and setting(r) == setting(row)), None
        )
        speed = f"{row['tok_s'] / bf16['tok_s']:.2f}x" if bf16 else "-"
        lines.append(
            f"| {row['model']} | {row['gpus']} | {row['precision']} | {row['options']} | "
            f"{row['batch']} | {row['seq']} | {row['tok_s_gpu']:,.0f} | {row['mfu']:.1%} | "
            f"{row['step_ms']:.1f} | {row['peak_gb']:.1f} | {speed} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )
    print(table(rows) if rows else f"{path}: no rows (every run failed: see the logs beside it)")

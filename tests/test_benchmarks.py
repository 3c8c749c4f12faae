"""The benchmark scripts run the real training step; a tiny CPU run keeps them working between GPU sessions."""
import json
import os
import subprocess
import sys

from conftest import ROOT, mpiexec

TINY = ["--num_layers", "1", "--num_heads", "2", "--embed_size", "32", "--seq_length", "16", "--vocab_size", "64",
        "--batch_size", "2", "--warmup", "1", "--steps", "2"]


def run(script, out, ranks=2, extra=()):
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(ROOT / "benchmarks" / script), *TINY, "--out", str(out),
           *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_throughput_reports_a_row(tmp_path):
    (row,) = run("throughput.py", tmp_path / "t.jsonl")
    assert row["gpus"] == 2 and row["tok_s"] > 0 and row["step_ms"] > 0 and row["seq"] == 16


def test_gossip_bench_reports_every_mode(tmp_path):
    rows = run("gossip_bench.py", tmp_path / "g.jsonl")
    assert {r["topology"] for r in rows} == {"-", "complete", "ring", "exp", "alternating-exp-ring"}
    assert all(r["step_ms"] > 0 for r in rows)

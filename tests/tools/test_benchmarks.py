"""The benchmark scripts run the real training step; a tiny CPU run keeps them working between GPU
runs and checks that what they report is consistent: tokens per step over the step time, parameter
and byte counts from the model's shape."""

import json
import math
import os
import subprocess
import sys

import pytest

from minimal_fsdp.models.gpt import GPT, GPTConfig

from conftest import ROOT, mpiexec

TINY = [
    "--num_layers",
    "1",
    "--num_heads",
    "2",
    "--embed_size",
    "32",
    "--seq_length",
    "16",
    "--vocab_size",
    "64",
    "--batch_size",
    "2",
    "--warmup",
    "1",
    "--steps",
    "2",
]
PARAMS = GPT(
    GPTConfig(vocab_size=64, seq_length=16, num_layers=1, num_heads=2, embed_size=32)
).num_params(False)


def run(script, out, ranks=2, extra=()):
    cmd = [
        mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        str(ROOT / "benchmarks" / script),
        *TINY,
        "--out",
        str(out),
        *extra,
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def positive(value):
    return math.isfinite(value) and value > 0


@pytest.mark.slow
def test_throughput_reports_a_consistent_row(tmp_path):
    (row,) = run("throughput.py", tmp_path / "t.jsonl")
    assert (row["gpus"], row["batch"], row["seq"], row["sharding"], row["device"]) == (
        2,
        2,
        16,
        "full-shard",
        "cpu",
    )
    assert all(
        positive(row[key]) for key in ("tok_s", "tok_s_gpu", "step_ms", "peak_gb", "host_rss_gb")
    ), row
    tokens_per_step = 2 * 2 * 16  # ranks x batch x seq
    assert row["tok_s"] == pytest.approx(tokens_per_step / (row["step_ms"] / 1000))
    assert row["tok_s_gpu"] == pytest.approx(row["tok_s"] / 2)
    assert math.isnan(row["mfu"])  # no peak FLOP/s is known for a CPU
    # rank 0's loss at the last step: the same seed and synthetic batches give the same training
    # under no-shard
    (ddp,) = run("throughput.py", tmp_path / "d.jsonl", extra=["--sharding", "no-shard"])
    assert 3 < row["last_loss"] < 6 and ddp["last_loss"] == pytest.approx(
        row["last_loss"], abs=1e-5
    ), (row, ddp)


@pytest.mark.slow
def test_gossip_bench_reports_every_mode(tmp_path):
    rows = run("gossip_bench.py", tmp_path / "g.jsonl")
    assert [r["topology"] for r in rows] == ["-", "complete", "ring", "exp", "alternating-exp-ring"]
    assert all(positive(r["step_ms"]) and r["gpus"] == 2 and r["batch"] == 2 for r in rows), rows
    assert all(r["params"] == PARAMS for r in rows), (PARAMS, rows)
    # On 2 ranks every mode moves one copy of the parameters per step: all-reduce 2(n-1)/n of the
    # fp32 gradient bytes, complete gossip the same of the replica (summed in fp32 whatever the
    # wire), each other topology one bf16 message (--gossip_dtype's default) to its single peer.
    assert all(
        r["bytes_per_step"] == pytest.approx((2 if r["wire"] == "bf16" else 4) * PARAMS)
        for r in rows
    )
    assert [r["wire"] for r in rows] == ["float32"] * 2 + ["bf16"] * 3


def test_fp8_table_gives_each_row_its_speed_over_bf16(tmp_path):
    rows = [
        dict(
            model="llama2-7b(6.7B)",
            gpus=4,
            precision=p,
            options="compile",
            batch=2,
            seq=4096,
            tok_s=t,
            tok_s_gpu=t / 4,
            mfu=0.5,
            step_ms=700.0,
            peak_gb=47.5,
        )
        for p, t in (("bf16", 40_000.0), ("fp8-tensorwise", 52_000.0), ("fp8-rowwise", 46_000.0))
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fp8_table.py"), str(tmp_path / "rows.jsonl")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [line.rsplit("|", 2)[1].strip() for line in out[2:]] == ["1.00x", "1.30x", "1.15x"]
    assert "| 13,000 |" in out[3]


@pytest.mark.slow
def test_eval_speed_scores_alike_with_both_backends(tmp_path):
    """benchmarks/eval_speed.py on a tiny model in float32 on CPU: ours over 2 ranks and lm_eval's
    hf backend pick the same answer for every item, so the accuracies in its table agree."""
    pytest.importorskip("lm_eval")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "eval_speed.py"),
            "--shapes",
            "tiny",
            "--device",
            "cpu",
            "--ranks",
            "2",
            "--items",
            "24",
            "--batch_size",
            "4",
            "--precision",
            "float32",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    ours, hf = [
        json.loads(line) for line in (tmp_path / "eval_speed.jsonl").read_text().splitlines()
    ]
    assert (ours["backend"], ours["gpus"], hf["backend"], hf["gpus"]) == ("ours", 2, "hf", 1)
    assert ours["same_choice"] == 1.0 and (ours["acc"], ours["acc_norm"]) == (
        hf["acc"],
        hf["acc_norm"],
    )
    assert all(
        positive(row["eval_s"]) and row["items_per_s"] == pytest.approx(24 / row["eval_s"])
        for row in (ours, hf)
    )


@pytest.mark.slow
def test_multihost_probe_times_both_collectives_across_two_virtual_hosts(tmp_path):
    """benchmarks/multihost.py --probe (CPU, gloo): link_probe.py runs on two network namespaces
    joined by a link shaped to 1 Gbit/s; neither collective moves its bytes faster than that (so
    they crossed the link)."""
    from minimal_fsdp.tools.virtual_cluster import unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "probe.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "multihost.py"),
            "--tiny",
            "--gbps",
            "1",
            "--probe",
            "4",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["hosts"], row["world"], row["gbps_set"], row["probe_mb"]) == (2, 2, 1.0, 4.0), row
    assert all(
        positive(row[k])
        for k in ("all_reduce_ms", "all_reduce_gbps", "exchange_ms", "exchange_gbps")
    ), row
    assert row["all_reduce_gbps"] <= 1.05 and row["exchange_gbps"] <= 1.05, row


def test_multihost_straggler_quota_holds_the_last_hosts_processes(tmp_path):
    """multihost.py --straggler's cgroup: the quota is the cores asked for, the process added is
    in it and throttled when it runs past that, and the group is gone once the process is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("multihost", ROOT / "benchmarks" / "multihost.py")
    multihost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(multihost)
    try:
        quota = multihost.CpuQuota(f"minimal_fsdp_test{os.getpid()}", 0.1)
    except OSError as e:
        pytest.skip(f"no cgroup to write here: {e}")
    # 50 ms of CPU time, at most 10 ms a 100 ms period: the quota runs out in every period
    busy = "import time\nwhile time.process_time() < 0.05: pass"
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.read()\n{busy}"],
                            stdin=subprocess.PIPE)  # fmt: skip
    quota.add(proc.pid)  # held before it starts its work, as the straggler's rank is
    assert str(proc.pid) in (quota.path / "cgroup.procs").read_text().split()
    proc.communicate(b"", timeout=60)
    v1 = (quota.path / "cpu.cfs_quota_us").exists()
    if v1:
        assert (quota.path / "cpu.cfs_quota_us").read_text().strip() == "10000"
    else:
        assert (quota.path / "cpu.max").read_text().split() == ["10000", "100000"]
    stat = dict(line.split() for line in (quota.path / "cpu.stat").read_text().splitlines())
    assert int(stat["nr_throttled"]) > 0, stat
    quota.remove()
    assert not quota.path.exists()


def test_multihost_rows_record_the_reduce_precision_in_either_spelling():
    """multihost.py's rows say what the gradients were summed in: --extra's --reduce_precision, as
    `X` or `=X`, resolved as training resolves it (auto: bf16 across hosts)."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("multihost", ROOT / "benchmarks" / "multihost.py")
    multihost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(multihost)

    def summed(extra, hosts=2):
        return multihost.summed_in(SimpleNamespace(extra=extra, hosts=hosts, precision="bf16"))

    assert summed("--reduce_precision float32") == summed("--reduce_precision=float32") == "float32"
    assert summed("--steps 3") == summed("--reduce_precision=auto") == "bf16"
    assert summed("", hosts=1) == "float32"  # one host: fp32 sums


def test_trace_breakdown_sorts_a_steps_kernels_by_kind(tmp_path):
    """trace_breakdown.py: each kernel of a traced step lands in its kind (the compiled
    optimizer's foreach kernels as optimizer, not elementwise), idle is the span less the union of
    kernels, and NCCL's time is its own kind, with the part no compute kernel overlaps, in total
    and by kernel (--exposed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "trace_breakdown", ROOT / "benchmarks" / "trace_breakdown.py"
    )
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    kernels = [  # name, start, duration (us)
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 4000),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 4000, 1000),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 5000, 2000),
        ("triton_poi_fused__to_copy_1", 7000, 500),
        ("loss_and_grad_kernel", 7500, 500),
        ("triton_poi_fused__unsafe_view_mul_silu_9", 8000, 500),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 9000, 1000),
        ("triton_for_fused_1", 10000, 3000),  # 500 us idle before AdamW
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 12500, 1000),  # 500 us beside AdamW
        # FSDP2's all-gather copy-in, a foreach copy: a copy, not the optimizer's
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
            "(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::"
            "CopyFunctor<c10::BFloat16, float, 2, 1, 1>, at::native::Copy<c10::BFloat16, float> >",
            13500,
            500,
        ),
    ]
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels
        ]
        + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999}]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    parts = tb.breakdown(path)
    expected = {
        "matmul": 4.0,
        "attention fwd": 1.0,
        "attention bwd": 2.0,
        "copies / casts (FSDP, dtype, fp8)": 1.0,
        "loss": 0.5,
        "elementwise": 0.5,
        "optimizer": 4.0,
        "communication (NCCL)": 1.0,
    }
    assert {k: parts[k] for k in expected} == pytest.approx(expected)
    assert parts["busy"] == pytest.approx(13.5) and parts["idle"] == pytest.approx(0.5)
    assert parts["communication alone"] == pytest.approx(0.5)
    # --top: the longest kernels first, with their calls and kind
    top = tb.top_kernels(path, 2)
    assert [(ms, calls, what) for ms, calls, what, _ in top] == [
        (4.0, 1, "matmul"),
        (3.0, 1, "optimizer"),
    ]
    assert top[1][3] == "triton_for_fused_1"
    # --gaps: the one idle stretch, between the compiled SiLU and AdamW
    ((ms, before, after),) = tb.gaps(path, 3)
    assert ms == pytest.approx(0.5) and before == "triton_poi_fused__unsafe_view_mul_silu_9"
    assert after == "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>"
    # --exposed: the reduce-scatter, 12.5 ms into the span, half of it beside AdamW
    ((alone, at, ms, name),) = tb.exposed(path, 3)
    assert (alone, at, ms) == pytest.approx((0.5, 12.5, 1.0))
    assert name == "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"


def test_titan_side_by_side_alternates_rounds_and_compares_medians(capsys):
    """titan_side_by_side.py --rounds: every second round reversed (no trainer always first on a
    cool card), the clock read only while the card is busy, medians compared with the first
    trainer's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "titan_side_by_side", ROOT / "benchmarks" / "titan_side_by_side.py"
    )
    sbs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sbs)
    assert sbs.orders([None, "a", "b"], 3) == [[None, "a", "b"], ["b", "a", None], [None, "a", "b"]]
    # nvidia-smi's csv: clock MHz, temperature C, utilization %; idle samples left out
    text = "345, 30, 0\n1980, 41, 100\n1830, 52, 98\nbad line\n1755, 60, 95\n"
    assert sbs.busy_clocks(text) == {"mhz": 1830, "celsius": 60}
    assert sbs.busy_clocks("") == {"mhz": None, "celsius": None}
    row = dict(memory="-", step_ms=1.0, mhz=None, celsius=None)
    rows = [
        dict(row, who="titan", tok_s=100, round=1, order=0),
        dict(row, who="ours", tok_s=120, round=1, order=1),
        dict(row, who="ours", tok_s=110, round=2, order=1),  # round 2: reversed
        dict(row, who="titan", tok_s=90, round=2, order=0),
        dict(row, who="titan", tok_s=95, round=3, order=0),
        dict(row, who="ours", tok_s=130, round=3, order=1),
    ]
    assert sbs.median_rows(rows) == {"titan": 95, "ours": 120}
    sbs.print_rows(rows, 3)
    out = capsys.readouterr().out
    assert "| 2 | titan | 90 | 1.0 | - | - | - | 0.818x |" in out  # against round 2's first
    assert "| ours | 120 | 1.263x |" in out

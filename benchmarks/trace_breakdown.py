"""One step's device time by kind, from a torch.profiler Chrome trace (ours from --profile, or
torchtitan's profile_traces/iteration_N/rank0_trace.json), traced over `steps` steps:

    python benchmarks/trace_breakdown.py TRACE [--steps 1] [--step_ms MS] [--top N] [--gaps N] \
        [--exposed N]

Kinds, by kernel name (the first that matches): attention forward / backward (cuDNN, flash,
memory-efficient), matmuls (cuBLAS, CUTLASS, nvjet, fp8 included), optimizer (AdamW's and the grad
norm and clipping's multi-tensor kernels, the compiled step's foreach kernels), copies and casts
(FSDP's all-gather copy-in (a foreach copy) and copy-out, chunk_cat, dtype casts, memcpy/memset,
and compiled kernels that scale and cast float8 matmul inputs), communication (NCCL's kernels, with
the part of them no compute kernel overlaps: "communication alone"), loss (cross-entropy kernels),
elementwise (everything else: Triton kernels compile made, torch's elementwise and reduction
kernels). busy = the union of kernel intervals; idle = the span from the first kernel's start to the
last one's end, less busy (with --step_ms: the measured step less busy, which also counts the gap
between steps). --top N lists the N kernels that take the most time, each with its kind, calls and
ms a step; --gaps N the N longest stretches with no kernel running inside the span, each with the
kernels on either side; --exposed N the N NCCL kernels that ran longest with no compute kernel
beside them, each with its start in the span (a step's first all-gathers, its last reduce-scatters).
"""

import argparse
import gzip
import json
import re

KINDS = [
    (
        "attention bwd",
        lambda n: _attention(n) and any(k in n for k in ("bwd", "bprop", "dot_do_o")),
    ),
    ("attention fwd", lambda n: _attention(n)),
    ("matmul", lambda n: not n.startswith("triton") and any(k in n for k in MATMULS)),
    # triton_for_: inductor's foreach kernels, made only for the compiled optimizer step
    # (ClippedAdamW); the model's graphs have no foreach ops
    ("optimizer", lambda n: any(k in n for k in OPTIMIZER) and not _foreach_copy(n)),
    # NCCL's kernels run beside compute on their own stream: counted apart, and "communication
    # alone" says how much of them no compute kernel hides
    ("communication (NCCL)", lambda n: "nccl" in n),
    ("copies / casts (FSDP, dtype, fp8)", lambda n: _copy(n)),
    ("loss", lambda n: any(k in n for k in LOSSES)),
    ("elementwise", lambda n: True),
]
MATMULS = ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "wgmma", "cublas", "splitk")
OPTIMIZER = ("adam", "multi_tensor", "foreach", "lpnorm", "triton_for_")
LOSSES = ("cross_entropy", "log_softmax", "nll_loss", "loss_and_grad")
COPIES = ("chunk_cat", "split_with_sizes", "all_gather", "memcpy", "memset", "copy_kernel")


def _copy(n):
    """Copies and dtype casts: FSDP's all-gather copy-in/out, torch's copy kernels, compiled kernels
    that only cast, and compiled kernels that make float8 matmul inputs (Triton names a kernel after
    every op it fused: a bf16 cast fused into other work counts as elementwise)."""
    return (
        any(k in n for k in COPIES)
        or _foreach_copy(n)
        or re.fullmatch(r"triton_\w+?_fused__to_copy(_t)?_\d+", n)
        or n.startswith("triton")
        and "scaled_mm" in n  # float8 scales and casts of matmul inputs
    )


def _foreach_copy(n):
    """torch's foreach copy (FSDP2's all-gather copy-in, casting or not): a multi-tensor kernel that
    is no optimizer's."""
    return "multi_tensor" in n and ("copyfunctor" in n or "native::copy<" in n)


def _attention(n):
    return any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn", "cudnn"))


def kind(name):
    n = name.lower()
    return next(k for k, test in KINDS if test(n))


def device_events(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def breakdown(path, steps=1):
    """{kind: ms a step, ..., 'busy': ms, 'span': ms, 'idle': ms}."""
    events = device_events(path)
    out = {k: 0.0 for k, _ in KINDS}
    for e in events:
        out[kind(e["name"])] += e["dur"] / 1e3 / steps
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    compute = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if kind(e["name"]) != "communication (NCCL)"
    )
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    busy = _union(intervals)
    out.update(busy=busy / 1e3 / steps, span=span / 1e3 / steps)
    out["idle"] = out["span"] - out["busy"]
    out["communication alone"] = (busy - _union(compute)) / 1e3 / steps
    return out


def _union(intervals):
    """The time covered by sorted (start, end) intervals."""
    return sum(b - a for a, b in _merged(intervals))


def _merged(intervals):
    """Sorted (start, end) intervals merged where they overlap."""
    out = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def top_kernels(path, n, steps=1):
    """The n kernels with the most device time: (ms a step, calls a step, kind, name)."""
    totals, calls = {}, {}
    for e in device_events(path):
        totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / 1e3 / steps
        calls[e["name"]] = calls.get(e["name"], 0) + 1 / steps
    ranked = sorted(totals, key=totals.get, reverse=True)[:n]
    return [(totals[k], calls[k], kind(k), k) for k in ranked]


def gaps(path, n):
    """The n longest stretches inside the span where no kernel runs: (ms, the kernel that ended
    last before it, the kernel that starts it), longest first."""
    events = sorted(device_events(path), key=lambda e: e["ts"])
    found, end, last = [], None, None
    for e in events:
        if end is not None and e["ts"] > end:
            found.append(((e["ts"] - end) / 1e3, last, e["name"]))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e["name"]
    return sorted(found, key=lambda g: g[0], reverse=True)[:n]


def exposed(path, n):
    """The n NCCL kernels with the most time no compute kernel overlaps: (ms alone, ms from the
    span's start, ms long, name), most exposed first."""
    events = device_events(path)
    if not events:
        return []
    start = min(e["ts"] for e in events)
    nccl, compute = [], []
    for e in events:
        if kind(e["name"]) == "communication (NCCL)":
            nccl.append(e)
        else:
            compute.append((e["ts"], e["ts"] + e["dur"]))
    compute = _merged(sorted(compute))
    found = []
    for e in nccl:
        a, b = e["ts"], e["ts"] + e["dur"]
        hidden = sum(max(0, min(b, y) - max(a, x)) for x, y in compute if x < b and y > a)
        found.append(((b - a - hidden) / 1e3, (a - start) / 1e3, e["dur"] / 1e3, e["name"]))
    return sorted(found, key=lambda f: f[0], reverse=True)[:n]


def print_exposed(rows):
    for alone, at, ms, name in rows:
        print(f"  {alone:7.3f} ms alone  at {at:8.2f} ms, {ms:6.2f} ms long  {name[:60]}")


def print_gaps(rows):
    for ms, before, after in rows:
        print(f"  {ms:7.3f} ms idle  after {before[:60]}  before {after[:60]}")


def print_top(rows):
    for ms, count, what, name in rows:
        print(f"  {ms:7.2f} ms {count:6.0f}x  {what:12.12s}  {name[:110]}")


def print_breakdown(who, parts, step_ms=None):
    idle = step_ms - parts["busy"] if step_ms else parts["idle"]
    # both: idle inside the traced span, or between steps (or the traced step ran faster)
    span = f"a {parts['span']:.1f} ms span"
    of = f" of {step_ms:.1f} ms measured ({span})" if step_ms else f" of {span}"
    print(f"\n{who}: device busy {parts['busy']:.1f} ms a step{of}")
    for k, _ in KINDS:
        print(f"  {k:34s} {parts[k]:7.1f} ms")
    print(f"  {'idle':34s} {idle:7.1f} ms")
    if parts["communication (NCCL)"]:
        print(f"  {'communication alone (not hidden)':34s} {parts['communication alone']:7.1f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--step_ms", type=float, default=None)
    p.add_argument("--top", type=int, default=0, help="list the N kernels that take the most time")
    p.add_argument("--gaps", type=int, default=0, help="list the N longest idle stretches")
    p.add_argument("--exposed", type=int, default=0, help="list the N NCCL kernels least hidden")
    args = p.parse_args()
    print_breakdown(args.trace, breakdown(args.trace, args.steps), args.step_ms)
    if args.top:
        print_top(top_kernels(args.trace, args.top, args.steps))
    if args.gaps:
        print_gaps(gaps(args.trace, args.gaps))
    if args.exposed:
        print_exposed(exposed(args.trace, args.exposed))


if __name__ == "__main__":
    main()

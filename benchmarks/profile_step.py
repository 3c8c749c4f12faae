"""Where does a training step's time go? torch.profiler over a few steps of the real train_step.

    mpiexec -n 1 python benchmarks/profile_step.py --model_preset gpt2 --vocab_size 50304 \
        --precision bf16 --batch_size 32 --compile [--out DIR]

Prints the host time to issue one step while the device is held busy (so the launch queue never
fills and blocks the host), the wall time of a step, and the device time per step split into kinds
of kernel (matmul, attention, fused element-wise, optimizer, copies), then the top kernels. Host
time near or above device time means the GPU waits on Python and launches. Over several GPUs,
communication kernels run on their own streams beside the compute, and their time includes waiting
for the other ranks: it overlaps, it does not add up.
"""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import BENCH_OPTIONS, build, parse  # noqa: E402  (flags and model as the throughput benchmark builds them)

from minimal_fsdp.launch import environment  # noqa: E402
from minimal_fsdp.train import train_step  # noqa: E402

# Kernel name fragments -> kind; the first match wins.
KINDS = [
    ("communication", ("nccldevkernel",)),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet")),
    ("optimizer", ("adam", "foreach", "norm_kernel")),
    ("loss", ("cross_entropy", "log_softmax", "nll", "loss_and_grad")),
    ("copy/cast", ("copy", "memcpy", "cast", "fill")),
    ("compiled (triton)", ("triton",)),
]


def annotation(name):
    """Profiler ranges that the device timeline shows beside the kernels (compiled graphs, FSDP,
    optimizer)."""
    return name.startswith(("##", "nccl:")) or (
        ("::" in name or "#" in name) and not name.startswith("void")
    )


def kind(name):
    lower = name.lower()
    return next((k for k, keys in KINDS if any(key in lower for key in keys)), "other")


def by_kind(prof, steps):
    """The profiled kernels (no annotation ranges) and their device ms a step summed by kind,
    largest first."""
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not annotation(e.key)
    ]
    kinds = {}
    for e in kernels:
        kinds[kind(e.key)] = kinds.get(kind(e.key), 0) + e.self_device_time_total / steps / 1e3
    return kernels, dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def print_kinds(kinds, before=""):
    """The device busy line (`before` leads it) and the ms a step of each kind."""
    print(f"{before}device busy {sum(kinds.values()):.1f} ms (sum of kernel times)")
    for k, ms in kinds.items():
        print(f"  {k:18s} {ms:6.1f} ms")


def print_kernels(kernels, steps, top=40):
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        ms, count = e.self_device_time_total / steps / 1e3, e.count // steps
        print(f"{ms:7.2f} ms {count:4d}x  [{kind(e.key)}] {e.key[:110]}")


def main():
    cfg, options = parse(
        {
            "steps": (int, 6, "profiled steps"),
            "warmup": (int, 5, "steps before any timing"),
            "out": (str, None, "write a Chrome trace here"),
            "fsdp_on_one_rank": BENCH_OPTIONS["fsdp_on_one_rank"],
        }
    )
    steps, out = options["steps"], options["out"]
    env, config, model, optimizer, sync = build(cfg, options["fsdp_on_one_rank"])
    tokens = torch.randint(
        config.vocab_size, (cfg.batch_size, config.seq_length + 1), device=env.device
    )
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    for _ in range(options["warmup"]):
        train_step(model, optimizer, batch, sync, cfg.grad_clip, env.device)
    torch.cuda.synchronize()
    # Host time: a long sleep kernel keeps the device busy, so issuing one step never waits on it.
    hosts = []
    for _ in range(3):
        torch.cuda._sleep(2_000_000_000)
        t0 = time.perf_counter()
        train_step(model, optimizer, batch, sync, cfg.grad_clip, env.device)
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, batch, sync, cfg.grad_clip, env.device)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
    ) as prof:
        for _ in range(steps):
            train_step(model, optimizer, batch, sync, cfg.grad_clip, env.device)
        torch.cuda.synchronize()
    if env.is_main:
        events = prof.key_averages()
        kernels, kinds = by_kind(prof, steps)
        # A step that launches more kernels than the device's queue holds waits for the sleep
        # to end.
        host = (
            f"{min(hosts) * 1e3:.1f} ms"
            if min(hosts) < 0.5
            else "not measurable (the launch queue filled)"
        )
        print_kinds(
            kinds, f"per step: host issue {host} (device kept busy), wall {wall * 1e3:.1f} ms, "
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        # Inclusive host time: which ranges (optimizer step, compiled graphs, DDP, autograd) hold
        # the host longest.
        print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
        # Which operator (and input shapes) launched the costliest kernels.
        print(
            prof.key_averages(group_by_input_shape=True).table(
                sort_by="device_time_total",
                row_limit=25,
                max_name_column_width=40,
                max_shapes_column_width=70,
            )
        )
        print_kernels(kernels, steps)
        if out:
            prof.export_chrome_trace(str(Path(out) / "trace.json"))
    environment.teardown()


if __name__ == "__main__":
    main()

"""nanoGPT's training step timed as benchmarks/throughput.py times ours, and profiled into
profile_step.py's kinds.

    python benchmarks/nanogpt_step.py --nanogpt .ref/nanogpt --batch_size 32 [--profile]
Runs the step of nanoGPT's bench.py (its GPT-2 124M without biases, compiled, bf16 autocast, its
fused AdamW, random tokens as bench.py --real_data=False) from a copy of its repository (never
committed here: gpu_check.sh's nanogpt_bench part carries it in .ref/nanogpt). bench.py itself times
the wall over steps that each wait on loss.item(); this times each step with CUDA events and reports
the median, as throughput.py does for ours, so the two rows compare kernel for kernel (issue 40,
target 4; docs/performance.md).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import by_kind, print_kernels, print_kinds  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--nanogpt", default=".ref/nanogpt", help="a copy of nanoGPT's repository (its model.py)"
    )
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--profile", action="store_true", help="then profile 3 steps: kernel time a step by kind"
    )
    args = p.parse_args()
    sys.path.insert(0, str(Path(args.nanogpt).resolve()))
    from model import GPT, GPTConfig  # nanoGPT's

    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as bench.py
    model = GPT(
        GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False)
    ).cuda()
    optimizer = model.configure_optimizers(
        weight_decay=1e-2, learning_rate=1e-4, betas=(0.9, 0.95), device_type="cuda"
    )
    model = torch.compile(model)
    x, y = (torch.randint(50304, (args.batch_size, 1024), device="cuda") for _ in range(2))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    events = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    print(
        f"nanoGPT, batch {args.batch_size}: median step {ms:.2f} ms, "
        f"{args.batch_size * 1024 / ms * 1e3:,.0f} tokens/s, peak "
        f"{torch.cuda.max_memory_allocated() / 1e9:.1f} GB"
    )
    if args.profile:
        steps = 3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        kernels, kinds = by_kind(prof, steps)
        print_kinds(kinds)
        print_kernels(kernels, steps, top=30)


if __name__ == "__main__":
    main()

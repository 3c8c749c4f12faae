"""Causal attention kernels at one model's shape: forward and forward+backward time of each SDPA
backend (cuDNN, flash, memory-efficient) and of FlexAttention (compiled), with q, k, v laid out as
the model makes them (views of one fused qkv projection).

    python benchmarks/attention.py --batch 32 --heads 12 --seq 1024 --head_dim 64
Prints one markdown row per kernel: ms forward, ms forward+backward, and the causal FLOP rate (half
of the 4·B·H·T²·D forward FLOPs of full attention; backward counted as 2.5× forward, as
FlashAttention's papers do). Each kernel's output is first checked against fp32 math attention on
the same inputs.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def qkv(batch, heads, seq, head_dim, generator):
    """q, k, v of shape (B, H, T, D) as strided views of one (B, T, 3C) tensor, like the model's."""
    c = heads * head_dim
    fused = torch.randn(batch, seq, 3 * c, device="cuda", dtype=torch.bfloat16, generator=generator)
    fused.requires_grad_(True)
    q, k, v = fused.split(c, dim=2)
    return fused, [t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in (q, k, v)]


def kernels():
    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run

    out = {
        "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        masks = {}

        def flex(q, k, v):
            T = q.shape[2]
            if T not in masks:
                masks[T] = create_block_mask(
                    lambda b, h, i, j: j <= i, None, None, T, T, device="cuda"
                )
            return compiled(q, k, v, block_mask=masks[T])

        out["flex"] = flex
    except ImportError:
        pass
    return out


def time_ms(fn, warmup=5, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head_dim", type=int, default=64)
    a = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    # causal: half the score matrix
    flops_fwd = 4 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    print(
        f"| kernel | B={a.batch} H={a.heads} T={a.seq} D={a.head_dim} | fwd ms | fwd+bwd ms | "
        f"fwd+bwd TFLOP/s | rel err |\n|---|---|---|---|---|---|"
    )
    for name, fn in kernels().items():
        # Check first, on small fresh inputs, against fp32 math attention.
        _, (q, k, v) = qkv(2, a.heads, 256, a.head_dim, generator)
        try:
            out = fn(q, k, v).float()
        except RuntimeError as e:
            print(f"| {name} | unavailable: {str(e).splitlines()[0][:80]} | | | | |")
            continue
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        err = ((out - ref).norm() / ref.norm()).item()
        fused, (q, k, v) = qkv(a.batch, a.heads, a.seq, a.head_dim, generator)
        grad = torch.randn(
            a.batch,
            a.heads,
            a.seq,
            a.head_dim,
            device="cuda",
            dtype=torch.bfloat16,
            generator=generator,
        )
        with torch.no_grad():
            fwd = time_ms(lambda: fn(q, k, v))

        def both():
            fused.grad = None
            fn(q, k, v).backward(grad)

        total = time_ms(both)
        print(
            f"| {name} | | {fwd:.2f} | {total:.2f} | {3.5 * flops_fwd / total / 1e9:.0f} | "
            f"{err:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

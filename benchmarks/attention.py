"""Causal attention kernels at one model's shape: forward and forward+backward time of each SDPA
backend (cuDNN, flash, memory-efficient), of FlexAttention (compiled) and, where it is installed,
of FlashAttention-4's CuTe kernels (`pip install --pre flash-attn-4`: Hopper and Blackwell), with
q, k, v laid out as the model makes them (views of one fused qkv projection).

    python benchmarks/attention.py --batch 32 --heads 12 --seq 1024 --head_dim 64
    python benchmarks/attention.py --batch 1 --heads 32 --kv_heads 8 --seq 8192 --head_dim 128
Prints one markdown row per kernel: ms forward, ms forward+backward, and the causal FLOP rate (half
of the 4·B·H·T²·D forward FLOPs of full attention; backward counted as 2.5× forward, as
FlashAttention's papers do). Each kernel's output is first checked against fp32 math attention on
the same inputs.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def qkv(batch, heads, kv_heads, seq, head_dim, generator):
    """q (B, H, T, D) and k, v (B, K, T, D) as strided views of one (B, T, (H + 2K)·D) tensor, like
    the model's."""
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    fused = torch.randn(
        batch, seq, sum(sizes), device="cuda", dtype=torch.bfloat16, generator=generator
    )
    fused.requires_grad_(True)
    return fused, [
        t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in fused.split(sizes, dim=2)
    ]


def kernels():
    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1)
                )

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
            gqa = k.size(1) != q.size(1)
            return compiled(q, k, v, block_mask=masks[T], enable_gqa=gqa)

        out["flex"] = flex
    except ImportError:
        pass
    try:
        from flash_attn.cute import flash_attn_func  # FlashAttention-4 (CuTe DSL), if installed

        def fa4(q, k, v):  # it takes (B, T, H, D): the same views, transposed back
            out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        out["fa4"] = fa4
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
    parser.add_argument("--kv_heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head_dim", type=int, default=64)
    a = parser.parse_args()
    kv = a.kv_heads or a.heads
    generator = torch.Generator(device="cuda").manual_seed(0)
    # causal: half the score matrix
    flops_fwd = 4 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    print(
        f"| kernel | B={a.batch} H={a.heads} K={kv} T={a.seq} D={a.head_dim} | fwd ms | "
        f"fwd+bwd ms | fwd+bwd TFLOP/s | rel err |\n|---|---|---|---|---|---|"
    )
    for name, fn in kernels().items():
        # Check first, on small fresh inputs, against fp32 math attention.
        _, (q, k, v) = qkv(2, a.heads, kv, 256, a.head_dim, generator)
        try:
            out = fn(q, k, v).float()
        except (RuntimeError, AssertionError, ValueError) as e:  # FA4 asserts what it cannot run
            print(f"| {name} | unavailable: {str(e).splitlines()[0][:80]} | | | | |")
            continue
        ref = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=True, enable_gqa=kv != a.heads
        )
        err = ((out - ref).norm() / ref.norm()).item()
        fused, (q, k, v) = qkv(a.batch, a.heads, kv, a.seq, a.head_dim, generator)
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

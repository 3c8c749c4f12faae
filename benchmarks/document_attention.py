"""Attention alone over windows packing documents, at one model's shape (default: Llama 3 8B at
T=8192): plain causal SDPA (what a run without --document_mask does), FlexAttention causal,
FlexAttention with the document mask (what --document_mask runs on CUDA by default:
minimal_fsdp/models/attention.py), and torch's variable-length flash attention
(torch.nn.attention.varlen, what it runs with MINIMAL_FSDP_DOCUMENT_KERNEL=varlen), each forward and
forward+backward.

    python benchmarks/document_attention.py --batch 1 --heads 32 --kv_heads 8 --seq 8192 \
        --head_dim 128 --document_length 2048

Prints one markdown row per kernel: the time to build its mask (or packed starts) for a batch,
forward, forward + backward, and for the document kernels the relative error against dense-mask math
on a small input.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import time_ms  # noqa: E402  (benchmarks/attention.py)
from document_mask import packed_windows  # noqa: E402

from minimal_fsdp.models import attention  # noqa: E402

EOT = 1


def causal_sdpa(idx):
    def run(q, k, v):
        groups = q.size(1) // k.size(1)  # as layers.attend: each query head gets its group's k, v
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
        )

    return run


def flex_causal(idx):
    from torch.nn.attention.flex_attention import create_block_mask

    T = idx.size(1)
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, T, T, device=idx.device)
    return lambda q, k, v: attention.attend_documents(q, k, v, mask, 0.0)


def flex_document(idx):
    # as the model builds it once per forward, on CUDA
    mask = attention.document_mask(idx, EOT, kernel="flex")
    return lambda q, k, v: attention.attend_documents(q, k, v, mask, 0.0)


def varlen_document(idx):
    # MINIMAL_FSDP_DOCUMENT_KERNEL=varlen's path
    mask = attention.document_mask(idx, EOT, kernel="varlen")
    return lambda q, k, v: attention.attend_documents(q, k, v, mask, 0.0)


def main():
    p = argparse.ArgumentParser()
    for name, default in (
        ("batch", 1),
        ("heads", 32),
        ("kv_heads", 8),
        ("seq", 8192),
        ("head_dim", 128),
        ("document_length", 2048),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def inputs(B, T):
        idx = packed_windows(1, B, T, 50000, a.document_length, EOT, 0)[0][0].cuda()
        q = torch.randn(B, a.heads, T, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (
            torch.randn(
                B, a.kv_heads, T, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g
            )
            for _ in range(2)
        )
        return idx, [t.requires_grad_() for t in (q, k, v)]

    kernels = {
        "sdpa causal": causal_sdpa,
        "flex causal": flex_causal,
        "flex document": flex_document,
        "varlen document": varlen_document,
    }
    print(
        f"| kernel | B={a.batch} H={a.heads} K={a.kv_heads} T={a.seq} D={a.head_dim}, docs "
        f"~{a.document_length} "
        "| build ms | fwd ms | fwd+bwd ms | rel err |\n|---|---|---|---|---|---|"
    )
    idx_small, (q, k, v) = inputs(1, 1024)
    dense = attention.document_mask(idx_small, EOT, kernel="dense")
    ref = attention.attend_documents(q.float(), k.float(), v.float(), dense, 0.0)
    idx, (q_big, k_big, v_big) = inputs(a.batch, a.seq)
    grad = torch.randn_like(q_big)
    for name, kernel in kernels.items():
        try:
            # the mask or the packed starts, once per batch in training
            build = time_ms(lambda: kernel(idx))
            if "causal" in name:
                err = ""
            else:
                error = (kernel(idx_small)(q, k, v).float() - ref).norm() / ref.norm()
                err = f"{error.item():.1e}"
            fn = kernel(idx)
            with torch.no_grad():
                fwd = time_ms(lambda: fn(q_big, k_big, v_big))
            total = time_ms(lambda: torch.autograd.backward(fn(q_big, k_big, v_big), grad))
        except (RuntimeError, ImportError) as e:
            print(f"| {name} | unavailable: {str(e).splitlines()[0][:80]} | | | | |", flush=True)
            continue
        print(f"| {name} | {build:.2f} | {fwd:.2f} | {total:.2f} | {err} |", flush=True)


if __name__ == "__main__":
    main()

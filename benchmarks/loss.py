"""The loss head alone at GPT-2's shape: output projection + cross-entropy, forward and backward.

    python benchmarks/loss.py [--tokens 32768] [--embed 768] [--vocab 50304]
Compares the fused Triton loss (minimal_fsdp/models/fused_loss.py) over a few block sizes and warp
counts with the compiled PyTorch loss that it replaced, each first checked against fp32 math; median
of 20 timed calls. CUDA only.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import time_ms  # noqa: E402  (median of timed calls, as the attention benchmark times)

from minimal_fsdp.models import fused_loss  # noqa: E402
from minimal_fsdp.models.gpt import cross_entropy  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--embed", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.embed, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(a.vocab, a.embed, device="cuda")).bfloat16().requires_grad_()
    targets = torch.randint(0, a.vocab, (a.tokens,), device="cuda")

    # fp32 math on a slice of the tokens (the full fp32 logits would not fit comfortably)
    def ref():
        n = 4096
        xr, wr = x[:n].detach().float().requires_grad_(), w.detach().float().requires_grad_()
        loss = torch.nn.functional.cross_entropy(xr @ wr.t(), targets[:n])
        loss.backward()
        return loss.item(), xr.grad

    ref_loss, ref_dx = ref()

    def run(loss_fn):
        x.grad = w.grad = None
        loss_fn(x, w, targets).backward()

    def check(loss_fn):
        x.grad = w.grad = None
        loss = loss_fn(x[:4096], w, targets[:4096])
        loss.backward()
        return abs(loss.item() - ref_loss), (
            (x.grad[:4096].float() - ref_dx).norm() / ref_dx.norm()
        ).item()

    matmuls = 3 * 2 * a.tokens * a.embed * a.vocab
    logits_gb = a.tokens * a.vocab * 2 / 1e9
    print(
        f"tokens {a.tokens}, embed {a.embed}, vocab {a.vocab}: bf16 logits {logits_gb:.2f} GB; "
        f"matmuls alone at 740 TFLOP/s would take {matmuls / 740e12 * 1e3:.2f} ms"
    )
    print(
        "| loss | config | fwd+bwd ms | forward ms | kernel alone ms | loss err | dx rel err |\n"
        "|---|---|---|---|---|---|---|"
    )
    compiled = torch.compile(cross_entropy)
    err = check(compiled)
    print(
        f"| compiled PyTorch | | {time_ms(lambda: run(compiled)):.2f} | | | {err[0]:.1e} | "
        f"{err[1]:.1e} |"
    )
    dlogits = torch.randn(a.tokens, a.vocab, device="cuda", dtype=torch.bfloat16)
    xd, wd = x.detach(), w.detach()
    ms = time_ms(lambda: (xd @ wd.t(), dlogits @ wd, dlogits.t() @ xd))
    print(f"| the three matmuls only | | {ms:.2f} | {time_ms(lambda: xd @ wd.t()):.2f} | | | |")
    print(
        f"| one read + one write of the logits (mul_) | | | | "
        f"{time_ms(lambda: dlogits.mul_(1.0)):.2f} | | |"
    )
    losses = torch.empty(a.tokens, device="cuda")
    for block, warps in ((4096, 8), (8192, 8), (16384, 8), (8192, 16)):
        fused_loss.BLOCK, fused_loss.NUM_WARPS = block, warps
        err = check(fused_loss.linear_cross_entropy)
        ms = time_ms(lambda: run(fused_loss.linear_cross_entropy))
        forward = time_ms(lambda: fused_loss.project_and_reduce(xd, wd, targets, True))
        kernel = time_ms(lambda: fused_loss.loss_and_grad(dlogits, targets, losses))
        print(
            f"| fused Triton | BLOCK {block}, {warps} warps | {ms:.2f} | {forward:.2f} | "
            f"{kernel:.2f} | {err[0]:.1e} | {err[1]:.1e} |",
            flush=True,
        )
    fused_loss.BLOCK, fused_loss.NUM_WARPS = 8192, 8
    with torch.no_grad():
        ms = time_ms(lambda: fused_loss.linear_cross_entropy(x, w, targets))
        print(f"| fused Triton, no grad (evaluation) | | | {ms:.2f} | | | |")


if __name__ == "__main__":
    main()

"""A GPT-2 MLP (fc, tanh GELU, proj; no biases) forward and backward at one shape: eager, compiled,
and, where it is installed, quack's GEMMs with the activation fused into their epilogues
(`pip install quack-kernels`: Hopper and Blackwell), the GELU and its gradient never written as
tensors of their own.

    python benchmarks/mlp.py --tokens 32768 --width 768
Prints one markdown row per path: ms forward+backward, the matmuls' FLOP rate, and the largest
relative difference of the output and the three gradients from the eager path's.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import time_ms  # noqa: E402  (median of CUDA-event timings)


def mlp(x, fc, proj):
    return F.linear(F.gelu(F.linear(x, fc), approximate="tanh"), proj)


def paths():
    out = {"eager": mlp, "compiled": torch.compile(mlp)}
    try:
        from quack.mlp import mlp_func

        def quack(x, fc, proj):
            return mlp_func(x, fc, proj, activation="gelu_tanh_approx")

        out["quack"] = quack
        out["quack, compiled"] = torch.compile(quack)
    except ImportError:
        pass
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768, help="batch x sequence")
    parser.add_argument("--width", type=int, default=768)
    a = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        t = torch.randn(*shape, device="cuda", generator=g) * scale
        return t.bfloat16().requires_grad_()

    x, fc, proj = (
        randn(a.tokens, a.width),
        randn(4 * a.width, a.width, scale=0.02),
        randn(a.width, 4 * a.width, scale=0.02),
    )
    grad = torch.randn(a.tokens, a.width, device="cuda", generator=g).bfloat16()
    flops = 3 * 2 * 2 * a.tokens * a.width * 4 * a.width  # two matmuls, forward and 2x backward
    print(
        f"| path | M={a.tokens} C={a.width} | fwd+bwd ms | TFLOP/s | rel diff |\n"
        "|---|---|---|---|---|"
    )
    reference = None
    for name, fn in paths().items():

        def both():
            out = fn(x, fc, proj)
            return [out, *torch.autograd.grad(out, (x, fc, proj), grad)]

        try:
            results = [t.float() for t in both()]
        except (RuntimeError, AssertionError, ValueError) as e:
            print(f"| {name} | unavailable: {str(e).splitlines()[0][:80]} | | | |")
            continue
        reference = reference or results
        diff = max(((r - e).norm() / e.norm()).item() for r, e in zip(results, reference))
        ms = time_ms(both)
        print(f"| {name} | | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()

"""Which kernel plain causal attention (layers.attend) runs on Hopper, and that it computes the same
function as flash attention (GPU tier): SDPA's own dispatch picks cuDNN's fused attention at the
Llama 3 8B and GPT-2 training shapes (torch 2.11, cuDNN 9.19, H200, 2026-11-29), the fastest SDPA
kernel there (benchmarks/attention.py); a torch whose dispatch moves off it fails here. In bf16 the
grouped keys and values go to SDPA as they are (enable_gqa), never repeated per query head."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from minimal_fsdp.models import layers
from minimal_fsdp.models.layers import attend

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU",
)


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("heads,kv_heads,head_size,T", [(32, 8, 128, 2048), (12, 12, 64, 1024)])
def test_training_attention_runs_cudnn_and_matches_flash_and_fp64(
    monkeypatch, heads, kv_heads, head_size, T
):
    """Llama 3's (grouped keys, head 128) and GPT-2's (head 64) attention, bf16: output and the
    gradients of q, k, v by SDPA's own dispatch against flash attention and an fp64 reference on
    the same fresh inputs; both land at bf16's rounding of the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, heads, T, head_size), (2, kv_heads, T, head_size), (2, kv_heads, T, head_size)]
    inputs = [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes]
    grad = torch.randn(shapes[0], device="cuda", generator=g, dtype=torch.bfloat16)

    sdpa, seen = layers.F.scaled_dot_product_attention, []

    def recorded(q, k, v, **kwargs):  # the key heads SDPA is handed, and whether as groups
        seen.append((k.size(1), kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", recorded)

    def run(dtype, backends=None):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
        if backends:
            with sdpa_kernel(backends):
                y = attend(q, k, v, None, 0, 0.0)
        else:
            y = attend(q, k, v, None, 0, 0.0)
        y.backward(grad.to(dtype))
        return [y.detach(), q.grad, k.grad, v.grad]

    reference = run(torch.float64, [SDPBackend.MATH])
    # fp64 has no fused kernel that takes groups: k and v are repeated per query head
    assert seen.pop() == (heads, False)
    flash = run(torch.bfloat16, [SDPBackend.FLASH_ATTENTION])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dispatched = run(torch.bfloat16)
        torch.cuda.synchronize()
    # bf16: flash and cuDNN read the groups' own k and v
    assert seen == [(kv_heads, heads != kv_heads)] * 2
    kernels = " ".join(e.key.lower() for e in prof.key_averages())
    assert "cudnn" in kernels and "flash_fwd" not in kernels, kernels[:2000]
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), dispatched, flash, reference):
        assert torch.isfinite(a).all(), name
        error, baseline = relative_error(a, r), relative_error(b, r)
        assert error < 1e-2 and error < 1.5 * baseline + 1e-3, (name, error, baseline)

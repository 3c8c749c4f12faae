"""SDPA's kernel order for plain causal attention (attention.prefer_cudnn_attention): cuDNN first on
Hopper, the same function as SDPA's default path (GPU tier), and the order and its fallbacks
(any machine)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from minimal_fsdp.models import attention
from minimal_fsdp.models.attention import KernelError, prefer_cudnn_attention
from minimal_fsdp.models.layers import attend


@pytest.fixture
def restored_order():
    before = torch._C._get_sdp_priority_order()
    yield
    torch._C._set_sdp_priority_order(before)


def test_default_leaves_sdpas_order_and_a_bad_value_is_refused(restored_order):
    before = torch._C._get_sdp_priority_order()
    assert "own kernel order" in prefer_cudnn_attention({"MINIMAL_FSDP_SDPA": "default"})
    assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(KernelError, match="MINIMAL_FSDP_SDPA"):
        prefer_cudnn_attention({"MINIMAL_FSDP_SDPA": "fast"})


def test_off_hopper_the_order_is_left_alone(restored_order, monkeypatch):
    before = torch._C._get_sdp_priority_order()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert prefer_cudnn_attention({}) is None
    assert torch._C._get_sdp_priority_order() == before


def test_on_hopper_cudnn_goes_first_and_the_rest_follow(restored_order, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: attention.CUDNN_MIN_VERSION)
    before = torch._C._get_sdp_priority_order()
    assert "cuDNN first" in prefer_cudnn_attention({})
    order = torch._C._get_sdp_priority_order()
    assert order[:3] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION),
                         int(SDPBackend.EFFICIENT_ATTENTION)]  # fmt: skip
    assert sorted(order) == sorted(before)  # a reordering: every backend is still there
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    torch._C._set_sdp_priority_order(before)
    assert "older than 9.5" in prefer_cudnn_attention({})
    assert torch._C._get_sdp_priority_order() == before


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU",
)


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("heads,kv_heads,head_size,T", [(32, 8, 128, 2048), (12, 12, 64, 1024)])
def test_cudnn_attention_matches_the_default_path_forward_and_backward(
    restored_order, heads, kv_heads, head_size, T
):
    """Llama 3's (grouped keys, head 128) and GPT-2's (head 64) attention, bf16: the output and the
    gradients of q, k, v through cuDNN first against SDPA's default path and an fp64 reference on
    the same fresh inputs; both bf16 paths land at bf16's rounding of the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, heads, T, head_size), (2, kv_heads, T, head_size), (2, kv_heads, T, head_size)]
    inputs = [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes]
    grad = torch.randn(shapes[0], device="cuda", generator=g, dtype=torch.bfloat16)

    def run(dtype, backends=None):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in inputs)
        if backends:
            with sdpa_kernel(backends):
                y = attend(q, k, v, None, 0, 0.0)
        else:
            y = attend(q, k, v, None, 0, 0.0)
        y.backward(grad.to(dtype))
        return [y.detach(), q.grad, k.grad, v.grad]

    torch.cuda.synchronize()
    reference = run(torch.float64, [SDPBackend.MATH])
    default = run(torch.bfloat16, [SDPBackend.FLASH_ATTENTION])
    assert "cuDNN first" in prefer_cudnn_attention({})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        cudnn = run(torch.bfloat16)
        torch.cuda.synchronize()
    kernels = " ".join(e.key.lower() for e in prof.key_averages())
    assert "cudnn" in kernels or "sm90" in kernels, kernels[:2000]  # cuDNN's kernels ran
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), cudnn, default, reference):
        assert torch.isfinite(a).all(), name
        error, baseline = relative_error(a, r), relative_error(b, r)
        assert error < 1e-2 and error < 1.5 * baseline + 1e-3, (name, error, baseline)

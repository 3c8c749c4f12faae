"""The fused Triton loss (CUDA only, marked gpu) against PyTorch's cross-entropy in fp32."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# bf16 logits are rounded to 8 bits of mantissa before the softmax; fp32 differs only in
# summation order.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def reference(x, weight, targets, scale):
    """Loss and gradients of scale * mean cross-entropy, in fp32 from the same (rounded) inputs."""
    x, weight = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    loss = F.cross_entropy((x @ weight.t()).view(-1, weight.size(0)), targets.view(-1))
    (scale * loss).backward()
    return loss, x.grad, weight.grad


def relative(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
# below, across and many times the kernel's block
@pytest.mark.parametrize("vocab", [50, 5003, 50304])
def test_loss_and_gradients_match_pytorch(dtype, vocab):
    from minimal_fsdp.models.fused_loss import linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(3, 37, 64, device="cuda", dtype=dtype, requires_grad=True)
    weight = (0.5 * torch.randn(vocab, 64, device="cuda")).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (3, 37), device="cuda")
    targets[0, :3] = torch.tensor([0, vocab - 1, vocab // 2])  # the first and last columns too
    scale = 0.25  # the 1 / accumulation steps training multiplies the loss by
    loss = linear_cross_entropy(x, weight, targets)
    (scale * loss).backward()
    ref_loss, ref_dx, ref_dweight = reference(x, weight, targets, scale)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=TOLERANCE[dtype] / 10)
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    assert relative(x.grad, ref_dx) < TOLERANCE[dtype]
    assert relative(weight.grad, ref_dweight) < TOLERANCE[dtype]


def loss_under_autocast():
    """fp32 x and weight (vocab 1000) and the fused loss of them under bf16 autocast."""
    from minimal_fsdp.models.fused_loss import linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(64, 32, device="cuda", requires_grad=True)
    weight = torch.randn(1000, 32, device="cuda", requires_grad=True)
    targets = torch.randint(0, 1000, (64,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return x, weight, targets, linear_cross_entropy(x, weight, targets)


def test_autocast_with_fp32_weights():
    """Decentralized replicas keep fp32 weights and run under bf16 autocast: gradients come back in
    fp32."""
    x, weight, targets, loss = loss_under_autocast()
    loss.backward()
    ref_loss, ref_dx, ref_dweight = reference(x, weight, targets, 1.0)
    assert x.grad.dtype == weight.grad.dtype == torch.float32
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2)
    assert relative(x.grad, ref_dx) < 3e-2 and relative(weight.grad, ref_dweight) < 3e-2


def test_backward_makes_one_pass_over_the_weight_gradient():
    """Under autocast with an fp32 weight, the weight's gradient comes out of its matmul in fp32:
    no other op of backward writes a vocab x C tensor (no scale multiply, no cast back from bf16);
    with an upstream scale, the result still matches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.ops.append((str(func), tuple(t.shape), t.dtype))
            return out

    x, weight, targets, loss = loss_under_autocast()
    writes = Writes()
    with writes:
        (0.5 * loss).backward()
    on_weight = [
        (op, dtype)
        for op, shape, dtype in writes.ops
        if shape == tuple(weight.shape) and "detach" not in op  # detach writes nothing
    ]
    assert on_weight == [("aten.mm.dtype", torch.float32)], on_weight
    _, ref_dx, ref_dweight = reference(x, weight, targets, 0.5)
    assert weight.grad.dtype == torch.float32
    assert relative(x.grad, ref_dx) < 3e-2 and relative(weight.grad, ref_dweight) < 3e-2


def test_models_on_cuda_use_it():
    """build_model swaps the fused loss in on CUDA; the model's loss still equals PyTorch's."""
    from types import SimpleNamespace

    from minimal_fsdp.config.flags import Config
    from minimal_fsdp.models.fused_loss import linear_cross_entropy
    from minimal_fsdp.models.gpt import GPT, GPTConfig
    from minimal_fsdp.models.layers import cross_entropy
    from minimal_fsdp.parallel.parallelize import build_model
    from minimal_fsdp.parallel.plan import make_plan

    cfg = Config(precision="float32")
    env = SimpleNamespace(
        device=torch.device("cuda"), world_size=1, local_world_size=1, num_nodes=1
    )
    config = GPTConfig(vocab_size=300)
    # one rank: no FSDP
    model = build_model(GPT, config, make_plan(cfg, env, config), env, cfg.seed)
    assert model.loss is linear_cross_entropy
    x = torch.randint(0, 300, (2, 128), device="cuda")
    fused = model(x, x)
    model.loss = cross_entropy
    assert fused.item() == pytest.approx(model(x, x).item(), rel=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_evaluation_computes_the_loss_without_the_gradient_pass(autocast):
    """Under no_grad the loss is the same, and the kernel leaves the logits as they were (no
    gradient pass)."""
    from minimal_fsdp.models.fused_loss import linear_cross_entropy, loss_and_grad

    torch.manual_seed(0)
    x = torch.randn(2, 50, 32, device="cuda", requires_grad=True)
    weight = torch.randn(5003, 32, device="cuda", requires_grad=True)
    targets = torch.randint(0, 5003, (2, 50), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(x, weight, targets)
    ref_loss = reference(x, weight, targets, 1.0)[0]
    assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2 if autocast else 1e-5)
    logits = torch.randn(100, 5003, device="cuda")
    kept, losses = logits.clone(), torch.empty(100, device="cuda")
    loss_and_grad(logits, targets.view(-1), losses, with_grad=False)
    assert torch.equal(logits, kept)
    assert torch.allclose(
        losses, F.cross_entropy(kept, targets.view(-1), reduction="none"), rtol=1e-5
    )


def scaled_mm_calls(fn):
    """The aten ops fn runs that are float8 matmuls (_scaled_mm), by the shapes they multiply."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_mm.default:
                self.shapes.append((tuple(args[0].shape), tuple(args[1].shape), args[0].dtype))
            return func(*args, **(kwargs or {}))

    with Calls() as calls:
        fn()
    return calls.shapes


float8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs float8 tensor cores (compute capability 8.9+)",
)


@float8_gpu
def test_float8_head_matches_pytorch_within_float8s_error(monkeypatch):
    """--precision fp8 (tensorwise): the logits come from e4m3 casts of x and the weight, both
    gradients from the e5m2 logits' gradient; the three float8 matmuls run; the loss and gradients
    stay within float8's rounding of fp32's. The backward casts of the weight and x take their
    forward scales (one amax of each a step), and the gradient's cast the scale the loss kernel
    found."""
    pytest.importorskip("torchao")
    from minimal_fsdp.models import fused_loss
    from minimal_fsdp.models.fused_loss import linear_cross_entropy

    casts, tensorwise = [], fused_loss._tensorwise

    def recorded(dtype, layouts=("rows",)):
        def cast(t, scale=None):
            casts.append((tuple(t.shape), dtype, layouts, scale is not None))
            return tensorwise(dtype, layouts)(t, scale)

        return cast

    monkeypatch.setattr(fused_loss, "_tensorwise", recorded)

    torch.manual_seed(0)
    x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.1 * torch.randn(5008, 128, device="cuda")).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 5008, (4, 64), device="cuda")
    scale = 0.25

    def step():
        (scale * linear_cross_entropy(x, weight, targets, float8=True)).backward()

    shapes = scaled_mm_calls(step)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    # forward: x (256 x 128) by the weight's transpose; backward: the logits' gradient by the
    # weight, and its transpose by x
    assert shapes == [
        ((256, 128), (128, 5008), e4m3),
        ((256, 5008), (5008, 128), e5m2),
        ((5008, 256), (256, 128), e5m2),
    ]
    rows, columns = ("rows",), ("columns",)
    assert casts == [
        ((256, 128), e4m3, rows, False),  # x
        ((5008, 128), e4m3, rows, False),  # the weight, its scale from its amax
        # the logits' gradient in both layouts, its scale from the loss kernel
        ((256, 5008), e5m2, ("rows", "columns"), True),
        ((5008, 128), e4m3, columns, True),  # the weight's transpose, with the forward's scale
        ((256, 128), e4m3, columns, True),  # x's transpose, with the forward's scale
    ]
    ref_loss, ref_dx, ref_dweight = reference(x, weight, targets, scale)
    loss = linear_cross_entropy(x, weight, targets, float8=True)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    assert x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    # e4m3 keeps 3 mantissa bits, e5m2 2: against bf16's 2e-2, a few times more
    assert relative(x.grad, ref_dx) < 0.1
    assert relative(weight.grad, ref_dweight) < 0.1
    # float8 is really in use: the bf16 path gives other values
    bf16_loss = linear_cross_entropy(x, weight, targets)
    assert loss.item() != bf16_loss.item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_kernel_finds_each_rows_largest_gradient_as_it_writes_it(dtype):
    """Asked for it, the kernel stores each row's largest absolute gradient, of the values it
    stored (5003 columns: the last block's masked columns do not count)."""
    from minimal_fsdp.models.fused_loss import loss_and_grad

    torch.manual_seed(0)
    logits = torch.randn(100, 5003, device="cuda", dtype=dtype) * 4
    targets = torch.randint(0, 5003, (100,), device="cuda")
    losses, amax = torch.empty(100, device="cuda"), torch.full((100,), -1.0, device="cuda")
    loss_and_grad(logits, targets, losses, with_grad=True, amax=amax)
    assert torch.equal(amax, logits.float().abs().amax(1))
    # without the buffer nothing else changes
    again, kept = logits.clone(), losses.clone()
    torch.manual_seed(0)
    logits = torch.randn(100, 5003, device="cuda", dtype=dtype) * 4
    loss_and_grad(logits, targets, losses, with_grad=True)
    assert torch.equal(logits, again) and torch.equal(losses, kept)


@float8_gpu
def test_the_float8_heads_gradient_scale_is_torchaos_to_the_bit():
    """The e5m2 scale made from the kernel's row maxima equals torchao's tensor_to_scale of the
    gradient the kernel wrote (16,400 columns: two blocks of 8,192 and a masked remainder)."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_utils import tensor_to_scale

    from minimal_fsdp.models.fused_loss import project_and_reduce

    torch.manual_seed(0)
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    weight = (0.3 * torch.randn(16400, 128, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, 16400, (2, 64), device="cuda")
    dlogits, _, scales = project_and_reduce(x, weight, targets, True, float8=True)
    x_scale, w_scale, d_scale = scales
    assert torch.equal(x_scale, tensor_to_scale(x, torch.float8_e4m3fn))
    assert torch.equal(w_scale, tensor_to_scale(weight, torch.float8_e4m3fn))
    assert torch.equal(d_scale, tensor_to_scale(dlogits, torch.float8_e5m2))
    # evaluation finds no gradient's scale; without float8 there are no scales
    assert project_and_reduce(x, weight, targets, False, float8=True)[2][2] is None
    assert project_and_reduce(x, weight, targets, True)[2] is None


@float8_gpu
def test_float8_head_falls_back_to_bf16_where_sizes_are_not_multiples_of_16():
    """_scaled_mm needs multiples of 16: 3 x 37 tokens keep the bf16 matmuls and their values."""
    pytest.importorskip("torchao")
    from minimal_fsdp.models.fused_loss import linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(3, 37, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.5 * torch.randn(512, 64, device="cuda")).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 512, (3, 37), device="cuda")
    grads = []
    for float8 in (True, False):
        x.grad = weight.grad = None
        assert not scaled_mm_calls(
            lambda: linear_cross_entropy(x, weight, targets, float8=float8).backward()
        )
        grads.append((x.grad.clone(), weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])

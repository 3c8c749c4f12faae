"""The output projection and cross-entropy as one autograd function, for CUDA (Triton).

The logits (tokens x vocab, 3.3 GB in bf16 for a GPT-2 batch of 32) are the largest tensor of a
step. One Triton kernel reads each row, writes its loss, and overwrites the row with its own
gradient, (softmax - one_hot) / tokens. The row is read twice, but the second read mostly comes from
L2: the first pass asks L2 to keep it, and the second walks it backwards, from the blocks read last.
The compiled PyTorch loss it replaces makes three passes over memory and allocates a second buffer
for the gradient. Backward is then just the two matmuls; it is linear in the gradient, so the
upstream scale (1 / accumulation steps) goes on the small tensors (x's rows, the input gradient),
not on the logits or the vocab x C weight gradient. Without grad (evaluation) the kernel skips the
second pass. benchmarks/loss.py times it.

float8=True (--precision fp8, tensorwise): the logits and both gradients come from float8
matmuls, as in the blocks' float8 layers and with torchao's scales (one per tensor: x and the
weight in e4m3, the logits' gradient in e5m2, its scale from the loss kernel's row maxima). The
weight's gradient takes the logits' gradient transposed, cast in the same pass as its row-major
copy. At Llama 3's 128K vocabulary the head is a sixth of a step's matmuls
(benchmarks/results/RESULTS.md, fp8-head).
"""

import functools

import torch
import triton
import triton.language as tl

BLOCK = 8192  # columns per load: a 50K vocabulary is 7 blocks
NUM_WARPS = 8


@triton.jit
def loss_and_grad_kernel(
    logits_ptr,
    targets_ptr,
    losses_ptr,
    amax_ptr,
    stride,
    vocab,
    inv_tokens,
    BLOCK: tl.constexpr,
    WITH_GRAD: tl.constexpr,
    AMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    # Pass 1: the running max and the sum of exponentials under it (online softmax), one exp
    # per element.
    m = float("-inf")
    s = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(
            ptr + cols, mask=cols < vocab, other=float("-inf"), eviction_policy="evict_last"
        )
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(losses_ptr + row, lse - tl.load(ptr + target).to(tl.float32))
    if WITH_GRAD:
        # Pass 2, last block first: the row again, replaced by d mean-loss / d logits.
        blocks = tl.cdiv(vocab, BLOCK)
        amax = 0.0
        for i in range(0, blocks):
            cols = (blocks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(ptr + cols, mask=cols < vocab, other=0.0, eviction_policy="evict_first").to(
                tl.float32
            )
            grad = (tl.exp(x - lse) - (cols == target).to(tl.float32)) * inv_tokens
            grad = grad.to(logits_ptr.dtype.element_ty)
            tl.store(ptr + cols, grad, mask=cols < vocab, cache_modifier=".cs")
            if AMAX:  # of the values stored, as a pass over them would find it
                stored = tl.abs(grad.to(tl.float32))
                amax = tl.maximum(amax, tl.max(tl.where(cols < vocab, stored, 0.0), 0))
        if AMAX:
            tl.store(amax_ptr + row, amax)


def loss_and_grad(logits, targets, losses, with_grad=True, amax=None):
    """Per-row losses into `losses`; with_grad, `logits` (tokens x vocab, rows contiguous) become
    their gradient, and `amax` (fp32, one a row), if given, each row's largest absolute gradient."""
    tokens, vocab = logits.shape
    loss_and_grad_kernel[(tokens,)](
        logits,
        targets,
        losses,
        losses if amax is None else amax,
        logits.stride(0),
        vocab,
        1.0 / tokens,
        BLOCK=BLOCK,
        WITH_GRAD=with_grad,
        AMAX=with_grad and amax is not None,
        num_warps=NUM_WARPS,
    )


@functools.cache
def _tensorwise(dtype, layouts=("rows",)):
    """A compiled cast of a tensor to float8 `dtype` with one scale, as torchao's tensorwise
    recipe computes it; returns the float8 tensor in each of `layouts` ("rows": as it is;
    "columns": of t.T, contiguous), from one read of t, then the scale. Given a scale, it casts
    with that one (the backward casts take the scales found in forward)."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    @torch.compile
    def cast(t, scale=None):
        if scale is None:
            scale = tensor_to_scale(t, dtype)
        t8 = to_fp8_saturated(t.float() * scale, dtype)
        return *(t8 if layout == "rows" else t8.t().contiguous() for layout in layouts), scale

    return cast


def float8_fits(rows, weight):
    """torch._scaled_mm takes sizes that are multiples of 16."""
    return rows.size(0) % 16 == 0 and rows.size(1) % 16 == 0 and weight.size(0) % 16 == 0


def logits_of(rows, weight, float8):
    """rows @ weight.T, in rows' dtype, and the float8 scales of rows and the weight: with float8,
    from e4m3 casts of both (else the scales are None)."""
    if not (float8 and float8_fits(rows, weight)):
        return rows @ weight.t(), None
    x8, x_scale = _tensorwise(torch.float8_e4m3fn)(rows)
    w8, w_scale = _tensorwise(torch.float8_e4m3fn)(weight)
    # the weight row-major is its transpose column-major, as _scaled_mm wants its second operand
    logits = torch._scaled_mm(
        x8, w8.t(), scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(), out_dtype=rows.dtype
    )
    return logits, (x_scale, w_scale)


def project_and_reduce(x, weight, targets, with_grad, float8=False):
    """The logits of x (..., C) as rows, x @ weight.T (with_grad: turned into their gradient), the
    mean loss, and with float8 the scales of x, the weight and (with_grad) the gradient (e5m2), or
    None."""
    logits, scales = logits_of(x.reshape(-1, x.size(-1)), weight, float8)
    losses = torch.empty(logits.size(0), device=logits.device, dtype=torch.float32)
    # The kernel finds the gradient's largest value as it writes it: a separate pass to find it
    # read the 2 GB gradient of Llama 3's 128K logits in 2.2 ms on an H200.
    amax = torch.empty_like(losses) if with_grad and scales else None
    loss_and_grad(logits, targets.reshape(-1).contiguous(), losses, with_grad, amax)
    if scales:
        from torchao.float8.float8_utils import amax_to_scale

        grad_scale = None if amax is None else amax_to_scale(amax.max(), torch.float8_e5m2)
        scales = (*scales, grad_scale)
    return logits, losses.mean(), scales


def float8_grads(grad, rows, weight, dlogits, scales, wanted, weight_dtype):
    """The gradients of rows and the weight (those `wanted`) from float8 matmuls, as torchao's
    tensorwise layers make them: the logits' gradient in e5m2 (row-major for x's, transposed for
    the weight's, both from one read of it), the weight and rows in e4m3 with their forward
    scales. The upstream grad (a scalar) goes on the scales."""
    x_scale, w_scale, d_scale = scales
    want_dx, want_dw = wanted
    e4m3 = torch.float8_e4m3fn
    *d8, _ = _tensorwise(torch.float8_e5m2, ("rows",) * want_dx + ("columns",) * want_dw)(
        dlogits, d_scale
    )
    d_inverse = d_scale.reciprocal()  # one scalar for both matmuls
    dx = dweight = None
    if want_dx:  # tokens x vocab by the weight, column-major: its transpose, row-major
        w8t, _ = _tensorwise(e4m3, ("columns",))(weight, w_scale)
        dx = torch._scaled_mm(
            d8[0],
            w8t.t(),
            scale_a=d_inverse * grad,
            scale_b=w_scale.reciprocal(),
            out_dtype=rows.dtype,
        )
    if want_dw:  # vocab x tokens by the rows, column-major
        x8t, _ = _tensorwise(e4m3, ("columns",))(rows, x_scale)
        dweight = torch._scaled_mm(
            d8[-1],
            x8t.t(),
            scale_a=d_inverse,
            scale_b=x_scale.reciprocal() * grad,
            out_dtype=weight_dtype,
        )
    return dx, dweight


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, float8=False):
        # Under autocast (one GPU, replicas) the inputs are cast here rather than by custom_fwd,
        # so that backward can hand an fp32 weight its gradient straight from the matmul (fp32
        # out): no bf16 vocab x C gradient written, read and cast back.
        ctx.weight_dtype = weight.dtype
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast("cuda", enabled=False):
            dlogits, loss, scales = project_and_reduce(x, weight, targets, True, float8)
        ctx.float8 = scales is not None
        ctx.save_for_backward(x, weight, dlogits, *(scales or ()))
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, weight, dlogits, *scales = ctx.saved_tensors
        rows = x.reshape(-1, x.size(-1))
        if ctx.float8:  # the logits came from float8 matmuls: so do both gradients
            dx, dweight = float8_grads(
                grad, rows, weight, dlogits, scales, ctx.needs_input_grad[:2], ctx.weight_dtype
            )
            return None if dx is None else dx.view_as(x), dweight, None, None
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dlogits @ weight).mul_(grad).view_as(x)
        dweight = None
        if ctx.needs_input_grad[1]:
            # the scale on x's rows (tokens x C), not on the vocab x C product
            scaled = rows * grad.to(rows.dtype)
            out = ctx.weight_dtype if ctx.weight_dtype != dlogits.dtype else None
            dweight = torch.mm(dlogits.t(), scaled, **({"out_dtype": out} if out else {}))
        # autograd casts dx to x's own dtype where autocast cast x
        return dx, dweight, None, None


def linear_cross_entropy(x, weight, targets, float8=False):
    """Mean cross-entropy of the logits x @ weight.T against targets, as layers.cross_entropy
    computes it; float8: the logits and x's gradient from float8 matmuls."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(x, weight, targets, float8)
    # Evaluation: the loss alone; the kernel skips the pass that writes the gradient.
    return project_and_reduce(x, weight, targets, with_grad=False, float8=float8)[1]

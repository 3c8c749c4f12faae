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

float8=True (--precision fp8, tensorwise): the logits and the input gradient come from float8
matmuls, as in the blocks' float8 layers and with torchao's scales (one per tensor: x and the
weight in e4m3, the logits' gradient in e5m2). The weight gradient stays a bf16 matmul: float8
would need the vocab x tokens gradient transposed first. At Llama 3's 128K vocabulary the head is
a sixth of a step's matmuls (benchmarks/results/RESULTS.md, fp8-head).
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
    stride,
    vocab,
    inv_tokens,
    BLOCK: tl.constexpr,
    WITH_GRAD: tl.constexpr,
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
        for i in range(0, blocks):
            cols = (blocks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(ptr + cols, mask=cols < vocab, other=0.0, eviction_policy="evict_first").to(
                tl.float32
            )
            grad = (tl.exp(x - lse) - (cols == target).to(tl.float32)) * inv_tokens
            tl.store(
                ptr + cols,
                grad.to(logits_ptr.dtype.element_ty),
                mask=cols < vocab,
                cache_modifier=".cs",
            )


def loss_and_grad(logits, targets, losses, with_grad=True):
    """Per-row losses into `losses`; with_grad, `logits` (tokens x vocab, rows contiguous) become
    their gradient."""
    tokens, vocab = logits.shape
    loss_and_grad_kernel[(tokens,)](
        logits,
        targets,
        losses,
        logits.stride(0),
        vocab,
        1.0 / tokens,
        BLOCK=BLOCK,
        WITH_GRAD=with_grad,
        num_warps=NUM_WARPS,
    )


@functools.cache
def _tensorwise(dtype, transpose=False):
    """A compiled cast of a tensor to float8 `dtype` with one scale, as torchao's tensorwise
    recipe computes it; returns the float8 tensor (transpose: of t.T, contiguous) and the scale.
    Given a scale, it casts with that one (the weight's backward cast takes its forward's)."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    @torch.compile
    def cast(t, scale=None):
        if scale is None:
            scale = tensor_to_scale(t, dtype)
        t8 = to_fp8_saturated(t.float() * scale, dtype)
        return (t8.t().contiguous() if transpose else t8), scale

    return cast


def float8_fits(rows, weight):
    """torch._scaled_mm takes sizes that are multiples of 16."""
    return rows.size(0) % 16 == 0 and rows.size(1) % 16 == 0 and weight.size(0) % 16 == 0


def logits_of(rows, weight, float8):
    """rows @ weight.T, in rows' dtype, and the weight's float8 scale: with float8, from e4m3 casts
    of both (else the scale is None)."""
    if not (float8 and float8_fits(rows, weight)):
        return rows @ weight.t(), None
    x8, x_scale = _tensorwise(torch.float8_e4m3fn)(rows)
    w8, w_scale = _tensorwise(torch.float8_e4m3fn)(weight)
    # the weight row-major is its transpose column-major, as _scaled_mm wants its second operand
    logits = torch._scaled_mm(
        x8, w8.t(), scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(), out_dtype=rows.dtype
    )
    return logits, w_scale


def project_and_reduce(x, weight, targets, with_grad, float8=False):
    """The logits of x (..., C) as rows, x @ weight.T (with_grad: turned into their gradient), the
    mean loss, and the weight's float8 scale (None without float8)."""
    logits, weight_scale = logits_of(x.reshape(-1, x.size(-1)), weight, float8)
    losses = torch.empty(logits.size(0), device=logits.device, dtype=torch.float32)
    loss_and_grad(logits, targets.reshape(-1).contiguous(), losses, with_grad)
    return logits, losses.mean(), weight_scale


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
            dlogits, loss, w_scale = project_and_reduce(x, weight, targets, True, float8)
        ctx.save_for_backward(x, weight, dlogits, w_scale)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, weight, dlogits, w_scale = ctx.saved_tensors
        rows = x.reshape(-1, x.size(-1))
        dx = None
        if ctx.needs_input_grad[0] and w_scale is not None:  # the logits came from float8
            d8, d_scale = _tensorwise(torch.float8_e5m2)(dlogits)
            # the weight's transpose row-major: the weight column-major, as _scaled_mm wants it;
            # with the forward's scale, so the weight is not read a second time for its amax
            w8t, _ = _tensorwise(torch.float8_e4m3fn, transpose=True)(weight, w_scale)
            dx = torch._scaled_mm(
                d8,
                w8t.t(),
                scale_a=d_scale.reciprocal() * grad,
                scale_b=w_scale.reciprocal(),
                out_dtype=x.dtype,
            ).view_as(x)
        elif ctx.needs_input_grad[0]:
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

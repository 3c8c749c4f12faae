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
"""

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


def project_and_reduce(x, weight, targets, with_grad):
    """The logits of x (..., C) as rows, x @ weight.T (with_grad: turned into their gradient), and
    the mean loss."""
    logits = x.reshape(-1, x.size(-1)) @ weight.t()
    losses = torch.empty(logits.size(0), device=logits.device, dtype=torch.float32)
    loss_and_grad(logits, targets.reshape(-1).contiguous(), losses, with_grad)
    return logits, losses.mean()


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets):
        # Under autocast (one GPU, replicas) the inputs are cast here rather than by custom_fwd,
        # so that backward can hand an fp32 weight its gradient straight from the matmul (fp32
        # out): no bf16 vocab x C gradient written, read and cast back.
        ctx.weight_dtype = weight.dtype
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            x, weight = x.to(dtype), weight.to(dtype)
        with torch.autocast("cuda", enabled=False):
            dlogits, loss = project_and_reduce(x, weight, targets, with_grad=True)
        ctx.save_for_backward(x, weight, dlogits)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, weight, dlogits = ctx.saved_tensors
        rows = x.reshape(-1, x.size(-1))
        dx = (dlogits @ weight).mul_(grad).view_as(x) if ctx.needs_input_grad[0] else None
        dweight = None
        if ctx.needs_input_grad[1]:
            # the scale on x's rows (tokens x C), not on the vocab x C product
            scaled = rows * grad.to(rows.dtype)
            out = ctx.weight_dtype if ctx.weight_dtype != dlogits.dtype else None
            dweight = torch.mm(dlogits.t(), scaled, **({"out_dtype": out} if out else {}))
        # autograd casts dx to x's own dtype where autocast cast x
        return dx, dweight, None


def linear_cross_entropy(x, weight, targets):
    """Mean cross-entropy of the logits x @ weight.T against targets, as layers.cross_entropy
    computes it."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(x, weight, targets)
    # Evaluation: the loss alone; the kernel skips the pass that writes the gradient.
    return project_and_reduce(x, weight, targets, with_grad=False)[1]

"""Document masks (--document_mask): attention that stays within each document packed into a window.

Pre-training packs documents end to end, separated by the tokenizer's end-of-text token, and cuts
the stream into windows. With a document mask a token attends to the earlier tokens of its own
document only (block-causal), so a window of several documents trains as each document alone would.
The end-of-text token belongs to the document it ends; a window's first tokens may be the tail of a
document the window cut.

Positions do not restart at a document's start, as in torchtitan's block-causal attention (its
training step passes no per-document positions) and Megatron-LM (reset_position_ids off by default):
rotary attention (Llama) depends only on the distance between two tokens, so a Llama document's
logits are those of the document alone; GPT's learned positions stay the window's.

One mask, three kernels; `document_kernel` chooses among them, in this one place:
- flex (CUDA, the default): FlexAttention, compiled into one Triton kernel that skips the (query
  block, key block) tiles no document spans and reads grouped-query k, v without copying them. Eager
  FlexAttention would hold the T x T scores.
- varlen (CUDA, MINIMAL_FSDP_DOCUMENT_KERNEL=varlen): torch's variable-length flash attention, every
  document of the batch one sequence of a packed batch. Faster than flex alone at the Llama 3 8B
  shape, but not in a training step (likely its host sync per forward, sizing the documents): hence
  not the default.
- dense, elsewhere (CPU, XLA), with attention dropout (neither CUDA kernel has it), or for flex with
  heads under 16 values (its kernel takes no fewer): SDPA with a dense
  (B, 1, T, T) boolean mask. Exact, T x T booleans of memory; FlexAttention has no backward on CPU.
Shapes: B batch, T time, H heads, K kv heads, D head size, N documents in the batch.
"""

import functools
import inspect
import os
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# torch 2.10 and later; torch 2.9 (the one torch_xla's last release runs on) has no varlen attention
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

KERNEL_VARIABLE = "MINIMAL_FSDP_DOCUMENT_KERNEL"


class KernelError(ValueError):
    """A MINIMAL_FSDP_DOCUMENT_KERNEL this torch cannot run; a run reports it as a flag error
    (models.families.with_document_mask), so the math needs nothing of the config."""


CUDA_KERNELS = ("flex", "varlen")

# varlen_attn's keywords differ by version, so they are read from its signature: causal is
# is_causal=True in its first releases, window_size=(-1, 0) later; fewer k, v heads than query heads
# need enable_gqa (2.13) or, without it, k, v repeated per query head.
_VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters if varlen_attn else {}
_VARLEN_CAUSAL = (
    {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}
)
_VARLEN_GQA = "enable_gqa" in _VARLEN_PARAMETERS

# The ops whose outputs --recompute selective keeps (parallelize.KEEP), as it keeps SDPA's.
KEPT_BY_SELECTIVE_RECOMPUTE = {
    torch._higher_order_ops.flex_attention,
    *([torch.ops.torch_attn._varlen_attn.default] if varlen_attn else []),
}


class Documents(NamedTuple):
    """The varlen kernel's mask: the batch's documents as the sequences of one packed batch of B*T
    tokens."""

    # (N + 1,) int32: where each document starts among the B*T tokens, then B*T
    starts: torch.Tensor
    longest: int  # the longest document's length
    # (B, T) document ids: the dense mask where flash attention has no kernel (fp32)
    ids: torch.Tensor


def document_ids(idx, eot_id):
    """(B, T) -> the index of each token's document within its window: the end-of-text tokens before
    it."""
    ends = (idx == eot_id).int()
    return ends.cumsum(1) - ends


@torch.compiler.disable  # data-dependent sizes: run eagerly, also where the whole trunk is compiled
def document_starts(ids):
    """(B, T) document ids -> (starts, longest) of Documents: a document starts where the id changes
    and at every window's first token (a window's end always ends a document). One host sync, for
    the count of documents (the size of starts) and the longest (varlen_attn takes it as an int)
    together, once per forward."""
    B, T = ids.shape
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = first.flatten()
    position = torch.arange(B * T, device=ids.device)
    own_start = torch.where(first, position, 0).cummax(0).values
    count, longest = torch.stack([first.sum(), (position - own_start).max() + 1]).tolist()
    # no second sync
    starts = torch.nonzero_static(first, size=count + 1, fill_value=B * T).flatten()
    return starts.int(), longest


# FlexAttention's CUDA kernel multiplies q by k with Triton's tl.dot, which takes heads of 16 or
# more values.
FLEX_MIN_HEAD_SIZE = 16


def document_kernel(device, dropout, head_size=FLEX_MIN_HEAD_SIZE):
    """flex, varlen or dense: a CUDA kernel where there is no dropout (neither has it), dense SDPA
    elsewhere and for heads narrower than FlexAttention's kernel takes."""
    if device.type != "cuda" or dropout != 0.0:
        return "dense"
    kernel = cuda_kernel()
    return "dense" if kernel == "flex" and head_size < FLEX_MIN_HEAD_SIZE else kernel


def cuda_kernel():
    """The CUDA kernel MINIMAL_FSDP_DOCUMENT_KERNEL names, flex when unset; checked as a run starts
    (families.with_document_mask), before any collective."""
    kernel = os.environ.get(KERNEL_VARIABLE, "flex")
    if kernel not in CUDA_KERNELS:
        raise KernelError(
            f"{KERNEL_VARIABLE}={kernel} is not a document-mask kernel: use one of "
            f"{', '.join(CUDA_KERNELS)}, or leave it unset (flex)"
        )
    if kernel == "varlen" and varlen_attn is None:
        raise KernelError(
            f"{KERNEL_VARIABLE}=varlen needs torch 2.10 or later (torch.nn.attention.varlen); this "
            f"is torch {torch.__version__}: leave it unset (flex)"
        )
    return kernel


def document_mask(idx, eot_id, dropout=0.0, kernel=None, head_size=FLEX_MIN_HEAD_SIZE):
    """The block-causal mask of the windows idx (B, T) whose documents end at eot_id, built once per
    forward and shared by every block, in the form its kernel takes: a BlockMask (flex), Documents
    (varlen) or a (B, 1, T, T) boolean tensor (dense; True: may attend). kernel: None chooses
    (document_kernel); a name forces one (tests)."""
    documents = document_ids(idx, eot_id)
    B, T = idx.shape
    kernel = kernel or document_kernel(idx.device, dropout, head_size)
    if kernel == "dense":
        return _dense(documents)
    if kernel == "varlen":
        return Documents(*document_starts(documents), documents)

    def same_document(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)

    return _compiled(create_block_mask, idx.device)(same_document, B, None, T, T, device=idx.device)


def attend_documents(q, k, v, mask, dropout):
    """Attention of q (B, H, T, D) over k, v (B, K, T, D) under a document_mask."""
    if isinstance(mask, BlockMask):
        return _compiled(flex_attention, q.device)(
            q, k, v, block_mask=mask, enable_gqa=k.size(1) != q.size(1)
        )
    if isinstance(mask, Documents):
        # Under autocast (a one-GPU run's bf16), in its dtype, as SDPA would be; flash attention
        # takes no fp32.
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        if dtype in (torch.bfloat16, torch.float16):
            return _attend_varlen(*(t.to(dtype) for t in (q, k, v)), mask)
        mask = _dense(mask.ids)  # fp32: flash attention has no kernel for it
    if k.size(1) != q.size(1):
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout
    )


def _attend_varlen(q, k, v, documents):
    """varlen_attn over the documents: causal within each, at SDPA's default scale 1/sqrt(D), as the
    models use."""
    B, H, T, D = q.shape
    if not _VARLEN_GQA and k.size(1) != H:
        k, v = (
            k.repeat_interleave(H // k.size(1), dim=1),
            v.repeat_interleave(H // k.size(1), dim=1),
        )
    q, k, v = (t.transpose(1, 2).reshape(B * T, t.size(1), D) for t in (q, k, v))  # (B*T, heads, D)
    gqa = {"enable_gqa": k.size(1) != H} if _VARLEN_GQA else {}
    y = varlen_attn(
        q,
        k,
        v,
        documents.starts,
        documents.starts,
        documents.longest,
        documents.longest,
        **_VARLEN_CAUSAL,
        **gqa,
    )
    return y.view(B, T, H, D).transpose(1, 2)


def _dense(documents):
    """(B, T) document ids -> the (B, 1, T, T) boolean block-causal mask."""
    T = documents.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


@functools.cache
def _compiled_on_cuda(function):
    return torch.compile(function)


def _compiled(function, device):
    """function compiled once on CUDA (inside a compiled block the compiler inlines it); as it is
    elsewhere."""
    return _compiled_on_cuda(function) if device.type == "cuda" else function

"""Document masks (--document_mask): attention that stays within each document packed into a window.

Pre-training packs documents end to end, separated by the tokenizer's end-of-text token, and cuts the stream into
windows. With a document mask a token attends to the earlier tokens of its own document only (block-causal), so
a window of several documents trains as each document alone would. The end-of-text token belongs to the document
it ends; a window's first tokens may be the tail of a document the window cut.

Positions do not restart at a document's start, as in torchtitan's block-causal attention (its training step passes
no per-document positions) and Megatron-LM (reset_position_ids off by default): rotary attention (Llama) depends
only on the distance between two tokens, so a Llama document's logits are those of the document alone; GPT's
learned positions stay the window's.

One mask, two implementations; `uses_flex` chooses between them, in this one place:
- CUDA: FlexAttention, compiled into one Triton kernel that skips the (query block, key block) tiles no document
  spans and reads grouped-query k, v without copying them. Eager FlexAttention would hold the T x T scores.
- elsewhere (CPU, XLA), or with attention dropout (FlexAttention has none): SDPA with a dense (B, 1, T, T)
  boolean mask. Exact, T x T booleans of memory; FlexAttention has no backward on CPU.
Shapes: B batch, T time, H heads, K kv heads, D head size.
"""
import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def document_ids(idx, eot_id):
    """(B, T) -> the index of each token's document within its window: the end-of-text tokens before it."""
    ends = (idx == eot_id).int()
    return ends.cumsum(1) - ends


def uses_flex(device, dropout):
    """FlexAttention where it is compiled into a fused kernel (CUDA) and no dropout is asked for; else dense SDPA."""
    return device.type == "cuda" and dropout == 0.0


def document_mask(idx, eot_id, dropout=0.0, flex=None):
    """The block-causal mask of the windows idx (B, T) whose documents end at eot_id, built once per forward and
    shared by every block: a BlockMask (FlexAttention) or a (B, 1, T, T) boolean tensor (True: may attend).
    flex: None chooses by device (uses_flex); True or False forces one (tests compare the two on CPU)."""
    documents = document_ids(idx, eot_id)
    B, T = idx.shape
    if not (uses_flex(idx.device, dropout) if flex is None else flex):
        causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        return (documents[:, None, :, None] == documents[:, None, None, :]) & causal

    def same_document(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)
    return _compiled(create_block_mask, idx.device)(same_document, B, None, T, T, device=idx.device)


def attend_documents(q, k, v, mask, dropout):
    """Attention of q (B, H, T, D) over k, v (B, K, T, D) under a document_mask."""
    if isinstance(mask, BlockMask):
        return _compiled(flex_attention, q.device)(q, k, v, block_mask=mask, enable_gqa=k.size(1) != q.size(1))
    if k.size(1) != q.size(1):
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


@functools.cache
def _compiled_on_cuda(function):
    return torch.compile(function)


def _compiled(function, device):
    """function compiled once on CUDA (inside a compiled block the compiler inlines it); as it is elsewhere."""
    return _compiled_on_cuda(function) if device.type == "cuda" else function

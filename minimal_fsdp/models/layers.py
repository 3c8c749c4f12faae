"""What the model classes share: attention over a KV cache or a document mask, the loss,
parameter and FLOP counts.

Only math lives here, as in gpt.py and llama.py.
Shapes: B batch, H heads, K heads with their own keys and values, T time, D head size.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimal_fsdp.models.attention import attend_documents, document_mask

_document_mask_outside_graphs = torch.compiler.disable(document_mask)


class KVCache:
    """Keys and values of every layer for positions [0, pos); preallocated for `length` positions
    (at most the model's context)."""

    def __init__(self, config, batch_size, device, dtype, num_kv_heads, length):
        self.length = length
        shape = (batch_size, num_kv_heads, length, config.embed_size // config.num_heads)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.pos = 0


def attend(q, k, v, cache, layer, dropout, mask=None):
    """Causal attention of q (B, H, T, D) over k, v (B, K, T, D). With a cache: this step's keys and
    values are written at its position and the queries see every cached one. dropout: the
    probability, 0 when evaluating. mask: a document mask (Decoder.attention_mask; never with a
    cache), else plain causal attention."""
    if mask is not None:
        return attend_documents(q, k, v, mask, dropout)
    T = q.size(2)
    if cache is not None:
        start = cache.pos
        cache.k[layer][:, :, start : start + T] = k
        cache.v[layer][:, :, start : start + T] = v
        k, v = cache.k[layer][:, :, : start + T], cache.v[layer][:, :, : start + T]
    gqa = k.size(1) != q.size(1)
    if gqa and not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        # Give each query head its group's k, v. In bf16 on a GPU SDPA's cuDNN and flash kernels
        # read the groups' own k, v (enable_gqa: no copies; at Llama 3 8B's shape attention with
        # its copies, forward and backward, took 3.92 ms, without 3.60 on an H200); elsewhere
        # enable_gqa would fall back to the math kernel and its T x T matrix.
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = False
    # A prefill (T > 1) starts at position 0 and is causal; a single new token sees every
    # cached one.
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=T > 1, dropout_p=dropout, enable_gqa=gqa
    )


def cross_entropy(x, weight, targets):
    """Mean next-token loss of the logits x @ weight.T, computed in fp32 whatever their dtype.
    It takes the output projection, not the logits, so that fused_loss.py can replace it whole on
    CUDA."""
    logits = F.linear(x, weight)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class OutputHead(nn.Linear):
    """An untied output head: the logits, or given targets the model's loss `loss(x, weight,
    targets)` (cross_entropy or what parallelize swaps in). The loss runs inside this module's
    forward so that FSDP2 can shard the head as a unit of its own (parallelize.shard), whose
    gradient then reduces while the blocks' backward runs."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x, targets=None, loss=None):
        if targets is None:
            return super().forward(x)
        return loss(x, self.weight, targets)


class Decoder(nn.Module):
    """The surface parallelize, train and generate rely on: `config`, `blocks`, `loss`,
    `initial_value`, and these counts. `lookup_only` names the embedding that is a table lookup
    rather than a matmul."""

    lookup_only = None

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())  # a sharded (DTensor) parameter counts whole
        if non_embedding and self.lookup_only:
            n -= self.get_parameter(self.lookup_only).numel()
        return n

    def flops_per_token(self):
        """Training FLOPs per token: 6N for the matmuls plus attention (PaLM's count, as nanoGPT
        does)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.num_layers * c.embed_size * c.seq_length

    def attention_mask(self, idx, cache=None):
        """The document mask of the windows idx (B, T) if the config has an end-of-text token
        (--document_mask), built once for all blocks; None: plain causal. Decoding with a cache
        continues one text: causal."""
        eot_id = self.config.document_eot_id
        if eot_id is None or cache is not None:
            return None
        # Without gradients the mask is built outside any compiled graph and enters it as an input,
        # as in blocks compiled one by one: inductor (torch 2.11, H200) failed to lower
        # FlexAttention in a no-grad graph whose mask reads documents computed in that same graph
        # ("convert FlexibleLayout to FixedLayout first").
        build = document_mask if torch.is_grad_enabled() else _document_mask_outside_graphs
        return build(
            idx,
            eot_id,
            self.config.dropout if self.training else 0.0,
            head_size=self.config.embed_size // self.config.num_heads,
        )

    def new_cache(self, batch_size, device, dtype, length=None):
        """An empty KV cache for generation, for `length` positions (default and most: the model's
        whole context)."""
        heads = getattr(self.config, "num_kv_heads", self.config.num_heads)
        length = min(length or self.config.seq_length, self.config.seq_length)
        return KVCache(self.config, batch_size, device, dtype, heads, length)

"""A GPT-2-style decoder: pre-LayerNorm blocks, GELU MLP, tied embeddings, causal SDPA attention.

Only the math lives here (the family: families/gpt.py); how it is sharded, checkpointed and
compiled lives in parallel/parallelize.py.
Shapes: B batch, T time, C embed_size, H heads, D = C // H.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimal_fsdp.models.families.gpt import PRESETS, GPTConfig
from minimal_fsdp.models.layers import Decoder, attend, cross_entropy


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.embed_size, 3 * config.embed_size, bias=config.bias)
        self.proj = nn.Linear(config.embed_size, config.embed_size, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None, layer=0, mask=None):
        B, T, C = x.shape
        # Three matmuls on slices of the one qkv weight (GPT-2's layout): backward then adds
        # their input gradients instead of concatenating dq, dk and dv into one tensor for a
        # single matmul.
        biases = self.qkv.bias.split(C) if self.qkv.bias is not None else (None,) * 3
        q, k, v = (F.linear(x, w, b) for w, b in zip(self.qkv.weight.split(C), biases))
        q, k, v = (
            t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v)
        )
        y = attend(q, k, v, cache, layer, self.dropout if self.training else 0.0, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.embed_size, 4 * config.embed_size, bias=config.bias)
        self.proj = nn.Linear(4 * config.embed_size, config.embed_size, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """The unit of sharding and activation checkpointing."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.embed_size, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.embed_size, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0, mask=None):
        x = x + self.attn(self.ln_1(x), cache, layer, mask)
        return x + self.mlp(self.ln_2(x))


class GPT(Decoder):
    config_class, presets = GPTConfig, PRESETS
    lookup_only = "wpe.weight"  # the token embedding is also the output projection: a matmul

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.embed_size)
        self.wpe = nn.Embedding(config.seq_length, config.embed_size)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.embed_size, bias=config.bias)
        self.loss = cross_entropy  # parallelize may swap in a compiled or fused version

    def forward(self, idx, targets=None, cache=None):
        """Returns the mean cross-entropy if targets are given, else the logits of the last
        position."""
        x = self.trunk(idx, cache)
        if targets is None:
            return F.linear(x[:, -1], self.wte.weight)  # tied output embedding
        return self.loss(x, self.wte.weight, targets)  # tied output embedding

    def trunk(self, idx, cache=None):
        """Token ids (B, T) -> the final normalized hidden states (B, T, C): all but the output
        projection."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = self.attention_mask(idx, cache)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, mask)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def initial_value(self, name, shape, generator, device):
        """The initial value of parameter `name`, a pure function of (name, seeded generator), so
        eager init and meta-device init of one shard at a time give identical weights."""
        if name.endswith("bias"):
            return torch.zeros(shape, device=device)
        if "ln_" in name:
            return torch.ones(shape, device=device)
        # GPT-2: residual projections scaled by 1/sqrt(2 * layers) so the residual stream
        # stays O(1).
        std = 0.02 / math.sqrt(2 * self.config.num_layers) if name.endswith("proj.weight") else 0.02
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

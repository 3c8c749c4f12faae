"""A Llama-style decoder: pre-RMSNorm blocks, rotary positions, grouped-query attention, SwiGLU MLP,
untied output head. The same surface as gpt.GPT, so parallelize, train and generate take either.
Qwen2 (qwen2.py) is this decoder with biases on q, k and v and, in its small sizes, the output head
tied to the embedding.

Only the math lives here (the family: families/llama.py). Rotary embeddings follow the Hugging Face
layout (dimension i pairs with i + D/2), so Hugging Face Llama weights load without permuting q
and k.

Shapes: B batch, T time, C embed_size, H heads, K kv heads, D = C // H head size, I
intermediate_size.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimal_fsdp.models.families.llama import PRESETS, LlamaConfig
from minimal_fsdp.models.layers import Decoder, OutputHead, attend, cross_entropy


def rotary_frequencies(config):
    """Angle per position step of each of the D/2 rotating pairs: theta^(-2i/D), optionally
    Llama-3-scaled."""
    head_size = config.embed_size // config.num_heads
    inv_freq = 1.0 / config.rope_theta ** (
        torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
    )
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type") == "llama3":
        # Llama 3.1: slow frequencies (wavelength beyond the original context) are divided by
        # `factor`, fast ones kept, and the band in between blended, so long contexts reuse the
        # angles seen in training.
        factor, low, high = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = (1 - blend) * inv_freq / factor + blend * inv_freq
    return inv_freq


# rotary_frequencies on each device, copied there once per (head size, theta, scaling). Copied per
# forward, the host's pageable copy waited for every kernel queued before it, so the host could not
# run ahead of the device (1.8-2.1 ms idle in a traced step of Llama 3 8B's shape on an H200; end
# to end within the noise of the runs, benchmarks/results/RESULTS.md, rotary-sync).
_FREQUENCIES = {}


def frequencies_on(config, device):
    scaling = config.rope_scaling
    key = (config.embed_size // config.num_heads, config.rope_theta, repr(scaling), device)
    if key not in _FREQUENCIES:
        # an ordinary tensor even when generation (inference mode) asks first
        with torch.inference_mode(False):
            _FREQUENCIES[key] = rotary_frequencies(config).to(device)
    return _FREQUENCIES[key]


def rotary_tables(config, start, length, device):
    """cos and sin of every (position, dimension) for positions [start, start + length): (T, D)
    each. Computed per forward from the config (cheap next to the model; the frequencies once per
    device), so there is no buffer for meta-device init, sharding or checkpoints to handle."""
    inv_freq = frequencies_on(config, device)
    positions = torch.arange(start, start + length, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


# Where the whole trunk is one compiled graph, inductor would fold the tables' arange, cos and sin
# into every kernel that rotates q or k, forward and backward, and recompute them per element
# (those kernels took 3.7 ms of a Llama 3 8B step at T=8192 on an H200). Made outside the graph,
# they are two small inputs it reads.
_rotary_tables_outside_graphs = torch.compiler.disable(rotary_tables)


def apply_rotary(x, cos, sin):
    """Rotate each pair (x_i, x_{i+D/2}) of x (B, H, T, D) by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config, qkv_bias=False):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_size = config.embed_size // config.num_heads
        self.dropout = config.dropout
        q_size, kv_size = config.num_heads * self.head_size, config.num_kv_heads * self.head_size
        self.q_proj = nn.Linear(config.embed_size, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(config.embed_size, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(config.embed_size, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * self.head_size, config.embed_size, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, cache=None, layer=0, mask=None):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_size).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_size).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_size).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = attend(q, k, v, cache, layer, self.dropout if self.training else 0.0, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.embed_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.embed_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.embed_size, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    """The unit of sharding and activation checkpointing."""

    def __init__(self, config, qkv_bias=False):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.embed_size, eps=config.norm_eps)
        self.attn = Attention(config, qkv_bias)
        self.mlp_norm = nn.RMSNorm(config.embed_size, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, layer=0, mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(Decoder):
    config_class, presets = LlamaConfig, PRESETS
    qkv_bias = False  # Qwen2's are True
    lookup_only = "wte.weight"  # the input embedding (the output head is its own matrix)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.embed_size)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, self.qkv_bias) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.embed_size, eps=config.norm_eps)
        # Qwen2's small sizes tie the output head to the embedding (LlamaConfig has no such field)
        if getattr(config, "tie_embeddings", False):
            self.lm_head, self.lookup_only = None, None  # the embedding is also a matmul
        else:
            self.lm_head = OutputHead(config.embed_size, config.vocab_size)
        self.loss = cross_entropy  # parallelize may swap in a compiled or fused version

    def forward(self, idx, targets=None, cache=None):
        """Returns the mean cross-entropy if targets are given, else the logits of the last
        position."""
        x = self.trunk(idx, cache)
        if self.lm_head is None:  # tied
            if targets is None:
                return F.linear(x[:, -1], self.wte.weight)
            return self.loss(x, self.wte.weight, targets)
        if targets is None:
            return self.lm_head(x[:, -1])
        return self.lm_head(x, targets, self.loss)

    def trunk(self, idx, cache=None):
        """Token ids (B, T) -> the final normalized hidden states (B, T, C): all but the output
        head."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        cos, sin = _rotary_tables_outside_graphs(self.config, start, T, idx.device)
        x = self.drop(self.wte(idx))
        # In the compute dtype, as Hugging Face does (bf16 q, k stay bf16, like v); cast once,
        # outside the blocks.
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        mask = self.attention_mask(idx, cache)
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer, mask)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def initial_value(self, name, shape, generator, device):
        """The initial value of parameter `name`, a pure function of (name, seeded generator), so
        eager init and meta-device init of one shard at a time give identical weights."""
        if name.endswith("bias"):  # Qwen2's q, k, v
            return torch.zeros(shape, device=device)
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device)
        # As GPT-2: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers) so the residual
        # stream stays O(1).
        residual = name.endswith(("o_proj.weight", "down_proj.weight"))
        std = 0.02 / math.sqrt(2 * self.config.num_layers) if residual else 0.02
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

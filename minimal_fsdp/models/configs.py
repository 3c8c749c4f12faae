"""The model families' config classes and presets: what a model is, as plain data. Nothing here
imports torch, so a checkpoint's meta.json is checked (checkpoint_meta.py) by the job chains'
progress command, and `minimal-fsdp plan` sizes a model, without it; the models themselves
(model.GPT, llama.Llama) carry these classes as `config_class`, with their presets."""

from dataclasses import asdict, dataclass
from typing import ClassVar

from minimal_fsdp.config.choices import ConfigError


def config_fields(config):
    """A model config as the dict checkpoints record. document_eot_id is left out when off, so a
    checkpoint written before document masks existed records the same model as a run without one."""
    return {k: v for k, v in asdict(config).items() if k != "document_eot_id" or v is not None}


@dataclass
class GPTConfig:
    # recorded in checkpoints, so generation rebuilds the right model
    model_type: ClassVar[str] = "gpt"
    vocab_size: int = 65
    seq_length: int = 128  # the context: positions the model has embeddings for
    num_layers: int = 4
    num_heads: int = 4
    embed_size: int = 128
    dropout: float = 0.0
    bias: bool = True
    # --document_mask: attention stays within documents, which end at this token
    document_eot_id: int = None

    def to_dict(self):
        return config_fields(self)


@dataclass
class LlamaConfig:
    # recorded in checkpoints, so generation rebuilds the right model
    model_type: ClassVar[str] = "llama"
    vocab_size: int = 32000
    seq_length: int = 128  # the context: positions the rotary tables and the KV cache cover
    num_layers: int = 4
    num_heads: int = 4
    # grouped-query attention: every num_heads // num_kv_heads query heads share one k, v
    num_kv_heads: int = 2
    embed_size: int = 128
    intermediate_size: int = 384
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1's long-context frequency scaling ({"rope_type": "llama3", ...}) or None
    rope_scaling: dict = None
    dropout: float = 0.0
    # --document_mask: attention stays within documents, which end at this token
    document_eot_id: int = None

    def to_dict(self):
        return config_fields(self)


CONFIGS = {"gpt": GPTConfig, "llama": LlamaConfig}  # models.MODELS's families, by the same names


def check_shape(config):
    """The shape constraints the flags alone cannot check (a preset's values may meet a flag's)."""
    c = config
    if c.embed_size % c.num_heads:
        raise ConfigError(f"embed size {c.embed_size} is not divisible by {c.num_heads} heads")
    if c.model_type == "llama" and (
        c.num_heads % c.num_kv_heads or c.embed_size // c.num_heads % 2
    ):
        raise ConfigError(
            f"llama needs --num_heads divisible by --num_kv_heads and an even head size (got "
            f"{c.num_heads} heads, {c.num_kv_heads} kv heads, head size "
            f"{c.embed_size // c.num_heads})"
        )
    return config


# The OpenAI GPT-2 shapes (vocab 50257, 1024 positions) and a tiny one that trains on a laptop CPU.
GPT_PRESETS = {
    "tiny": dict(num_layers=4, num_heads=4, embed_size=128, seq_length=128, dropout=0.0),
    "gpt2": dict(
        num_layers=12, num_heads=12, embed_size=768, seq_length=1024, vocab_size=50257, dropout=0.0
    ),
    "gpt2-medium": dict(
        num_layers=24, num_heads=16, embed_size=1024, seq_length=1024, vocab_size=50257, dropout=0.0
    ),
    "gpt2-large": dict(
        num_layers=36, num_heads=20, embed_size=1280, seq_length=1024, vocab_size=50257, dropout=0.0
    ),
    "gpt2-xl": dict(
        num_layers=48, num_heads=25, embed_size=1600, seq_length=1024, vocab_size=50257, dropout=0.0
    ),
}

# Llama 3.1's rotary scaling (its config.json's rope_scaling; Meta's reference code applies it to
# Llama 3.1 8B).
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Llama 2 shapes from the paper (and the reference's table); Llama 3 8B as Meta's Llama 3.1 8B
# config.json (128K vocabulary, 8 kv heads, rope theta 500000 and Llama 3.1's scaling, norm eps
# 1e-5) at its 8K training context; llama3-tiny: the same family (4 query heads per kv head, theta,
# scaling, vocabulary) in a few blocks of width 256; tiny for laptops.
LLAMA_PRESETS = {
    "tiny": dict(
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_size=128,
        intermediate_size=384,
        seq_length=128,
    ),
    "llama2-7b": dict(
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        embed_size=4096,
        intermediate_size=11008,
        seq_length=4096,
        vocab_size=32000,
    ),
    "llama2-13b": dict(
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        embed_size=5120,
        intermediate_size=13824,
        seq_length=4096,
        vocab_size=32000,
    ),
    "llama2-70b": dict(
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        embed_size=8192,
        intermediate_size=28672,
        seq_length=4096,
        vocab_size=32000,
    ),
    "llama3-8b": dict(
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        embed_size=4096,
        intermediate_size=14336,
        seq_length=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE,
    ),
    "llama3-tiny": dict(
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        embed_size=256,
        intermediate_size=896,
        seq_length=512,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE,
    ),
}

PRESETS = {"gpt": GPT_PRESETS, "llama": LLAMA_PRESETS}


def make_config(model_type, preset, **overrides):
    """A preset's shape with any explicitly given (non-None) fields replacing it."""
    fields = dict(PRESETS[model_type][preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return CONFIGS[model_type](**fields)

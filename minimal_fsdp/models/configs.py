"""The model families' config classes: what a model is, as plain data. Nothing here imports torch,
so a checkpoint's meta.json is checked (checkpoint_meta.py) by the job chains' progress command
without it; the models themselves (model.GPT, llama.Llama) carry these classes as `config_class`,
with their presets."""

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

"""Qwen2 and Qwen2.5: Llama's block (llama.py) with biases on q, k and v, the output head tied to
the embedding in the small sizes, rotary theta 1e6 and RMSNorm epsilon 1e-6. The shape, presets,
Hugging Face mapping (Qwen2ForCausalLM) and planner terms; the math is models/qwen2.py (Llama's)."""

from dataclasses import dataclass
from typing import ClassVar

from minimal_fsdp.models.families import llama
from minimal_fsdp.models.families.llama import LlamaConfig

MODEL = "minimal_fsdp.models.qwen2.Qwen2"


@dataclass
class Qwen2Config(LlamaConfig):
    # recorded in checkpoints, so generation rebuilds the right model
    model_type: ClassVar[str] = "qwen2"
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    # the output head is the input embedding (Qwen2.5 0.5B to 3B; the larger ones have their own)
    tie_embeddings: bool = True


Config = Qwen2Config

# Llama's: the shape's constraints, and the planner's terms (the biases add no saved activations)
problem = llama.problem
activations_per_token, kept_per_token = llama.activations_per_token, llama.kept_per_token
float8_inputs_per_token = llama.float8_inputs_per_token
final_norm_per_token = llama.final_norm_per_token

# Qwen2.5 0.5B as its config.json (151,936-token vocabulary, 2 kv heads, tied embeddings) at its
# 32K context; tiny for laptops.
# fmt: off
PRESETS = {
    "tiny":         dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_size=128, intermediate_size=384, seq_length=128),
    "qwen2.5-0.5b": dict(num_layers=24, num_heads=14, num_kv_heads=2, embed_size=896, intermediate_size=4864, seq_length=32768, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True),
}
# fmt: on

# -----------------------------------------------------------------------------
# Hugging Face: Qwen2ForCausalLM

HF_TYPE = "qwen2"
HF_SIZES = llama.HF_SIZES
HF_TOKENIZER = None  # a Qwen2 directory brings its own
transposed, stored_names = llama.transposed, llama.stored_names  # stored as Llama's


def from_hf(field, check, shape):
    """The rest of our config from config.json (`field` reads a field, checked; `check(ok, what)`
    refuses what we do not implement); shape: the HF_SIZES read already."""
    check(not field("use_sliding_window", "raw"), "sliding-window attention")
    layer_types = field("layer_types", "raw") or ()
    check(
        all(kind == "full_attention" for kind in layer_types),
        "layers other than full attention (layer_types)",
    )
    return dict(
        llama.decoder_from_hf(field, check, shape),
        tie_embeddings=field("tie_word_embeddings", "raw", False),
    )


def to_hf(config):
    """config.json's Qwen2 fields (hf/write.py adds the vocabulary, the dtype and token ids)."""
    return dict(
        llama.decoder_to_hf(config),
        architectures=["Qwen2ForCausalLM"],
        model_type=HF_TYPE,
        use_sliding_window=False,
        tie_word_embeddings=config.tie_embeddings,
    )


def hf_names(config):
    """{our parameter name: its name in the files Qwen2ForCausalLM saves}: Llama's, with the biases
    of q, k and v, and no lm_head when it is the embedding."""
    return llama.hf_names(config, qkv_bias=True, tied=config.tie_embeddings)


def sizes(config):
    """Llama's terms with the q/k/v biases."""
    return llama.sizes(config, qkv_bias=True)

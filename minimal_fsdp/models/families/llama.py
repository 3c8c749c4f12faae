"""Llama 2 and 3: the shape, presets, Hugging Face mapping (LlamaForCausalLM) and planner terms. The
math is models/llama.py. Qwen2 (qwen2.py) is this family with biased q, k, v and reads and writes
through the functions below. Shapes: C embed_size, H heads, K kv heads, D = C // H, I
intermediate_size."""

from dataclasses import asdict, dataclass
from typing import ClassVar

MODEL = "minimal_fsdp.models.llama.Llama"


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
        """As checkpoints record it. document_eot_id is left out when off, so a checkpoint written
        before document masks existed records the same model as a run without one."""
        return {k: v for k, v in asdict(self).items() if k != "document_eot_id" or v is not None}


Config = LlamaConfig

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
# fmt: off
PRESETS = {
    "tiny":        dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_size=128, intermediate_size=384, seq_length=128),
    "llama2-7b":   dict(num_layers=32, num_heads=32, num_kv_heads=32, embed_size=4096, intermediate_size=11008, seq_length=4096, vocab_size=32000),
    "llama2-13b":  dict(num_layers=40, num_heads=40, num_kv_heads=40, embed_size=5120, intermediate_size=13824, seq_length=4096, vocab_size=32000),
    "llama2-70b":  dict(num_layers=80, num_heads=64, num_kv_heads=8, embed_size=8192, intermediate_size=28672, seq_length=4096, vocab_size=32000),
    "llama3-8b":   dict(num_layers=32, num_heads=32, num_kv_heads=8, embed_size=4096, intermediate_size=14336, seq_length=8192, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE),
    "llama3-tiny": dict(num_layers=4, num_heads=8, num_kv_heads=2, embed_size=256, intermediate_size=896, seq_length=512, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE),
}
# fmt: on


def problem(config):
    """Grouped-query attention needs whole groups, rotary embeddings pairs of dimensions."""
    c = config
    if c.num_heads % c.num_kv_heads or c.embed_size // c.num_heads % 2:
        return (
            f"{c.model_type} needs --num_heads divisible by --num_kv_heads and an even head size "
            f"(got {c.num_heads} heads, {c.num_kv_heads} kv heads, head size "
            f"{c.embed_size // c.num_heads})"
        )
    return None


# -----------------------------------------------------------------------------
# Hugging Face: LlamaForCausalLM

HF_TYPE = "llama"
# our whole-number fields: config.json's names for them
HF_SIZES = {
    "seq_length": "max_position_embeddings",
    "embed_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "num_layers": "num_hidden_layers",
    "intermediate_size": "intermediate_size",
}
HF_TOKENIZER = None  # a Llama directory brings its own
ROPE_SCALING = (
    "rope_type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def from_hf(field, check, shape):
    """The rest of our config from config.json (`field` reads a field, checked; `check(ok, what)`
    refuses what we do not implement); shape: the HF_SIZES read already."""
    check(
        not field("attention_bias", "raw") and not field("mlp_bias", "raw"),
        "biases in attention or MLP",
    )
    return decoder_from_hf(field, check, shape)


def decoder_from_hf(field, check, shape):
    """What Llama and Qwen2 read alike: kv heads, norm epsilon, rotary embeddings."""
    # transformers 5 / 4
    spelling = "rope_parameters" if field("rope_parameters", "raw") else "rope_scaling"
    rope = field(spelling, "object", {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    check(
        rope_type in ("default", "llama3"),
        f"rope type {rope_type!r} (supported: default, llama3)",
    )
    activation = field("hidden_act", "raw", "silu")
    check(activation == "silu", f"activation {activation} (we use SiLU)")
    embed, heads = shape["embed_size"], shape["num_heads"]
    check(field("head_dim", "raw") in (None, embed // heads), "head_dim != hidden_size / heads")
    return dict(
        num_kv_heads=field("num_key_value_heads", default=heads, bound="num_kv_heads"),
        norm_eps=field("rms_norm_eps", "number", 1e-6),
        rope_theta=float(field("rope_theta", "number", rope.get("rope_theta", 10000.0))),
        rope_scaling={
            k: field(k, "number", within=f"{spelling}.", source=rope)
            if k != "rope_type"
            else field(k, "text", within=f"{spelling}.", source=rope)
            for k in ROPE_SCALING
        }
        if rope_type == "llama3"
        else None,
    )


def to_hf(config):
    """config.json's Llama fields (hf/write.py adds the vocabulary, the dtype and token ids)."""
    return dict(
        decoder_to_hf(config),
        architectures=["LlamaForCausalLM"],
        model_type=HF_TYPE,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )


def decoder_to_hf(config):
    """What Llama and Qwen2 write alike."""
    c = config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    return {
        "max_position_embeddings": c.seq_length,
        "hidden_size": c.embed_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.embed_size // c.num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        # both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta and rope_scaling
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": rope if c.rope_scaling else None,
        "attention_dropout": c.dropout,
    }


def hf_names(config, qkv_bias=False, tied=False):
    """{our parameter name: its name in the files LlamaForCausalLM saves}; with Qwen2's biases of q,
    k and v, and without an output head when it is the embedding (tied)."""
    names = {"wte.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    pairs = [
        ("attn_norm.weight", "input_layernorm.weight"),
        ("mlp_norm.weight", "post_attention_layernorm.weight"),
        *((f"attn.{p}.weight", f"self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")),
        *(
            (f"attn.{p}.bias", f"self_attn.{p}.bias")
            for p in ("q_proj", "k_proj", "v_proj")
            if qkv_bias
        ),
        ("attn.o_proj.weight", "self_attn.o_proj.weight"),
        *((f"mlp.{p}.weight", f"mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
    ]
    for i in range(config.num_layers):
        for ours, theirs in pairs:
            names[f"blocks.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def transposed(hf_name):
    """Every weight is stored as nn.Linear holds it."""
    return False


def stored_names(hf_name):
    """The names a tensor may have in the files, in the order tried: files with tied embeddings
    (Llama 3.2 1B/3B) have no lm_head, which we then untie from the embedding."""
    return hf_name, "model.embed_tokens.weight" if hf_name == "lm_head.weight" else None


# -----------------------------------------------------------------------------
# the memory planner's terms (tools/model_size.py), in elements per token of one block


def activations_per_token(config, device_type="cuda"):
    """What autograd saves for backward: q, k, v (k and v repeated to all heads), attention output
    (4 C); per RMSNorm its input and output (2 C; CPU's unfused RMSNorm also keeps the normalized
    input, +1 C), twice; SwiGLU: gate, silu(gate), up, their product (4 I)."""
    c = config
    norm = 2 if device_type == "cuda" else 3
    return (4 + 2 * norm) * c.embed_size + 4 * c.intermediate_size


def float8_inputs_per_token(config):
    """The distinct inputs of the float8 layers: normalized input (q, k, v), attention output (o),
    normalized input (gate, up), down's input = 3 C + I."""
    return 3 * config.embed_size + config.intermediate_size


def kept_per_token(config):
    """What --recompute selective keeps: input (1), q, k, v ((H + 2K) D), attention (1), o (1), gate
    and up (2 I), down (1)."""
    c = config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * (c.embed_size // c.num_heads)
    return 4 * c.embed_size + qkv + 2 * c.intermediate_size


def final_norm_per_token(config, device_type="cuda"):
    """The final RMSNorm's input and output (and on CPU, unfused, its normalized input)."""
    return (2 if device_type == "cuda" else 3) * config.embed_size


def sizes(config, qkv_bias=False):
    """(per block, outside the blocks, looked-up embedding, each block linear's (name, in, out),
    the matrices outside the blocks):
    models/llama.Llama's RMSNorms (weight), q/k/v/o (q/k/v with biases: qkv_bias), SwiGLU
    gate/up/down; an output head of its own unless tied to the embedding."""
    C, V = config.embed_size, config.vocab_size
    D = C // config.num_heads
    Q, K, inter = config.num_heads * D, config.num_kv_heads * D, config.intermediate_size
    linears = (("attn.q_proj", C, Q), ("attn.k_proj", C, K), ("attn.v_proj", C, K))
    linears += (("attn.o_proj", Q, C), ("mlp.gate_proj", C, inter), ("mlp.up_proj", C, inter))
    linears += (("mlp.down_proj", inter, C),)
    per_block = sum(i * o for _, i, o in linears) + 2 * C + (Q + 2 * K if qkv_bias else 0)
    tied = getattr(config, "tie_embeddings", False)
    root = V * C + C + (0 if tied else C * V)
    return per_block, root, 0 if tied else V * C, linears, ((V, C),) * (1 if tied else 2)

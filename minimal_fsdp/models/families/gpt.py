"""GPT-2: its shape, presets, Hugging Face mapping (GPT2LMHeadModel) and planner terms. The math is
models/gpt.py. Shapes: C embed_size."""

from dataclasses import asdict, dataclass
from typing import ClassVar

from minimal_fsdp.config.choices import ConfigError

MODEL = "minimal_fsdp.models.gpt.GPT"


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
        """As checkpoints record it. document_eot_id is left out when off, so a checkpoint written
        before document masks existed records the same model as a run without one."""
        return {k: v for k, v in asdict(self).items() if k != "document_eot_id" or v is not None}


Config = GPTConfig

# The OpenAI GPT-2 shapes (vocab 50257, 1024 positions) and a tiny one that trains on a laptop CPU.
# fmt: off
PRESETS = {
    "tiny":        dict(num_layers=4, num_heads=4, embed_size=128, seq_length=128, dropout=0.0),
    "gpt2":        dict(num_layers=12, num_heads=12, embed_size=768, seq_length=1024, vocab_size=50257, dropout=0.0),
    "gpt2-medium": dict(num_layers=24, num_heads=16, embed_size=1024, seq_length=1024, vocab_size=50257, dropout=0.0),
    "gpt2-large":  dict(num_layers=36, num_heads=20, embed_size=1280, seq_length=1024, vocab_size=50257, dropout=0.0),
    "gpt2-xl":     dict(num_layers=48, num_heads=25, embed_size=1600, seq_length=1024, vocab_size=50257, dropout=0.0),
}
# fmt: on


def problem(config):
    """Every shape the flags accept builds a GPT."""
    return None


# -----------------------------------------------------------------------------
# Hugging Face: GPT2LMHeadModel

HF_TYPE = "gpt2"
# our whole-number fields: config.json's names for them
HF_SIZES = {
    "seq_length": "n_positions",
    "embed_size": "n_embd",
    "num_heads": "n_head",
    "vocab_size": "vocab_size",
    "num_layers": "n_layer",
}
# the hub's gpt2 has no tokenizer.json beside the weights: tiktoken's GPT-2 BPE is the same one
HF_TOKENIZER = "gpt2"


def from_hf(field, check, shape):
    """The rest of our config from config.json (`field` reads a field, checked; `check(ok, what)`
    refuses what we do not implement); shape: the HF_SIZES read already."""
    activation = field("activation_function", "text", "gelu_new")
    check(
        activation in ("gelu_new", "gelu_pytorch_tanh"),
        f"activation {activation} (we use GPT-2's tanh GELU)",
    )
    check(
        field("n_inner", "raw") in (None, 4 * shape["embed_size"]),
        "an MLP width other than 4 x n_embd",
    )
    check(field("layer_norm_epsilon", "raw", 1e-5) == 1e-5, "a LayerNorm epsilon other than 1e-5")
    check(not field("scale_attn_by_inverse_layer_idx", "raw"), "scale_attn_by_inverse_layer_idx")
    return dict(bias=True)


def to_hf(config):
    """config.json's GPT-2 fields (hf/write.py adds the vocabulary, the dtype and token ids)."""
    c = config
    if not c.bias:
        raise ConfigError("a GPT without biases has no GPT2LMHeadModel equivalent")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": HF_TYPE,
        "n_positions": c.seq_length,
        "n_embd": c.embed_size,
        "n_layer": c.num_layers,
        "n_head": c.num_heads,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "tie_word_embeddings": True,
    }


def hf_names(config):
    """{our parameter name: its name in the files GPT2LMHeadModel saves}."""
    names = {
        "wte.weight": "transformer.wte.weight",
        "wpe.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight",
        "ln_f.bias": "transformer.ln_f.bias",
    }
    pairs = [
        ("ln_1", "ln_1"),
        ("attn.qkv", "attn.c_attn"),
        ("attn.proj", "attn.c_proj"),
        ("ln_2", "ln_2"),
        ("mlp.fc", "mlp.c_fc"),
        ("mlp.proj", "mlp.c_proj"),
    ]
    for i in range(config.num_layers):
        for ours, theirs in pairs:
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    return names


def transposed(hf_name):
    """GPT-2's linear layers are Conv1D modules that store weights as (in, out): ours are
    nn.Linear's (out, in)."""
    return (
        hf_name.startswith("transformer.h.")
        and ".ln_" not in hf_name
        and hf_name.endswith(".weight")
    )


def stored_names(hf_name):
    """The names a tensor may have in the files, in the order tried: files saved from GPT2Model
    (the hub's `gpt2`) drop the 'transformer.' prefix."""
    return hf_name, hf_name.removeprefix("transformer.")


# -----------------------------------------------------------------------------
# the memory planner's terms (tools/model_size.py), in elements per token of one block


def activations_per_token(config, device_type="cuda"):
    """What autograd saves for backward: LayerNorm input (1), qkv input (1), q/k/v (3), attention
    output (1; SDPA writes it in the layout the out-projection reads, so no copy), LayerNorm input +
    MLP input (2), GELU input (4), proj input (4) = 16 C."""
    return 16 * config.embed_size


def float8_inputs_per_token(config):
    """The distinct inputs of the float8 layers: attention output (proj), MLP input (fc), GELU
    output (proj) = 6 C (attn.qkv is not converted)."""
    return 6 * config.embed_size


def kept_per_token(config):
    """What --recompute selective keeps: input (1), qkv (3), attention (1), its projection (1), fc
    (4), MLP projection (1) = 11 C."""
    return 11 * config.embed_size


def final_norm_per_token(config, device_type="cuda"):
    """The final LayerNorm's input and output."""
    return 2 * config.embed_size


def sizes(config):
    """(per block, outside the blocks, looked-up embedding, each block linear's (name, in, out),
    the matrices outside the blocks):
    models/gpt.GPT's LayerNorms (weight, bias), attn.qkv, attn.proj, mlp.fc, mlp.proj; the token
    embedding is the output head (tied); wpe is only looked up."""
    C, V, T = config.embed_size, config.vocab_size, config.seq_length
    linears = (("attn.qkv", C, 3 * C), ("attn.proj", C, C), ("mlp.fc", C, 4 * C))
    linears += (("mlp.proj", 4 * C, C),)
    bias = 1 if config.bias else 0
    per_block = sum(i * o + bias * o for _, i, o in linears) + 2 * (C + bias * C)
    return per_block, V * C + T * C + C + bias * C, T * C, linears, ((V, C), (T, C))

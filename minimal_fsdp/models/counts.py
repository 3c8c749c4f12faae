"""How many parameters a model has, counted from its shape without building it: what `minimal-fsdp
plan` uses, so it answers without importing torch. models/size.py counts the same from one block
built on the meta device (the training code's counter); tests/models/test_counts.py holds the two
equal for every preset and for shapes drawn at random."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sizes:
    total: int  # every parameter, embeddings included, counted once (tied weights too)
    per_block: int
    # everything outside the blocks: embeddings, final norm, output head (FSDP's root unit)
    root: int
    lookup: int = 0  # the embedding that is only looked up (no FLOPs; layers.Decoder.lookup_only)
    # (name in the block, in features, out features) of each linear layer of a block
    block_linears: tuple = ()


def count(config):
    """Sizes of a GPTConfig or LlamaConfig, as models/size.count_parameters counts them."""
    c = config
    C, V, T = c.embed_size, c.vocab_size, c.seq_length
    if c.model_type == "gpt":
        # model.GPT: LayerNorms (weight, bias), attn.qkv, attn.proj, mlp.fc, mlp.proj; the token
        # embedding is the output head (tied); wpe is only looked up.
        linears = (("attn.qkv", C, 3 * C), ("attn.proj", C, C), ("mlp.fc", C, 4 * C))
        linears += (("mlp.proj", 4 * C, C),)
        bias = 1 if c.bias else 0
        per_block = sum(i * o + bias * o for _, i, o in linears) + 2 * (C + bias * C)
        root = V * C + T * C + C + bias * C
        return Sizes(root + per_block * c.num_layers, per_block, root, T * C, linears)
    # llama.Llama: RMSNorms (weight), q/k/v/o, SwiGLU gate/up/down, no biases; an untied lm_head.
    D = C // c.num_heads
    Q, K, inter = c.num_heads * D, c.num_kv_heads * D, c.intermediate_size
    linears = (("attn.q_proj", C, Q), ("attn.k_proj", C, K), ("attn.v_proj", C, K))
    linears += (("attn.o_proj", Q, C), ("mlp.gate_proj", C, inter), ("mlp.up_proj", C, inter))
    linears += (("mlp.down_proj", inter, C),)
    per_block = sum(i * o for _, i, o in linears) + 2 * C
    root = V * C + C + C * V
    return Sizes(root + per_block * c.num_layers, per_block, root, V * C, linears)

"""The model families and how a run's flags pick a model's shape.

MODELS is the one table of families: "gpt" (model.GPT) and "llama" (llama.Llama). Each class carries
its config class (model_configs.py, which imports no torch) and its presets, and a checkpoint's
meta.json records the family as "model_type".
"""

import dataclasses

from minimal_fsdp.models.attention import KernelError, cuda_kernel
from minimal_fsdp.config.checks import model_family
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.models.llama import Llama
from minimal_fsdp.models.gpt import GPT
from minimal_fsdp.models.configs import check_shape, make_config  # noqa: F401 (torch-free)

MODELS = {"gpt": GPT, "llama": Llama}


def config_from_dict(model_type, fields):
    """A saved config (a checkpoint's meta.json "model", or our export's config.json) as its config
    class."""
    return MODELS[model_type].config_class(**fields)


def config_from_flags(cfg, vocab_size=None):
    """--model_preset's shape with the explicit model flags applied (vocab: --vocab_size, else
    vocab_size (the tokenizer's), else the preset's)."""
    family = model_family(cfg)
    shape = dict(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        embed_size=cfg.embed_size,
        seq_length=cfg.seq_length,
        dropout=cfg.dropout,
        vocab_size=cfg.vocab_size or vocab_size,
    )
    if family == "llama":
        shape.update(num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size)
    else:
        shape.update(bias=cfg.bias)
    return check_shape(make_config(family, cfg.model_preset, **shape))


def with_document_mask(config, cfg, tokenizer):
    """The model config with --document_mask's end-of-text token (the tokenizer's), which the
    model's attention keeps documents apart at (attention.py); unchanged without the flag."""
    if not cfg.document_mask:
        return config
    if tokenizer.eot_id is None:
        raise ConfigError(
            f"--document_mask needs a tokenizer with an end-of-text token, and {tokenizer.kind} "
            "has none: use --tokenizer gpt2 or sentencepiece, a --tokenizer_dir that names an eos "
            "token, or drop --document_mask"
        )
    try:
        # a mistyped MINIMAL_FSDP_DOCUMENT_KERNEL fails here, not in the first forward
        cuda_kernel()
    except KernelError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(config, document_eot_id=tokenizer.eot_id)

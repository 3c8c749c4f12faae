"""The model families, one module each, and FAMILIES, the one table that names them.

A family's module holds all that differs from one family to another:
  Config, PRESETS   its shape as plain data (a checkpoint's meta.json records it), the named shapes
  MODEL             where its model class is: models/<module>.Class (the math, which imports torch)
  HF_TYPE, HF_SIZES config.json's model_type and whole-number fields; from_hf(field, check) reads
                    the rest of a Hugging Face config, to_hf(config) writes one
  hf_names(config)  {our parameter: its Hugging Face tensor}; transposed(hf_name) and
                    stored_names(hf_name) say how the files may hold it
  HF_TOKENIZER      the tokenizer a Hugging Face directory without tokenizer files gets, or None
  problem(config)   what its shape cannot be beyond the flags' own checks, or None
  activations_per_token, float8_inputs_per_token, kept_per_token, final_norm_per_token: its terms
                    in the memory planner (tools/model_size.py)

Nothing here imports torch: `minimal-fsdp progress` checks a meta.json's model against these
config classes (checkpoint/meta.py) without it; models/classes.py imports the model classes. A new
family is a module here, its line in FAMILIES, and its preset names and own shape flags in
config/choices.py (config imports no models, so that `--help` needs no torch).
"""

import dataclasses
import importlib

from minimal_fsdp.config.checks import model_family
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.models.families import gpt, llama, qwen2

FAMILIES = {"gpt": gpt, "llama": llama, "qwen2": qwen2}


def model_class(model_type):
    """The family's model class, imported (it needs torch)."""
    module, _, name = FAMILIES[model_type].MODEL.rpartition(".")
    return getattr(importlib.import_module(module), name)


def make_config(model_type, preset, **overrides):
    """A preset's shape with any explicitly given (non-None) fields replacing it."""
    fields = dict(FAMILIES[model_type].PRESETS[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return FAMILIES[model_type].Config(**fields)


def config_from_dict(model_type, fields):
    """A saved config (a checkpoint's meta.json "model", or our export's config.json) as its config
    class."""
    return FAMILIES[model_type].Config(**fields)


def guess_family(fields):
    """The family of a saved config that does not say (an export of ours written before exports
    recorded model_type): the first whose config has every field."""
    for model_type, family in FAMILIES.items():
        if set(fields) <= {f.name for f in dataclasses.fields(family.Config)}:
            return model_type
    return next(iter(FAMILIES))


def of_hf(hf_type):
    """Our family of a Hugging Face config.json's model_type, or None."""
    return next((name for name, f in FAMILIES.items() if f.HF_TYPE == hf_type), None)


def check_shape(config):
    """The shape constraints the flags alone cannot check (a preset's values may meet a flag's)."""
    c = config
    if c.embed_size % c.num_heads:
        raise ConfigError(f"embed size {c.embed_size} is not divisible by {c.num_heads} heads")
    problem = FAMILIES[c.model_type].problem(c)
    if problem:
        raise ConfigError(problem)
    return config


def config_from_flags(model, vocab_size=None):
    """--model_preset's shape with the explicit model flags applied (vocab: --vocab_size, else
    vocab_size (the tokenizer's), else the preset's). A family takes the shape flags its config has
    (config.checks refused the others)."""
    family = model_family(model)
    fields = {f.name for f in dataclasses.fields(FAMILIES[family].Config)}
    shape = dict(
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        embed_size=model.embed_size,
        seq_length=model.seq_length,
        dropout=model.dropout,
        vocab_size=model.vocab_size or vocab_size,
    )
    shape.update(
        {name: getattr(model, name) for name in ("num_kv_heads", "intermediate_size", "bias")}
    )
    shape = {name: value for name, value in shape.items() if name in fields}
    return check_shape(make_config(family, model.model_preset, **shape))


def with_document_mask(config, model, tokenizer):
    """The model config with --document_mask's end-of-text token (the tokenizer's), which the
    model's attention keeps documents apart at (attention.py); unchanged without the flag."""
    if not model.document_mask:
        return config
    if tokenizer.eot_id is None:
        raise ConfigError(
            f"--document_mask needs a tokenizer with an end-of-text token, and {tokenizer.kind} "
            "has none: use --tokenizer gpt2 or sentencepiece, a --tokenizer_dir that names an eos "
            "token, or drop --document_mask"
        )
    # imported here: attention.py imports torch, which the families' table does not
    from minimal_fsdp.models.attention import KernelError, cuda_kernel

    try:
        # a mistyped MINIMAL_FSDP_DOCUMENT_KERNEL fails here, not in the first forward
        cuda_kernel()
    except KernelError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(config, document_eot_id=tokenizer.eot_id)

"""A checkpoint -> one consolidated model.safetensors plus config.json and the tokenizer, for
inference and sharing.

    minimal-fsdp export checkpoints/shakespeare/step_600 exported/
    minimal-fsdp export checkpoints/shakespeare exported/ --dtype bf16    # the run's newest
    minimal-fsdp export checkpoints/shakespeare/best exported/ --format hf

--format safetensors keeps our parameter names, config.json is our model config, and the tokenizer
files are the checkpoint's (`minimal-fsdp sample` reads it back). --format hf writes what
transformers' AutoModelForCausalLM and AutoTokenizer read (see hf/write.py), which --hf_model also
reads.

Runs in one CPU process with no process group and no GPU. Each tensor is read from the DCP shards
and written straight into the file, so memory holds one tensor at a time, not the model.
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from minimal_fsdp.checkpoint import find, safe_load
from minimal_fsdp.checkpoint.meta import read_meta
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data.tokenizer import has_tokenizer, load_tokenizer
from minimal_fsdp.hf import write

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def _tokenizer(path):
    """The checkpoint's tokenizer, or None (with a warning) when it cannot be rebuilt here, e.g.
    gpt2 offline."""
    if not has_tokenizer(path):
        print(
            f"warning: {path} holds no tokenizer files: the export has none",
            file=sys.stderr,
            flush=True,
        )
        return None
    try:
        return load_tokenizer(path)
    except ConfigError as e:
        print(f"warning: the export has no tokenizer: {e}", file=sys.stderr, flush=True)
        return None


def export(ckpt, out, dtype=None, fmt="safetensors"):
    """Write `ckpt`'s model to directory `out`; returns the path of the weights file (or of
    `out`). A run directory gives its newest complete checkpoint, as sample and evaluate find it;
    one whose shards fail to load is passed over in one line for the next, as a resumed run passes
    it (the files written from it are written again)."""
    named, next_one = find.source_fallback(ckpt, together=False)
    _, written = find.first_loading(
        find.checkpoint_path(ckpt),
        lambda path: _export(path, out, dtype, fmt),
        next_one,
        named,
        failures=find.LoadFailed,
    )
    return written


def _export(path, out, dtype, fmt):
    meta = read_meta(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [(name, shape, dtype or saved) for name, shape, saved in safe_load.tensor_names(path)]

    def read(name):
        try:
            return safe_load.read_tensors(path, [name])[name]
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
            raise find.LoadFailed() from e

    if fmt == "hf":
        return write.write_hf(out, meta, specs, read, _tokenizer(path))
    weights = out / "model.safetensors"
    write.write_safetensors(
        weights,
        specs,
        read,
        {
            "format": "pt",
            "step": meta["step"],
            "source": path,
            "model_type": meta.get("model_type", "gpt"),
        },
    )
    for f in path.glob("tokenizer.*"):
        write.write_public(out / f.name, lambda p: p.write_bytes(f.read_bytes()))
    config = json.dumps(meta["model"], indent=1) + "\n"
    write.write_public(out / "config.json", lambda p: p.write_text(config))
    return weights

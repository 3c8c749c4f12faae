"""A checkpoint -> one consolidated model.safetensors plus config.json and the tokenizer, for inference and sharing.

    python -m minimal_fsdp.hf.export checkpoints/shakespeare/step_600 exported/
    python -m minimal_fsdp.hf.export checkpoints/shakespeare exported/ --dtype bf16    # the run's newest
    python -m minimal_fsdp.hf.export checkpoints/shakespeare/best exported/ --format hf

--format safetensors keeps our parameter names, config.json is our model config, and the tokenizer files are
the checkpoint's (python -m minimal_fsdp.inference.sample reads it back). --format hf writes what transformers'
AutoModelForCausalLM and AutoTokenizer read (see hf_write.py), which --hf_model also reads.

Runs in one CPU process with no process group and no GPU. Each tensor is read from the DCP shards and
written straight into the file, so memory holds one tensor at a time, not the model.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from minimal_fsdp.checkpoint import find as checkpoint_find
from minimal_fsdp.checkpoint import meta as checkpoint_meta
from minimal_fsdp.hf import write as hf_write
from minimal_fsdp.checkpoint import safe_load
from minimal_fsdp.config.flags import ConfigError, one_line_errors
from minimal_fsdp.data.tokenizer import has_tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def _tokenizer(path):
    """The checkpoint's tokenizer, or None (with a warning) when it cannot be rebuilt here, e.g. gpt2 offline."""
    if not has_tokenizer(path):
        print(f"warning: {path} holds no tokenizer files: the export has none", file=sys.stderr, flush=True)
        return None
    try:
        return load_tokenizer(path)
    except ConfigError as e:
        print(f"warning: the export has no tokenizer: {e}", file=sys.stderr, flush=True)
        return None


def export(ckpt, out, dtype=None, fmt="safetensors"):
    """Write `ckpt`'s model to directory `out`; returns the path of the weights file (or of `out`)."""
    path = checkpoint_find.resolve(ckpt)
    problem = checkpoint_find.verify(path)
    if problem:
        raise ConfigError(f"{ckpt} is not a complete checkpoint: {path}: {problem}")
    meta = checkpoint_meta.read_meta(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [(name, shape, dtype or saved) for name, shape, saved in safe_load.tensor_names(path)]

    def read(name):
        return safe_load.read_tensors(path, [name])[name]

    if fmt == "hf":
        return hf_write.write_hf(out, meta, specs, read, _tokenizer(path))
    weights = out / "model.safetensors"
    hf_write.write_safetensors(weights, specs, read, {"format": "pt", "step": meta["step"], "source": path,
                                                      "model_type": meta.get("model_type", "gpt")})
    for f in path.glob("tokenizer.*"):
        hf_write.write_public(out / f.name, lambda p: p.write_bytes(f.read_bytes()))
    config = json.dumps(meta["model"], indent=1) + "\n"
    hf_write.write_public(out / "config.json", lambda p: p.write_text(config))
    return weights


@one_line_errors
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minimal_fsdp.hf.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step_<N> directory, a run's `latest`/`best` marker, or a run directory")
    parser.add_argument("out", help="directory for model.safetensors, config.json and the tokenizer's files")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)")
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors: our names and config.json; hf: Hugging Face transformers layout "
                             "(config.json, safetensors, tokenizer.json)")
    args = parser.parse_args(argv)
    print(f"wrote {export(args.checkpoint, args.out, DTYPES.get(args.dtype), args.format)}")


if __name__ == "__main__":
    main()

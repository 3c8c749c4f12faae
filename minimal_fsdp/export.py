"""A checkpoint -> one consolidated model.safetensors plus config.json, for inference and sharing.

    python -m minimal_fsdp.export checkpoints/shakespeare/step_600 exported/
    python -m minimal_fsdp.export checkpoints/shakespeare exported/ --dtype bf16    # the run's newest
    python -m minimal_fsdp.export checkpoints/shakespeare/best exported/ --format hf

Runs in one CPU process with no process group and no GPU. Each tensor is read from the DCP shards and
written straight into the file, so memory holds one tensor at a time, not the model.
"""
import argparse
import json
import math
import shutil
import struct
import sys
from pathlib import Path

import torch

from . import checkpoint
from .config import ConfigError
from .files import write_atomic

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                      torch.int32: "I32", torch.uint8: "U8"}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def write_safetensors(path, specs, read, metadata):
    """Write a .safetensors file one tensor at a time. `specs` lists (name, shape, dtype) in file order and
    `read(name)` returns that tensor. safetensors' own save_file wants every tensor in memory at once; the
    format (an 8-byte header size, a JSON header of dtypes, shapes and byte offsets, then the raw
    little-endian bytes) lets us write the header first and stream the rest."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {key: str(value) for key, value in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header so the data starts 8-byte aligned

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in specs:
                tensor = read(name).to(dtype).contiguous()
                assert tuple(tensor.shape) == tuple(shape), name
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())

    write_atomic(path, write)


def export(ckpt, out, dtype=None, fmt="safetensors"):
    """Write `ckpt`'s model to directory `out`; returns the path of the weights file (or of `out`)."""
    path = checkpoint.resolve(ckpt)
    problem = checkpoint.verify(path)
    if problem:
        raise ConfigError(f"{ckpt} is not a complete checkpoint: {path}: {problem}")
    meta = checkpoint.read_meta(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        from .hf import save_hf
        state = checkpoint.load_full_model_state(path)
        save_hf({k: v.to(dtype) if dtype else v for k, v in state.items()}, meta, out, tokenizer_dir=path)
        return out
    specs = [(name, shape, dtype or saved) for name, shape, saved in checkpoint.tensor_names(path)]
    weights = out / "model.safetensors"
    write_safetensors(weights, specs, lambda name: checkpoint.read_tensors(path, [name])[name],
                      {"format": "pt", "step": meta["step"], "source": path})
    (out / "config.json").write_text(json.dumps(meta["model"], indent=1) + "\n")
    for f in path.glob("tokenizer.*"):
        shutil.copy(f, out / f.name)
    return weights


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minimal_fsdp.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step_<N> directory, a run's `latest`/`best` marker, or a run directory")
    parser.add_argument("out", help="directory for model.safetensors, config.json and the tokenizer's files")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)")
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors: our names and config.json; hf: Hugging Face transformers layout")
    args = parser.parse_args(argv)
    try:
        written = export(args.checkpoint, args.out, DTYPES.get(args.dtype), args.format)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()

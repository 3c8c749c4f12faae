"""Writing a Hugging Face model directory that transformers loads: config.json, the weights as
safetensors streamed one tensor at a time (sharded with an index when large), and tokenizer.json +
tokenizer_config.json.

torch.distributed.checkpoint's Hugging Face writer saves a state dict held in memory (all of it on
rank 0, or shards under a process group), and its consolidation merges its own sharded safetensors:
neither streams one tensor at a time out of our DCP checkpoints in a single process, so we keep this
writer.
"""

import json
import math
import os
import struct
import sys
from pathlib import Path

import torch

from minimal_fsdp.files import write_atomic
from minimal_fsdp.hf.read import hf_names, is_transposed
from minimal_fsdp.hf.tokenizer import PROBE, hf_tokenizer
from minimal_fsdp.models.families import FAMILIES, config_from_dict

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


def write_public(path, write):
    """write_atomic, then the mode an ordinary new file gets (0666 less the umask): the temporary
    file is created private (0600), which would keep other users of a shared model directory out."""
    write_atomic(path, write)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_safetensors(path, specs, read, metadata):
    """Write a .safetensors file one tensor at a time. `specs` lists (name, shape, dtype) in file
    order and `read(name)` returns that tensor (cast to dtype here). safetensors' own save_file
    wants every tensor in memory at once; the format (an 8-byte header size, a JSON header of
    dtypes, shapes and byte offsets, then the raw little-endian bytes) lets us write the header
    first and stream the rest."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {key: str(value) for key, value in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header so the data starts 8-byte aligned

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in specs:
                tensor = read(name).detach().to("cpu", dtype).contiguous()
                assert tuple(tensor.shape) == tuple(shape), name
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())

    write_public(path, write)


def hf_config(model_type, config, dtype=torch.float32, bos_id=None, eos_id=None):
    """The config.json that makes transformers build the same model. bos/eos: the tokenizer's ids,
    or None."""
    family = FAMILIES[model_type].to_hf(config)
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": family.pop("architectures"),
        "model_type": family.pop("model_type"),
        "vocab_size": config.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        # both spellings: transformers 5 reads dtype, 4 reads torch_dtype
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        **family,
    }


def write_hf(out_dir, model_meta, specs, read, tokenizer=None, max_shard_bytes=5 * 2**30):
    """Write a model as a Hugging Face directory, one tensor in memory at a time: config.json,
    model.safetensors (or shards of at most max_shard_bytes plus model.safetensors.index.json), and
    the tokenizer's files. model_meta is a checkpoint's meta.json: its "model" (config dict) and
    "model_type" ("gpt" when absent). specs lists (our name, shape, dtype to write) and read(our
    name) returns the tensor. Each file is written under a temporary name and renamed; config.json
    comes last, so its presence means the export is complete."""
    model_type = model_meta.get("model_type", "gpt")
    config = config_from_dict(model_type, model_meta["model"])
    # the config names the dtype that holds most of the weights (all of them, as we write)
    written_bytes = {}
    for _, shape, dtype in specs:
        written_bytes[dtype] = written_bytes.get(dtype, 0) + math.prod(shape) * dtype.itemsize
    config_json = json.dumps(
        hf_config(
            model_type,
            config,
            max(written_bytes, key=written_bytes.get),
            getattr(tokenizer, "bos_id", None),
            getattr(tokenizer, "eot_id", None),
        ),
        indent=1,
    )
    names = hf_names(model_type, config)
    ours_of = {names[ours]: ours for ours, _, _ in specs}
    hf_specs = [
        (names[ours], tuple(shape)[::-1] if is_transposed(names[ours]) else tuple(shape), dtype)
        for ours, shape, dtype in specs
    ]

    def read_hf(name):
        t = read(ours_of[name])
        return t.t() if is_transposed(name) else t

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    # greedy: start a new shard when this tensor would overflow the current one
    for spec in hf_specs:
        nbytes = math.prod(spec[1]) * spec[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    if len(shards) == 1:
        written = ["model.safetensors"]
        write_safetensors(out / "model.safetensors", shards[0], read_hf, {"format": "pt"})
    else:
        written, weight_map = ["model.safetensors.index.json"], {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / file, shard, read_hf, {"format": "pt"})
            weight_map.update({name: file for name, _, _ in shard})
            written.append(file)
        total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in hf_specs)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        write_public(out / "model.safetensors.index.json", lambda p: p.write_text(index))
    # Weights of an earlier export to the same directory would otherwise be found instead of these.
    for stale in [
        *out.glob("model*.safetensors"),
        out / "model.safetensors.index.json",
        *out.glob("pytorch_model*"),
    ]:
        if stale.exists() and stale.name not in written:
            stale.unlink()
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out, config.seq_length)
    write_public(out / "config.json", lambda p: p.write_text(config_json + "\n"))
    return out


def save_hf(state_dict, model_meta, out_dir, tokenizer=None, max_shard_bytes=5 * 2**30):
    """write_hf from a full state dict held in memory (tests, small models)."""
    specs = [(name, tuple(t.shape), t.dtype) for name, t in state_dict.items()]
    return write_hf(out_dir, model_meta, specs, state_dict.__getitem__, tokenizer, max_shard_bytes)


def write_hf_tokenizer(tokenizer, out, model_max_length):
    """tokenizer.json and tokenizer_config.json (and a sentencepiece model's own tokenizer.model) in
    `out`."""
    tok, names = hf_tokenizer(tokenizer)
    probe = "".join(tokenizer.chars) if tokenizer.kind == "char" else PROBE
    encoded = tok.encode(probe, add_special_tokens=False).ids
    if encoded != tokenizer.encode(probe):
        print(
            f"warning: the exported tokenizer.json encodes a test text differently from our "
            f"{tokenizer.kind} "
            "tokenizer: check it before relying on it",
            file=sys.stderr,
            flush=True,
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    write_public(out / "tokenizer.json", lambda p: p.write_text(tok.to_str(), encoding="utf-8"))
    write_public(
        out / "tokenizer_config.json", lambda p: p.write_text(json.dumps(config, indent=1) + "\n")
    )
    if tokenizer.kind == "sentencepiece":
        write_public(out / "tokenizer.model", lambda p: p.write_bytes(tokenizer.model_proto))

"""Hugging Face checkpoints in and out, for GPT-2 (GPT2LMHeadModel) and Llama 2/3 (LlamaForCausalLM).

In:  resolve(name_or_dir)              a local directory (a hub name is downloaded if the hub answers)
     read_config(dir, ...)             -> our model type ("gpt" or "llama") and config
     load_weights(model, dir, type)    each rank reads only its own rows of each tensor into its shard
     load_tokenizer(dir)               the directory's own tokenizer (tokenizer.load_tokenizer)
Out: write_hf(out_dir, meta, specs, read, tokenizer)   config.json, safetensors written a tensor at a time, and
                                       tokenizer.json + tokenizer_config.json, all of which transformers loads
     save_hf(state_dict, meta, out_dir, tokenizer)     the same from a state dict in memory

transformers itself is never imported: the formats are plain JSON, safetensors and the `tokenizers` library's
tokenizer.json.

torch.distributed.checkpoint has a Hugging Face reader and writer (hf_storage.py) and a consolidation helper
(_consolidate_hf_safetensors.py). We keep our own reader because the DCP reader needs stored names and shapes
to equal the state dict's: it cannot transpose GPT-2's Conv1D weights, read .bin files, untie a missing lm_head
(Llama 3.2) or keep the first rows of shortened position embeddings. We keep our own writer because
the DCP writer saves a state dict held in memory (all of it on rank 0, or shards under a process group), and
its consolidation merges its own sharded safetensors: neither streams one tensor at a time out of our DCP
checkpoints in a single process. sample.py does use the DCP reader, for our own exports, where names match.
"""
import json
import math
import os
import struct
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

from . import tokenizer as tk
from .config import ConfigError
from .files import write_atomic
from .models import config_from_dict



# -----------------------------------------------------------------------------
# names: our parameter -> the Hugging Face tensor

def hf_names(model_type, config):
    """{our parameter name: its Hugging Face name}, in the names GPT2LMHeadModel / LlamaForCausalLM save."""
    if model_type == "gpt":
        names = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
                 "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
        pairs = [("ln_1", "ln_1"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("ln_2", "ln_2"),
                 ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]
        for i in range(config.num_layers):
            for ours, theirs in pairs:
                for kind in ("weight", "bias"):
                    names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
        return names
    names = {"wte.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    pairs = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
             *((f"attn.{p}", f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
             *((f"mlp.{p}", f"mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj"))]
    for i in range(config.num_layers):
        for ours, theirs in pairs:
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    return names


def is_transposed(hf_name):
    """GPT-2's linear layers are Conv1D modules that store weights as (in, out): ours are nn.Linear's (out, in)."""
    return hf_name.startswith("transformer.h.") and ".ln_" not in hf_name and hf_name.endswith(".weight")


# -----------------------------------------------------------------------------
# in

def resolve(name_or_dir):
    """A local directory holding config.json and weights. A name that is not a directory is taken from the
    Hugging Face cache or fetched from the hub with huggingface_hub (if installed); run it on one rank."""
    path = Path(name_or_dir)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"--hf_model {path} has no config.json: pass a Hugging Face model directory")
        if not any(path.glob("model*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
            raise ConfigError(f"--hf_model {path} has a config.json but no weights (model.safetensors, its shards, "
                              "or pytorch_model.bin): download them too")
        return str(path)
    if path.exists() or name_or_dir.startswith((".", "/", "~")) or name_or_dir.count("/") > 1:
        raise ConfigError(f"--hf_model {name_or_dir} is not a directory")
    try:
        from huggingface_hub import HfApi, constants, snapshot_download
    except ImportError:
        raise ConfigError(f"--hf_model {name_or_dir} is not a local directory, and fetching it from the Hugging "
                          "Face hub needs huggingface_hub: pip install huggingface_hub "
                          "(or download the model elsewhere and pass its directory)") from None
    patterns = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "model*.safetensors",
                "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]
    try:  # downloaded before: no network needed
        return snapshot_download(name_or_dir, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    # huggingface_hub retries an unreachable hub for half a minute; a quick look first gives a quick answer.
    if constants.HF_HUB_OFFLINE or not tk.reachable(constants.ENDPOINT):
        raise ConfigError(f"--hf_model {name_or_dir} is not a local directory nor in the Hugging Face cache, and "
                          f"the hub ({constants.ENDPOINT}) is unreachable (offline?): download the model where the "
                          "hub is reachable and pass its directory")
    try:
        files = HfApi().list_repo_files(name_or_dir)
        if any(f.endswith(".safetensors") for f in files):  # fetch one format, not both
            patterns = [p for p in patterns if "pytorch_model" not in p]
        return snapshot_download(name_or_dir, allow_patterns=patterns)
    except Exception as e:  # unknown or gated repo, lost connection, ...: one line, whatever was raised
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"--hf_model {name_or_dir} could not be fetched from the Hugging Face hub "
                          f"({type(e).__name__}: {reason})") from None


def read_config(directory, seq_length=None, dropout=None):
    """Our (model type, config) for the checkpoint in `directory`. seq_length may shorten the context
    (GPT-2 keeps the first seq_length position embeddings); dropout defaults to 0."""
    hf = json.loads((Path(directory) / "config.json").read_text())
    kind = hf.get("model_type")
    where = f"--hf_model {directory}"
    if kind == "gpt2":
        context = hf["n_positions"]
        _check(where, hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
               f"activation {hf.get('activation_function')} (we use GPT-2's tanh GELU)")
        _check(where, hf.get("n_inner") in (None, 4 * hf["n_embd"]), "an MLP width other than 4 x n_embd")
        _check(where, hf.get("layer_norm_epsilon", 1e-5) == 1e-5, "a LayerNorm epsilon other than 1e-5")
        _check(where, not hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx")
        model_type = "gpt"
        fields = dict(vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], num_heads=hf["n_head"],
                      embed_size=hf["n_embd"], bias=True)
    elif kind == "llama":
        context = hf["max_position_embeddings"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 / 4 spelling
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _check(where, rope_type in ("default", "llama3"), f"rope type {rope_type!r} (supported: default, llama3)")
        _check(where, hf.get("hidden_act", "silu") == "silu", f"activation {hf.get('hidden_act')} (we use SiLU)")
        _check(where, not hf.get("attention_bias") and not hf.get("mlp_bias"), "biases in attention or MLP")
        heads = hf["num_attention_heads"]
        _check(where, hf.get("head_dim") in (None, hf["hidden_size"] // heads), "head_dim != hidden_size / heads")
        model_type = "llama"
        fields = dict(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
                      num_kv_heads=hf.get("num_key_value_heads") or heads, embed_size=hf["hidden_size"],
                      intermediate_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
                      rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                      rope_scaling={k: rope[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings")}
                      if rope_type == "llama3" else None)
    else:
        raise ConfigError(f"{where} is a {kind!r} model; supported are gpt2 and llama")
    if seq_length and seq_length > context:
        raise ConfigError(f"--seq_length {seq_length} is longer than {where}'s context of {context} tokens")
    return model_type, config_from_dict(model_type, dict(fields, seq_length=seq_length or context,
                                                         dropout=dropout or 0.0))


def read_model_config(directory, cfg):
    """The --hf_model's config, with --seq_length and --dropout applied; a --model given too must match it."""
    model_type, config = read_config(directory, cfg.seq_length, cfg.dropout)
    if cfg.model and cfg.model != model_type:
        raise ConfigError(f"--model {cfg.model}, but --hf_model {cfg.hf_model} is a {model_type} model: drop --model")
    return config


def _check(where, ok, what):
    if not ok:
        raise ConfigError(f"{where} uses {what}, which our model does not implement")


class CheckpointFiles:
    """The tensors of a Hugging Face directory, read a slice at a time: safetensors (one file or an index of
    shards), else PyTorch .bin files memory-mapped with weights_only (so no pickled code runs and only the
    pages of the slices we touch are read)."""

    def __init__(self, directory):
        d = Path(directory)
        self.file_of, self.open_files = {}, {}
        for index, single in (("model.safetensors.index.json", "model.safetensors"),
                              ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            if (d / index).exists():
                weight_map = json.loads((d / index).read_text())["weight_map"]
                self.file_of = {name: d / file for name, file in weight_map.items()}
                return
            if (d / single).exists():
                self.file_of = {name: d / single for name in self._open(d / single).keys()}
                return
        raise ConfigError(f"--hf_model {d} has no model.safetensors or pytorch_model.bin (nor an index of shards)")

    def _open(self, file):
        if file not in self.open_files:
            if file.suffix == ".safetensors":
                self.open_files[file] = safe_open(str(file), framework="pt")
            else:
                try:
                    self.open_files[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # files from torch < 1.6 cannot be memory-mapped: read them whole
                    self.open_files[file] = torch.load(file, map_location="cpu", weights_only=True)
        return self.open_files[file]

    def __contains__(self, name):
        return name in self.file_of

    def shape(self, name):
        f = self._open(self.file_of[name])
        return tuple(f.get_slice(name).get_shape()) if hasattr(f, "get_slice") else tuple(f[name].shape)

    def rows(self, name, start, stop, transposed=False):
        """Rows [start, stop) of the tensor as we store it (columns of a transposed one)."""
        f = self._open(self.file_of[name])
        tensor = f.get_slice(name) if hasattr(f, "get_slice") else f[name]
        return tensor[:, start:stop].t() if transposed else tensor[start:stop]


def _stored_name(files, hf_name, directory):
    """GPT-2 files saved from GPT2Model (the hub's `gpt2`) drop the 'transformer.' prefix, and Llama files
    with tied embeddings (Llama 3.2 1B/3B) have no lm_head: we then untie it from the embedding."""
    for name in (hf_name, hf_name.removeprefix("transformer."),
                 "model.embed_tokens.weight" if hf_name == "lm_head.weight" else None):
        if name in files:
            return name
    raise ConfigError(f"--hf_model {directory} has no tensor {hf_name}: not a checkpoint of this model type?")


def local_rows(param):
    """The rows [start, stop) of dim 0 that this rank holds of a parameter. FSDP2 shards dim 0 over the mesh's
    shard dimension in torch.chunk pieces (ceil(rows / ranks) each; trailing ranks may hold fewer or none)."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    start = 0
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunk = -(-param.shape[0] // param.device_mesh.size(mesh_dim))
            start = min(param.shape[0], chunk * param.device_mesh.get_local_rank(mesh_dim))
    return start, start + param.to_local().shape[0]


@torch.no_grad()
def load_weights(model, directory, model_type):
    """Copy a Hugging Face checkpoint into a built (sharded or not) model. Every rank reads only the rows of
    its own shard, one tensor at a time, so no rank ever holds more than its shard plus one tensor slice."""
    files = CheckpointFiles(directory)
    names = hf_names(model_type, model.config)
    stored = {}
    # Check every tensor before copying any: the same files give the same verdict on every rank.
    for ours, param in model.named_parameters():
        name = stored[ours] = _stored_name(files, names[ours], directory)
        shape = files.shape(name)[::-1] if is_transposed(names[ours]) else files.shape(name)
        # Position embeddings may be cut to a shorter --seq_length; everything else must match exactly.
        fits = shape == tuple(param.shape) or ours == "wpe.weight" and shape[1:] == tuple(param.shape[1:]) \
            and shape[0] >= param.shape[0]
        if not fits:
            raise ConfigError(f"--hf_model {directory}: {name} has shape {shape}, our {ours} is {tuple(param.shape)}")
    for ours, param in model.named_parameters():
        start, stop = local_rows(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(files.rows(stored[ours], start, stop, transposed=is_transposed(names[ours])))


def load_tokenizer(directory):
    """The tokenizer a Hugging Face directory brings (tokenizer.load_tokenizer says which files, in which order).
    A GPT-2 directory of weights alone gets tiktoken's GPT-2 BPE (from tiktoken's cache, or downloaded)."""
    model_type = tk._read_json(Path(directory) / "config.json").get("model_type")
    if model_type == "gpt2" and not tk.has_tokenizer(directory):
        try:
            return tk.GPT2Tokenizer()
        except tk.TokenizerError:
            raise tk.TokenizerError(f"--hf_model {directory} has no tokenizer files (tokenizer.json, or vocab.json + "
                                    "merges.txt), and tiktoken's gpt2 files are not cached nor downloadable "
                                    "(offline?): copy the model's tokenizer files into it, or pass "
                                    "--tokenizer_dir DIR") from None
    try:
        return tk.load_tokenizer(directory)
    except tk.TokenizerError as e:
        raise tk.TokenizerError(f"--hf_model: {e} (or pass --tokenizer_dir DIR)") from None


# -----------------------------------------------------------------------------
# out: weights

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                      torch.int32: "I32", torch.uint8: "U8"}


def write_public(path, write):
    """write_atomic, then the mode an ordinary new file gets (0666 less the umask): the temporary file is
    created private (0600), which would keep other users of a shared model directory out."""
    write_atomic(path, write)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_safetensors(path, specs, read, metadata):
    """Write a .safetensors file one tensor at a time. `specs` lists (name, shape, dtype) in file order and
    `read(name)` returns that tensor (cast to dtype here). safetensors' own save_file wants every tensor in memory
    at once; the format (an 8-byte header size, a JSON header of dtypes, shapes and byte offsets, then the raw
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
                tensor = read(name).detach().to("cpu", dtype).contiguous()
                assert tuple(tensor.shape) == tuple(shape), name
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())

    write_public(path, write)


def hf_config(model_type, config, dtype=torch.float32, bos_id=None, eos_id=None):
    """The config.json that makes transformers build the same model. bos/eos: the tokenizer's ids, or None."""
    c = config
    dtype_name = str(dtype).removeprefix("torch.")
    # both spellings: transformers 5 reads dtype, 4 reads torch_dtype
    common = {"vocab_size": c.vocab_size, "bos_token_id": bos_id, "eos_token_id": eos_id, "dtype": dtype_name,
              "torch_dtype": dtype_name}
    if model_type == "gpt":
        if not c.bias:
            raise ConfigError("a GPT without biases has no GPT2LMHeadModel equivalent")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_positions": c.seq_length, "n_embd": c.embed_size, "n_layer": c.num_layers, "n_head": c.num_heads,
                "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
                "tie_word_embeddings": True}
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "max_position_embeddings": c.seq_length, "hidden_size": c.embed_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.embed_size // c.num_heads, "hidden_act": "silu", "rms_norm_eps": c.norm_eps,
            # both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta and rope_scaling
            "rope_theta": c.rope_theta, "rope_parameters": rope,
            "rope_scaling": rope if c.rope_scaling else None, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": c.dropout, "tie_word_embeddings": False}


def write_hf(out_dir, model_meta, specs, read, tokenizer=None, max_shard_bytes=5 * 2**30):
    """Write a model as a Hugging Face directory, one tensor in memory at a time: config.json, model.safetensors
    (or shards of at most max_shard_bytes plus model.safetensors.index.json), and the tokenizer's files.
    model_meta is a checkpoint's meta.json: its "model" (config dict) and "model_type" ("gpt" when absent).
    specs lists (our name, shape, dtype to write) and read(our name) returns the tensor. Each file is written
    under a temporary name and renamed; config.json comes last, so its presence means the export is complete."""
    model_type = model_meta.get("model_type", "gpt")
    config = config_from_dict(model_type, model_meta["model"])
    written_bytes = {}  # the config names the dtype that holds most of the weights (all of them, as we write)
    for _, shape, dtype in specs:
        written_bytes[dtype] = written_bytes.get(dtype, 0) + math.prod(shape) * dtype.itemsize
    config_json = json.dumps(hf_config(model_type, config, max(written_bytes, key=written_bytes.get),
                                       getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eot_id", None)),
                             indent=1)
    names = hf_names(model_type, config)
    ours_of = {names[ours]: ours for ours, _, _ in specs}
    hf_specs = [(names[ours], tuple(shape)[::-1] if is_transposed(names[ours]) else tuple(shape), dtype)
                for ours, shape, dtype in specs]

    def read_hf(name):
        t = read(ours_of[name])
        return t.t() if is_transposed(name) else t

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for spec in hf_specs:  # greedy: start a new shard when this tensor would overflow the current one
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
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json", *out.glob("pytorch_model*")]:
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


# -----------------------------------------------------------------------------
# out: the tokenizer, as a tokenizer.json that transformers' PreTrainedTokenizerFast reads and that encodes
# exactly as ours does (write_hf_tokenizer checks that on a probe text)

PROBE = "ROMEO:\nO  sweet night, thou art   fair!\n\n\tnaïve café, 42 or 1234567 — 😀 ẞ\r\nend. "


def _bytes_to_unicode():
    """GPT-2's table of printable stand-ins for the 256 bytes, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    return {b: chr(c) for b, c in zip(printable + extra, printable + [256 + i for i in range(len(extra))])}


def _from_tiktoken(ranks, pattern, special_tokens):
    """tiktoken's BPE as a tokenizers byte-level BPE. tiktoken merges, at each step, the adjacent pair whose
    concatenation has the lowest rank; every split of a token into two tokens is therefore a merge, ranked by the
    token it makes (transformers' TikTokenConverter does the same). ignore_merges: tiktoken takes a piece that is
    itself a token whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    byte = _bytes_to_unicode()

    def text(token):
        return "".join(byte[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(ranks[token[:i]], ranks[token[i:]], token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges += [(text(left), text(right)) for _, _, left, right in sorted(splits)]
    tok = Tokenizer(models.BPE({text(t): r for t, r in ranks.items()}, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for name, i in sorted(special_tokens.items(), key=lambda item: item[1]):
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if tok.token_to_id(name) != i:  # ids are handed out in turn: only a contiguous block after the ranks fits
            raise ConfigError(f"special token {name} has id {i}, which tokenizer.json cannot give it")
    return tok


def _from_sentencepiece(sp):
    """A sentencepiece BPE model (ours: identity normalization; Llama 2's) as a tokenizers BPE: the pieces by
    score give the merges (sentencepiece merges the adjacent pair that makes the highest-scoring piece), spaces
    become "▁" and a leading one is added, as sentencepiece's dummy prefix is; unknown characters fall back to
    bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    size = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(size)}
    special = [i for i in range(size) if sp.is_control(i) or sp.is_unknown(i)]
    normal = {sp.id_to_piece(i): i for i in range(size)
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))}
    merges = []
    for piece, i in sorted(normal.items(), key=lambda item: (-sp.get_score(item[1]), item[1])):
        splits = [(normal[piece[:k]], normal[piece[k:]], piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in normal and piece[k:] in normal]
        merges += [(left, right) for _, _, left, right in sorted(splits)]
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                               byte_fallback=any(sp.is_byte(i) for i in range(size))))
    dummy_prefix = sp.encode("x", out_type=str)[0].startswith("▁")
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if dummy_prefix else [])
                                          + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if dummy_prefix else []))
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
    return tok


def _from_chars(chars):
    """One token per character: a BPE without merges, whose decoder joins the characters as they are."""
    from tokenizers import Tokenizer, decoders, models
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(chars)}, []))
    tok.decoder = decoders.Fuse()
    return tok


def hf_tokenizer(tokenizer):
    """(a tokenizers.Tokenizer that encodes as `tokenizer` does, {"eos_token": ..., ...} for tokenizer_config.json)."""
    kind = tokenizer.kind
    if kind == "hf":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_str(tokenizer.json)
    elif kind in ("gpt2", "tiktoken"):
        tok = _from_tiktoken(tokenizer.ranks, tokenizer.pattern, tokenizer.special_tokens)
    elif kind == "sentencepiece":
        tok = _from_sentencepiece(tokenizer.sp)
    elif kind == "char":
        tok = _from_chars(tokenizer.chars)
    else:
        raise ConfigError(f"no Hugging Face tokenizer.json for a {kind} tokenizer")
    names = {key: tok.id_to_token(i) if i is not None else None
             for key, i in (("eos_token", tokenizer.eot_id), ("bos_token", tokenizer.bos_id))}
    if kind == "sentencepiece" and tokenizer.sp.unk_id() >= 0:
        names["unk_token"] = tokenizer.sp.id_to_piece(tokenizer.sp.unk_id())
    return tok, names


def write_hf_tokenizer(tokenizer, out, model_max_length):
    """tokenizer.json and tokenizer_config.json (and a sentencepiece model's own tokenizer.model) in `out`."""
    tok, names = hf_tokenizer(tokenizer)
    probe = "".join(tokenizer.chars) if tokenizer.kind == "char" else PROBE
    encoded = tok.encode(probe, add_special_tokens=False).ids
    if encoded != tokenizer.encode(probe):
        print(f"warning: the exported tokenizer.json encodes a test text differently from our {tokenizer.kind} "
              "tokenizer: check it before relying on it", file=sys.stderr, flush=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    write_public(out / "tokenizer.json", lambda p: p.write_text(tok.to_str(), encoding="utf-8"))
    write_public(out / "tokenizer_config.json", lambda p: p.write_text(json.dumps(config, indent=1) + "\n"))
    if tokenizer.kind == "sentencepiece":
        write_public(out / "tokenizer.model", lambda p: p.write_bytes(tokenizer.model_proto))

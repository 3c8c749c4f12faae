"""Hugging Face checkpoints in and out, for GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM).

In:  resolve(name_or_dir)              a local directory (a hub name is downloaded if the hub answers)
     read_config(dir, ...)             -> our model type ("gpt" or "llama") and config
     load_weights(model, dir, type)    each rank reads only its own rows of each tensor into its shard
     load_tokenizer(dir)               tiktoken's GPT-2 BPE, or the directory's sentencepiece tokenizer.model
Out: save_hf(state_dict, model_meta, out_dir)   config.json + safetensors that transformers loads

transformers itself is never imported: the formats are plain JSON and safetensors.
"""
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from .config import ConfigError
from .files import write_atomic
from .llama import LlamaConfig
from .model import GPTConfig
from .tokenizer import GPT2Tokenizer, load_sentencepiece

CONFIGS = {"gpt": GPTConfig, "llama": LlamaConfig}


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
        return str(path)
    if path.exists() or name_or_dir.startswith((".", "/", "~")) or name_or_dir.count("/") > 1:
        raise ConfigError(f"--hf_model {name_or_dir} is not a directory")
    try:
        from huggingface_hub import HfApi, constants, snapshot_download
    except ImportError:
        raise ConfigError(f"--hf_model {name_or_dir} is not a local directory, and fetching it from the Hugging "
                          "Face hub needs huggingface_hub: pip install huggingface_hub "
                          "(or download the model elsewhere and pass its directory)") from None
    patterns = ["config.json", "tokenizer.model", "model*.safetensors", "model.safetensors.index.json",
                "pytorch_model*.bin", "pytorch_model.bin.index.json"]
    try:  # downloaded before: no network needed
        return snapshot_download(name_or_dir, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    # huggingface_hub retries an unreachable hub for half a minute; a quick look first gives a quick answer.
    if constants.HF_HUB_OFFLINE or not _reachable(constants.ENDPOINT):
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


def _reachable(url, timeout=5.0):
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


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
    return model_type, CONFIGS[model_type](**fields, seq_length=seq_length or context, dropout=dropout or 0.0)


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
    """GPT-2 checkpoints use OpenAI's BPE, which tiktoken provides; Llama ones bring a sentencepiece tokenizer.model."""
    if json.loads((Path(directory) / "config.json").read_text()).get("model_type") == "gpt2":
        return GPT2Tokenizer()
    path = Path(directory) / "tokenizer.model"
    if not path.exists():
        raise ConfigError(f"--hf_model {directory} has no sentencepiece tokenizer.model (Llama 3 ships a tiktoken "
                          "tokenizer, which is not supported yet)")
    return load_sentencepiece(path)


# -----------------------------------------------------------------------------
# out

def hf_config(model_type, config):
    """The config.json that makes transformers build the same model."""
    c = config
    if model_type == "gpt":
        if not c.bias:
            raise ConfigError("a GPT without biases has no GPT2LMHeadModel equivalent")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
                "n_positions": c.seq_length, "n_embd": c.embed_size, "n_layer": c.num_layers, "n_head": c.num_heads,
                "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
                "tie_word_embeddings": True, "dtype": "float32"}
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
            "max_position_embeddings": c.seq_length, "hidden_size": c.embed_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.embed_size // c.num_heads, "hidden_act": "silu", "rms_norm_eps": c.norm_eps,
            # both spellings: transformers 5 reads rope_parameters, 4 reads rope_theta and rope_scaling
            "rope_theta": c.rope_theta, "rope_parameters": rope,
            "rope_scaling": rope if c.rope_scaling else None, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": c.dropout, "tie_word_embeddings": False, "dtype": "float32"}


def save_hf(state_dict, model_meta, out_dir, tokenizer_dir=None, max_shard_bytes=5 * 2**30):
    """Write our full model state dict as a Hugging Face directory: config.json, model.safetensors (or
    shards of at most max_shard_bytes plus model.safetensors.index.json), and the sentencepiece
    tokenizer.model if tokenizer_dir has one. model_meta is a checkpoint's meta.json: its "model" (config
    dict) and "model_type" ("gpt" when absent). Each file is written under a temporary name and renamed."""
    model_type = model_meta.get("model_type", "gpt")
    config = CONFIGS[model_type](**model_meta["model"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for ours, theirs in hf_names(model_type, config).items():
        t = state_dict[ours].detach().cpu()
        tensors[theirs] = (t.t() if is_transposed(theirs) else t).contiguous()
    shards, size = [{}], 0
    for name, t in tensors.items():  # greedy: start a new shard when this tensor would overflow the current one
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        written = ["model.safetensors"]
        write_atomic(out / "model.safetensors", lambda p: save_file(shards[0], p, metadata={"format": "pt"}))
    else:
        written, weight_map = ["model.safetensors.index.json"], {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_atomic(out / file, lambda p: save_file(shard, p, metadata={"format": "pt"}))
            weight_map.update(dict.fromkeys(shard, file))
            written.append(file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_atomic(out / "model.safetensors.index.json", lambda p: p.write_text(json.dumps(index, indent=1)))
    # Weights of an earlier export to the same directory would otherwise be found instead of these.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json", *out.glob("pytorch_model*")]:
        if stale.exists() and stale.name not in written:
            stale.unlink()
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.model").exists():
        write_atomic(out / "tokenizer.model", lambda p: shutil.copy(Path(tokenizer_dir) / "tokenizer.model", p))
    config_json = json.dumps(hf_config(model_type, config), indent=1)
    write_atomic(out / "config.json", lambda p: p.write_text(config_json))  # last: its presence means complete
    return out

"""Hugging Face model directories read in, for each family of models/families (GPT2LMHeadModel,
LlamaForCausalLM, ...: a family's module maps its config.json and tensor names).

In:  read_config(dir, ...)           -> our model type (a family's name) and config
     load_weights(model, dir, type)  each rank reads only its own rows of each tensor into its shard
     load_tokenizer(dir)             the directory's own tokenizer (tokenizer.load_tokenizer)
Out: write.py (config.json, safetensors, tokenizer files); tokenizer.py (our tokenizers as
tokenizer.json). Where a directory comes from (a local one, or a hub name downloaded): hub.py.

transformers itself is never imported: the formats are plain JSON, safetensors and the `tokenizers`
library's tokenizer.json.

torch.distributed.checkpoint has a Hugging Face reader and writer (hf_storage.py) and a
consolidation helper (_consolidate_hf_safetensors.py). We keep our own reader because the DCP reader
needs stored names and shapes to equal the state dict's: it cannot transpose GPT-2's Conv1D weights,
read .bin files, untie a missing lm_head (Llama 3.2) or keep the first rows of shortened position
embeddings.
"""

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

from minimal_fsdp.checkpoint.meta import MODEL_BOUNDS, PLAIN_NAME, model_problem
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data import tokenizer
from minimal_fsdp.files import _depth, open_regular, read_json
from minimal_fsdp.files import shown as escaped
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import FAMILIES, config_from_dict, of_hf

CONFIG_MAX_BYTES = 16 * 2**20  # config.json is a few KB
INDEX_MAX_BYTES = 64 * 2**20  # an index names each tensor once: a few MB for the largest models
# tokenizer.json: 9 MB for Llama 3's 128K tokens
TOKENIZER_MAX_BYTES = tokenizer.MAX_TOKENIZER_BYTES
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "added_tokens.json",
)
LAYER = re.compile(r"(?:^|\.)(?:h|layers|blocks)\.(\d+)\.")  # theirs, and ours (an export of ours)
HEADER_MAX_BYTES = 100 * 2**20  # a safetensors header, as the safetensors library bounds it
HEADER_MAX_DEPTH = 3  # {name: {"shape": [...]}}: a deeper header is not one


# -----------------------------------------------------------------------------
# names: our parameter -> the Hugging Face tensor


def hf_names(model_type, config):
    """{our parameter name: its Hugging Face name}, in the names the family's transformers class
    saves."""
    return FAMILIES[model_type].hf_names(config)


def is_transposed(hf_name):
    """Whether the files hold this tensor transposed from our nn.Linear's (out, in): GPT-2's Conv1D
    weights. Each family's rule names only its own tensors, so any of them answers."""
    return any(family.transposed(hf_name) for family in FAMILIES.values())


# -----------------------------------------------------------------------------
# in


def config_json(directory):
    """A model directory's config.json as a dict, read defensively (files.read_json): a file
    that is not a bounded JSON object is one ConfigError naming it."""
    try:
        return read_json(Path(directory) / "config.json", CONFIG_MAX_BYTES)
    except OSError as e:
        raise ConfigError(
            f"--hf_model {directory}: config.json cannot be read ({e.strerror or e})"
        ) from None
    except ValueError as e:
        raise ConfigError(f"--hf_model {directory}: config.json {e}") from None


def _field(hf, where, name, kind="size", default=None, bound=None, within=""):
    """config.json's `name`, checked: "size" a whole number in [1, bound], "number" a finite one >
    0, "text" a string, "object" a JSON object, "raw" as it is; absent: `default`, or a ConfigError
    naming the field when there is none."""
    if kind == "raw":
        return hf.get(name, default)
    if name not in hf or hf[name] is None and default is not None:
        if default is None:
            raise ConfigError(f"{where}: config.json has no {within}{name}")
        return default
    value = hf[name]
    ok, wanted = {
        "size": (
            type(value) is int and 1 <= value <= (bound or 2**62),
            f"a whole number in [1, {bound}]",
        ),
        "number": (type(value) in (int, float) and 0 < value < math.inf, "a finite number > 0"),
        "text": (isinstance(value, str), "a string"),
        "object": (isinstance(value, dict), "an object"),
    }[kind]
    if not ok:
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ConfigError(f"{where}: config.json: {within}{name} is {shown}, not {wanted}")
    return value


def read_config(directory, seq_length=None, dropout=None):
    """Our (model type, config) for the checkpoint in `directory`, every field it uses checked
    (type, range, shapes that fit) before anything is built. seq_length may shorten the context
    (GPT-2 keeps the first seq_length position embeddings); dropout defaults to 0."""
    hf = config_json(directory)
    kind = hf.get("model_type")
    where = f"--hf_model {directory}"
    model_type = of_hf(kind)
    if model_type is None:
        *others, last = (f.HF_TYPE for f in FAMILIES.values())
        supported = f"{', '.join(others)} and {last}" if others else last
        raise ConfigError(
            f"{where} is a {escaped(repr(kind), 100)} model; supported are {supported}"
        )
    family = FAMILIES[model_type]

    def field(name, kind="size", default=None, bound=None, within="", source=hf):
        """A field of config.json (or of its object `source`); bound: our field whose
        MODEL_BOUNDS bound a size."""
        return _field(source, where, name, kind, default, MODEL_BOUNDS.get(bound), within)

    def check(ok, what):
        if not ok:  # what may quote config.json's value: escaped, cut short
            raise ConfigError(
                f"{where} uses {escaped(what, 300)}, which our model does not implement"
            )

    fields = {ours: field(theirs, bound=ours) for ours, theirs in family.HF_SIZES.items()}
    embed, heads = fields["embed_size"], fields["num_heads"]
    fields.update(family.from_hf(field, check, fields))
    if embed % heads:
        raise ConfigError(
            f"{where}: config.json: {family.HF_SIZES['num_heads']} {heads} does not divide "
            f"{family.HF_SIZES['embed_size']} {embed}"
        )
    context = fields["seq_length"]
    if seq_length and seq_length > context:
        raise ConfigError(
            f"--seq_length {seq_length} is longer than {where}'s context of {context} tokens"
        )
    fields = dict(fields, seq_length=seq_length or context, dropout=dropout or 0.0)
    # what the model needs beyond the fields above (kv heads, ...)
    problem = model_problem(model_type, fields)
    if problem:
        raise ConfigError(f"{where}: config.json: {problem}")
    return model_type, config_from_dict(model_type, fields)


def read_model_config(directory, model):
    """The --hf_model's config, with --seq_length and --dropout applied; a --model given too must
    match it."""
    model_type, config = read_config(directory, model.seq_length, model.dropout)
    if model.model and model.model != model_type:
        raise ConfigError(
            f"--model {model.model}, but --hf_model {model.hf_model} is a {model_type} model: drop "
            f"--model"
        )
    check_weights(directory, model_type, config)
    return config


class CheckpointFiles:
    """The tensors of a Hugging Face directory, read a slice at a time: safetensors (one file or an
    index of shards), else PyTorch .bin files memory-mapped with weights_only (so no pickled code
    runs and only the pages of the slices we touch are read)."""

    def __init__(self, directory, where=None):
        d = Path(directory)
        self.file_of, self.open_files = {}, {}
        self.where = where or f"--hf_model {d}"  # how errors name the directory
        for index, single in (
            ("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"),
        ):
            if (d / index).exists():
                names = _weight_map(d, index, self.where)
                self.file_of = {name: d / file for name, file in names.items()}
                return
            if (d / single).exists():
                self.file_of = {name: d / single for name in self._open(d / single).keys()}
                return
        raise ConfigError(
            f"{self.where} has no model.safetensors or pytorch_model.bin (nor an index of shards)"
        )

    def _open(self, file):
        if file not in self.open_files:
            try:
                if file.suffix == ".safetensors":
                    check_header(file)  # also refuses a device, FIFO or link out of the directory
                else:
                    open_regular(file).close()
                self.open_files[file] = self._load(file)
            except Exception as e:  # noqa: BLE001 - random bytes or a hostile header fail in many ways: one line
                raise ConfigError(
                    f"{self.where}: {file.name} cannot be read as "
                    f"{'safetensors' if file.suffix == '.safetensors' else 'a PyTorch file'} "
                    f"({type(e).__name__}: {escaped(' '.join(str(e).split())[:150])})"
                ) from None
        return self.open_files[file]

    @staticmethod
    def _load(file):
        # safetensors checks the header's length and offsets against the file
        if file.suffix == ".safetensors":
            return safe_open(str(file), framework="pt")
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # files from torch < 1.6 cannot be memory-mapped: read them whole
            return torch.load(file, map_location="cpu", weights_only=True)

    def metadata(self, file):
        """A safetensors file's __metadata__ ({} for none)."""
        f = self._open(file)
        return (f.metadata() or {}) if hasattr(f, "metadata") else {}

    def __contains__(self, name):
        return name in self.file_of

    def shape(self, name):
        f = self._open(self.file_of[name])
        return (
            tuple(f.get_slice(name).get_shape())
            if hasattr(f, "get_slice")
            else tuple(f[name].shape)
        )

    def rows(self, name, start, stop, transposed=False):
        """Rows [start, stop) of the tensor as we store it (columns of a transposed one)."""
        f = self._open(self.file_of[name])
        tensor = f.get_slice(name) if hasattr(f, "get_slice") else f[name]
        return tensor[:, start:stop].t() if transposed else tensor[start:stop]


def check_header(file):
    """A safetensors file checked before the library opens it: a regular file (open_regular: no
    FIFO, device or link), whose header, if its length is one the library reads (it checks the
    length and offsets itself), is nested at most HEADER_MAX_DEPTH deep. Raises OSError or
    ValueError."""
    with open_regular(file) as f:
        size = int.from_bytes(f.read(8), "little")
        header = f.read(size) if 2 <= size <= HEADER_MAX_BYTES else b""
    if _depth(header.decode("utf-8", "replace")) > HEADER_MAX_DEPTH:
        raise ValueError(f"its header nests deeper than {HEADER_MAX_DEPTH} levels")


def _weight_map(directory, index, where):
    """An index file's {tensor name: shard file}, every shard a plain file name in the directory."""
    try:
        weight_map = read_json(directory / index, INDEX_MAX_BYTES).get("weight_map")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {index} {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) and PLAIN_NAME.fullmatch(f) for f in weight_map.values()
    ):
        raise ConfigError(
            f"{where}: {index}: weight_map is not an object of file names in the directory"
        )
    return weight_map


def check_weights(directory, model_type, config, names=hf_names, where=None):
    """The weight files hold exactly the model `config` describes (its layers, and every tensor with
    its shape): ConfigError naming the file and the field otherwise. Only headers are read, and the
    model is built on the meta device once its layer count matches the files', so a config that
    disagrees allocates nothing."""
    files = CheckpointFiles(directory, where)
    layers = {int(m.group(1)) for m in map(LAYER.search, files.file_of) if m}
    if len(layers) != config.num_layers:
        field = FAMILIES[model_type].HF_SIZES["num_layers"] if names is hf_names else "num_layers"
        raise ConfigError(
            f"{files.where}: config.json: {field} is {config.num_layers}, but the "
            f"weights hold {len(layers)} layers"
        )
    with torch.device("meta"):
        model = MODELS[model_type](config)
    _stored_names(files, model, names(model_type, config), FAMILIES[model_type])


def _stored_names(files, model, names, family):
    """{our parameter: its name in the files}, after checking every shape: the same files give the
    same verdict on every rank, before anything is copied."""
    stored = {}
    for ours, param in model.named_parameters():
        name = stored[ours] = _stored_name(files, names[ours], family)
        shape = files.shape(name)[::-1] if is_transposed(names[ours]) else files.shape(name)
        # Position embeddings may be cut to a shorter --seq_length; everything else must
        # match exactly.
        fits = (
            shape == tuple(param.shape)
            or ours == "wpe.weight"
            and shape[1:] == tuple(param.shape[1:])
            and shape[0] >= param.shape[0]
        )
        if not fits:
            raise ConfigError(
                f"{files.where}: {name} has shape {shape}, our {ours} is {tuple(param.shape)}"
            )
    return stored


def _stored_name(files, hf_name, family):
    """The name the files hold `hf_name` under: the first of the family's stored_names there."""
    for name in family.stored_names(hf_name):
        if name in files:
            return name
    raise ConfigError(
        f"{files.where} has no tensor {hf_name}: not a checkpoint of this model type?"
    )


def local_rows(param):
    """The rows [start, stop) of dim 0 that this rank holds of a parameter. FSDP2 shards dim 0 over
    the mesh's shard dimension in torch.chunk pieces (ceil(rows / ranks) each; trailing ranks may
    hold fewer or none)."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    start = 0
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            chunk = -(-param.shape[0] // param.device_mesh.size(mesh_dim))
            start = min(param.shape[0], chunk * param.device_mesh.get_local_rank(mesh_dim))
    return start, start + param.to_local().shape[0]


@torch.no_grad()
def load_weights(model, directory, model_type, names=hf_names, where=None):
    """Copy a Hugging Face checkpoint into a built (sharded or not) model. Every rank reads only the
    rows of its own shard, one tensor at a time, so no rank ever holds more than its shard plus one
    tensor slice."""
    files, family = CheckpointFiles(directory, where), FAMILIES[model_type]
    names = names(model_type, model.config)
    stored = _stored_names(files, model, names, family)
    for ours, param in model.named_parameters():
        start, stop = local_rows(param)
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(files.rows(stored[ours], start, stop, transposed=is_transposed(names[ours])))


def load_tokenizer(directory):
    """The tokenizer a Hugging Face directory brings (tokenizer.load_tokenizer says which files, in
    which order). A directory of weights alone gets its family's HF_TOKENIZER if it has one (GPT-2:
    tiktoken's GPT-2 BPE, from tiktoken's cache, or downloaded)."""
    model_type = of_hf(config_json(directory).get("model_type"))
    fallback = FAMILIES[model_type].HF_TOKENIZER if model_type else None
    # the tokenizers library and json.loads would recurse into a deeply nested one
    for name in TOKENIZER_JSON:
        if (Path(directory) / name).exists():
            try:
                read_json(Path(directory) / name, TOKENIZER_MAX_BYTES)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"--hf_model {directory}: {name} {getattr(e, 'strerror', None) or e}"
                ) from None
    if fallback and not tokenizer.has_tokenizer(directory):
        try:
            return {"gpt2": tokenizer.GPT2Tokenizer}[fallback]()
        except tokenizer.TokenizerError:
            raise tokenizer.TokenizerError(
                f"--hf_model {directory} has no tokenizer files (tokenizer.json, or vocab.json + "
                f"merges.txt), and tiktoken's {fallback} files are not cached nor downloadable "
                "(offline?): copy the model's tokenizer files into it, or pass "
                "--tokenizer_dir DIR"
            ) from None
    try:
        return tokenizer.load_tokenizer(directory)
    except tokenizer.TokenizerError as e:
        raise tokenizer.TokenizerError(f"--hf_model: {e} (or pass --tokenizer_dir DIR)") from None

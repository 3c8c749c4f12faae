"""Reading a checkpoint's files without running code or blocking: files opened only when they are
regular files inside the directory (files.open_regular), DCP's .metadata pickle through an unpickler
that knows only the plain classes it is made of, non-tensor entries with
torch.load(weights_only=True), and whole tensors in one process (tests, export, sampling,
inspection)."""

import enum
import importlib
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from minimal_fsdp.files import open_regular


def _allowed_globals():
    """Exactly the (module, name) pairs a DCP .metadata pickle refers to: DCP's metadata classes, a
    few containers, and torch's dtype/layout/memory-format values. torch's own weights-only
    unpickler is private and reads torch.save archives, not DCP's bare pickle, so we keep this small
    allow-list ourselves."""
    allowed = {
        (dcp_metadata.__name__, name)
        for name, value in vars(dcp_metadata).items()
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__
    }
    allowed |= {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        # Python >= 3.13
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
    }
    allowed |= {
        ("torch", name)
        for name, value in vars(torch).items()
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    }
    return frozenset(allowed)


_ALLOWED = _allowed_globals()


def _build(unpickler):
    """BUILD that refuses to set attributes on a class (it would change that class for the whole
    process)."""
    if isinstance(unpickler.stack[-2], type):
        raise pickle.UnpicklingError("checkpoint metadata tries to modify a class")
    pickle._Unpickler.dispatch[pickle.BUILD[0]](unpickler)


def _enum_member(cls, name):
    """getattr limited to a member of one of the allowed Enum classes (any other getattr could reach
    code)."""
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(
        f"checkpoint metadata reads an attribute of {cls!r}, which is not allowed"
    )


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcode table can be changed; the C one's cannot) with
    find_class limited to _ALLOWED. A name is looked up as one attribute, never as a dotted path
    (protocol 4 would otherwise walk 'filesystem' + 'os.system' to os.system), so nothing outside
    the list is reachable."""

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _build

    def find_class(self, module, name):
        # Python 3.11.2 pickles an Enum member as getattr(cls, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            )
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(
            "checkpoint metadata holds a persistent id, which is not allowed"
        )


def read_dcp_metadata(path, max_bytes=None):
    """DCP's Metadata of a checkpoint directory (or of one of its per-rank metadata files), refused
    (OSError) when over max_bytes before a byte is unpickled: the pure-Python unpickler reads about
    1.4 MB/s."""
    with open_regular(path, max_bytes) as f:
        return _MetadataUnpickler(f).load()


def load_quietly(file):
    """torch.load(weights_only=True) of a checkpoint's bytes, without torch's UserWarnings (a raw
    pickle of protocol 4 is warned about before it is refused): the caller reports a refusal in one
    line of its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(file, weights_only=True)


class SafeReader(FileSystemReader):
    """DCP's reader with .metadata read by _MetadataUnpickler, at most max_bytes of it (find's
    metadata_cap, from meta.json)."""

    def __init__(self, path, max_bytes=None):
        super().__init__(path)
        self.max_bytes = max_bytes

    def read_metadata(self, *args, rank=None, **kwargs):
        metadata = read_dcp_metadata(
            Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"),
            self.max_bytes,
        )
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyperparameters) are read with weights_only=True, never plain
    pickle."""

    def load_bytes(self, read_item, value):
        set_element(
            self.original_state_dict,
            self.mappings[read_item.dest_index.fqn],
            load_quietly(value),
        )


def tensor_names(path, prefix="model."):
    """Names, shapes and dtypes of the checkpoint's tensors under `prefix` (prefix stripped), in
    saved order."""
    metadata = read_dcp_metadata(Path(path) / ".metadata")
    return [
        (key[len(prefix) :], md.size, md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(md, "size")
    ]


def read_tensors(path, names, prefix="model."):
    """Read the named tensors, whole, in one process with no process group (tests, export,
    inspection). Only their byte ranges are read from the shards."""
    specs = {name: (size, dtype) for name, size, dtype in tensor_names(path, prefix)}
    # DCP matches entries by their dotted key, so a flat {"model.wte.weight": t} finds the
    # nested one.
    flat = {prefix + name: torch.empty(specs[name][0], dtype=specs[name][1]) for name in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            flat, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), no_dist=True
        )
    return {name: flat[prefix + name] for name in names}


def load_full_model_state(path):
    """The whole model state dict as plain tensors (for tests, export and inspection)."""
    return read_tensors(path, [name for name, _, _ in tensor_names(path)])

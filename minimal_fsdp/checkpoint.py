"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, loaded without pickle.

Layout: <checkpoint_dir>/<run_name>/step_<N>/ holds DCP shards (one file per rank), meta.json (step, epoch,
model config, resolved flags) and the tokenizer's files; <run_name>/latest names the newest complete one.
A checkpoint is written as .tmp-step_<N> and renamed only when every rank has finished, so a crash mid-write
leaves the previous checkpoint, and `latest`, untouched.
"""
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from .config import ConfigError

_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata file is a pickle; allow only the plain data classes it is made of, so a crafted
    checkpoint cannot run code when loaded."""

    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in (
                ("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, rank=None, **kwargs):
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyperparameters) are read with weights_only=True, never plain pickle."""

    def load_bytes(self, read_item, value):
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


def _state(model, optimizer):
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(run_dir, step, model, optimizer, meta, tokenizer_dir=None, state=None):
    """Collective: every rank writes its shards; rank 0 finishes the directory and renames it into place.
    `state` replaces the model and optimizer state when given (decentralized replicas: save_replicas)."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step_{step}", run_dir / f".tmp-step_{step}"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_state(model, optimizer) if state is None else state, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        (tmp / "meta.json").write_text(json.dumps(dict(meta, step=step), indent=1))
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).glob("tokenizer.*"):
                shutil.copy(f, tmp / f.name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(run_dir, final.name)
    dist.barrier()
    return final


def _write_latest(run_dir, name):
    marker = run_dir / "latest"
    tmp = run_dir / "latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, marker)


def latest(run_dir):
    """The newest complete checkpoint of a run, or None."""
    marker = Path(run_dir) / "latest"
    if not marker.exists():
        return None
    path = Path(run_dir) / marker.read_text().strip()
    return path if (path / "meta.json").exists() else None


def find(cfg):
    """The checkpoint a run should start from: --restart_checkpoint_file, else the run's latest, else None."""
    if cfg.restart_checkpoint_file:
        path = Path(cfg.restart_checkpoint_file)
        if not (path / "meta.json").exists() or not (path / ".metadata").exists():
            raise ConfigError(f"--restart_checkpoint_file {path} is not a complete checkpoint "
                              "(no meta.json/.metadata in it)")
        return path
    return latest(Path(cfg.checkpoint_dir) / cfg.run_name)


def read_meta(path):
    return json.loads((Path(path) / "meta.json").read_text())


def load(path, model, optimizer=None):
    """Collective: load model (and optimizer) state saved under any world size or sharding into this one."""
    state = _state(model, optimizer)
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def load_full_model_state(path):
    """The whole model state dict as plain tensors, read in one process with no process group
    (for tests, export and inspection)."""
    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items() if key.startswith("model.")}
    nested = {"model": {key[len("model."):]: t for key, t in state.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(nested, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return nested["model"]


# Decentralized training: every rank holds a different replica, so a checkpoint keeps them apart by rank.

def _network_average(tree):
    """The same nested state with every floating-point tensor averaged over all ranks (collective)."""
    if isinstance(tree, dict):
        return {key: _network_average(value) for key, value in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        total = tree.detach().clone()
        dist.all_reduce(total)  # SUM: gloo has no AVG
        return total.div_(dist.get_world_size())
    return tree


def save_replicas(run_dir, step, model, optimizer, meta, tokenizer_dir=None, average_only=False):
    """Collective. `model` and `optim` hold the network average of the replicas and their optimizer states,
    an ordinary checkpoint that generation, export and all-reduce runs read as usual; `replicas.<rank>` holds
    each rank's own model and optimizer state for an exact resume (left out with average_only)."""
    own = _state(model, optimizer)
    state = _network_average(own)
    if not average_only:
        state["replicas"] = {str(dist.get_rank()): own}
    replicas = 0 if average_only else dist.get_world_size()
    return save(run_dir, step, model, optimizer, dict(meta, replicas=replicas), tokenizer_dir, state=state)


def load_replicas(path, model, optimizer=None):
    """Collective. Each rank resumes its own replica when the checkpoint holds one per rank of this world;
    otherwise (average-only, or another world size) every rank starts from the network average."""
    saved, world = read_meta(path).get("replicas", 0), dist.get_world_size()
    if saved != world:
        if saved and dist.get_rank() == 0:
            print(f"{path} holds {saved} replicas and this run has {world} ranks: "
                  "every rank starts from their average", flush=True)
        return load(path, model, optimizer)
    rank = str(dist.get_rank())
    state = {"replicas": {rank: _state(model, optimizer)}}
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["replicas"][rank]["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["replicas"][rank]["optim"])

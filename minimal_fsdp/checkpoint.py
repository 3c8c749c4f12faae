"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, loaded without pickle.

Layout of <checkpoint_dir>/<run_name>/:
  step_<N>/   DCP shards (one file per rank) and .metadata; meta.json (step, epoch, model config, resolved
              flags, LR horizon, data position, val loss, world size); rng_<rank>.pt (each rank's torch,
              CUDA, numpy and python RNG states); the tokenizer's files
  latest      names the newest complete checkpoint; best names the one with the lowest val loss

A checkpoint is written as .tmp-step_<N> and renamed only when every rank has finished, and `latest` moves
only after the rename, so a crash mid-write leaves the previous checkpoint, and `latest`, untouched. A
checkpoint that is damaged anyway (a truncated file, a missing shard) is detected by `verify` and skipped.
"""
import io
import json
import math
import os
import pickle
import random
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

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


# ---- saving ----

def save(run_dir, step, model, optimizer, meta, tokenizer_dir=None, keep_last=0, state=None, planner=None):
    """Collective: every rank writes its shards and RNG states; rank 0 finishes the directory, renames it
    into place, then moves `latest` (and `best`) and prunes to --keep_last. `state` replaces the model and
    optimizer state when given (decentralized replicas: save_replicas; xla.py), `planner` DCP's save planner."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step_{step}", run_dir / f".tmp-step_{step}"
    rank = dist.get_rank()
    if rank == 0:
        for leftover in run_dir.glob(".tmp-*"):  # of a save or a prune that crashed
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _write_durably(tmp / _rng_file(rank), _rng_bytes())
    dcp.save(_state(model, optimizer) if state is None else state, checkpoint_id=str(tmp), planner=planner)  # ends with a gather: every rank has written
    if rank == 0:
        meta = dict(meta, step=step, world_size=dist.get_world_size())
        _write_durably(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).glob("tokenizer.*"):
                _write_durably(tmp / f.name, f.read_bytes())
        replaced = run_dir / f".tmp-old-{final.name}"
        if final.exists():  # saved again after resuming from an older checkpoint: never half-delete it
            os.replace(final, replaced)
        os.replace(tmp, final)
        _sync_directory(run_dir)
        _write_marker(run_dir, "latest", final)
        shutil.rmtree(replaced, ignore_errors=True)
        if meta.get("val_loss") is not None and meta["val_loss"] < _best_val_loss(run_dir):
            _write_marker(run_dir, "best", final)
        if keep_last:
            _prune(run_dir, keep_last, step)
    dist.barrier()
    return final


def _write_durably(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_directory(path):
    """Make a rename survive a power cut (the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(run_dir, name, target):
    tmp = run_dir / f"{name}.tmp"
    _write_durably(tmp, (Path(target).name + "\n").encode())
    os.replace(tmp, run_dir / name)
    _sync_directory(run_dir)


def _marker(run_dir, name):
    """The checkpoint a marker (`latest`, `best`) names, or None if there is no marker."""
    marker = Path(run_dir) / name
    return Path(run_dir) / marker.read_text().strip() if marker.is_file() else None


def _best_val_loss(run_dir):
    best = _marker(run_dir, "best")
    try:
        value = read_meta(best).get("val_loss")
    except (TypeError, OSError, ValueError, AttributeError):  # no marker, or it names a damaged checkpoint
        return math.inf
    return math.inf if value is None else value


def step_dirs(run_dir):
    """The run's step_<N> directories, newest first."""
    found = [p for p in Path(run_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def _prune(run_dir, keep_last, step):
    """Delete all but the newest keep_last checkpoints up to `step`, sparing `best`. Checkpoints past `step`
    (left by a run that was restarted from an earlier one) are not this timeline's to delete."""
    spared = {_marker(run_dir, "latest"), _marker(run_dir, "best")}
    mine = [p for p in step_dirs(run_dir) if int(p.name[5:]) <= step]
    for old in mine[keep_last:]:
        if old not in spared:
            doomed = run_dir / f".tmp-old-{old.name}"  # renamed first, so no half-deleted step_<N> is ever seen
            os.replace(old, doomed)
            shutil.rmtree(doomed)


# ---- RNG states: each rank's own, so dropout masks continue exactly after a resume ----

def _rng_file(rank):
    return f"rng_{rank}.pt"


def _rng_bytes():
    """Tensors and plain numbers only, so torch.load(weights_only=True) reads it back."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, mt_state, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                       "cached_gaussian": cached_gaussian},
             "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def restore_rng(path, rank, world_size, seed):
    """Put this rank's RNG states back. A checkpoint from another number of ranks has no stream that is
    "this rank's"; then each rank is seeded from (seed, rank, step) so it does not replay old masks."""
    path, meta = Path(path), read_meta(path)
    file = path / _rng_file(rank)
    if meta.get("world_size") != world_size or not file.is_file():
        torch.manual_seed((seed * 1_000_003 + rank) * 1_000_000_007 + meta["step"])
        return False
    state = torch.load(file, weights_only=True)
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))
    return True


# ---- finding a checkpoint that is complete ----

def read_meta(path):
    return json.loads((Path(path) / "meta.json").read_text())


def verify(path):
    """Why `path` is not a complete checkpoint, or None if it is. Cheap checks only: meta.json parses, DCP's
    .metadata loads (without running pickled code), every byte range it lists lies inside its shard file,
    and every rank's RNG file loads."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        meta = read_meta(path)
    except (OSError, ValueError):
        return "meta.json is missing or unreadable"
    if not isinstance(meta, dict) or "step" not in meta:
        return "meta.json has no step"
    try:
        metadata = SafeReader(str(path)).read_metadata()
        needed = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # a truncated pickle fails in many ways; all mean "unreadable"
        return f".metadata is missing or unreadable ({type(e).__name__})"
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < size:
            return f"{name} is truncated ({file.stat().st_size} of {size} bytes)"
    for rank in range(meta.get("world_size", 0)):
        try:
            torch.load(path / _rng_file(rank), weights_only=True)
        except Exception as e:  # missing, truncated: a few KB each, so read them all
            return f"{_rng_file(rank)} is missing or unreadable ({type(e).__name__})"
    return None


def newest_complete(run_dir):
    """The checkpoint `latest` names if it is complete, else the newest complete step_<N>. Each one skipped
    is reported in one line on stderr."""
    run_dir = Path(run_dir)
    marked = _marker(run_dir, "latest")
    candidates = ([marked] if marked else []) + [p for p in step_dirs(run_dir) if p != marked]
    for path in candidates:
        problem = verify(path)
        if problem is None:
            return path
        print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return None


def latest(run_dir):
    """The newest complete checkpoint of a run, or None."""
    return newest_complete(run_dir)


def resolve(path):
    """A checkpoint directory from what a user may pass: the directory itself, a `latest`/`best` marker, or a
    run directory (its newest complete checkpoint)."""
    path = Path(path)
    if path.is_file():
        return path.parent / path.read_text().strip()
    if path.is_dir() and not (path / "meta.json").exists() and ((path / "latest").exists() or step_dirs(path)):
        return newest_complete(path) or path
    return path


def find(cfg):
    """The checkpoint a run starts from: --restart_checkpoint_file, else (--resume auto) the run's newest
    complete one, else None. Reads the file system, so call it on rank 0 and share the answer
    (environment.run_on_main): then every rank loads the same checkpoint even if files change meanwhile."""
    if cfg.restart_checkpoint_file:
        path = resolve(cfg.restart_checkpoint_file)
        problem = verify(path)
        if problem:
            raise ConfigError(f"--restart_checkpoint_file {cfg.restart_checkpoint_file} is not a complete "
                              f"checkpoint: {path}: {problem}")
        return path
    run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
    if cfg.resume == "never" and not cfg.generate_only:
        if step_dirs(run_dir):
            raise ConfigError(f"--resume never, but {run_dir} already holds checkpoints: pick another --run_name, "
                              "move that directory away, or resume from it with --resume auto")
        return None
    return newest_complete(run_dir)


# ---- loading ----

def load(path, model, optimizer=None):
    """Collective: load model (and optimizer) state saved under any world size or sharding into this one."""
    state = _state(model, optimizer)
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def tensor_names(path, prefix="model."):
    """Names, shapes and dtypes of the checkpoint's tensors under `prefix` (prefix stripped), in saved order."""
    metadata = SafeReader(str(path)).read_metadata()
    return [(key[len(prefix):], md.size, md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(md, "size")]


def read_tensors(path, names, prefix="model."):
    """Read the named tensors, whole, in one process with no process group (tests, export, inspection).
    Only their byte ranges are read from the shards."""
    specs = {name: (size, dtype) for name, size, dtype in tensor_names(path, prefix)}
    # DCP matches entries by their dotted key, so a flat {"model.wte.weight": t} finds the nested one.
    flat = {prefix + name: torch.empty(specs[name][0], dtype=specs[name][1]) for name in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), no_dist=True)
    return {name: flat[prefix + name] for name in names}


def load_full_model_state(path):
    """The whole model state dict as plain tensors (for tests, export and inspection)."""
    return read_tensors(path, [name for name, _, _ in tensor_names(path)])


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


def save_replicas(run_dir, step, model, optimizer, meta, tokenizer_dir=None, keep_last=0, average_only=False):
    """Collective. `model` and `optim` hold the network average of the replicas and their optimizer states,
    an ordinary checkpoint that generation, export and all-reduce runs read as usual; `replicas.<rank>` holds
    each rank's own model and optimizer state for an exact resume (left out with average_only)."""
    own = _state(model, optimizer)
    state = _network_average(own)
    if not average_only:
        state["replicas"] = {str(dist.get_rank()): own}
    replicas = 0 if average_only else dist.get_world_size()
    return save(run_dir, step, model, optimizer, dict(meta, replicas=replicas), tokenizer_dir, keep_last, state=state)


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

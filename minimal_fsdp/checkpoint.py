"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, verified, loaded without pickle.

Layout of <checkpoint_dir>/<run_name>/:
  step_<N>/   DCP shards (one file per rank) and .metadata; meta.json (below); rng_<rank>.pt (each rank's
              torch, CUDA, numpy and python RNG states); the tokenizer's files
  latest      names the newest committed checkpoint; best names the one with the lowest val loss
  .lock       held by the training run that uses the directory (files.RunLock)

A checkpoint is written as .tmp-step_<N> and renamed only when every rank has finished; moving `latest` to it
commits it. A crash anywhere in a save leaves the previous checkpoint, and `latest`, untouched; a failed save
(a full disk) is reported in one line on every rank, and its partial directory removed. Before a run loads a
checkpoint every file is checked against its recorded size and checksum, the ranks sharing the reading; a
damaged checkpoint is reported in one line and the previous complete one is used.

meta.json, format 2 (read_meta turns a format-1 file, from before "format" existed, into this layout):
  format      2
  step        optimizer steps done; world_size: ranks that saved it; val_loss: at this step, or null
  model_type  "gpt" or "llama"; model: the model config's fields; config: every resolved flag
  state       the JSON state of the run's other parts, each written by its own state_dict(): "schedule"
              (train.Schedule: lr_decay_steps, last_step) and "data" (data.TokenData / streaming.StreamingData:
              the position of the train stream)
  replicas    decentralized runs: replicas saved one per rank (0: the average only)
  files       {file name: [size, CRC-32]} of every other file of the checkpoint

Loading never runs code from the files: DCP's .metadata pickle is read by an unpickler that knows only the
plain classes it is made of, and everything else with json or torch.load(weights_only=True).
"""
import dataclasses
import enum
import importlib
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from . import environment, files
from .config import ConfigError
from .parallelize import seed64

STEP_NAME = re.compile(r"step_(\d+)")


class SaveError(RuntimeError):
    """A save failed (a full disk, a lost run lock). Raised alike on every rank; its text is one line."""


# ---- reading DCP's .metadata without running code ----

def _allowed_globals():
    """Exactly the (module, name) pairs a DCP .metadata pickle refers to: DCP's metadata classes, a few
    containers, and torch's dtype/layout/memory-format values. torch's own weights-only unpickler is private
    and reads torch.save archives, not DCP's bare pickle, so we keep this small allow-list ourselves."""
    allowed = {(dcp_metadata.__name__, name) for name, value in vars(dcp_metadata).items()
               if isinstance(value, type) and value.__module__ == dcp_metadata.__name__}
    allowed |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
                ("torch", "Size"), ("torch.serialization", "_get_layout"), ("builtins", "set"),
                ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath")}  # Python >= 3.13
    allowed |= {("torch", name) for name, value in vars(torch).items()
                if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))}
    return frozenset(allowed)


_ALLOWED = _allowed_globals()


def _build(unpickler):
    """BUILD that refuses to set attributes on a class (it would change that class for the whole process)."""
    if isinstance(unpickler.stack[-2], type):
        raise pickle.UnpicklingError("checkpoint metadata tries to modify a class")
    pickle._Unpickler.dispatch[pickle.BUILD[0]](unpickler)


def _enum_member(cls, name):
    """getattr limited to a member of one of the allowed Enum classes (any other getattr could reach code)."""
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"checkpoint metadata reads an attribute of {cls!r}, which is not allowed")


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcode table can be changed; the C one's cannot) with find_class limited
    to _ALLOWED. A name is looked up as one attribute, never as a dotted path (protocol 4 would otherwise
    walk 'filesystem' + 'os.system' to os.system), so nothing outside the list is reachable."""

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _build

    def find_class(self, module, name):
        if (module, name) == ("builtins", "getattr"):  # Python 3.11.2 pickles an Enum member as getattr(cls, name)
            return _enum_member
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("checkpoint metadata holds a persistent id, which is not allowed")


def read_dcp_metadata(path):
    """DCP's Metadata of a checkpoint directory (or of one of its per-rank metadata files)."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, rank=None, **kwargs):
        metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
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


class Checkpointer:
    """A training run's saves and restores: the model and optimizer as DCP shards (one replica per rank for a
    decentralized run), every rank's RNG, and meta.json: what the model is, the flags, and the state of the
    run's other parts, each given by its own state_dict() (train.Schedule, the data)."""

    def __init__(self, cfg, model_config, tokenizer_dir, decentralized):
        self.run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
        self.about = {"model_type": model_config.model_type, "model": model_config.to_dict(),
                      "config": dataclasses.asdict(cfg)}
        self.tokenizer_dir, self.keep_last = tokenizer_dir, cfg.keep_last
        self.decentralized, self.average_only = decentralized, cfg.save_average

    def save(self, step, model, optimizer, val_loss, state):
        """Collective. state: {part name: its state_dict(), JSON}."""
        meta = dict(self.about, format=FORMAT, val_loss=val_loss, state=state)
        if self.decentralized:
            return save_replicas(self.run_dir, step, model, optimizer, meta, self.tokenizer_dir, self.keep_last,
                                 self.average_only)
        return save(self.run_dir, step, model, optimizer, meta, self.tokenizer_dir, self.keep_last)

    def restore(self, path, model, optimizer, seed):
        """Collective: load the model and optimizer (under any world size and sharding) and this rank's RNG
        states; returns the checkpoint's meta.json, whose "state" the caller hands to each part."""
        (load_replicas if self.decentralized else load)(path, model, optimizer)
        restore_rng(path, dist.get_rank(), dist.get_world_size(), seed)
        return read_meta(path)


# ---- saving ----

def save(run_dir, step, model, optimizer, meta, tokenizer_dir=None, keep_last=0, state=None, planner=None):
    """Collective: every rank writes its shards, its RNG states and their checksums; rank 0 finishes the
    directory, renames it into place, then moves `latest` (the commit) and `best`, and prunes to --keep_last.
    `state` replaces the model and optimizer state when given (decentralized replicas: save_replicas; xla.py),
    `planner` DCP's save planner. If any rank fails (a full disk, say), every rank raises SaveError and the
    partial directory is removed."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step_{step}", run_dir / f".tmp-step_{step}"
    rank = dist.get_rank()
    error = None
    if rank == 0:
        try:
            files.check_lock(run_dir)
            for leftover in run_dir.glob(".tmp-*"):  # of a save or a prune that crashed
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        except (OSError, files.LockError) as e:
            error = e
    _gather_or_fail(f"cannot start checkpoint {final}", error, tmp)  # the others wait here for the directory
    try:
        # DCP gathers the ranks' failures and raises them on every rank, so all reach the gather below.
        dcp.save(_state(model, optimizer) if state is None else state, checkpoint_id=str(tmp), planner=planner)
        _write_durably(tmp / _rng_file(rank), _rng_bytes())
        mine = _checksums(tmp, [_rng_file(rank)] + sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp")))
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - a full disk, as OSError or inside DCP's
        mine = e  # CheckpointException (a BaseException)
    sums = _gather_or_fail(f"writing checkpoint {final} failed", mine, tmp)
    error = None
    if rank == 0:
        try:
            _finish(run_dir, tmp, final, dict(meta, step=step, world_size=dist.get_world_size()),
                    {name: v for rank_sums in sums for name, v in rank_sums.items()}, tokenizer_dir, keep_last)
        except OSError as e:
            error = e
    _gather_or_fail(f"finishing checkpoint {final} failed", error, tmp)
    return final


def _finish(run_dir, tmp, final, meta, checksums, tokenizer_dir, keep_last):
    """Rank 0, once every rank has written: meta.json (with every file's checksum), the tokenizer, the rename
    into place, then the commit (`latest`), `best`, and pruning."""
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).glob("tokenizer.*"):
            _write_durably(tmp / f.name, f.read_bytes())
    names = [".metadata"] + sorted(p.name for p in tmp.iterdir() if p.name.startswith("tokenizer."))
    meta["files"] = dict(sorted({**checksums, **_checksums(tmp, names)}.items()))
    _write_durably(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    _publish(tmp, final)
    _write_marker(run_dir, "latest", final)
    if meta.get("val_loss") is not None and meta["val_loss"] < _best_val_loss(run_dir):
        _write_marker(run_dir, "best", final)
    if keep_last:
        _prune(run_dir, keep_last, meta["step"])


def _publish(tmp, final):
    """Rename the finished directory into place. A step_<N> saved before (a run resumed from an older
    checkpoint saves it again) is moved aside first and deleted only after, never half-deleted in place."""
    replaced = final.parent / f".tmp-old-{final.name}"
    if final.exists():
        os.replace(final, replaced)
    os.replace(tmp, final)
    files.sync(final.parent)  # the rename survives a power cut
    shutil.rmtree(replaced, ignore_errors=True)


def _gather_or_fail(what, outcome, tmp):
    """Collective: every rank's outcome (a value, or the exception it hit). If any rank failed, every rank
    raises SaveError naming the first failure, after rank 0 has removed the partial directory."""
    failure = _failure(outcome, dist.get_rank()) if isinstance(outcome, BaseException) else None
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (failure, None if failure else outcome))
    failures = sorted(f for f, _ in outcomes if f)
    if not failures:
        return [value for _, value in outcomes]
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    rank, text = failures[0]
    raise SaveError(f"{what} (rank {rank}: {text}); the previous checkpoint is untouched")


def _failure(error, rank):
    """(the rank that failed, one line of why). DCP reports every rank's exception in one CheckpointException."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        error = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    if isinstance(error, OSError) and error.strerror:
        return rank, error.strerror + (f": {error.filename}" if error.filename else "")
    return rank, f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _checksums(directory, names):
    """{file name: [size, CRC-32]}: CRC-32 (zlib) finds bit rot and overwritten blocks at about 1 GB/s; the files
    are not secrets, and a forger could rewrite meta.json anyway, so a cryptographic hash would add only time."""
    return {name: [os.path.getsize(Path(directory) / name), _crc32(Path(directory) / name)] for name in names}


def _crc32(path, chunk=16 * 2**20):
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _write_durably(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_marker(run_dir, name, target):
    files.write_atomic(Path(run_dir) / name, lambda tmp: tmp.write_text(Path(target).name + "\n"), durable=True)


def _marker(run_dir, name, warn=True):
    """The checkpoint a marker (`latest`, `best`) names, or None if there is none. A marker that does not hold
    exactly the name of a step_<N> beside it (damaged bytes, a path into another run) is reported and ignored."""
    marker = Path(run_dir) / name
    if not marker.is_file():
        return None
    try:
        with open(marker, "rb") as f:
            text = f.read(65).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if not STEP_NAME.fullmatch(text):
        if warn:
            print(f"warning: ignoring {marker}: it does not name a step_<N> checkpoint of this run", file=sys.stderr,
                  flush=True)
        return None
    return Path(run_dir) / text


def _best_val_loss(run_dir):
    best = _marker(run_dir, "best", warn=False)
    try:
        value = read_meta(best).get("val_loss")
    except (TypeError, OSError, ValueError, AttributeError):  # no marker, or it names a damaged checkpoint
        return math.inf
    return math.inf if value is None else value


def step_dirs(run_dir):
    """The run's step_<N> directories, newest first."""
    found = [p for p in Path(run_dir).glob("step_*") if p.is_dir() and STEP_NAME.fullmatch(p.name)]
    return sorted(found, key=_step_of, reverse=True)


def _step_of(path):
    return int(Path(path).name[5:])


def _prune(run_dir, keep_last, step):
    """Delete all but the newest keep_last checkpoints up to `step`, sparing `best`. Checkpoints past `step`
    (left by a run that was restarted from an earlier one) are not this timeline's to delete."""
    spared = {_marker(run_dir, "latest", warn=False), _marker(run_dir, "best", warn=False)}
    mine = [p for p in step_dirs(run_dir) if _step_of(p) <= step]
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
        torch.manual_seed(seed64((seed * 1_000_003 + rank) * 1_000_000_007 + meta["step"]))
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

FORMAT = 2


def read_meta(path):
    """A checkpoint's meta.json in the current format's layout (see the top of this file)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if not isinstance(meta, dict) or meta.get("format", 1) == FORMAT:
        return meta
    # Format 1 kept the parts' state at the top level and often no model_type (it was always GPT then).
    config = meta.get("config") or {}
    blocks_per_micro_step = meta.get("world_size", 1) * config.get("batch_size", 1)
    data = meta.get("data_position") or {"train_blocks_seen": blocks_per_micro_step * meta.get(
        "train_batches", meta.get("step", 0) * config.get("grad_accum_steps", 1))}
    schedule = {"lr_decay_steps": meta.get("lr_decay_steps"), "last_step": meta.get("last_step")}
    return dict(meta, format=FORMAT, model_type=meta.get("model_type", "gpt"),
                state={"schedule": schedule, "data": data})


def verify(path, checksums=True, share=(0, 1)):
    """Why `path` is not a complete checkpoint, or None if it is: meta.json parses, DCP's .metadata loads
    (without running code), every byte range it lists lies inside its shard file, every rank's RNG file loads,
    and, with checksums, every file has the size and CRC-32 recorded at save (this caller's `share` of them,
    (index, count), when several processes split the reading). Checkpoints from before checksums skip that."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        meta = read_meta(path)
    except (OSError, ValueError):
        return "meta.json is missing or unreadable"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return "meta.json has no step"
    try:
        metadata = read_dcp_metadata(path / ".metadata")
        needed = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - a truncated or hostile pickle fails in many ways; all mean "unusable"
        return f".metadata is missing or unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < size:
            return f"{name} is truncated ({file.stat().st_size} of {size} bytes)"
    for rank in range(meta.get("world_size", 0)):
        try:
            torch.load(path / _rng_file(rank), weights_only=True)
        except Exception as e:  # noqa: BLE001 - missing, truncated: a few KB each, so read them all
            return f"{_rng_file(rank)} is missing or unreadable ({type(e).__name__})"
    return _checksum_problem(path, meta.get("files") or {}, share) if checksums else None


def _checksum_problem(path, recorded, share):
    index, count = share
    for name in sorted(recorded)[index::count]:
        size, crc = recorded[name]
        file = Path(path) / name
        try:
            if file.stat().st_size != size:
                return f"{name} has {file.stat().st_size} bytes, {size} when saved"
            if _crc32(file) != crc:
                return f"{name} does not match its checksum: the file was damaged after it was saved"
        except OSError as e:
            return f"{name}: {e.strerror or e}"
    return None


def candidates(run_dir):
    """A run's checkpoints in the order to try them: the one `latest` names (the last commit), then older ones,
    newest first, then newer ones (a save that crashed between its rename and its commit, or another
    timeline's, when a run was restarted from an older checkpoint)."""
    run_dir = Path(run_dir)
    marked = _marker(run_dir, "latest")
    others = [p for p in step_dirs(run_dir) if p != marked]
    if marked is None:
        return others
    older = [p for p in others if _step_of(p) < _step_of(marked)]
    return [marked] + older + [p for p in others if _step_of(p) > _step_of(marked)]


def newest_complete(run_dir, checksums=True):
    """The first complete checkpoint among candidates(run_dir), or None. Each one skipped is reported in one
    line on stderr."""
    for path in candidates(run_dir):
        problem = verify(path, checksums)
        if problem is None:
            return path
        _skipping(path, problem)
    return None


def _skipping(path, problem):
    print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)


def latest(run_dir):
    """The newest complete checkpoint of a run, or None (one process; training uses find)."""
    return newest_complete(run_dir)


def resolve(path):
    """A checkpoint directory from what a user may pass: the directory itself, a `latest`/`best` marker, or a
    run directory (its newest complete checkpoint, by the cheap checks; verify() the result)."""
    path = Path(path)
    if path.is_file():
        target = _marker(path.parent, path.name, warn=False)
        if target is None:
            raise ConfigError(f"{path} is a file but not a checkpoint marker (one line naming a step_<N> directory "
                              "beside it): pass a step_<N> directory, a run directory or its latest/best marker")
        return target
    if path.is_dir() and not (path / "meta.json").exists() and ((path / "latest").exists() or step_dirs(path)):
        return newest_complete(path, checksums=False) or path
    return path


def find(cfg):
    """Collective. The checkpoint a run starts from: --restart_checkpoint_file, else (--resume auto) the run's
    newest complete one, else None. Rank 0 looks at the files and passes its candidates to all (so every rank
    loads the same checkpoint even if files change meanwhile); the ranks then share the checksum reading."""
    together = dist.is_initialized()  # else one process (a tool, a test) does it all
    rank, world = (dist.get_rank(), dist.get_world_size()) if together else (0, 1)
    for path in environment.run_on_main(_cheaply_complete, cfg) if together else _cheaply_complete(cfg):
        problems = [verify(path, share=(rank, world))]
        if together:
            problems *= world
            dist.all_gather_object(problems, problems[rank])
        problem = next((p for p in problems if p), None)
        if problem is None:
            return Path(path)
        if cfg.restart_checkpoint_file:
            raise ConfigError(f"--restart_checkpoint_file {cfg.restart_checkpoint_file} is damaged: {path}: {problem}")
        if rank == 0:
            _skipping(path, problem)
    return None


def _cheaply_complete(cfg):
    """Rank 0: the checkpoints to try, in order, that pass verify's cheap checks (no checksums yet)."""
    if cfg.restart_checkpoint_file:
        path = resolve(cfg.restart_checkpoint_file)
        problem = verify(path, checksums=False)
        if problem:
            raise ConfigError(f"--restart_checkpoint_file {cfg.restart_checkpoint_file} is not a complete "
                              f"checkpoint: {path}: {problem}")
        return [str(path)]
    run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
    if cfg.resume == "never" and not cfg.generate_only:
        if step_dirs(run_dir):
            raise ConfigError(f"--resume never, but {run_dir} already holds checkpoints: pick another --run_name, "
                              "move that directory away, or resume from it with --resume auto")
        return []
    found = []
    for path in candidates(run_dir):
        problem = verify(path, checksums=False)
        if problem is None:
            found.append(str(path))
        else:
            _skipping(path, problem)
    return found


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
    metadata = read_dcp_metadata(Path(path) / ".metadata")
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


def main(argv=None):
    """`python -m minimal_fsdp.checkpoint progress [training flags]` prints "STEP LAST_STEP" of the run's newest
    complete checkpoint ("0 none" without one): how the PBS and SLURM job chains know whether a run is done."""
    from .config import parse_args
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "progress":
        sys.exit("usage: python -m minimal_fsdp.checkpoint progress [the run's training flags]")
    cfg = parse_args(argv[1:])
    path = newest_complete(Path(cfg.checkpoint_dir) / cfg.run_name, checksums=False)
    if path is None:
        print("0 none")
        return
    meta = read_meta(path)
    print(meta["step"], meta["state"]["schedule"].get("last_step") or "none")


if __name__ == "__main__":
    main()

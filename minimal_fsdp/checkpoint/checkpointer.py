"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, verified, loaded
without pickle.

Layout of <checkpoint_dir>/<run_name>/:
  step_<N>/   DCP shards (one file per rank) and .metadata; meta.json (checkpoint/meta.py);
              rng_<rank>.pt (each rank's torch, CUDA, numpy and python RNG states); the tokenizer's
              files
  latest      names the newest committed checkpoint; best the one with the lowest val loss
              (checkpoint/best.py)
  .lock       held by the training run that uses the directory (run_lock.RunLock)

A checkpoint is written as .tmp-step_<N> and renamed only when every rank has finished; moving
`latest` to it commits it. A crash anywhere in a save leaves the previous checkpoint, and `latest`,
untouched; a failed save (a full disk) is reported in one line on every rank, and its partial
directory removed. Every file's checksum is taken from its bytes as they are written
(checkpoint/background.py, which also writes a save beside training under --checkpoint_mode async).
Before a run loads a checkpoint every file is checked against its recorded size and checksum, the
ranks sharing the reading; a damaged checkpoint is reported in one line and the previous complete
one is used.

meta.json's layout is described in checkpoint/meta.py; finding a complete checkpoint is
checkpoint/find.py's job.

Loading never runs code from the files: DCP's .metadata pickle is read by an unpickler that knows
only the plain classes it is made of (safe_load.py), and everything else with json or
torch.load(weights_only=True).
"""

import contextlib
import dataclasses
import functools
import json
import os
import random
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from minimal_fsdp import files
from minimal_fsdp.checkpoint.background import Saved, writer_threads
from minimal_fsdp.checkpoint.best import better
from minimal_fsdp.checkpoint.dirs import step_of
from minimal_fsdp.checkpoint.find import load_first, marker, step_dirs
from minimal_fsdp.checkpoint.meta import FORMAT, read_meta
from minimal_fsdp.checkpoint.rng import read_rng, rng_bytes, rng_file
from minimal_fsdp.checkpoint.safe_load import SafeLoadPlanner, SafeReader
from minimal_fsdp.checkpoint.writer import ChecksummingWriter, write_failure_reason
from minimal_fsdp.launch import run_lock
from minimal_fsdp.parallel.parallelize import seed64


class SaveError(RuntimeError):
    """A save failed (a full disk, a lost run lock). Raised alike on every rank; its text is one
    line."""


def _state(model, optimizer):
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


class Checkpointer:
    """A training run's saves and restores: the model and optimizer as DCP shards (one replica per
    rank for a decentralized run), every rank's RNG, and meta.json: what the model is, the flags,
    and the state of the run's other parts, each given by its own state_dict() (train.Schedule, the
    data).

    Given the run's env and model (collective then), saves are asynchronous where --checkpoint_mode
    and the host's memory say so (background.for_run): `mode`, and `staging` bytes of host
    memory per rank."""

    restore_s = restored_from = None  # how long the restore took, and from where, once one has

    def __init__(
        self, checkpoint, flags, model_config, tokenizer_dir, decentralized, background=None
    ):
        """checkpoint: config.sections.Checkpoint; flags: every resolved flag of the run, {name:
        value}, kept in meta.json; background: background.for_run's Background (saves beside
        training), or None (synchronous saves)."""
        self.checkpoint = checkpoint
        self.run_dir = Path(checkpoint.checkpoint_dir) / checkpoint.run_name
        self.about = {
            "model_type": model_config.model_type,
            "model": model_config.to_dict(),
            "config": dict(flags),
        }
        self.tokenizer_dir, self.keep_last = tokenizer_dir, checkpoint.keep_last
        self.decentralized, self.average_only = decentralized, checkpoint.save_average
        self.background = background
        self.mode, self.staging = (
            ("async", self.background.staging) if self.background else ("sync", 0)
        )
        self.in_flight, self.ended = None, []

    def save(self, step, model, optimizer, val_loss, state):
        """Collective. state: {part name: its state_dict(), JSON}. The save in flight, if any, ends
        first. Returns the new checkpoint's path (committed, or being written in the background)."""
        asked = time.perf_counter()
        self.wait()
        start = time.perf_counter()
        path = self.write(
            step, model, optimizer, dict(self.about, format=FORMAT, val_loss=val_loss, state=state)
        )
        record = Saved(step, path, time.perf_counter() - asked, start - asked)
        if self.background is None:
            record.total_s = time.perf_counter() - start
        else:
            self.in_flight = (dataclasses.replace(record), start)
        self.ended.append(record)
        return path

    def write(self, step, model, optimizer, meta):
        """The files of one save (xla.py's Checkpointer writes them its own way); returns the
        checkpoint's path."""
        if self.decentralized:
            return save_replicas(
                self.run_dir,
                step,
                model,
                optimizer,
                meta,
                self.tokenizer_dir,
                self.keep_last,
                self.average_only,
                self.background,
            )
        return save(
            self.run_dir,
            step,
            model,
            optimizer,
            meta,
            self.tokenizer_dir,
            self.keep_last,
            background=self.background,
        )

    def wait(self):
        """Wait for the save in flight, if any; raises SaveError (on every rank) if it failed."""
        if self.in_flight is not None:
            (record, start), self.in_flight = self.in_flight, None
            record.total_s = self.background.wait() - start
            self.ended.append(record)

    def poll(self):
        """Collective, at logging steps: wait() for the save in flight if it has ended on every
        rank."""
        if self.in_flight is not None and self.background.ended():
            self.wait()

    def reports(self):
        """The Saved records of the saves begun or ended since the last call, for the log."""
        ended, self.ended = self.ended, []
        return ended

    @contextlib.contextmanager
    def saving(self):
        """Around training: whatever ends it, the save in flight ends before the process moves on
        (its outcome is wait()'s to report), and the host memory of the staged copies is let go."""
        try:
            yield self
        finally:
            self.in_flight = None
            if self.background is not None:
                self.background.close()

    def restore(self, path, model, optimizer, seed):
        """Collective: load the model and optimizer (under any world size and sharding) and this
        rank's RNG states; returns the checkpoint's meta.json, whose "state" the caller hands to
        each part."""
        start = time.perf_counter()
        # Shards that load wrong despite every check: one line, then the next complete checkpoint.
        path = self.restored_from = load_first(
            self.checkpoint, path, lambda p: self.read(p, model, optimizer)
        )
        restore_rng(path, dist.get_rank(), dist.get_world_size(), seed)
        self.restore_s = time.perf_counter() - start
        return read_meta(path)

    def read(self, path, model, optimizer):
        """The model's and optimizer's tensors from one checkpoint, in place (xla.py's Checkpointer
        reads them its own way)."""
        (load_replicas if self.decentralized else load)(path, model, optimizer)


# ---- saving ----


def save(
    run_dir,
    step,
    model,
    optimizer,
    meta,
    tokenizer_dir=None,
    keep_last=0,
    state=None,
    planner=None,
    background=None,
):
    """Collective: every rank writes its shards, its RNG states and their checksums; rank 0 finishes
    the directory, renames it into place, then moves `latest` (the commit) and `best`, and prunes to
    --keep_last. `state` replaces the model and optimizer state when given (decentralized replicas:
    save_replicas; xla.py), `planner` DCP's save planner. If any rank fails (a full disk, say),
    every rank raises SaveError and the partial directory is removed. With `background`
    (background.Background) save returns once the state is copied to host memory; the rest
    goes on in the background, and background.wait() tells how it ended."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step_{step}", run_dir / f".tmp-step_{step}"
    error = None
    if dist.get_rank() == 0:
        try:
            run_lock.check_lock(run_dir)
            for leftover in run_dir.glob(".tmp-*"):  # of a save or a prune that crashed
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        except (OSError, run_lock.LockError) as e:
            error = e
    # the others wait here for the directory
    _gather_or_fail(f"cannot start checkpoint {final}", error, tmp)
    state = _state(model, optimizer) if state is None else state
    writer = ChecksummingWriter(
        tmp,
        writer_threads(state),
        staged=background is not None,
        process=background and background.writer,
    )
    meta = dict(meta, step=step, world_size=dist.get_world_size())
    complete = functools.partial(
        _complete, run_dir, final, tmp, meta, writer, rng_bytes(), tokenizer_dir, keep_last
    )
    if background is None:
        try:
            # DCP gathers the ranks' failures and raises them on every rank, so all reach the
            # gather below.
            dcp.save(state, storage_writer=writer, planner=planner)
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - a full disk, as OSError or inside DCP's
            return complete(e)  # CheckpointException (a BaseException)
        return complete(None)
    try:
        staged, error = background.stage(state), None
    except Exception as e:  # noqa: BLE001 - out of host memory, say
        staged, error = None, e
    _gather_or_fail(f"copying checkpoint {final} to host memory failed", error, tmp)
    background.start(
        state, staged, writer, lambda write_error: complete(write_error, background.group)
    )
    return final


def _complete(run_dir, final, tmp, meta, writer, rng, tokenizer_dir, keep_last, error, group=None):
    """Collective over `group`, once the shards are written (or failed with `error`): each rank
    writes its RNG states, every rank's checksums go to rank 0, which finishes the directory
    (_finish); all learn how it went."""
    mine = error
    if error is None:
        try:
            mine = dict(
                writer.checksums,
                **{rng_file(dist.get_rank()): _write_durably(tmp / rng_file(dist.get_rank()), rng)},
            )
        except OSError as e:
            mine = e
    sums = _gather_or_fail(f"writing checkpoint {final} failed", mine, tmp, group)
    error = None
    if dist.get_rank() == 0:
        try:
            _finish(
                run_dir,
                tmp,
                final,
                meta,
                {name: v for rank_sums in sums for name, v in rank_sums.items()},
                tokenizer_dir,
                keep_last,
            )
        except OSError as e:
            error = e
    _gather_or_fail(f"finishing checkpoint {final} failed", error, tmp, group)
    return final


def _finish(run_dir, tmp, final, meta, checksums, tokenizer_dir, keep_last):
    """Rank 0, once every rank has written: meta.json (with every file's checksum), the tokenizer,
    the rename into place, then the commit (`latest`), `best`, and pruning."""
    checksums = dict(checksums)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).glob("tokenizer.*"):
            checksums[f.name] = _write_durably(tmp / f.name, f.read_bytes())
    meta["files"] = dict(sorted(checksums.items()))
    _write_durably(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    _publish(tmp, final)
    _write_marker(run_dir, "latest", final)
    if better(meta, _best_meta(run_dir)):  # by val loss, or by --best_metric's score
        _write_marker(run_dir, "best", final)
    if keep_last:
        _prune(run_dir, keep_last, meta["step"])


def _publish(tmp, final):
    """Rename the finished directory into place. A step_<N> saved before (a run resumed from an
    older checkpoint saves it again) is moved aside first and deleted only after, never half-deleted
    in place."""
    replaced = final.parent / f".tmp-old-{final.name}"
    if os.path.lexists(final):
        os.replace(final, replaced)
    os.replace(tmp, final)
    files.sync(final.parent)  # the rename survives a power cut
    if replaced.is_symlink():  # a link put in a checkpoint's place: removed, never followed
        replaced.unlink()
    shutil.rmtree(replaced, ignore_errors=True)


def _gather_or_fail(what, outcome, tmp, group=None):
    """Collective (over `group`, all ranks): every rank's outcome (a value, or the exception it
    hit). If any rank failed, every rank raises SaveError naming the first failure, after rank 0 has
    removed the partial directory."""
    failure = (
        _failure(outcome, dist.get_rank(), tmp) if isinstance(outcome, BaseException) else None
    )
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (failure, None if failure else outcome), group=group)
    failures = sorted(f for f, _ in outcomes if f)
    if not failures:
        return [value for _, value in outcomes]
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    rank, text = failures[0]
    raise SaveError(f"{what} (rank {rank}: {text}); the previous checkpoint is untouched")


def _failure(error, rank, where=None):
    """(the rank that failed, one line of why). DCP reports every rank's exception in one
    CheckpointException. torch.save's zip writer turns a failed write into a RuntimeError without
    the OS's reason: it is named here."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        error = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    if isinstance(error, OSError) and error.strerror:
        return rank, error.strerror + (
            f": {error.filename or where}" if error.filename or where else ""
        )
    text = " ".join(str(error).split())
    if where is not None and ("unexpected pos" in text or "write failed" in text):
        return rank, f"{write_failure_reason(where)}: {where}"
    return rank, f"{type(error).__name__}: {text[:300]}"


def _write_durably(path, data):
    """Write and fsync a file; returns its [size, CRC-32] for meta.json. CRC-32 (zlib) finds bit rot
    and overwritten blocks at over 1 GB/s; the files are not secrets, and a forger could rewrite
    meta.json anyway, so a cryptographic hash would add only time."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return [len(data), zlib.crc32(data)]


def _write_marker(run_dir, name, target):
    files.write_atomic(
        Path(run_dir) / name, lambda tmp: tmp.write_text(Path(target).name + "\n"), durable=True
    )


def _best_meta(run_dir):
    best = marker(run_dir, "best", warn=False)
    try:
        return read_meta(best)
    # no marker, or it names a damaged checkpoint
    except (TypeError, OSError, ValueError, AttributeError):
        return None


def _prune(run_dir, keep_last, step):
    """Delete all but the newest keep_last checkpoints up to `step`, sparing `best`. Checkpoints
    past `step` (left by a run that was restarted from an earlier one) are not this timeline's to
    delete."""
    spared = {marker(run_dir, "latest", warn=False), marker(run_dir, "best", warn=False)}
    mine = [p for p in step_dirs(run_dir) if step_of(p) <= step]
    for old in mine[keep_last:]:
        if old not in spared:
            # renamed first, so no half-deleted step_<N> is ever seen
            doomed = run_dir / f".tmp-old-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed)


# ---- RNG states: each rank's own, so dropout masks continue exactly after a resume ----


def restore_rng(path, rank, world_size, seed):
    """Put this rank's RNG states back (verify checked them with rng_problem). A checkpoint from
    another number of ranks has no stream that is "this rank's"; then each rank is seeded from
    (seed, rank, step) so it does not replay old masks."""
    path, meta = Path(path), read_meta(path)
    file = path / rng_file(rank)
    if meta.get("world_size") != world_size or not file.is_file():
        torch.manual_seed(seed64((seed * 1_000_003 + rank) * 1_000_000_007 + meta["step"]))
        return False
    state = read_rng(path, rank)
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss_next"]))
    return True


# ---- loading ----


def load(path, model, optimizer=None):
    """Collective: load model (and optimizer) state saved under any world size or sharding into this
    one."""
    state = _state(model, optimizer)
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state(model, optimizer, state["optim"])


def set_optimizer_state(model, optimizer, saved):
    """DCP's set_optimizer_state_dict, keeping this run's own kernels (each group's fused and
    foreach): the saved ones say how the saving run stepped (ClippedAdamW's compiled step saves
    neither, an XLA run no fused kernels), not what this run's device has."""
    kernels = [
        {k: group[k] for k in ("fused", "foreach") if k in group}
        for group in optimizer.param_groups
    ]
    set_optimizer_state_dict(model, optimizer, saved)
    for group, own in zip(optimizer.param_groups, kernels):
        group.update(own)


# Decentralized training: every rank holds a different replica, so a checkpoint keeps them apart
# by rank.


def _network_average(tree):
    """The same nested state with every floating-point tensor averaged over all ranks
    (collective)."""
    if isinstance(tree, dict):
        return {key: _network_average(value) for key, value in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        total = tree.detach().clone()
        dist.all_reduce(total)  # SUM: gloo has no AVG
        return total.div_(dist.get_world_size())
    return tree


def save_replicas(
    run_dir,
    step,
    model,
    optimizer,
    meta,
    tokenizer_dir=None,
    keep_last=0,
    average_only=False,
    background=None,
):
    """Collective. `model` and `optim` hold the network average of the replicas and their optimizer
    states, an ordinary checkpoint that generation, export and all-reduce runs read as usual;
    `replicas.<rank>` holds each rank's own model and optimizer state for an exact resume (left out
    with average_only)."""
    own = _state(model, optimizer)
    state = _network_average(own)
    if not average_only:
        state["replicas"] = {str(dist.get_rank()): own}
    replicas = 0 if average_only else dist.get_world_size()
    return save(
        run_dir,
        step,
        model,
        optimizer,
        dict(meta, replicas=replicas),
        tokenizer_dir,
        keep_last,
        state=state,
        background=background,
    )


def load_replicas(path, model, optimizer=None):
    """Collective. Each rank resumes its own replica when the checkpoint holds one per rank of this
    world; otherwise (average-only, or another world size) every rank starts from the network
    average."""
    saved, world = read_meta(path).get("replicas", 0), dist.get_world_size()
    if saved != world:
        if saved and dist.get_rank() == 0:
            print(
                f"{path} holds {saved} replicas and this run has {world} ranks: "
                "every rank starts from their average",
                flush=True,
            )
        return load(path, model, optimizer)
    rank = str(dist.get_rank())
    state = {"replicas": {rank: _state(model, optimizer)}}
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["replicas"][rank]["model"])
    if optimizer is not None:
        set_optimizer_state(model, optimizer, state["replicas"][rank]["optim"])

"""Saves written beside training (--checkpoint_mode async) with DCP's async_save, and what each save
cost training (Saved).

An asynchronous save stops training only to copy the rank's model and optimizer state into host
memory (page-locked on a GPU, and kept from one save to the next: Background.stage). DCP's
async_save then plans the save from its own thread while the rank's writer process writes the files,
and the rest of the save (checkpointer._complete: the checksums gathered, meta.json, the rename, the
commit, pruning) follows in that thread. Its collectives run on a gloo process group of their own,
so they never interleave with training's. At most one save is in flight: the next save, a stop and
the end of the run wait for it, and every logging step asks (one collective) whether it has ended,
so a failed write ends the run there.

The files' bytes are written by a process of the rank's own (writer.WriterProcess) from
host memory both map, so that the write's Python work does not hold training's GIL; DCP's planning
and collectives stay in its thread here. DCP's own process-based async_save would need every rank's
process to meet again (a second rendezvous, which mpiexec, srun and PBS launches do not give) and a
picklable copy of the DTensors.
"""

import dataclasses
import datetime
import sys
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# the keys DCP's planner looks up
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from minimal_fsdp.checkpoint.writer import (
    ALIGN,
    SharedMemory,
    WriterProcess,
    in_process,
)
from minimal_fsdp.config.checks import host_memory_available
from minimal_fsdp.launch import hosts

# The staged copy may take this share of the host memory that is free when the run starts; the rest
# is left to the page cache, data loading and everything else on the node.
HOST_SHARE = 0.8


@dataclasses.dataclass
class Saved:
    """One save as the log reports it: training stopped `blocking_s` for it, of which `waited_s` for
    the save before it to end (at most one is in flight); `total_s` from its start (once the one
    before had ended) until it was committed, None while it is still being written in the
    background."""

    step: int
    path: Path
    blocking_s: float
    waited_s: float = 0.0
    total_s: float = None


def writer_threads(state):
    """Files (and threads) a rank writes its shard in: one per GB, at most 4: four threads write as
    fast as a GPU host's disk, one does not (benchmarks/results/RESULTS.md#levers-kept); a small
    state stays in one file."""
    size = sum(
        (t.to_local() if isinstance(t, DTensor) else t).nbytes
        for t in flatten_state_dict(state)[0].values()
        if isinstance(t, torch.Tensor)
    )
    return int(min(4, max(1, size // 10**9)))


def staging_bytes(model, decentralized=False, average_only=False):
    """Host memory one rank's asynchronous saves keep: a copy of its shard of the fp32 parameters
    and of AdamW's two moments (4 + 8 bytes an element), twice for a decentralized run that saves
    each replica beside their average. The optimizer's step counts and hyperparameters are a few
    bytes."""
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    return local * 12 * (2 if decentralized and not average_only else 1)


def choose_mode(mode, device_type, per_rank, ranks_on_node, available):
    """(sync or async, the reason to print or None). auto: async on GPUs, where a save would
    otherwise leave them idle; sync on a CPU, where the background write would take cores from
    training, to save seconds at most. A host without room for every local rank's staged copy saves
    synchronously, and says so."""
    if mode == "sync" or mode == "auto" and device_type != "cuda":
        return "sync", None
    needed = per_rank * ranks_on_node
    if available is not None and needed > HOST_SHARE * available:
        return "sync", (
            f"warning: asynchronous checkpoint saves would keep {needed / 1e9:.1f} GB of host "
            f"memory on this node ({per_rank / 1e9:.1f} GB per rank) and {available / 1e9:.1f} GB "
            "is free: saving synchronously (--checkpoint_mode sync says so in advance)"
        )
    return "async", None


def for_run(checkpoint, env, model, decentralized):
    """Collective: the run's Background, or None for synchronous saves (choose_mode's verdict; a
    rank on a node short of memory makes every rank save synchronously, and rank 0 says why).
    checkpoint: config.sections.Checkpoint."""
    staging = staging_bytes(model, decentralized, checkpoint.save_average)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(
        verdicts,
        choose_mode(
            checkpoint.checkpoint_mode,
            env.device.type,
            staging,
            env.local_world_size,
            host_memory_available(),
        ),
    )
    notes = [note for _, note in verdicts if note]
    if notes and env.is_main:
        print(notes[0], file=sys.stderr, flush=True)
    if any(mode == "sync" for mode, _ in verdicts):
        return None
    # as staging_bytes counts them
    copies = 3 * (2 if decentralized and not checkpoint.save_average else 1)
    return Background(env.device, checkpoint.collective_timeout, staging, model, copies)


class StagedPlanner(DefaultSavePlanner):
    """DCP's planner, which plans from the live state (only its shapes and layout, which training
    does not change) and writes the tensors' copies staged at the save's step: {flattened key: host
    tensor} (Background.stage); `places` says where each lies in SharedMemory, for a
    WriterProcess."""

    def __init__(self, staged, places=None):
        # Every save of a run has the same layout: DCP reuses the first one's global plan and
        # metadata (about half of the Python work a save does here, beside training, after the
        # writer process's share).
        super().__init__(enable_plan_caching=True)
        self.staged, self.places = staged, places

    def lookup_object(self, index):
        staged = self.staged.get(index.fqn)
        return super().lookup_object(index) if staged is None else staged


class Background:
    """The one asynchronous save in flight, what it is written with (a process group for its
    collectives, the rank's WriterProcess) and the host buffers every save of the run is staged in.

    Staged by our own copy loop: DCP's stagers (DefaultStager, BlockingAsyncStager) deep-copy
    DTensors, which fails ("invalid python storage", torch 2.13) for a DTensor whose local shard is
    a view at an offset into a larger buffer, as whole_unit.py's are; a DTensor's local shard is all
    a save writes anyway."""

    def __init__(self, device, timeout_seconds, staging=0, model=None, copies=3):
        self.staging = staging  # bytes of host memory the staged copy takes (staging_bytes)
        with hosts.gloo_quiet():  # collective: every rank builds its Checkpointer at the same point
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds)
            )
        self.pin = device.type == "cuda"
        # Host memory the writer process maps too (writer.in_process says whether there
        # is one).
        self.memory = SharedMemory(self.pin) if in_process() else None
        # flattened key -> (host tensor, where it lies in self.memory), taken at the first save
        self.buffers = {}
        self.spare = {}  # (shape, dtype) -> such pairs made at startup, for the first save to take
        if self.pin and model is not None:
            # Page-locking is slow (benchmarks/results/RESULTS.md#levers-kept): done here, at
            # startup, for every parameter's shard and its AdamW moments, so that no save waits
            # for it.
            shards = [
                param.to_local() if isinstance(param, DTensor) else param
                for param in model.parameters()
            ]
            if self.memory is not None:
                self.memory.reserve(
                    copies * sum(-(-local.nbytes // ALIGN) * ALIGN for local in shards)
                )
            for local in shards:
                self.spare.setdefault((tuple(local.shape), local.dtype), []).extend(
                    self._allocate(local) for _ in range(copies)
                )
        self.writer = WriterProcess(self.memory) if self.memory is not None else None
        self.pending = None

    @torch.no_grad()
    def stage(self, state):
        """Copy every tensor of `state` (a DTensor's local shard) to host memory: all a save stops
        training for, since the next optimizer step overwrites the originals. Returns a
        StagedPlanner for them."""
        staged, places = {}, {}
        for key, value in flatten_state_dict(state)[0].items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                buffer, where = self.buffers.get(key, (None, None))
                if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                    spare = self.spare.get((tuple(local.shape), local.dtype))
                    buffer, where = self.buffers[key] = (
                        spare.pop() if spare else self._allocate(local)
                    )
                staged[key] = buffer.copy_(local, non_blocking=self.pin)
                places[key] = (where, tuple(local.shape), local.dtype)
        if self.pin:
            torch.cuda.current_stream().synchronize()
        return StagedPlanner(staged, places)

    def _allocate(self, like):
        """(a host tensor shaped as `like`, where it lies in self.memory or None), page-locked on a
        GPU so the copy runs at the link's speed. Registered rather than taken from torch's pinned
        allocator, which rounds each block up to a power of two."""
        if self.memory is not None:
            return self.memory.tensor(like.shape, like.dtype)
        buffer = torch.empty(like.shape, dtype=like.dtype)
        if self.pin and buffer.numel():
            if (
                torch.cuda.cudart().cudaHostRegister(
                    buffer.data_ptr(), buffer.untyped_storage().nbytes(), 0
                )
                == 0
            ):
                weakref.finalize(buffer, torch.cuda.cudart().cudaHostUnregister, buffer.data_ptr())
        return buffer, None

    def start(self, state, planner, writer, then):
        """Write `state` (its tensors staged in `planner`) with DCP's async_save, then run then(the
        write's exception or None) in DCP's thread; wait() tells when it ended (or raises its
        error)."""
        done = Future()

        def finish(upload):
            try:
                then(upload.exception())
                done.set_result(time.perf_counter())
            except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
                done.set_exception(e)

        upload = dcp.async_save(
            state, storage_writer=writer, planner=planner, process_group=self.group
        )
        self.pending = done
        upload.add_done_callback(finish)

    def wait(self):
        """When (time.perf_counter) the save in flight ended (None if there is none); raises its
        error."""
        pending, self.pending = self.pending, None
        return None if pending is None else pending.result()

    def ended(self):
        """Collective: whether the save in flight has ended on every rank (so all may wait() without
        waiting)."""
        flag = torch.tensor([self.pending is None or self.pending.done()], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # a CPU tensor: gloo, no wait for the GPU
        return bool(flag.item())

    def close(self):
        """Wait for the save in flight, whatever its outcome (the caller is leaving on another
        error), and let the host buffers go."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.exception()
        self.buffers.clear()
        self.spare.clear()
        if self.writer is not None:
            self.writer.close()
            self.memory.close()
            self.writer = None

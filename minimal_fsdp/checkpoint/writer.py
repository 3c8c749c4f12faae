"""How a rank's checkpoint files are written: DCP's FileSystemWriter, with every file's size and
CRC-32 taken from the bytes on their way to it (ChecksummingWriter); for an asynchronous save, in a
process of the rank's own (WriterProcess) that reads the staged copy from host memory both processes
map (SharedMemory).

Why a process: the write's own Python work (torch.save's pickling and zip records for each of a
rank's thousands of tensors, DCP's per-item bookkeeping) holds the GIL, and a thread doing it beside
training holds up training's kernel launches, which need the GIL too (training ran slower while
its saves were written by threads: benchmarks/results/RESULTS.md#hosts-and-saves). The process does
only the bytes; DCP's planning, its collectives and the commit stay in the rank.
"""

import errno
import io
import mmap
import multiprocessing.connection
import multiprocessing.reduction
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItemType

ALIGN = 64  # bytes: each staged tensor starts on a cache line
FULL_BELOW = 2**20  # bytes free: a file system this full after a failed write is full


def write_failure_reason(directory):
    """Why a write into `directory` failed when torch.save's zip writer says only "unexpected pos"
    or "file write failed": a full file system, or the process's file size limit (ulimit -f), as the
    OS would have said it."""
    try:
        if shutil.disk_usage(directory).free < FULL_BELOW:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return f"{os.strerror(errno.EFBIG)} (over this process's file size limit, ulimit -f)"
    return "a write failed: no space left on the device, or a file too large"


class _Checksummed:
    """A file being written, whose size and CRC-32 follow every write (what DCP calls on its
    streams)."""

    def __init__(self, stream):
        self.stream, self.size, self.crc = stream, 0, 0

    def write(self, data):
        view = memoryview(data)
        # zlib lets go of the GIL for large buffers, as the write does
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.stream.write(view)

    def tell(self):
        return self.stream.tell()

    def fileno(self):
        return self.stream.fileno()

    def flush(self):
        self.stream.flush()

    def close(self):
        self.stream.close()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording {file name: [size, CRC-32]} of every file written through
    it."""

    def __init__(self):
        super().__init__()
        self.files = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            counted = _Checksummed(stream)
            yield counted
        # only once the file is whole and closed
        self.files[Path(path).name] = [counted.size, counted.crc]

    def rename(self, path, new_path):  # DCP writes .metadata as .metadata.tmp, then renames it
        super().rename(path, new_path)
        if Path(path).name in self.files:
            self.files[Path(new_path).name] = self.files.pop(Path(path).name)


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (the same files, fsynced), which also knows the size and CRC-32 of
    every file it wrote (`checksums`), taken from the bytes as they were written: no file is read
    back. DCP has no hook for this, so the writer's file system is swapped for one whose streams
    checksum what passes through them. With a WriterProcess, the shards' bytes are written there
    (write_data); .metadata is written here."""

    def __init__(self, path, threads=1, staged=False, process=None):
        # Staged tensors are on the host already: nothing to copy ahead of the writes.
        super().__init__(
            path, thread_count=threads, **({"per_thread_copy_ahead": 0} if staged else {})
        )
        self.fs = _ChecksummingFileSystem()
        self.process = process

    def stage(self, state_dict):
        """async_save asks its writer to stage the state; Background.start has staged it already."""
        return state_dict

    def write_data(self, plan, planner):
        if self.process is None:
            return super().write_data(plan, planner)
        results, checksums = self.process.write(self, plan, planner)
        self.fs.files.update(checksums)
        done = torch.futures.Future()  # what DCP's save waits on
        done.set_result(results)
        return done

    @property
    def checksums(self):
        return dict(self.fs.files)


def in_process():
    """Whether asynchronous saves are written by a WriterProcess: only with
    $MINIMAL_FSDP_ASYNC_WRITER=process (and memfd). The default stays DCP's threads in the rank
    until the process is measured on GPUs: it is checked on CPUs only (page-locking the memfd and a
    writer beside CUDA ranks have not run on a GPU host yet)."""
    return os.environ.get("MINIMAL_FSDP_ASYNC_WRITER", "thread") == "process" and hasattr(
        os, "memfd_create"
    )


class SharedMemory:
    """Host memory this process and its WriterProcess both map: anonymous files (memfd; no /dev/shm,
    whose size a container may cap), each handed out in aligned pieces, one torch tensor (with a
    storage of its own) each."""

    def __init__(self, pin=False):
        self.segments = []  # [fd, mmap, bytes handed out, its page-locked view or None]
        self.pin = pin

    def reserve(self, size):
        """A new segment of at least `size` bytes (page-locked on a GPU, so copies into it run at
        the link's speed: cudaHostRegister, rather than torch's pinned allocator, which rounds up to
        a power of two)."""
        size = max(size, ALIGN)
        fd = os.memfd_create("minimal_fsdp-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size)
        if self.pin:
            base = torch.frombuffer(memory, dtype=torch.uint8)
            if torch.cuda.cudart().cudaHostRegister(base.data_ptr(), size, 0) != 0:
                base = None  # not page-locked: copies into it are slower, nothing worse
            self.segments.append([fd, memory, 0, base])
        else:
            self.segments.append([fd, memory, 0, None])

    def tensor(self, shape, dtype):
        """(a new host tensor, where it lies: (segment, offset), or None for an empty one)."""
        count = torch.Size(shape).numel()
        size = count * dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype), None
        if not self.segments or self.segments[-1][2] + size > len(self.segments[-1][1]):
            self.reserve(max(size, 2**26))
        segment = self.segments[-1]
        offset, segment[2] = segment[2], segment[2] + -(-size // ALIGN) * ALIGN
        return view(segment[1], offset, shape, dtype), (len(self.segments) - 1, offset)

    def close(self):
        for fd, _, _, pinned in self.segments:
            if pinned is not None:
                torch.cuda.cudart().cudaHostUnregister(pinned.data_ptr())
            os.close(fd)  # the mappings go when their last tensor does
        self.segments = []


def view(memory, offset, shape, dtype):
    count = torch.Size(shape).numel()
    return torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(shape)


class WriterProcess:
    """A process that writes this rank's shard files of each save from SharedMemory, started beside
    the rank and ended with it. It ignores SIGTERM and SIGINT (a stop waits for the save in flight,
    which it is writing) and dies with the rank (PR_SET_PDEATHSIG, which fires when the thread that
    made it ends: make it on the rank's main thread), so a rank killed mid-save leaves no writer
    behind."""

    def __init__(self, memory):
        self.memory, self.sent = memory, 0  # segments the process has been handed
        here, there = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS="1",
        )
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from minimal_fsdp.checkpoint.writer import serve; serve({there.fileno()}, "
                f"{os.getpid()})",
            ],
            pass_fds=[there.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        there.close()
        self.connection = multiprocessing.connection.Connection(here.detach())

    def write(self, writer, plan, planner):
        """Write `plan`'s items (tensors staged in planner.places, small objects resolved here) into
        the writer's directory; returns (DCP's WriteResults, {file name: [size, CRC-32]}). Raises
        the write's error, or OSError if the process is gone."""
        try:
            for fd, memory, _, _ in self.memory.segments[self.sent :]:
                self.connection.send(("segment", len(memory)))
                multiprocessing.reduction.send_handle(self.connection, fd, self.process.pid)
                self.sent += 1
            objects = {
                item.index.fqn: planner.resolve_data(item).getvalue()
                for item in plan.items
                if item.type == WriteItemType.BYTE_IO
            }
            self.connection.send(
                ("write", str(writer.path), writer.thread_count, plan, planner.places, objects)
            )
            outcome, *value = self.connection.recv()
        except (EOFError, OSError):
            code = self.process.poll()
            raise OSError(
                errno.EIO,
                "the checkpoint writer process "
                + ("broke its connection" if code is None else f"ended (exit code {code})"),
            ) from None
        if outcome == "error":
            raise value[0]
        return value

    def close(self):
        try:
            self.connection.send(None)
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.connection.close()


class _Resolver:
    """What the writer asks DCP's planner for: each item's bytes, from the staged tensors or the
    objects sent."""

    def __init__(self, tensors, objects):
        self.tensors, self.objects = tensors, objects

    def resolve_data(self, item):
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[item.index.fqn])
        return self.tensors[item.index.fqn]


def serve(fd, parent):
    """The writer process: write each save asked for, answer ("done", results, checksums) or
    ("error", e)."""
    for name in ("SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _die_with(parent)
    torch.set_num_threads(1)
    connection, segments = multiprocessing.connection.Connection(fd), []
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message is None:
            return
        if message[0] == "segment":
            handle = multiprocessing.reduction.recv_handle(connection)
            segments.append(mmap.mmap(handle, message[1]))
            os.close(handle)
            continue
        _, path, threads, plan, places, objects = message
        try:
            tensors = {
                key: torch.empty(shape, dtype=dtype)
                if where is None
                else view(segments[where[0]], where[1], shape, dtype)
                for key, (where, shape, dtype) in places.items()
            }
            writer = ChecksummingWriter(path, threads, staged=True)
            answer = (
                "done",
                writer.write_data(plan, _Resolver(tensors, objects)).value(),
                writer.checksums,
            )
        except Exception as e:  # noqa: BLE001 - the rank reports it
            answer = (
                "error",
                e if isinstance(e, OSError) else RuntimeError(f"{type(e).__name__}: {e}"),
            )
        connection.send(answer)


def _die_with(parent):
    """Be SIGKILLed when the rank ends, however it ends (Linux; elsewhere the closed connection ends
    the loop)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the rank ended before the line above
        os._exit(1)

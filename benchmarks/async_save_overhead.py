"""How much an asynchronous checkpoint save in flight slows training's own thread, on a CPU.

    python benchmarks/async_save_overhead.py --gb 2 --repeats 3 \
        [--writer process|thread] [--sink disk|null]

A GPU training step is, for its Python thread, a loop of thousands of small kernel launches, each of
which lets go of the GIL and takes it back: whatever the save's background work does while holding
the GIL delays those launches, and the GPU idles. This proxy times such a loop (tiny torch ops,
which release and retake the GIL as launches do) with no save, then while checkpointer.save(...,
background=...) writes a state shaped like one rank's shard of GPT-2 XL under AdamW (48 blocks of 12
tensors, each with two moments and a step count: about 2,300 tensors, scaled to --gb), and reports
the loop's time lost per save. --sink null writes the bytes nowhere (no checksums, no disk; with
--writer thread only): what is left is the save's Python work alone. --dir /dev/shm writes to memory
instead of a disk. On a machine with few cores the write's own CPU work (checksums, copies into the
page cache) also competes with the loop; --writer thread against --writer process compares the two
with that work equal.
"""

import argparse
import io
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimal_fsdp.checkpoint import (
    checkpointer,
    writer,  # noqa: E402
)
from minimal_fsdp.checkpoint.background import Background, flatten_state_dict

LAYERS, OPS_PER_BATCH = 48, 200


def shard_like_gpt2_xl(gb):
    """{"model": ..., "optim": ...} as get_model_state_dict and get_optimizer_state_dict give them:
    GPT-2's tensors (embed size chosen so the weights and moments together take about `gb` GB)."""
    embed = max(64, int(((gb * 1e9 / 12) / (LAYERS * 12)) ** 0.5) // 64 * 64)
    block = {
        "ln_1.weight": [embed],
        "ln_1.bias": [embed],
        "attn.c_attn.weight": [3 * embed, embed],
        "attn.c_attn.bias": [3 * embed],
        "attn.c_proj.weight": [embed, embed],
        "attn.c_proj.bias": [embed],
        "ln_2.weight": [embed],
        "ln_2.bias": [embed],
        "mlp.c_fc.weight": [4 * embed, embed],
        "mlp.c_fc.bias": [4 * embed],
        "mlp.c_proj.weight": [embed, 4 * embed],
        "mlp.c_proj.bias": [embed],
    }
    shapes = {
        "transformer.wte.weight": [8 * embed, embed],
        "transformer.wpe.weight": [embed, embed],
        **{
            f"transformer.h.{i}.{name}": shape
            for i in range(LAYERS)
            for name, shape in block.items()
        },
        "transformer.ln_f.weight": [embed],
        "transformer.ln_f.bias": [embed],
    }
    model = {name: torch.randn(shape) for name, shape in shapes.items()}
    state = {
        name: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(shape),
            "exp_avg_sq": torch.rand(shape),
        }
        for name, shape in shapes.items()
    }
    groups = [
        {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(shapes)}
    ]
    size = sum(t.nbytes for t in model.values()) * 3
    return {"model": model, "optim": {"state": state, "param_groups": groups}}, size


def launch_loop(stop, counts):
    """Training's thread: batches of tiny ops (each lets go of the GIL and takes it back, as a
    launch does)."""
    x = torch.zeros(16)
    while not stop.is_set():
        start = time.perf_counter()
        for _ in range(OPS_PER_BATCH):
            x.add_(1.0)
        counts.append((start, time.perf_counter(), time.thread_time()))


def loop_cpu(counts, at):
    """The loop thread's CPU seconds at the end of its last batch before `at`."""
    return max((cpu for _, end, cpu in counts if end <= at), default=0.0)


def rate(counts, start, end):
    """Batches per second of the loop between two instants."""
    inside = [b - a for a, b, _ in counts if a >= start and b <= end]
    return len(inside) / max(1e-9, sum(inside)) if inside else float("nan"), len(inside)


@contextmanager
def null_sink():
    """DCP's streams write nowhere and fsync nothing: the save keeps only its Python work."""

    class Null:
        size = 0

        def write(self, data):
            n = memoryview(data).nbytes
            self.size += n
            return n

        def tell(self):
            return self.size

        def flush(self):
            pass

        def close(self):
            pass

        def fileno(self):
            raise io.UnsupportedOperation("no file")  # DCP then skips its fsync

    real = writer._ChecksummingFileSystem.create_stream

    @contextmanager
    def create_stream(fs, path, mode):
        if "w" in mode and not str(path).endswith(".metadata.tmp"):
            yield Null()
            fs.files[Path(path).name] = [0, 0]
        else:
            with real(fs, path, mode) as stream:
                yield stream

    writer._ChecksummingFileSystem.create_stream = create_stream
    fsync = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        writer._ChecksummingFileSystem.create_stream, os.fsync = real, fsync


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the state saved")
    parser.add_argument(
        "--repeats", type=int, default=3, help="saves measured (each against a loop alone)"
    )
    parser.add_argument("--sink", choices=("disk", "null"), default="disk")
    parser.add_argument(
        "--writer",
        choices=("process", "thread"),
        default=None,
        help="the background writer (default: what --checkpoint_mode async uses)",
    )
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    if args.sink == "null" and args.writer != "thread":
        parser.error("--sink null works in this process only: add --writer thread")
    if args.writer:
        os.environ["MINIMAL_FSDP_ASYNC_WRITER"] = args.writer
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state, size = shard_like_gpt2_xl(args.gb)
    tensors = sum(1 for _ in flatten_state_dict(state)[0].values())
    print(
        f"state: {size / 1e9:.2f} GB in {tensors} entries; sink {args.sink}; writer "
        f"{os.environ.get('MINIMAL_FSDP_ASYNC_WRITER', 'default')}",
        flush=True,
    )
    background = Background(torch.device("cpu"), 600, size)
    stop, counts = threading.Event(), []
    loop = threading.Thread(target=launch_loop, args=(stop, counts))
    lost, slowdowns, blocking, totals, besides = [], [], [], [], []
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        null_sink() if args.sink == "null" else contextmanager(lambda: (yield))(),
    ):
        loop.start()
        try:
            for step in range(1, args.repeats + 2):
                begin = time.perf_counter()
                checkpointer.save(
                    Path(tmp) / "run",
                    step,
                    None,
                    None,
                    {"val_loss": None},
                    keep_last=1,
                    state=state,
                    background=background,
                )
                returned, cpu = time.perf_counter(), time.process_time()
                ended = background.wait()
                # CPU seconds this process spent on the save beside the loop: what could hold the
                # loop's GIL (a writer process's own CPU is not counted).
                beside = (
                    time.process_time()
                    - cpu
                    - (loop_cpu(counts, ended) - loop_cpu(counts, returned))
                )
                if step == 1:  # the first save also starts what later saves reuse
                    print(
                        f"first save: {returned - begin:.2f} s blocking, {ended - begin:.2f} s in "
                        f"all",
                        flush=True,
                    )
                    continue
                time.sleep(max(0.5, ended - returned))  # the loop alone, as long as the write took
                alone, _ = rate(counts, ended + 0.05, time.perf_counter())
                during, batches = rate(counts, returned, ended)
                duration = ended - returned
                slowdowns.append(1 - during / alone)
                lost.append(duration - batches / alone)
                blocking.append(returned - begin)
                totals.append(ended - begin)
                besides.append(beside)
                print(
                    f"save {step}: blocking {blocking[-1]:.2f} s, background {duration:.2f} s; "
                    f"loop {during:.0f} batches/s during it against {alone:.0f} alone: "
                    f"{slowdowns[-1]:.1%} slower, {lost[-1]:.2f} s lost; {beside:.2f} CPU s beside "
                    f"the loop in this process",
                    flush=True,
                )
        finally:
            stop.set()
            loop.join()
            background.close()
    print(
        f"median of {len(lost)}: loop {statistics.median(slowdowns):.1%} slower while a save is "
        f"written, {statistics.median(lost):.2f} s lost per save, {statistics.median(besides):.2f} "
        f"CPU s of the save in training's process; saves {statistics.median(blocking):.2f} s "
        f"blocking, {statistics.median(totals):.2f} s in all"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

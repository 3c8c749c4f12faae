"""How fast the collectives training uses cross the link between hosts: an all-reduce of a buffer
over every rank, and the exchange gossip makes (each rank sends the whole buffer to its counterpart
on the next host and receives its counterpart's from the previous, in one batch_isend_irecv, as
gossip.Gossip does). Launched on each host by `benchmarks/multihost.py --probe MB` (torchrun-style
variables); rank 0 prints one JSON line.

Rates are per rank, each way: an all-reduce of S bytes over n ranks moves 2(n-1)/n x S in and out of
a rank (a ring), an exchange S. With one rank a host those bytes all cross the host's link. NCCL's
socket threads are training's (minimal_fsdp.launch.hosts.nccl_socket_threads) unless the environment
sets them: NCCL's own defaults are `--env NCCL_SOCKET_NTHREADS=1,NCCL_NSOCKS_PERTHREAD=1`.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from minimal_fsdp.launch.hosts import nccl_socket_threads


def timed(fn, repeats):
    """Median seconds of fn over repeats, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    megabytes, repeats = float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    # as training
    nccl_socket_threads(int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    buffer = torch.ones(int(megabytes * 2**20) // 4, device=device)
    received = torch.empty_like(buffer)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def all_reduce():
        dist.all_reduce(buffer)
        sync()

    def exchange():
        # as gossip.Gossip posts them
        ops = [
            dist.P2POp(dist.irecv, received, (rank - per_host) % world),
            dist.P2POp(dist.isend, buffer, (rank + per_host) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        sync()

    size = buffer.numel() * 4
    reduce_s, exchange_s = timed(all_reduce, repeats), timed(exchange, repeats)
    if rank == 0:
        gbps = lambda nbytes, seconds: round(nbytes * 8 / seconds / 1e9, 2)  # noqa: E731
        print(
            json.dumps(
                {
                    "probe_mb": megabytes,
                    "world": world,
                    "all_reduce_ms": round(1000 * reduce_s, 1),
                    "all_reduce_gbps": gbps(2 * (world - 1) / world * size, reduce_s),
                    "exchange_ms": round(1000 * exchange_s, 1),
                    "exchange_gbps": gbps(size, exchange_s),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run under mpiexec by test_gossip.py: real gossip steps between ranks (gloo on CPUs, NCCL on
GPUs), also with the ranks told they are on two hosts (4 ranks). Rank 0 writes what every rank
held before and after each step, and consensus trajectories, as JSON to argv[1]; the test checks
them."""

import json
import sys

import torch
import torch.distributed as dist

from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.launch import environment
from minimal_fsdp.parallel.gossip import TOPOLOGIES, Gossip

STEPS = 6
LR = 0.1  # of the quadratic toy problem


class Replica(torch.nn.Module):
    """Two parameters of different shapes, so the flat buffer and its views are exercised."""

    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(3, 4, generator=generator, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.randn(5, generator=generator, dtype=dtype))

    def vector(self):
        return torch.cat([p.detach().reshape(-1) for p in self.parameters()])


def gathered(vector):
    out = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vector)
    return torch.stack(out).tolist()


def mixing_steps(
    topology, rank, device, wire=torch.float32, hosts=None, bucket_mb=25, global_average_every=0
):
    """Before/after of STEPS gossip steps; the parameters are read through the model, not the flat
    buffer. hosts: each host's ranks (None: found from the hostnames), as Gossip takes them."""
    model = Replica(seed=100 + rank).to(device)
    gossip = Gossip(
        model,
        topology,
        wire,
        hosts=hosts,
        bucket_mb=bucket_mb,
        global_average_every=global_average_every,
    )
    steps = []
    for step in range(STEPS):
        before = gathered(model.vector())
        gossip.start(step)
        gossip.finish()
        steps.append(
            {
                "before": before,
                "after": gathered(model.vector()),
                "consensus": gossip.consensus_distance(),
            }
        )
    return {"steps": steps, "bytes_sent": gossip.bytes_sent, "numel": model.vector().numel()}


def quadratic(topology, rank, lr, steps, device):
    """Decentralized gradient descent on f(x) = |x - b|^2 / 2 (one b for all), replicas starting
    apart, in the order training uses: start the exchange, compute the gradient at x^t, finish
    (mix), step."""
    model = Replica(seed=200 + rank, dtype=torch.float64).to(device)
    target = Replica(seed=7, dtype=torch.float64).to(device)
    gossip = Gossip(model, topology, torch.float64)
    distances = [gossip.consensus_distance()]
    for step in range(steps):
        gossip.start(step)
        grads = [p.detach() - b.detach() for p, b in zip(model.parameters(), target.parameters())]
        gossip.finish()
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.sub_(lr * g)
        distances.append(gossip.consensus_distance())
    return distances


def main():
    env = environment.setup(parse_args(["--collective_timeout", "60"]))
    results = {
        "world": env.world_size,
        "lr": LR,
        "device": env.device.type,
        "mixing": {t: mixing_steps(t, env.rank, env.device) for t in TOPOLOGIES},
        "quadratic": {t: quadratic(t, env.rank, LR, 12, env.device) for t in ("ring", "exp")},
        "exp_no_lr": quadratic("exp", env.rank, 0.0, 4, env.device),
    }
    # two hosts of two ranks, told so: host-aware gossip over gloo's groups and a thread
    if env.world_size == 4:
        hosts = [(0, 1), (2, 3)]
        results["hosts"] = {
            f"{t} {wire}": mixing_steps(t, env.rank, env.device, getattr(torch, wire), hosts, 1e-5)
            for t in TOPOLOGIES
            for wire in ("float32", "bfloat16")
        }
    if env.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    environment.teardown()


if __name__ == "__main__":
    main()

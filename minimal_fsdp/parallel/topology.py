"""Gossip's topologies: who sends to and receives from whom at each step, and with which weights.
Torch-free, so the planner's step-time estimate (tools/step_time.py) asks it without importing
torch; parallel/gossip.py runs the exchanges."""

from dataclasses import dataclass

from minimal_fsdp.config.choices import TOPOLOGIES


@dataclass(frozen=True)
class Exchange:
    """One peer's part of a gossip step: x_i <- self_weight * x_i + sum(weight * x_j for j, weight
    in recv_from), while x_i goes to every peer in send_to."""

    self_weight: float
    send_to: tuple
    recv_from: tuple  # ((peer, weight), ...)


def exp_distances(world):
    """Peer distances of the one-peer exponential graph: 1, 2, 4, ... below the world size."""
    return [2**k for k in range(max(0, (world - 1).bit_length()))]


def topology_at(topology, step, global_average_every=0):
    """The topology gossip step `step` runs: every global_average_every-th step (the last of each
    such run of steps) averages all replicas (complete), in the manner of Gossip-PGA (Chen et al.,
    2021), which bounds the replicas' drift by the period instead of by the graph's mixing."""
    if global_average_every and (step + 1) % global_average_every == 0:
        return "complete"
    return topology


def exchange_for(topology, rank, world, step):
    """Who this peer sends to and receives from at `step`, and with which weights."""
    if world == 1:
        return Exchange(1.0, (), ())
    if topology == "alternating-exp-ring":
        topology, step = ("exp", step // 2) if step % 2 == 0 else ("ring", step // 2)
    if topology == "complete":
        others = tuple(r for r in range(world) if r != rank)
        return Exchange(1 / world, others, tuple((r, 1 / world) for r in others))
    if topology == "ring":
        if world == 2:
            return Exchange(0.5, (1 - rank,), ((1 - rank, 0.5),))
        left, right = (rank - 1) % world, (rank + 1) % world
        return Exchange(1 / 3, (left, right), ((left, 1 / 3), (right, 1 / 3)))
    if topology == "exp":
        distances = exp_distances(world)
        d = distances[step % len(distances)]
        return Exchange(0.5, ((rank + d) % world,), (((rank - d) % world, 0.5),))
    raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")

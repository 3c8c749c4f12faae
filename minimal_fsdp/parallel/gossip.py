"""Decentralized data parallel: each rank trains its own whole replica and, every step, averages parameters
with a few neighbours (gossip) instead of all-reducing gradients across every rank.

Topologies, for n ranks at step t (x_i is rank i's flat parameter vector):
  complete              x_i <- mean of all replicas (one all-reduce)
  ring                  x_i <- (x_{i-1} + x_i + x_{i+1}) / 3        (n = 2: (x_0 + x_1) / 2)
  exp                   one peer at distance d = 2^(t mod ceil(log2 n)): x_i <- (x_i + x_{i-d}) / 2,
                        sending to i + d (a one-peer exponential graph; indices mod n, so any n works)
  alternating-exp-ring  exp on even steps (cycling d over those), ring on odd steps
Every mixing matrix is doubly stochastic, so a gossip step keeps the network average of the replicas.

A step is "communicate while computing": `start(step)` posts the exchange of the current parameters x^t,
forward and backward then run at x^t, and `finish()` waits and mixes, so the optimizer's update lands on the
mixed parameters: x^{t+1} = W_t x^t - lr * update(x^t). On gloo the messages travel during forward and
backward; on NCCL they run on NCCL's own stream beside the compute stream.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minimal_fsdp.config.choices import TOPOLOGIES  # --topology's choices, there for config.py to read without torch


@dataclass(frozen=True)
class Exchange:
    """One rank's part of a gossip step: x_i <- self_weight * x_i + sum(weight * x_j for j, weight in recv_from),
    while x_i goes to every rank in send_to."""
    self_weight: float
    send_to: tuple
    recv_from: tuple  # ((rank, weight), ...)


def exp_distances(world):
    """Peer distances of the one-peer exponential graph: 1, 2, 4, ... below the world size."""
    return [2 ** k for k in range(max(0, (world - 1).bit_length()))]


def exchange_for(topology, rank, world, step):
    """Who this rank sends to and receives from at `step`, and with which weights."""
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


def mixing_matrix(topology, world, step):
    """The dense n x n matrix W_t of a gossip step (row i: what rank i ends up with); for tests and analysis."""
    w = torch.zeros(world, world, dtype=torch.float64)
    for i in range(world):
        ex = exchange_for(topology, i, world, step)
        w[i, i] += ex.self_weight
        for j, weight in ex.recv_from:
            w[i, j] += weight
    return w


class Gossip:
    """Gossip averaging of one model's parameters with its neighbours' replicas.

    The parameters are moved into one flat buffer (each parameter becomes a view of it), so a step sends one
    message per peer with no copy, and mixing is a few vector operations.
    """

    def __init__(self, model, topology):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")
        self.topology = topology
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        if len({(p.device, p.dtype) for p in params}) != 1:
            raise ValueError("gossip needs every parameter on one device with one dtype")
        self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        with torch.no_grad():
            for p in params:
                p.data = self.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.received = []  # one buffer per incoming message, allocated on first use
        self.pending = None  # (exchange, work handles) between start and finish
        self.bytes_sent = 0  # payload this rank has sent so far

    def _buffers(self, count):
        while len(self.received) < count:
            self.received.append(torch.empty_like(self.flat))
        return self.received[:count]

    def start(self, step):
        """Post the exchange of the current parameters; returns at once. The parameters must not change
        until finish() (forward and backward only read them)."""
        assert self.pending is None, "gossip start() twice without finish()"
        exchange = exchange_for(self.topology, self.rank, self.world, step)
        nbytes = self.flat.numel() * self.flat.element_size()
        if self.world == 1:
            works = []
        elif self.topology == "complete":
            (total,) = self._buffers(1)
            total.copy_(self.flat)  # forward reads the parameters while the all-reduce writes its buffer
            works = [dist.all_reduce(total, async_op=True)]
            self.bytes_sent += round(2 * (self.world - 1) / self.world * nbytes)  # ring all-reduce's share
        else:
            buffers = self._buffers(len(exchange.recv_from))
            # Receives posted before sends: on gloo, sends first moved the exchange at half the link's rate in about
            # half the tries (both ways at once over one connection), receives first at its rate every time.
            ops = [dist.P2POp(dist.irecv, buf, peer) for buf, (peer, _) in zip(buffers, exchange.recv_from)]
            ops += [dist.P2POp(dist.isend, self.flat, peer) for peer in exchange.send_to]
            works = dist.batch_isend_irecv(ops)
            self.bytes_sent += nbytes * len(exchange.send_to)
        self.pending = (exchange, works)

    @torch.no_grad()
    def finish(self):
        """Wait for the neighbours' parameters and replace ours with the weighted average."""
        exchange, works = self.pending
        self.pending = None
        for work in works:
            work.wait()
        if self.world == 1:
            return
        if self.topology == "complete":
            self.flat.copy_(self.received[0]).div_(self.world)
            return
        self.flat.mul_(exchange.self_weight)
        for buf, (_, weight) in zip(self.received, exchange.recv_from):
            self.flat.add_(buf, alpha=weight)

    def micro_step(self, last):
        pass  # a replica never reduces gradients: accumulation is plain autograd accumulation

    def after_step(self):
        pass

    def clip_grad_norm(self, parameters, max_norm):
        """Clip this replica's own gradient to max_norm; returns the mean of the replicas' grad norms (collective):
        non-finite on every rank if any replica's is, so all ranks skip or stop at the same step."""
        total = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm or float("inf")).detach().clone()
        dist.all_reduce(total)
        return total / self.world

    @torch.no_grad()
    def consensus_distance(self):
        """Mean over ranks of ||x_i - x_mean||^2. Collective (two all-reduces): call it on every rank."""
        mean = self.flat.clone()
        dist.all_reduce(mean)
        mean.div_(self.world)
        local = (self.flat - mean).square().sum().reshape(1).double()
        dist.all_reduce(local)
        return local.item() / self.world


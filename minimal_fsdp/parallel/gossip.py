"""Decentralized data parallel: each rank trains its own whole replica and, every step, averages
parameters with a few neighbours (gossip) instead of all-reducing gradients across every rank.

Topologies, for n peers at step t (x_i is peer i's flat parameter vector):
  complete              x_i <- mean of all replicas (one all-reduce, summed in fp32 whatever the
                        wire: a bf16 sum rounds every partial sum, and cost 12% more val loss than
                        fp32's at 8 ranks, docs/parallelism.md)
  ring                  x_i <- (x_{i-1} + x_i + x_{i+1}) / 3        (n = 2: (x_0 + x_1) / 2)
  exp                   one peer at distance d = 2^(t mod ceil(log2 n)): x_i <- (x_i + x_{i-d}) / 2,
                        sending to i + d (a one-peer exponential graph; indices mod n, so any n
                        works)
  alternating-exp-ring  exp on even steps (cycling d over those), ring on odd steps
Every mixing matrix is doubly stochastic, so a gossip step keeps the network average of the
replicas. With global_average_every = K (--global_average_every), every K-th step is a complete one
whatever the topology: one all-reduce that brings every replica back to the average, so they never
drift further apart than K sparse steps take them (Gossip-PGA, Chen et al., 2021), for one fp32
all-reduce of the replica every K steps.

Host-aware: on one host (or one rank a host) the peers are the ranks. On H hosts of L ranks each,
the peers are the hosts: a step averages the L replicas of each host over its local links
(reduce-scatter: local rank j holds the host's mean of slice j, 1/L of the vector), local rank j
mixes its slice with local rank j of the peer hosts under the topology over hosts, and an all-gather
inside the host gives every local rank the mixed vector. The rank-level matrix is W_hosts (x) (1/L)
11^T, doubly stochastic; one replica's bytes cross a host's link per peer host, not L. Replicas of
one host stay distinct between steps (each trains on its own batches).

The wire: the vector travels in `wire_dtype` (bf16 by default, half fp32's bytes); the receiver
mixes in fp32 as x_i <- x_i + sum_j w_ij (q(x_j) - q(x_i)), q the rounding to the wire dtype, which
keeps the network average to fp32 rounding for any doubly stochastic W (the q(x_i) terms cancel over
i). With an fp32 wire it is x_i <- w_ii x_i + sum_j w_ij x_j, as before.

A step is "communicate while computing": `start(step)` posts the exchange of the current parameters
x^t (the result of step t-1's update), forward and backward then run at x^t, and `finish()` waits
and mixes, so the update lands on the mixed parameters: x^{t+1} = W_t x^t - lr * update(x^t). On one
host the messages travel on gloo's or NCCL's own threads and streams; across hosts a thread of the
gossip's own runs the three stages per bucket (bucket_mb), so one bucket crosses hosts while the
next is reduced inside its host.
"""

import queue
import socket
import threading

import torch
import torch.distributed as dist

# --topology's choices, there for config/flags.py to read without torch
from minimal_fsdp.config.choices import TOPOLOGIES

# fp32 megabytes of the vector per pipelined bucket (across hosts), as Decent-DP's buckets
BUCKET_MB = 25


# who exchanges with whom: in parallel/topology.py, torch-free, for the memory planner's step times
from minimal_fsdp.parallel.topology import (  # noqa: E402,F401
    Exchange,
    exchange_for,
    exp_distances,
    topology_at,
)


def mixing_matrix(topology, world, step, global_average_every=0):
    """The dense n x n matrix W_t of a gossip step (row i: what peer i ends up with); for tests and
    analysis."""
    topology = topology_at(topology, step, global_average_every)
    w = torch.zeros(world, world, dtype=torch.float64)
    for i in range(world):
        ex = exchange_for(topology, i, world, step)
        w[i, i] += ex.self_weight
        for j, weight in ex.recv_from:
            w[i, j] += weight
    return w


def rank_mixing_matrix(topology, hosts, step, global_average_every=0):
    """W_t over ranks for a host layout (hosts: each host's ranks): the host-level matrix, each
    host's replicas averaged inside it. One host, or one rank a host: the topology over the
    ranks."""
    world = sum(map(len, hosts))
    if not hierarchical(hosts):
        return mixing_matrix(topology, world, step, global_average_every)
    over_hosts = mixing_matrix(topology, len(hosts), step, global_average_every)
    w = torch.zeros(world, world, dtype=torch.float64)
    for a, mine in enumerate(hosts):
        for b, theirs in enumerate(hosts):
            for i in mine:
                for j in theirs:
                    w[i, j] = over_hosts[a, b] / len(theirs)
    return w


def hierarchical(hosts):
    """Host-aware gossip applies: several hosts, several ranks on each, as many on every host."""
    return len(hosts) > 1 and len(hosts[0]) > 1 and len({len(h) for h in hosts}) == 1


def host_layout():
    """Every host's ranks, in order of their first rank, from each rank's hostname (collective).
    Virtual hosts (tools/virtual_cluster.py) have hostnames of their own, as real ones do."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    hosts = {}
    for rank, name in enumerate(names):
        hosts.setdefault(name, []).append(rank)
    return [tuple(ranks) for ranks in hosts.values()]


class Gossip:
    """Gossip averaging of one model's parameters with its neighbours' replicas.

    The parameters are moved into one flat buffer (each parameter becomes a view of it), so a step
    sends one message per peer with no copy, and mixing is a few vector operations.
    hosts: each host's ranks (default: found from the hostnames); wire_dtype: what the vector
    travels in; global_average_every: every this many steps, a complete average (0: never).
    """

    def __init__(
        self,
        model,
        topology,
        wire_dtype=torch.bfloat16,
        hosts=None,
        bucket_mb=BUCKET_MB,
        global_average_every=0,
    ):
        if topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")
        self.topology, self.wire_dtype = topology, wire_dtype
        self.global_average_every = global_average_every
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        if len({(p.device, p.dtype) for p in params}) != 1:
            raise ValueError("gossip needs every parameter on one device with one dtype")
        self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        with torch.no_grad():
            for p in params:
                p.data = self.flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.lossy = wire_dtype != self.flat.dtype
        self.received = []  # one buffer per incoming message, allocated on first use
        self.total = None  # complete's fp32 sum, allocated on first use
        # (exchange, work handles, the step's topology) between start and finish
        self.pending = None
        self.bytes_sent = 0  # payload this rank has sent so far (across hosts, when host-aware)
        self.hosts = [
            tuple(h)
            for h in (hosts if hosts is not None else host_layout() if self.world > 1 else [(0,)])
        ]
        self.relay = Relay(self, bucket_mb) if hierarchical(self.hosts) else None

    def _buffers(self, count):
        while len(self.received) < count:
            self.received.append(torch.empty_like(self.flat, dtype=self.wire_dtype))
        return self.received[:count]

    def start(self, step):
        """Post the exchange of the current parameters; returns at once. The parameters must not
        change until finish() (forward and backward only read them)."""
        assert self.pending is None, "gossip start() twice without finish()"
        if self.relay:
            self.pending = (None, self.relay.start(step), None)
            return
        topology = topology_at(self.topology, step, self.global_average_every)
        exchange = exchange_for(topology, self.rank, self.world, step)
        self.sent = self.flat.to(self.wire_dtype) if self.lossy else self.flat  # q(x_i)
        nbytes = self.sent.numel() * self.sent.element_size()
        if self.world == 1:
            works = []
        elif topology == "complete":
            if self.total is None:
                self.total = torch.empty_like(self.flat)
            # q(x_i) in fp32, summed in fp32; forward reads the parameters meanwhile
            self.total.copy_(self.sent)
            works = [dist.all_reduce(self.total, async_op=True)]
            # ring all-reduce's share
            self.bytes_sent += round(2 * (self.world - 1) / self.world * self.total.nbytes)
        else:
            buffers = self._buffers(len(exchange.recv_from))
            # Receives posted before sends: on gloo, sends first moved the exchange at half the
            # link's rate in about half the tries (both ways at once over one connection), receives
            # first at its rate every time.
            ops = [
                dist.P2POp(dist.irecv, buf, peer)
                for buf, (peer, _) in zip(buffers, exchange.recv_from)
            ]
            ops += [dist.P2POp(dist.isend, self.sent, peer) for peer in exchange.send_to]
            works = dist.batch_isend_irecv(ops)
            self.bytes_sent += nbytes * len(exchange.send_to)
        self.pending = (exchange, works, topology)

    @torch.no_grad()
    def finish(self):
        """Wait for the neighbours' parameters and replace ours with the weighted average."""
        exchange, works, topology = self.pending
        self.pending = None
        if self.relay:
            self.flat.copy_(self.relay.finish(works))
            return
        for work in works:
            work.wait()
        if self.world == 1:
            return
        if topology == "complete":
            # x_i + mean(q) - q(x_i): the average kept, q's rounding left on each replica
            if self.lossy:
                self.flat.add_(self.total.div_(self.world) - self.sent)
            else:
                self.flat.copy_(self.total).div_(self.world)
            return
        if self.lossy:
            mixed = self.sent.float().mul_(exchange.self_weight - 1)
            for buf, (_, weight) in zip(self.received, exchange.recv_from):
                mixed.add_(buf.float(), alpha=weight)
            self.flat.add_(mixed)
            return
        self.flat.mul_(exchange.self_weight)
        for buf, (_, weight) in zip(self.received, exchange.recv_from):
            self.flat.add_(buf, alpha=weight)

    def micro_step(self, last):
        pass  # a replica never reduces gradients: accumulation is plain autograd accumulation

    def after_step(self):
        pass

    def clip_grad_norm(self, parameters, max_norm):
        """Clip this replica's own gradient to max_norm; returns the mean of the replicas' grad
        norms (collective): non-finite on every rank if any replica's is, so all ranks skip or stop
        at the same step."""
        total = (
            torch.nn.utils.clip_grad_norm_(list(parameters), max_norm or float("inf"))
            .detach()
            .clone()
        )
        dist.all_reduce(total)
        return total / self.world

    @torch.no_grad()
    def consensus_distance(self):
        """Mean over ranks of ||x_i - x_mean||^2. Collective (two all-reduces of the replica):
        training calls it at evaluation steps only, never on the hot path."""
        mean = self.flat.clone()
        dist.all_reduce(mean)
        mean.div_(self.world)
        local = (self.flat - mean).square().sum().reshape(1).double()
        dist.all_reduce(local)
        return local.item() / self.world


class Relay:
    """Host-aware gossip's exchange (module docstring): per bucket, the host's mean of this local
    rank's slice (reduce-scatter), mixed with the same slice of the peer hosts, all-gathered inside
    the host; on a thread of its own, so the three stages of each bucket run while forward and
    backward do."""

    def __init__(self, gossip, bucket_mb):
        self.gossip = g = gossip
        hosts = g.hosts
        self.local_size, self.host_count = len(hosts[0]), len(hosts)
        self.host = next(h for h, ranks in enumerate(hosts) if g.rank in ranks)
        self.local = hosts[self.host].index(g.rank)
        # Groups of its own, so the thread's collectives never interleave with the loop's on the
        # default group; new_group is collective: every rank makes every group, in one order.
        local_groups = [dist.new_group(list(ranks)) for ranks in hosts]
        cross_groups = [
            dist.new_group([ranks[j] for ranks in hosts]) for j in range(self.local_size)
        ]
        self.local_group, self.cross_group = local_groups[self.host], cross_groups[self.local]
        self.p2p_group = dist.new_group(list(range(g.world)))
        numel = g.flat.numel()
        per_bucket = min(numel, int(bucket_mb * 2**20) // 4)
        self.chunk = max(1, per_bucket // self.local_size)  # one local rank's slice of a bucket
        buckets = -(-numel // (self.chunk * self.local_size))
        like = dict(dtype=g.flat.dtype, device=g.flat.device)
        # the vector, zero-padded
        self.full = torch.zeros(buckets, self.local_size * self.chunk, **like)
        # the host's mean of my slices, then mixed
        self.slices = torch.empty(buckets, self.chunk, **like)
        self.mixed = torch.empty_like(self.full)
        self.sent = torch.empty(buckets, self.chunk, dtype=g.wire_dtype, device=g.flat.device)
        # ring: two peer hosts at most
        self.received = [torch.empty_like(self.sent) for _ in range(2)]
        self.total = None  # complete's fp32 sums, allocated on first use
        self.stream = torch.cuda.Stream(g.flat.device) if g.flat.device.type == "cuda" else None
        self.jobs, self.results = queue.Queue(), queue.Queue()
        threading.Thread(target=self._serve, name="gossip", daemon=True).start()

    def start(self, step):
        self.full.view(-1)[: self.gossip.flat.numel()].copy_(self.gossip.flat)
        if self.stream:  # the thread's kernels wait for the copy, not for forward and backward
            self.stream.wait_stream(torch.cuda.current_stream())
        self.jobs.put(step)
        return step

    def finish(self, step):
        error = self.results.get()
        if error is not None:
            raise error
        if self.stream:
            torch.cuda.current_stream().wait_stream(self.stream)
        return self.mixed.view(-1)[: self.gossip.flat.numel()]

    def _serve(self):
        if self.stream:
            torch.cuda.set_device(self.gossip.flat.device)
        while True:
            step = self.jobs.get()
            try:
                if self.stream:
                    with torch.cuda.stream(self.stream):
                        self._exchange(step)
                else:
                    self._exchange(step)
                self.results.put(None)
            except BaseException as e:  # noqa: B036 (raised in the training thread, by finish)
                self.results.put(e)

    @torch.no_grad()
    def _exchange(self, step):
        g, hosts = self.gossip, self.gossip.hosts
        topology = topology_at(g.topology, step, g.global_average_every)
        ex = exchange_for(topology, self.host, self.host_count, step)
        complete = topology == "complete"
        reduced = [
            dist.reduce_scatter_tensor(
                self.slices[k], self.full[k], group=self.local_group, async_op=True
            )
            for k in range(len(self.full))
        ]
        crossing = []
        for k, work in enumerate(reduced):  # bucket k crosses hosts while k + 1 is still reduced
            work.wait()
            self.slices[k].div_(self.local_size)
            self.sent[k].copy_(self.slices[k])
            if complete:
                if self.total is None:
                    self.total = torch.empty_like(self.slices)
                self.total[k].copy_(self.sent[k])  # q, summed in fp32 (Gossip's complete)
                crossing.append(
                    [dist.all_reduce(self.total[k], group=self.cross_group, async_op=True)]
                )
                g.bytes_sent += round(
                    2 * (self.host_count - 1) / self.host_count * self.total[k].nbytes
                )
                continue
            # local rank j of each host
            peer = [hosts[h][self.local] for h in range(self.host_count)]
            ops = [
                dist.P2POp(dist.irecv, buf[k], peer[h], group=self.p2p_group)
                for buf, (h, _) in zip(self.received, ex.recv_from)
            ]
            ops += [
                dist.P2POp(dist.isend, self.sent[k], peer[h], group=self.p2p_group)
                for h in ex.send_to
            ]
            crossing.append(dist.batch_isend_irecv(ops))
            g.bytes_sent += self.sent[k].nbytes * len(ex.send_to)
        gathered = []
        for k, works in enumerate(crossing):
            for work in works:
                work.wait()
            y, q = self.slices[k], self.sent[k].float()
            if complete:
                total = self.total[k].div_(self.host_count)
                y.add_(total - q) if g.lossy else y.copy_(total)
            else:
                if g.lossy:
                    y.add_(q, alpha=ex.self_weight - 1)
                else:
                    y.mul_(ex.self_weight)
                for buf, (_, weight) in zip(self.received, ex.recv_from):
                    y.add_(buf[k].float(), alpha=weight)
            gathered.append(
                dist.all_gather_into_tensor(self.mixed[k], y, group=self.local_group, async_op=True)
            )
        for work in gathered:
            work.wait()

"""Gossip: the mixing matrices of every topology, and what gossip.py does with them, twice over. In
one process, ranks as threads with a small stand-in for torch.distributed (the calls gossip.py
makes: all_reduce, all_gather, batched isend/irecv): each step applies W_t and counts its bytes, the
quadratic's rate, buffers, clipping and misuse. Then real exchanges between 4 and 3 ranks over gloo
(tests/gossip_ranks.py under mpiexec), checked the same way: each step applies exactly W_t, complete
gives the network average, and ring and exp drive replicas of a quadratic toy problem to consensus
at the rate the spectrum of W predicts."""

import queue
import threading
import types

import gossip_ranks
import pytest
import torch

from minimal_fsdp.parallel import gossip
from minimal_fsdp.parallel.gossip import (
    TOPOLOGIES,
    Gossip,
    exchange_for,
    exp_distances,
    mixing_matrix,
)

from support import check_mixing, check_quadratic, period, predicted_rate, run_gossip_ranks


@pytest.mark.parametrize("world", range(1, 10))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_mixing_is_doubly_stochastic_and_sends_match_receives(topology, world):
    for step in range(2 * period(topology, world)):
        w = mixing_matrix(topology, world, step)
        assert (w >= 0).all()
        ones = torch.ones(world, dtype=torch.float64)
        torch.testing.assert_close(w.sum(dim=1), ones)  # a weighted average on every rank
        torch.testing.assert_close(w.sum(dim=0), ones)  # ... that keeps the network average
        for rank in range(world):
            sends = set(exchange_for(topology, rank, world, step).send_to)
            receivers = {
                j
                for j in range(world)
                if rank in [peer for peer, _ in exchange_for(topology, j, world, step).recv_from]
            }
            assert sends == receivers, (step, rank)  # every message posted has a matching receive


def test_topology_shapes():
    assert exp_distances(4) == [1, 2] and exp_distances(5) == [1, 2, 4] and exp_distances(1) == []
    ring = exchange_for("ring", 0, 6, 0)
    assert set(ring.send_to) == {1, 5} and ring.self_weight == pytest.approx(1 / 3)
    assert [exchange_for("exp", 0, 6, s).send_to for s in range(4)] == [(1,), (2,), (4,), (1,)]
    alternating = [exchange_for("alternating-exp-ring", 0, 8, s).send_to for s in range(6)]
    assert alternating == [(1,), (7, 1), (2,), (7, 1), (4,), (7, 1)]
    with pytest.raises(ValueError, match="unknown topology"):
        exchange_for("star", 0, 4, 0)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_exp_averages_exactly_in_log2_world_steps(world):
    product = torch.eye(world, dtype=torch.float64)
    for step in range(len(exp_distances(world))):
        product = mixing_matrix("exp", world, step) @ product
    torch.testing.assert_close(product, torch.full((world, world), 1 / world, dtype=torch.float64))


@pytest.mark.parametrize("world", [3, 5, 8, 12])
def test_ring_spectrum(world):
    j = torch.arange(world, dtype=torch.float64)
    expected = (1 + 2 * torch.cos(2 * torch.pi * j / world)) / 3
    eigenvalues = torch.linalg.eigvalsh(mixing_matrix("ring", world, 0))
    torch.testing.assert_close(eigenvalues, expected.sort().values)


# a launch each: the quick tier runs 4 ranks; 3 (an odd world) only with --full
@pytest.fixture(
    scope="module", params=[4, pytest.param(3, marks=pytest.mark.slow)], ids=["4 ranks", "3 ranks"]
)
def ranks_result(request, tmp_path_factory):
    return run_gossip_ranks(request.param, tmp_path_factory.mktemp("gossip") / "result.json")


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_each_gossip_step_applies_its_mixing_matrix(ranks_result, topology):
    check_mixing(ranks_result, topology)


@pytest.mark.parametrize("topology", ["ring", "exp"])
def test_quadratic_reaches_consensus_at_the_predicted_rate(ranks_result, topology):
    check_quadratic(ranks_result, topology)


def test_exp_without_gradient_steps_is_exact_averaging_for_powers_of_two(ranks_result):
    world = ranks_result["world"]
    distances = ranks_result["exp_no_lr"]
    steps = len(exp_distances(world))
    if world & (world - 1) == 0:
        assert distances[steps] < 1e-20 * distances[0]  # consensus after log2(world) steps
    else:
        rate, p = predicted_rate("exp", world, 0.0)
        assert distances[p] / distances[0] <= rate ** (2 * p) * (1 + 1e-9)
        # not exact: the one-peer graph needs 2^k ranks for that
        assert distances[p] > 1e-3 * distances[0]


WAIT = 10  # seconds: a mismatched exchange fails instead of hanging


class Done:
    def wait(self):
        pass


class Receive:
    def __init__(self, box, tensor):
        self.box, self.tensor = box, tensor

    def wait(self):
        self.tensor.copy_(self.box.get(timeout=WAIT))


class ThreadWorld:
    """torch.distributed as seen by `world` threads, thread i being rank i (only what gossip uses).
    Groups are numbered by creation, as every rank makes them in one order; a thread a rank starts
    is that rank's too."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, world):
        self.world, self.local = world, threading.local()
        self.lock = threading.Lock()
        self.groups = {}  # key -> (barrier, slots)
        self.made = [0] * world  # groups each rank has made
        self.boxes = {}
        self.default = ("world", tuple(range(world)))
        fake = self

        class RankThread(threading.Thread):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.rank = fake.local.rank

            def run(self):
                fake.local.rank = self.rank
                super().run()

        self.threading = types.SimpleNamespace(Thread=RankThread)

    def get_rank(self):
        return self.local.rank

    def get_world_size(self):
        return self.world

    def new_group(self, ranks):
        with self.lock:
            self.made[self.local.rank] += 1
            return (self.made[self.local.rank], tuple(ranks))

    def _state(self, group):
        with self.lock:
            if group not in self.groups:
                self.groups[group] = (threading.Barrier(len(group[1]), timeout=WAIT), {})
            return self.groups[group]

    def _everyone(self, value, group=None):
        """Every rank's value (a tensor, cloned), in the group's order, once all have posted
        theirs."""
        group = group or self.default
        barrier, slots = self._state(group)
        slots[self.local.rank] = value.clone() if isinstance(value, torch.Tensor) else value
        barrier.wait()
        values = [slots[r] for r in group[1]]
        barrier.wait()
        return values

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
        assert op == self.ReduceOp.SUM, op  # the only one gossip uses
        tensor.copy_(torch.stack(self._everyone(tensor, group)).sum(0))
        return Done() if async_op else None

    def reduce_scatter_tensor(self, out, tensor, group=None, async_op=False):
        total = torch.stack(self._everyone(tensor, group)).sum(0)
        out.copy_(
            total.view(len((group or self.default)[1]), -1)[
                (group or self.default)[1].index(self.get_rank())
            ]
        )
        return Done() if async_op else None

    def all_gather_into_tensor(self, out, tensor, group=None, async_op=False):
        out.copy_(torch.cat(self._everyone(tensor, group)))
        return Done() if async_op else None

    def all_gather(self, out, tensor):
        for o, t in zip(out, self._everyone(tensor)):
            o.copy_(t)

    def all_gather_object(self, out, obj):
        out[:] = self._everyone(obj)

    def _box(self, group, src, dst):
        with self.lock:
            return self.boxes.setdefault((group or self.default, src, dst), queue.Queue())

    def isend(self, tensor, peer, group=None):
        self._box(group, self.local.rank, peer).put(tensor.clone())
        return Done()

    def irecv(self, tensor, peer, group=None):
        return Receive(self._box(group, peer, self.local.rank), tensor)

    class P2POp:
        def __init__(self, op, tensor, peer, group=None):
            self.op, self.tensor, self.peer, self.group = op, tensor, peer, group

    def batch_isend_irecv(self, ops):
        return [op.op(op.tensor, op.peer, op.group) for op in ops]

    def run(self, fn):
        """fn(rank) on every rank, each in its own thread; their results in rank order."""
        results, errors = [None] * self.world, []

        def rank_main(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: B036 (reported below, in the test's thread)
                errors.append(e)
                for barrier, _ in list(self.groups.values()):
                    barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def world(monkeypatch):
    def make(n):
        fake = ThreadWorld(n)
        monkeypatch.setattr(gossip, "dist", fake)
        monkeypatch.setattr(gossip, "threading", fake.threading)
        monkeypatch.setattr(gossip_ranks, "dist", fake)
        return fake

    return make


@pytest.mark.parametrize("ranks", [4, 3, 2])
def test_each_step_applies_its_mixing_matrix_and_counts_its_bytes(world, ranks):
    fake = world(ranks)
    mixing = {
        t: fake.run(lambda rank: gossip_ranks.mixing_steps(t, rank, "cpu"))[0] for t in TOPOLOGIES
    }
    for topology in TOPOLOGIES:
        check_mixing({"world": ranks, "mixing": mixing}, topology)


@pytest.mark.parametrize("ranks", [4, 3])
def test_quadratic_in_threads_reaches_consensus_at_the_predicted_rate(world, ranks):
    fake = world(ranks)
    result = {
        "world": ranks,
        "lr": gossip_ranks.LR,
        "quadratic": {
            t: fake.run(lambda rank: gossip_ranks.quadratic(t, rank, gossip_ranks.LR, 12, "cpu"))[0]
            for t in ("ring", "exp")
        },
    }
    for topology in ("ring", "exp"):
        check_quadratic(result, topology)


def test_one_buffer_per_incoming_message_reused_across_steps(world):
    fake = world(4)

    def steps(rank):
        g = Gossip(gossip_ranks.Replica(seed=rank), "alternating-exp-ring")
        counts = []
        for step in range(4):  # exp (1 message in), ring (2 in), exp, ring
            g.start(step)
            g.finish()
            counts.append(len(g.received))
        return counts, g.received

    for counts, buffers in fake.run(steps):
        assert counts == [1, 2, 2, 2] and all(b.shape == buffers[0].shape for b in buffers)


def test_receives_are_posted_before_sends(world, monkeypatch):
    """On gloo, an exchange posted sends-first moved at half a shaped link's rate in about half the
    tries, and receives-first at its rate every time (docs/performance.md): every step posts its
    receives first."""
    fake = world(4)
    posted = []
    batch = fake.batch_isend_irecv
    monkeypatch.setattr(
        fake, "batch_isend_irecv", lambda ops: posted.append([op.op for op in ops]) or batch(ops)
    )

    def steps(rank):
        g = Gossip(gossip_ranks.Replica(seed=rank), "alternating-exp-ring")
        for step in range(4):  # exp (one message each way), ring (two)
            g.start(step)
            g.finish()

    fake.run(steps)
    assert len(posted) == 16 and {len(ops) for ops in posted} == {2, 4}
    for ops in posted:
        # every irecv before any isend
        assert ops == sorted(ops, key=lambda op: op != fake.irecv), ops


def test_clip_grad_norm_clips_this_replica_and_returns_the_mean_norm(world):
    fake = world(2)

    def clip(rank, max_norm):
        model = gossip_ranks.Replica(seed=rank, dtype=torch.float64)
        g = Gossip(model, "ring")
        for p in model.parameters():
            # 17 elements: norm 3 * (rank + 1) * sqrt(17)
            p.grad = torch.full_like(p, 3.0 * (rank + 1))
        norm = g.clip_grad_norm(model.parameters(), max_norm)
        return norm.item(), torch.cat(
            [p.grad.reshape(-1) for p in model.parameters()]
        ).norm().item()

    own = [3 * 17**0.5, 6 * 17**0.5]
    for norm, after in fake.run(lambda rank: clip(rank, 1.0)):
        assert norm == pytest.approx(sum(own) / 2) and after == pytest.approx(1.0)
    for max_norm in (None, 0.0):  # no --grad_clip: gradients untouched
        results = fake.run(lambda rank: clip(rank, max_norm))
        assert [after for _, after in results] == pytest.approx(own)
        assert [norm for norm, _ in results] == pytest.approx([sum(own) / 2] * 2)


def test_a_nonfinite_grad_norm_on_one_replica_reaches_every_rank(world):
    fake = world(3)

    def clip(rank):
        model = gossip_ranks.Replica(seed=rank)
        g = Gossip(model, "exp")
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan") if rank == 1 else 1.0)
        return g.clip_grad_norm(model.parameters(), 1.0).item()

    # NaN everywhere: every rank skips or stops together
    assert all(norm != norm for norm in fake.run(clip))


def test_one_rank_gossip_leaves_parameters_alone(world):
    fake = world(1)

    def steps(rank):
        model = gossip_ranks.Replica(seed=3)
        before = model.vector().clone()
        g = Gossip(model, "complete")
        for step in range(3):
            g.start(step)
            g.finish()
        return before, model.vector(), g.bytes_sent, g.consensus_distance()

    ((before, after, sent, distance),) = fake.run(steps)
    assert torch.equal(before, after) and sent == 0 and distance == 0.0


def test_parameters_become_views_of_one_flat_buffer(world):
    fake = world(1)

    def build(rank):
        model = gossip_ranks.Replica(seed=0)
        # three parameters: offsets add up
        model.scale = torch.nn.Parameter(torch.tensor([2.0, 3.0]))
        values = model.vector().clone()
        g = Gossip(model, "ring")
        assert torch.equal(g.flat, values)  # the same values, in parameter order
        g.flat.add_(1.0)
        return values, model.vector()

    ((values, through_model),) = fake.run(build)
    assert torch.equal(through_model, values + 1)


def test_misuse_is_refused(world):
    fake = world(1)

    def refuse(rank):
        with pytest.raises(
            ValueError,
            match="^unknown topology 'star'; choose from complete, ring, exp, "
            "alternating-exp-ring$",
        ):
            Gossip(gossip_ranks.Replica(seed=0), "star")
        mixed = gossip_ranks.Replica(seed=0)
        mixed.bias.data = mixed.bias.data.double()
        with pytest.raises(
            ValueError, match="^gossip needs every parameter on one device with one dtype$"
        ):
            Gossip(mixed, "ring")
        frozen = gossip_ranks.Replica(seed=0)
        frozen.bias.requires_grad_(False)
        assert Gossip(frozen, "ring").flat.numel() == 12  # only trained parameters travel
        g = Gossip(gossip_ranks.Replica(seed=0), "ring")
        g.start(0)
        with pytest.raises(AssertionError, match="^gossip start\\(\\) twice without finish\\(\\)$"):
            g.start(1)

    fake.run(refuse)
    with pytest.raises(
        ValueError,
        match="^unknown topology 'star'; choose from complete, ring, exp, alternating-exp-ring$",
    ):
        gossip.exchange_for("star", 0, 4, 0)


# Host-aware gossip: ranks of one machine told they are on several hosts (hosts=), every topology.
LAYOUTS = {
    "1x1": [(0,)],
    "1x2": [(0, 1)],
    "2x1": [(0,), (1,)],
    "2x2": [(0, 1), (2, 3)],
    "4x1": [(0,), (1,), (2,), (3,)],
    "4x2": [(0, 1), (2, 3), (4, 5), (6, 7)],
}
# twice bf16's unit roundoff (2^-9): q(x_j) - x_j and q(x_i) - x_i, relative
BF16_ROUNDING = 2.0**-8


def host_matrix(topology, layout, step):
    """W_t over ranks, written from gossip.py's docstring: the topology over hosts, each host's L
    replicas averaged (hosts of contiguous ranks); one host, or one rank a host: the topology over
    ranks."""
    hosts, per_host = len(layout), len(layout[0])
    if hosts == 1 or per_host == 1:
        return mixing_matrix(topology, hosts * per_host, step)
    return torch.kron(
        mixing_matrix(topology, hosts, step),
        torch.full((per_host, per_host), 1 / per_host, dtype=torch.float64),
    )


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_host_aware_gossip_applies_its_matrix_and_keeps_the_average(world, name, wire):
    layout = LAYOUTS[name]
    fake = world(sum(map(len, layout)))
    for topology in TOPOLOGIES:
        # bucket_mb so small that the 17 numbers travel as several buckets of 2 (padding the last)
        run = fake.run(
            lambda rank: gossip_ranks.mixing_steps(
                topology, rank, "cpu", getattr(torch, wire), layout, 1e-5
            )
        )[0]
        check_host_mixing(run, layout, topology, wire)


def check_host_mixing(run, layout, topology, wire):
    for step, record in enumerate(run["steps"]):
        before = torch.tensor(record["before"], dtype=torch.float64)
        after = torch.tensor(record["after"], dtype=torch.float64)
        w = host_matrix(topology, layout, step)
        torch.testing.assert_close(gossip.rank_mixing_matrix(topology, layout, step), w)
        # the network average, to fp32 rounding, on either wire (complete sums in fp32: a bf16
        # all-reduce moved it by bf16's rounding)
        torch.testing.assert_close(after.mean(0), before.mean(0), atol=1e-6, rtol=1e-6)
        if wire == "float32":
            torch.testing.assert_close(after, w @ before, atol=1e-6, rtol=1e-6)
        else:  # each replica off the exact mix by no more than bf16's rounding of what travelled
            assert (after - w @ before).abs().max() <= BF16_ROUNDING * before.abs().max() + 1e-6, (
                topology,
                step,
            )
            if len(before) > 1:  # the rounding is there (one rank alone has nothing to send)
                assert not torch.equal(after, (w @ before).float().double())
        consensus = (after - after.mean(0)).square().sum(1).mean().item()
        assert record["consensus"] == pytest.approx(consensus, rel=1e-3, abs=1e-9)


def test_every_kth_step_is_a_complete_average_whatever_the_topology():
    assert [gossip.topology_at("exp", s, 3) for s in range(7)] == [
        "exp", "exp", "complete", "exp", "exp", "complete", "exp"
    ]  # fmt: skip
    assert {gossip.topology_at("ring", s, 0) for s in range(9)} == {"ring"}  # 0: never
    uniform = torch.full((5, 5), 1 / 5, dtype=torch.float64)
    assert torch.equal(mixing_matrix("exp", 5, 3, global_average_every=4), uniform)
    assert torch.equal(
        mixing_matrix("exp", 5, 2, global_average_every=4), mixing_matrix("exp", 5, 2)
    )


@pytest.mark.parametrize("topology", ["ring", "exp", "alternating-exp-ring"])
def test_global_average_every_brings_every_replica_to_the_average(world, topology):
    """--global_average_every 3 on 4 ranks: steps 2 and 5 are one all-reduce that leaves every
    replica at the network average (its bytes, an all-reduce's); the others mix by the topology."""
    fake = world(4)
    run = fake.run(
        lambda rank: gossip_ranks.mixing_steps(topology, rank, "cpu", global_average_every=3)
    )[0]
    nbytes = run["numel"] * 4
    expected_bytes = 0
    for step, record in enumerate(run["steps"]):
        before = torch.tensor(record["before"], dtype=torch.float64)
        after = torch.tensor(record["after"], dtype=torch.float64)
        w = mixing_matrix(topology, 4, step, global_average_every=3)
        torch.testing.assert_close(after, w @ before, atol=1e-6, rtol=1e-6)
        if step in (2, 5):
            torch.testing.assert_close(after, before.mean(0).expand_as(after), atol=1e-6, rtol=1e-6)
            assert record["consensus"] == pytest.approx(0.0, abs=1e-9)
            expected_bytes += round(2 * 3 / 4 * nbytes)
        else:
            # the first sparse step leaves the replicas apart (later ones may meet or stay met)
            assert step > 0 or record["consensus"] > 1e-6
            expected_bytes += nbytes * len(exchange_for(topology, 0, 4, step).send_to)
    assert run["bytes_sent"] == expected_bytes


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_host_aware_gossip_averages_all_hosts_every_kth_step(world, wire):
    layout = LAYOUTS["2x2"]
    fake = world(4)
    run = fake.run(
        lambda rank: gossip_ranks.mixing_steps(
            "exp", rank, "cpu", getattr(torch, wire), layout, 1e-5, global_average_every=2
        )
    )[0]
    for step, record in enumerate(run["steps"]):
        before = torch.tensor(record["before"], dtype=torch.float64)
        after = torch.tensor(record["after"], dtype=torch.float64)
        w = gossip.rank_mixing_matrix("exp", layout, step, global_average_every=2)
        if step % 2 == 1:
            torch.testing.assert_close(w, torch.full((4, 4), 0.25, dtype=torch.float64))
        tolerance = 1e-6 + (BF16_ROUNDING * before.abs().max() if wire == "bfloat16" else 0)
        assert (after - w @ before).abs().max() <= tolerance, step


@pytest.mark.parametrize("name", ["2x2", "4x2"])
def test_one_replica_crosses_a_host_pair_per_step_not_one_per_rank(world, name):
    """Each local rank carries its half of the host's mean (17 numbers: 9 each, one padded) across,
    so a host's two ranks together send one replica to each peer host a step; flat gossip sent
    two."""
    layout = LAYOUTS[name]
    fake = world(sum(map(len, layout)))
    for topology, wire in (
        ("exp", torch.bfloat16),
        ("ring", torch.float32),
        ("complete", torch.bfloat16),
    ):
        runs = fake.run(
            lambda rank: gossip_ranks.mixing_steps(topology, rank, "cpu", wire, layout, 1e-5)
        )
        # complete sums in fp32 whatever the wire
        size = 4 if topology == "complete" else torch.finfo(wire).bits // 8
        hosts = len(layout)
        if topology == "complete":  # a ring all-reduce over the hosts of each local rank's half
            per_step = [round(2 * (hosts - 1) / hosts * size) * 9] * gossip_ranks.STEPS
        else:
            per_step = [
                len(exchange_for(topology, 0, hosts, s).send_to) * 9 * size
                for s in range(gossip_ranks.STEPS)
            ]
        assert [r["bytes_sent"] for r in runs] == [sum(per_step)] * len(runs), topology
        # the host's two ranks: one padded replica, where flat gossip sent two
        assert 2 * 9 < 2 * 17


def test_one_host_is_the_single_host_gossip_bit_for_bit(world):
    """Four ranks on one host, fp32 wire: x_i <- w_ii x_i + sum w_ij x_j in the order the receives
    are listed, as gossip did before it knew hosts; complete: the sum over ranks / 4."""
    fake = world(4)
    for topology in TOPOLOGIES:
        run = fake.run(
            lambda rank: gossip_ranks.mixing_steps(
                topology, rank, "cpu", torch.float32, [(0, 1, 2, 3)]
            )
        )[0]
        for step, record in enumerate(run["steps"]):
            before = torch.tensor(record["before"], dtype=torch.float32)
            for rank in range(4):
                ex = exchange_for(topology, rank, 4, step)
                if topology == "complete":
                    expected = torch.stack(list(before)).sum(0).div_(4)
                else:
                    expected = before[rank].clone().mul_(ex.self_weight)
                    for peer, weight in ex.recv_from:
                        expected.add_(before[peer], alpha=weight)
                assert torch.equal(
                    torch.tensor(record["after"][rank], dtype=torch.float32), expected
                )


def test_a_failed_exchange_across_hosts_is_raised_in_the_training_thread(world, monkeypatch):
    fake = world(4)

    def broken(*args, **kwargs):
        raise RuntimeError("link down")

    monkeypatch.setattr(fake, "reduce_scatter_tensor", broken)

    def step(rank):
        g = Gossip(gossip_ranks.Replica(seed=rank), "exp", hosts=LAYOUTS["2x2"])
        g.start(0)
        with pytest.raises(RuntimeError, match="^link down$"):
            g.finish()

    fake.run(step)


def test_host_aware_gossip_over_gloo(ranks_result):
    """Four real ranks told they are two hosts of two: gloo's groups, the exchange's own thread,
    both wires."""
    if ranks_result["world"] != 4:
        pytest.skip("two hosts of two ranks: the 4-rank launch")
    assert len(ranks_result["hosts"]) == 2 * len(TOPOLOGIES)
    for key, run in ranks_result["hosts"].items():
        topology, wire = key.split()
        check_host_mixing(run, LAYOUTS["2x2"], topology, wire)

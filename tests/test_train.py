"""train.py's parts in one process, without a launch: the run's length and what the startup line
says about it, the schedule at its boundaries, the optimizer's groups and betas, one optimizer
step's calls into the gradient sync, evaluation, and the NaN/Inf guard's verdicts and messages. The
loop as a whole: test_run.py (in process) and test_resume.py, test_schedule.py."""

import gc
import math
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.config.sections import LrSchedule, Optimizer
from minimal_fsdp.parallel.accum_adamw import AccumAdamW
from minimal_fsdp.parallel.clipped_adamw import ClippedAdamW
from minimal_fsdp.run import RunSections
from minimal_fsdp.train import (
    Diverged,
    NonFiniteGuard,
    RunParts,
    Schedule,
    _to_device,
    build_optimizer,
    evaluate,
    run_length,
    train,
    train_step,
)


def cfg(*flags):
    return parse_args([str(f) for f in flags])


def schedule(*flags):
    return LrSchedule.of(cfg(*flags))


def optimizer(*flags):
    return Optimizer.of(cfg(*flags))


def test_run_length_of_a_stream_is_max_steps():
    assert run_length(schedule("--max_steps", 7), None) == (
        7,
        "7 steps (--max_steps; a stream has no epochs)",
    )


def test_run_length_max_steps_alone_or_first():
    assert run_length(schedule("--max_steps", 12), 5) == (
        12,
        "12 steps = 2.4 epochs of 5 steps (--max_steps)",
    )
    assert run_length(schedule("--max_steps", 5), 5) == (
        5,
        "5 steps = 1 epoch of 5 steps (--max_steps)",
    )
    assert run_length(schedule("--max_steps", 7, "--max_epochs", 2), 5) == (
        7,
        "7 steps = 1.4 epochs of 5 steps (--max_steps)",
    )
    assert (
        run_length(schedule("--max_steps", 1000, "--max_epochs", 1), 3)[1]
        == "3 steps = 1 epoch of 3 steps (--max_epochs)"
    )
    assert run_length(schedule("--max_steps", 2, "--max_epochs", 1), 3000)[1] == (
        "2 steps = 0.000667 epochs of 3000 steps (--max_steps)"
    )  # three significant digits


def test_run_length_max_epochs_alone_or_first():
    assert run_length(schedule("--max_steps", 0, "--max_epochs", 2), 5) == (
        10,
        "10 steps = 2 epochs of 5 steps (--max_epochs)",
    )
    assert run_length(schedule("--max_steps", 30, "--max_epochs", 2), 5)[0] == 10
    assert run_length(schedule("--max_steps", 10, "--max_epochs", 2), 5) == (
        10,
        "10 steps = 2 epochs of 5 steps (--max_epochs)",
    )


def test_schedule_for_a_new_run_spans_the_run():
    s = Schedule.for_run(schedule("--max_steps", 20, "--lr", 0.01, "--warmup_steps", 3), 5)
    assert (s.peak_lr, s.min_lr, s.warmup_steps, s.decay_steps, s.last_step) == (
        0.01,
        0.001,
        3,
        20,
        20,
    )
    assert s.length == "20 steps = 4 epochs of 5 steps (--max_steps)"
    assert s.state_dict() == {"lr_decay_steps": 20, "last_step": 20}
    assert Schedule.for_run(schedule("--max_steps", 20, "--min_lr", 0), 5).min_lr == 0.0


def test_schedule_of_a_resumed_run_keeps_its_horizon_unless_told():
    resumed = Schedule.for_run(
        schedule("--max_steps", 30), 5, saved={"lr_decay_steps": 20, "last_step": 20}
    )
    assert (resumed.decay_steps, resumed.last_step) == (20, 30)
    assert resumed.length == (
        "30 steps = 6 epochs of 5 steps (--max_steps); the LR schedule spans 20 steps, as when "
        "the run began (--lr_decay_steps changes it)"
    )
    told = Schedule.for_run(
        schedule("--max_steps", 30, "--lr_decay_steps", 25), 5, saved={"lr_decay_steps": 20}
    )
    assert told.decay_steps == 25 and told.length == "30 steps = 6 epochs of 5 steps (--max_steps)"
    same = Schedule.for_run(schedule("--max_steps", 20), 5, saved={"lr_decay_steps": 20})
    assert same.length == "20 steps = 4 epochs of 5 steps (--max_steps)"
    assert Schedule.for_run(schedule("--max_steps", 30), 5, saved={}).decay_steps == 30


def test_lr_at_the_schedules_boundaries():
    s = Schedule(peak_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=12, last_step=16, length="")
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == 1.0  # the cosine starts at the peak
    assert s.lr_at(8) == pytest.approx(0.55)  # halfway
    # flat past the horizon
    assert s.lr_at(12) == pytest.approx(0.1) and s.lr_at(15) == pytest.approx(0.1)
    no_warmup = Schedule(
        peak_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=2, last_step=2, length=""
    )
    assert [no_warmup.lr_at(i) for i in range(3)] == pytest.approx([1.0, 0.5, 0.0])
    # decay as long as warmup: no division by zero; the peak once more, then min_lr
    short = Schedule(peak_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=2, last_step=5, length="")
    assert [short.lr_at(i) for i in range(5)] == pytest.approx([0.5, 1.0, 1.0, 0.1, 0.1])
    one = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=1, decay_steps=3, last_step=3, length="")
    assert [one.lr_at(i) for i in range(4)] == pytest.approx([1.0, 1.0, 0.5, 0.0])


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 3))
        self.norm = torch.nn.Parameter(torch.ones(3))
        self.frozen = torch.nn.Parameter(torch.ones(3, 3), requires_grad=False)
        self.calls = []

    def forward(self, x, y):
        self.calls.append(("forward", self.training))
        return ((x @ self.weight.T).sum(1) * self.norm.sum() - y).square().mean()


def test_optimizer_decays_matrices_only_with_the_betas_asked_for():
    model = Model()
    opt = build_optimizer(model, optimizer("--lr", 0.02, "--weight_decay", 0.3))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert opt.defaults["lr"] == 0.02 and opt.defaults["betas"] == (0.9, 0.95)
    (decayed,), (plain,) = [g["params"] for g in opt.param_groups]
    assert decayed is model.weight and plain is model.norm  # the frozen matrix is left out
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert build_optimizer(model, optimizer("--beta1", 0.8, "--beta2", 0.99)).defaults["betas"] == (
        0.8,
        0.99,
    )


def test_the_plans_one_unit_gets_adamw_on_local_tensors_and_nothing_else_does():
    """The choice reads the plan's strategy, never the model's attributes; the same groups and
    settings either way."""
    from minimal_fsdp.parallel.plan import STRATEGIES
    from minimal_fsdp.parallel.whole_unit import LocalAdamW

    model = Model()
    unit = build_optimizer(
        model,
        optimizer("--lr", 0.02),
        SimpleNamespace(strategy="one-unit", fused_optimizer=True, compiled_optimizer=False),
    )
    assert (
        type(unit) is LocalAdamW and unit.defaults["fused"] is True and unit.defaults["lr"] == 0.02
    )
    for strategy in set(STRATEGIES) - {"one-unit", "gossip"}:
        plan = SimpleNamespace(strategy=strategy, fused_optimizer=True, compiled_optimizer=False)
        assert type(build_optimizer(model, optimizer(), plan)) is torch.optim.AdamW
    plan.compiled_optimizer = True  # the plan's word (test_plan.py), not the strategy's
    compiled = build_optimizer(model, optimizer("--lr", 0.02), plan)
    assert type(compiled) is ClippedAdamW and compiled.defaults["lr"] == 0.02
    model.whole_unit = object()
    assert type(build_optimizer(model, optimizer())) is torch.optim.AdamW


def test_decentralized_runs_get_accum_adamw_with_beta2_098():
    model = Model()
    opt = build_optimizer(
        model,
        optimizer(
            "--data_parallel",
            "decentralized",
            "--lr",
            0.02,
            "--accum_steps",
            3,
            "--weight_decay",
            0.3,
        ),
    )
    assert type(opt) is AccumAdamW
    assert (
        opt.defaults["betas"] == (0.9, 0.98)
        and opt.defaults["lr"] == 0.02
        and opt.defaults["accum_steps"] == 3
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    explicit = build_optimizer(model, optimizer("--data_parallel", "decentralized", "--beta2", 0.9))
    assert explicit.defaults["betas"] == (0.9, 0.9)


class Sync:
    """Records train_step's calls into the gradient sync; clips nothing, returns `norm`."""

    def __init__(self, norm=1.0):
        self.calls, self.norm = [], norm

    def start(self, step):
        self.calls.append(("start", step))

    def micro_step(self, last):
        self.calls.append(("micro_step", last))

    def finish(self):
        self.calls.append(("finish",))

    def clip_grad_norm(self, parameters, max_norm):
        self.calls.append(("clip", [p.shape for p in parameters], max_norm))
        return torch.tensor(self.norm)

    def after_step(self):
        self.calls.append(("after_step",))

    def consensus_distance(self):
        return 0.25


def micro_batches(n):
    return [(torch.full((2, 3), float(i + 1)), torch.zeros(2)) for i in range(n)]


def test_train_step_accumulates_micro_batches_then_steps_once():
    model, sync = Model(), Sync()
    opt = torch.optim.SGD([model.weight, model.norm], lr=0.0)
    batches = micro_batches(3)
    loss, norm = train_step(model, opt, batches, sync, 0.5, torch.device("cpu"), step=7)
    expected = sum(model(x, y).item() for x, y in batches) / 3
    assert loss.item() == pytest.approx(expected) and not loss.requires_grad and norm.item() == 1.0
    assert sync.calls == [
        ("start", 7),
        ("micro_step", False),
        ("micro_step", False),
        ("micro_step", True),
        ("finish",),
        ("clip", [(2, 3), (3,), (3, 3)], 0.5),
        ("after_step",),
    ]
    assert model.weight.grad is None and model.norm.grad is None  # zeroed by dropping them


def test_train_step_leaves_the_clip_to_clipped_adamw():
    """With ClippedAdamW the sync only measures the norm (max_norm 0) and the step clips: the same
    updates as AdamW on gradients clipped to 0.5, with norms 2 then 0.1 (factors 0.25, then 1:
    Adam is blind to one scale for every step, not to a changing one)."""
    model, reference, unclipped, sync = Model(), Model(), Model(), Sync()
    opt = ClippedAdamW([model.weight, model.norm], compile=False, lr=0.1)
    ref_opt = torch.optim.AdamW([reference.weight, reference.norm], lr=0.1)
    plain_opt = torch.optim.AdamW([unclipped.weight, unclipped.norm], lr=0.1)
    for norm, batches in ((2.0, micro_batches(1)), (0.1, micro_batches(2)[1:])):
        sync.norm = norm
        train_step(model, opt, batches, sync, 0.5, torch.device("cpu"))
        for m, o, factor in (
            (reference, ref_opt, min(1, 0.5 / (norm + 1e-6))),
            (unclipped, plain_opt, 1),
        ):
            m(*batches[0]).backward()
            for p in (m.weight, m.norm):
                p.grad.mul_(factor)
            o.step()
            o.zero_grad()
    assert sync.calls.count(("clip", [(2, 3), (3,), (3, 3)], 0)) == 2
    torch.testing.assert_close(model.weight, reference.weight)
    torch.testing.assert_close(model.norm, reference.norm)
    assert not torch.allclose(model.weight, unclipped.weight)


def test_train_step_gradient_is_the_mean_over_micro_batches():
    seen = {}

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen["grad"] = self.param_groups[0]["params"][0].grad.clone()
            return super().step(closure)

    model = Model()
    batches = micro_batches(2)
    sync = Sync()
    train_step(model, Spy([model.weight], lr=0.1), batches, sync, None, torch.device("cpu"))
    assert sync.calls[0] == ("start", 0)  # step defaults to 0
    reference = Model()
    (sum(reference(x, y) for x, y in batches) / 2).backward()
    torch.testing.assert_close(seen["grad"], reference.weight.grad)
    torch.testing.assert_close(
        model.weight.detach(), reference.weight.detach() - 0.1 * reference.weight.grad
    )


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_train_step_skips_a_nonfinite_update_only_when_asked(skip_nonfinite):
    model = Model()
    opt = torch.optim.SGD([model.weight], lr=0.1)
    before = model.weight.detach().clone()
    _, norm = train_step(
        model,
        opt,
        micro_batches(1),
        Sync(float("nan")),
        1.0,
        torch.device("cpu"),
        skip_nonfinite=skip_nonfinite,
    )
    assert math.isnan(norm.item())
    assert torch.equal(model.weight.detach(), before) == skip_nonfinite
    assert model.weight.grad is None
    train_step(
        model, opt, micro_batches(1), Sync(2.0), 1.0, torch.device("cpu"), skip_nonfinite=True
    )
    assert not torch.equal(model.weight.detach(), before)  # a finite step is applied either way


def test_train_step_applies_a_nonfinite_update_by_default():
    model = Model()
    before = model.weight.detach().clone()
    train_step(
        model,
        torch.optim.SGD([model.weight], lr=0.1),
        micro_batches(1),
        Sync(float("inf")),
        1.0,
        torch.device("cpu"),
    )
    assert not torch.equal(model.weight.detach(), before)


class HostTensor:
    """Duck-types what _to_device uses of a tensor: its device, contiguous(), pin_memory() and
    to()."""

    def __init__(self, device_type):
        self.device, self.calls = SimpleNamespace(type=device_type), []

    def contiguous(self):
        self.calls.append("contiguous")
        return self

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", device, non_blocking))
        return self


def test_to_device_pins_host_batches_and_copies_them_asynchronously():
    """Made contiguous before pinning: a strided host tensor goes to the GPU through a pageable
    temporary."""
    cuda = torch.device("cuda", 1)  # a device name only: no GPU is touched
    host, there = HostTensor("cpu"), HostTensor("cuda")
    assert _to_device([host, there], cuda) == [host, there]
    assert host.calls == ["contiguous", "pin_memory", ("to", cuda, True)] and there.calls == []
    cpu_batch = [HostTensor("cpu")]
    assert _to_device(cpu_batch, torch.device("cpu")) is cpu_batch and cpu_batch[0].calls == []


def test_evaluate_is_the_mean_of_the_first_batches_in_eval_mode(one_rank_group):
    class Data:
        def val_batch(self, i):
            return micro_batches(i + 1)[i]

    model = Model()
    model.train()
    loss = evaluate(model, Data(), 3, torch.device("cpu"))
    expected = sum(model(*micro_batches(3)[i]).item() for i in range(3)) / 3
    assert loss == pytest.approx(expected)
    assert model.calls[:3] == [("forward", False)] * 3 and model.training
    assert isinstance(loss, float)


class Log:
    """Stands in for metrics.TrainingLog: records what the loop reports, in order."""

    @classmethod
    def open(cls, logging, flags, env, model, schedule, first, tokens_per_step, synchronize):
        return cls(logging, env, model, schedule, first, tokens_per_step)

    def __init__(self, logging, env, model, schedule, first, tokens_per_step):
        self.schedule, self.first, self.tokens_per_step, self.events = (
            schedule,
            first,
            tokens_per_step,
            [],
        )
        Log.made = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.events.append(("exit",))

    def warn(self, text):
        self.events.append(("warn", text))

    def step(self, loss):
        self.events.append(("step", None if loss is None else round(float(loss), 6)))

    def row(self, step, lr, grad_norm, **extra):
        self.events.append(("row", step, lr, float(grad_norm), extra))

    @contextmanager
    def paused(self):
        self.events.append(("paused",))
        yield
        self.events.append(("resumed",))

    def validation(self, step, val_loss):
        self.events.append(("validation", step, val_loss))

    def consensus(self, step, distance):
        self.events.append(("consensus", step, distance))

    def saved(self, saves):
        self.events.extend(("saved", path) for path in saves)

    def restored(self, step, seconds):
        pass

    def stopped(self, step, reason):
        self.events.append(("stopped", step, reason))


class Data:
    """5 steps per epoch; step s's one micro-batch holds the value s + 1."""

    def steps_per_epoch(self):
        return 5

    def train_batches(self, step):
        return [(torch.full((2, 3), step + 1.0), torch.zeros(2))]

    def val_batch(self, i):
        return torch.full((2, 3), 0.5 * (i + 1)), torch.zeros(2)

    def state_dict(self, step):
        return {"at": step}


class Checkpointer:
    """Synchronous saves: each is reported once, when made; nothing is ever in flight."""

    restore_s = None

    def __init__(self):
        self.saves, self.unreported = [], []

    def save(self, step, model, optimizer, val_loss, state):
        self.saves.append((step, val_loss, state))
        self.unreported.append(f"step_{step}")
        return f"step_{step}"

    def saving(self):
        return nullcontext(self)

    def poll(self):
        pass

    def wait(self):
        pass

    def reports(self):
        reports, self.unreported = self.unreported, []
        return reports


def steps_so_far():
    """Steps the loop has reported to the Log stand-in in this run."""
    return sum(e[0] == "step" for e in Log.made.events)


class Stop:
    """agreed() answers `reason` from the call at step `at` on; records the steps it was asked
    at."""

    def __init__(self, at=None, reason="SIGTERM received"):
        self.at, self.reason, self.asked = at, reason, []

    def agreed(self, step=None):
        step = steps_so_far()
        self.asked.append(step)
        return self.reason if self.at is not None and step >= self.at else None

    # the real one's time-bounded looks: none here, only where the loop syncs anyway
    def due(self, step):
        return False


class LrSpy(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.lrs = []
        LrSpy.made = self

    def step(self, closure=None):
        self.lrs.append([g["lr"] for g in self.param_groups])
        return super().step(closure)


class LoopModel(Model):
    config = SimpleNamespace(seq_length=8)


COLLECT = gc.collect


def loop(
    monkeypatch,
    *flags,
    saved=None,
    sync="stand-in",
    norms=(),
    ranks=None,
    stop=None,
    is_main=True,
    decentralized=False,
):
    """train.train for 6 steps (unless flags say otherwise) with stand-ins for everything around the
    loop."""
    monkeypatch.setattr("minimal_fsdp.train.TrainingLog", Log)
    monkeypatch.setattr("minimal_fsdp.train.mean_across_ranks", float)
    if gc.collect is COLLECT:
        # the loop's full collections take 0.15 s each with a whole test session's objects alive
        # (most of this file's time); when it collects is tested with a collect of its own below
        monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    options = cfg(
        "--max_steps",
        6,
        "--lr",
        0.01,
        "--warmup_steps",
        2,
        "--log_interval",
        2,
        "--checkpoint_interval",
        3,
        "--eval_interval",
        4,
        "--eval_batches",
        2,
        "--grad_clip",
        0.7,
        "--batch_size",
        4,
        *flags,
    )
    model = LoopModel()
    # every group gets the rate
    optimizer = LrSpy([{"params": [model.weight]}, {"params": [model.norm]}])
    if sync == "stand-in":
        sync = Sync()
    if norms:  # the grad norm of each step, in order
        values = iter(norms)
        sync.clip_grad_norm = lambda parameters, max_norm: torch.tensor(next(values))
    env = SimpleNamespace(world_size=2, is_main=is_main, device=torch.device("cpu"), rank=0)
    plan = SimpleNamespace(decentralized=decentralized, fsdp=False)
    checkpointer, stop = Checkpointer(), stop or Stop()
    parts = RunParts(model, optimizer, Data(), sync, checkpointer, ranks or env.world_size)
    result = train(parts, env, plan, stop, saved=saved, **RunSections.of(options).for_loop())
    return SimpleNamespace(
        result=result,
        log=Log.made,
        optimizer=optimizer,
        saves=checkpointer.saves,
        sync=sync,
        stop=stop,
        model=model,
    )


def val_loss(model):
    return sum(model(*Data().val_batch(i)).item() for i in range(2)) / 2


def kinds(events):
    return [
        e[0] if e[0] not in ("row", "validation", "stopped", "saved") else e[:2] for e in events
    ]


def test_loop_logs_evaluates_and_saves_at_their_intervals_and_the_end(monkeypatch):
    run = loop(monkeypatch)
    assert run.result == (6, run.log)
    assert kinds(run.log.events) == [
        "step",
        "step",
        ("row", 2),
        "step",
        "paused",
        ("validation", 3),
        ("saved", "step_3"),
        "resumed",
        "step",
        ("row", 4),
        "paused",
        ("validation", 4),
        "resumed",
        "step",
        "step",
        ("row", 6),
        "paused",
        ("validation", 6),
        ("saved", "step_6"),
        "resumed",
        "exit",
    ]
    schedule = run.log.schedule
    assert [lrs for lrs in run.optimizer.lrs] == [[schedule.lr_at(s)] * 2 for s in range(6)]
    rows = [e for e in run.log.events if e[0] == "row"]
    assert [(step, lr, norm, extra) for _, step, lr, norm, extra in rows] == [
        (s, schedule.lr_at(s - 1), 1.0, {}) for s in (2, 4, 6)
    ]
    assert [step for step, _, _ in run.saves] == [3, 6]
    assert [state for _, _, state in run.saves] == [
        {"schedule": {"lr_decay_steps": 6, "last_step": 6}, "data": {"at": s}} for s in (3, 6)
    ]
    for _, loss, _ in run.saves:  # the checkpoint records the validation loss just measured
        assert isinstance(loss, float)
    assert [e[2] for e in run.log.events if e[0] == "validation"][-1] == pytest.approx(
        val_loss(run.model)
    )
    assert run.stop.asked == [2, 3, 4, 6]  # only where the loop syncs anyway
    starts = [c for c in run.sync.calls if c[0] == "start"]
    assert starts == [("start", s) for s in range(6)]
    assert {c[2] for c in run.sync.calls if c[0] == "clip"} == {0.7}
    assert run.log.tokens_per_step == 2 * 4 * 1 * 8  # ranks x batch x accumulation x sequence


def test_loop_counts_tokens_of_every_rank_and_micro_batch(monkeypatch):
    assert loop(monkeypatch, "--grad_accum_steps", 3).log.tokens_per_step == 2 * 4 * 3 * 8
    assert loop(monkeypatch, "--grad_accum_steps", 3, ranks=5).log.tokens_per_step == 5 * 4 * 3 * 8


def test_loop_stops_where_the_ranks_agree_and_saves_first(monkeypatch):
    run = loop(monkeypatch, stop=Stop(at=2))
    assert run.result == (2, run.log)
    assert kinds(run.log.events) == [
        "step",
        "step",
        ("row", 2),
        "paused",
        ("validation", 2),
        ("saved", "step_2"),
        "resumed",
        ("stopped", 2),
        "exit",
    ]
    assert ("validation", 2, None) in run.log.events  # not an evaluation step: nothing measured
    assert ("stopped", 2, "SIGTERM received") in run.log.events
    assert run.saves == [
        (2, None, {"schedule": {"lr_decay_steps": 6, "last_step": 6}, "data": {"at": 2}})
    ]
    assert len(run.optimizer.lrs) == 2


def test_loop_resumes_at_the_saved_step_on_the_saved_schedule(monkeypatch):
    saved = {"step": 3, "state": {"schedule": {"lr_decay_steps": 10, "last_step": 6}}}
    run = loop(monkeypatch, saved=saved)
    assert run.result == (6, run.log) and run.log.first == 3
    assert run.log.schedule.decay_steps == 10
    assert [c for c in run.sync.calls if c[0] == "start"] == [("start", s) for s in (3, 4, 5)]
    assert run.optimizer.lrs == [[run.log.schedule.lr_at(s)] * 2 for s in (3, 4, 5)]
    finished = loop(monkeypatch, saved=dict(saved, step=6))
    assert finished.result == (6, finished.log) and finished.optimizer.lrs == []


def test_loop_skips_a_nonfinite_step_with_a_warning_when_allowed(monkeypatch):
    nan = float("nan")
    run = loop(monkeypatch, "--skip_nonfinite", 1, norms=[1.0, nan, 1.0, 1.0, 1.0, 1.0])
    assert len(run.optimizer.lrs) == 5  # the NaN step's update is not applied
    steps = [e[1] for e in run.log.events if e[0] == "step"]
    assert steps[1] is None and None not in steps[:1] + steps[2:]
    assert (
        "warn",
        "warning: step 2: grad norm nan; update skipped (1 of --skip_nonfinite 1)",
    ) in run.log.events
    quiet = loop(
        monkeypatch, "--skip_nonfinite", 1, norms=[1.0, nan, 1.0, 1.0, 1.0, 1.0], is_main=False
    )
    assert not [e for e in quiet.log.events if e[0] == "warn"]  # only rank 0 prints
    with pytest.raises(Diverged, match="^step 4: the grad norm is inf"):
        loop(monkeypatch, "--skip_nonfinite", 1, norms=[1.0, nan, 1.0, math.inf, 1.0, 1.0])


def test_loop_stops_at_a_nonfinite_step_at_the_next_log_before_saving(monkeypatch):
    run_events = []
    with pytest.raises(Diverged, match=r"^step 1: the grad norm is nan \(loss [0-9.]+ on rank 0\)"):
        try:
            loop(monkeypatch, norms=[float("nan")] + [1.0] * 5)
        finally:
            run_events = Log.made.events
    assert kinds(run_events) == ["step", "step", "exit"]  # found at the step-2 log; nothing saved
    # --skip_nonfinite 0 never checks a step before its update (that would wait for the device
    # every step)
    assert len(LrSpy.made.lrs) == 2


def test_the_loop_logs_gossips_consensus_distance(monkeypatch):
    """A decentralized run logs its sync's consensus distance at the evaluation steps (3 and 6: the
    saves, 4: the --eval_interval), never in a logging row (two all-reduces of the replica: not on
    the hot path); another run never. (The sync is the backend's:
    tests/backends/test_backend.py.)"""
    run = loop(
        monkeypatch, "--data_parallel", "decentralized", "--topology", "ring", decentralized=True
    )
    assert [e[1:] for e in run.log.events if e[0] == "consensus"] == [
        (3, 0.25),
        (4, 0.25),
        (6, 0.25),
    ]
    assert [e[4] for e in run.log.events if e[0] == "row"] == [{}] * 3
    plain = loop(monkeypatch)
    assert not [e for e in plain.log.events if e[0] == "consensus"]


def test_loop_collects_garbage_itself_at_the_same_steps_on_every_rank(monkeypatch):
    """Automatic collection is off inside the loop (a full one on one rank stalls the others) and
    back on after; the loop collects everything after the first step and after each save, the young
    generations every GC_INTERVAL steps. (steps so far, generation, automatic collection on)."""
    collections = []

    def collect(generation=2):
        collections.append((steps_so_far(), generation, gc.isenabled()))

    monkeypatch.setattr("minimal_fsdp.train.GC_INTERVAL", 2)
    monkeypatch.setattr(gc, "collect", collect)
    assert gc.isenabled()
    loop(monkeypatch, "--max_steps", 7)
    assert gc.isenabled()
    # before the loop; after step 1; the young every 2; all after the saves at 3, 6
    # (--checkpoint_interval 3), 7
    assert collections == [
        (0, 2, True),
        (1, 2, False),
        (2, 1, False),
        (3, 2, False),
        (4, 1, False),
        (6, 1, False),
        (6, 2, False),
        (7, 2, False),
    ]
    collections.clear()
    loop(
        monkeypatch,
        "--max_steps",
        7,
        saved={"step": 3, "state": {"schedule": {"lr_decay_steps": 7, "last_step": 7}}},
    )
    # steps counted from the resume at 3: step 4 is the first (all), step 6 the next on the interval
    assert collections == [(0, 2, True), (1, 2, False), (3, 1, False), (3, 2, False), (4, 2, False)]


def test_loop_leaves_garbage_collection_as_it_found_it_after_an_error(monkeypatch):
    monkeypatch.setattr(
        "minimal_fsdp.train.train_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(RuntimeError, match="boom"):
        loop(monkeypatch)
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            loop(monkeypatch)
        assert not gc.isenabled()
    finally:
        gc.enable()


# ---- the NaN/Inf guard ----

NAN = float("nan")


def test_deferred_guard_never_skips_and_flush_names_the_first_bad_step():
    guard = NonFiniteGuard(allowed=0)
    # --skip_nonfinite 0: every update counts at check time, even a NaN one (nothing is synced then)
    assert guard.check(1, torch.tensor(1.5), torch.tensor(2.0)) is True
    assert guard.check(2, torch.tensor(math.inf), torch.tensor(2.5)) is True
    assert guard.check(3, torch.tensor(NAN), torch.tensor(3.0)) is True
    with pytest.raises(Diverged) as raised:
        guard.flush()
    assert str(raised.value) == (
        "step 2: the grad norm is inf (loss 2.5 on rank 0): the run diverged and stops here; its "
        "last checkpoint is untouched. Lower --lr or raise --warmup_steps, or let --skip_nonfinite "
        "N skip up to N such steps"
    )
    assert guard.pending == [] and guard.flush() is None  # looked at once; nothing left


def test_deferred_guard_flush_of_finite_norms_passes_and_empties():
    guard = NonFiniteGuard(allowed=0)
    guard.flush()  # nothing pending: no error
    for step in range(1, 4):
        guard.check(step, torch.tensor(float(step)), torch.tensor(1.0))
    assert len(guard.pending) == 3
    guard.flush()
    assert guard.pending == [] and guard.skipped == 0


def test_skipping_guard_skips_up_to_n_steps_with_a_warning_then_stops():
    warnings = []
    guard = NonFiniteGuard(allowed=2, warn=warnings.append)
    assert guard.check(1, torch.tensor(0.5), torch.tensor(4.0)) is True
    assert guard.check(2, torch.tensor(NAN), torch.tensor(4.0)) is False
    assert guard.check(3, torch.tensor(1.0), torch.tensor(3.0)) is True
    assert guard.check(4, torch.tensor(-math.inf), torch.tensor(3.0)) is False
    assert guard.pending == [] and guard.skipped == 2
    assert warnings == [
        "warning: step 2: grad norm nan; update skipped (1 of --skip_nonfinite 2)",
        "warning: step 4: grad norm -inf; update skipped (2 of --skip_nonfinite 2)",
    ]
    with pytest.raises(
        Diverged, match=r"^step 7: the grad norm is nan \(loss 1.25 on rank 0\): the run diverged"
    ):
        guard.check(7, torch.tensor(NAN), torch.tensor(1.25))
    assert len(warnings) == 2


def test_skipping_guard_without_a_warn_callback_still_skips():
    guard = NonFiniteGuard(allowed=1)  # ranks other than 0 have no progress bar to print around
    assert guard.check(5, torch.tensor(NAN), torch.tensor(1.0)) is False
    with pytest.raises(Diverged, match="^step 6:"):
        guard.check(6, torch.tensor(NAN), torch.tensor(1.0))

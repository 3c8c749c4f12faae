"""train.py's parts in one process, without a launch: the run's length and what the startup line says about it,
the schedule at its boundaries, the optimizer's groups and betas, one optimizer step's calls into the gradient
sync, and evaluation. The loop as a whole: test_run.py (in process) and test_resume.py, test_schedule.py."""
import math

import pytest
import torch

from minimal_fsdp.accum_adamw import AccumAdamW
from minimal_fsdp.config import parse_args
from minimal_fsdp.train import Schedule, build_optimizer, evaluate, run_length, train_step


def cfg(*flags):
    return parse_args([str(f) for f in flags])


def test_run_length_of_a_stream_is_max_steps():
    assert run_length(cfg("--max_steps", 7), None) == (7, "7 steps (--max_steps; a stream has no epochs)")


def test_run_length_max_steps_alone_or_first():
    assert run_length(cfg("--max_steps", 12), 5) == (12, "12 steps = 2.4 epochs of 5 steps (--max_steps)")
    assert run_length(cfg("--max_steps", 5), 5) == (5, "5 steps = 1 epoch of 5 steps (--max_steps)")
    assert run_length(cfg("--max_steps", 7, "--max_epochs", 2), 5) == (
        7, "7 steps = 1.4 epochs of 5 steps (--max_steps)")
    assert run_length(cfg("--max_steps", 1000, "--max_epochs", 1), 3)[1] == "3 steps = 1 epoch of 3 steps (--max_epochs)"
    assert run_length(cfg("--max_steps", 2, "--max_epochs", 1), 3000)[1] == (
        "2 steps = 0.000667 epochs of 3000 steps (--max_steps)")  # three significant digits


def test_run_length_max_epochs_alone_or_first():
    assert run_length(cfg("--max_steps", 0, "--max_epochs", 2), 5) == (10, "10 steps = 2 epochs of 5 steps (--max_epochs)")
    assert run_length(cfg("--max_steps", 30, "--max_epochs", 2), 5)[0] == 10
    assert run_length(cfg("--max_steps", 10, "--max_epochs", 2), 5) == (10, "10 steps = 2 epochs of 5 steps (--max_epochs)")


def test_schedule_for_a_new_run_spans_the_run():
    s = Schedule.for_run(cfg("--max_steps", 20, "--lr", 0.01, "--warmup_steps", 3), 5)
    assert (s.peak_lr, s.min_lr, s.warmup_steps, s.decay_steps, s.last_step) == (0.01, 0.001, 3, 20, 20)
    assert s.length == "20 steps = 4 epochs of 5 steps (--max_steps)"
    assert s.state_dict() == {"lr_decay_steps": 20, "last_step": 20}
    assert Schedule.for_run(cfg("--max_steps", 20, "--min_lr", 0), 5).min_lr == 0.0


def test_schedule_of_a_resumed_run_keeps_its_horizon_unless_told():
    resumed = Schedule.for_run(cfg("--max_steps", 30), 5, saved={"lr_decay_steps": 20, "last_step": 20})
    assert (resumed.decay_steps, resumed.last_step) == (20, 30)
    assert resumed.length == ("30 steps = 6 epochs of 5 steps (--max_steps); the LR schedule spans 20 steps, as when "
                              "the run began (--lr_decay_steps changes it)")
    told = Schedule.for_run(cfg("--max_steps", 30, "--lr_decay_steps", 25), 5, saved={"lr_decay_steps": 20})
    assert told.decay_steps == 25 and told.length == "30 steps = 6 epochs of 5 steps (--max_steps)"
    same = Schedule.for_run(cfg("--max_steps", 20), 5, saved={"lr_decay_steps": 20})
    assert same.length == "20 steps = 4 epochs of 5 steps (--max_steps)"
    assert Schedule.for_run(cfg("--max_steps", 30), 5, saved={}).decay_steps == 30


def test_lr_at_the_schedules_boundaries():
    s = Schedule(peak_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=12, last_step=16, length="")
    assert [s.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4) == 1.0  # the cosine starts at the peak
    assert s.lr_at(8) == pytest.approx(0.55)  # halfway
    assert s.lr_at(12) == pytest.approx(0.1) and s.lr_at(15) == pytest.approx(0.1)  # flat past the horizon
    no_warmup = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=2, last_step=2, length="")
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
    opt = build_optimizer(model, cfg("--lr", 0.02, "--weight_decay", 0.3))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert opt.defaults["lr"] == 0.02 and opt.defaults["betas"] == (0.9, 0.95)
    (decayed,), (plain,) = [g["params"] for g in opt.param_groups]
    assert decayed is model.weight and plain is model.norm  # the frozen matrix is left out
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert build_optimizer(model, cfg("--beta1", 0.8, "--beta2", 0.99)).defaults["betas"] == (0.8, 0.99)


def test_decentralized_runs_get_accum_adamw_with_beta2_098():
    model = Model()
    opt = build_optimizer(model, cfg("--data_parallel", "decentralized", "--lr", 0.02, "--accum_steps", 3,
                                     "--weight_decay", 0.3))
    assert type(opt) is AccumAdamW
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["lr"] == 0.02 and opt.defaults["accum_steps"] == 3
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    explicit = build_optimizer(model, cfg("--data_parallel", "decentralized", "--beta2", 0.9))
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


def micro_batches(n):
    return [(torch.full((2, 3), float(i + 1)), torch.zeros(2)) for i in range(n)]


def test_train_step_accumulates_micro_batches_then_steps_once():
    model, sync = Model(), Sync()
    opt = torch.optim.SGD([model.weight, model.norm], lr=0.0)
    batches = micro_batches(3)
    loss, norm = train_step(model, opt, batches, sync, 0.5, torch.device("cpu"), step=7)
    expected = sum(model(x, y).item() for x, y in batches) / 3
    assert loss.item() == pytest.approx(expected) and not loss.requires_grad and norm.item() == 1.0
    assert sync.calls == [("start", 7), ("micro_step", False), ("micro_step", False), ("micro_step", True),
                          ("finish",), ("clip", [(2, 3), (3,), (3, 3)], 0.5), ("after_step",)]
    assert model.weight.grad is None and model.norm.grad is None  # zeroed by dropping them


def test_train_step_gradient_is_the_mean_over_micro_batches():
    seen = {}

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen["grad"] = self.param_groups[0]["params"][0].grad.clone()
            return super().step(closure)
    model = Model()
    batches = micro_batches(2)
    train_step(model, Spy([model.weight], lr=0.1), batches, Sync(), None, torch.device("cpu"))
    reference = Model()
    (sum(reference(x, y) for x, y in batches) / 2).backward()
    torch.testing.assert_close(seen["grad"], reference.weight.grad)
    torch.testing.assert_close(model.weight.detach(), reference.weight.detach() - 0.1 * reference.weight.grad)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_train_step_skips_a_nonfinite_update_only_when_asked(skip_nonfinite):
    model = Model()
    opt = torch.optim.SGD([model.weight], lr=0.1)
    before = model.weight.detach().clone()
    _, norm = train_step(model, opt, micro_batches(1), Sync(float("nan")), 1.0, torch.device("cpu"),
                         skip_nonfinite=skip_nonfinite)
    assert math.isnan(norm.item())
    assert torch.equal(model.weight.detach(), before) == skip_nonfinite
    assert model.weight.grad is None
    train_step(model, opt, micro_batches(1), Sync(2.0), 1.0, torch.device("cpu"), skip_nonfinite=True)
    assert not torch.equal(model.weight.detach(), before)  # a finite step is applied either way


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

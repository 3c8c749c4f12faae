"""AccumAdamW against torch.optim.AdamW: identical with accum_steps=1; with k, every step is the
AdamW step whose gradient history is the means of the completed k-step windows followed by the
current gradient."""

import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from minimal_fsdp.parallel.accum_adamw import AccumAdamW  # noqa: E402

HYPER = dict(betas=(0.9, 0.98), eps=1e-8)


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(6, 4, generator=generator)),
        torch.nn.Parameter(torch.randn(4, generator=generator)),
    ]


def groups(params):
    return [
        {"params": [params[0]], "weight_decay": 0.1},
        {"params": [params[1]], "weight_decay": 0.0},
    ]


def gradients(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)]
        for _ in range(steps)
    ]


def lr_at(step):
    return 1e-2 * (1 + step % 3)  # changes every step, as a schedule does


def run(optimizer, params, grads, start=0):
    for step, gs in enumerate(grads, start):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.step()


def test_one_step_windows_are_exactly_adamw():
    ours, theirs = make_params(), make_params()
    grads = gradients(25)
    run(AccumAdamW(groups(ours), accum_steps=1, **HYPER), ours, grads)
    run(torch.optim.AdamW(groups(theirs), foreach=True, **HYPER), theirs, grads)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_k_step_windows_match_adamw_on_window_means(k):
    params = make_params()
    optimizer = AccumAdamW(groups(params), accum_steps=k, **HYPER)
    grads = gradients(4 * k + 1)
    for t, gs in enumerate(grads):
        # Reference: a fresh AdamW on a copy of the parameters is shown the completed windows' mean
        # gradients with lr 0 (moments only), then this step's gradient at this step's lr.
        probe = [torch.nn.Parameter(p.detach().clone()) for p in params]
        adamw = torch.optim.AdamW(groups(probe), foreach=True, **HYPER)
        for window in range(t // k):
            means = [
                torch.stack([grads[s][i] for s in range(window * k, window * k + k)]).mean(0)
                for i in range(2)
            ]
            for q, g in zip(probe, means):
                q.grad = g
            for group in adamw.param_groups:
                group["lr"] = 0.0
            adamw.step()
        for q, g in zip(probe, gs):
            q.grad = g.clone()
        for group in adamw.param_groups:
            group["lr"] = lr_at(t)
        adamw.step()

        run(optimizer, params, [gs], start=t)
        for p, q in zip(params, probe):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {t + 1}")
    # it moved, so the comparison is not vacuous
    assert not torch.equal(params[0], make_params()[0])


def test_state_dict_resumes_mid_window_exactly():
    grads = gradients(11)
    whole = make_params()
    run(AccumAdamW(groups(whole), accum_steps=4, **HYPER), whole, grads)

    first = make_params()
    optimizer = AccumAdamW(groups(first), accum_steps=4, **HYPER)
    run(optimizer, first, grads[:6])  # stop inside the second window
    state = optimizer.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    optimizer = AccumAdamW(groups(resumed), accum_steps=4, **HYPER)
    optimizer.load_state_dict(state)
    run(optimizer, resumed, grads[6:], start=6)
    for a, b in zip(whole, resumed):
        assert torch.equal(a, b)


def test_rejects_zero_accum_steps():
    with pytest.raises(ValueError, match="accum_steps"):
        AccumAdamW(make_params(), accum_steps=0)


def step_with(optimizer, params, grads):
    """Steps at the optimizer's own learning rate (run() above sets one per step)."""
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        optimizer.step()


def test_defaults_are_adamw_with_beta2_098_and_no_weight_decay():
    """build_optimizer leaves eps (and here lr) to the defaults: they must be
    torch.optim.AdamW's."""
    ours, theirs = make_params(), make_params()
    grads = gradients(6)
    step_with(AccumAdamW(ours), ours, grads)
    step_with(
        torch.optim.AdamW(theirs, betas=(0.9, 0.98), weight_decay=0.0, foreach=True), theirs, grads
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_constructor_arguments_reach_groups_that_do_not_set_them():
    ours, theirs = make_params(), make_params()
    grads = gradients(6)
    hyper = dict(lr=3e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)
    step_with(AccumAdamW(ours, **hyper), ours, grads)
    step_with(torch.optim.AdamW(theirs, foreach=True, **hyper), theirs, grads)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_parameters_without_gradients_are_left_alone():
    """A frozen parameter before a trained one in a group, and a group with no gradient at all
    before another."""

    def layout(trained):
        frozen = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        return frozen, [
            {"params": [frozen[0], trained[0]]},
            {"params": [frozen[1]]},
            {"params": [trained[1]]},
        ]

    ours, theirs = make_params(), make_params()
    frozen_ours, groups_ours = layout(ours)
    frozen_theirs, groups_theirs = layout(theirs)
    grads = gradients(4)
    step_with(AccumAdamW(groups_ours, lr=1e-2, **HYPER), ours, grads)
    step_with(
        torch.optim.AdamW(groups_theirs, lr=1e-2, weight_decay=0.0, foreach=True, **HYPER),
        theirs,
        grads,
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert not torch.equal(ours[1], make_params()[1])  # the last group moved
    assert all(torch.equal(p, torch.ones_like(p)) for p in frozen_ours)


def test_step_returns_the_closure_loss_computed_with_gradients():
    """As torch.optim.AdamW: step(closure) evaluates the closure with autograd on and returns its
    loss."""

    def closure_for(params, optimizer):
        def closure():
            optimizer.zero_grad()
            loss = (params[0] ** 2).sum() + params[1].sum()
            loss.backward()
            return loss

        return closure

    ours, theirs = make_params(), make_params()
    ours_optimizer = AccumAdamW(ours, lr=1e-2, **HYPER)
    theirs_optimizer = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0, foreach=True, **HYPER)
    loss = ours_optimizer.step(closure_for(ours, ours_optimizer))
    assert torch.equal(loss, theirs_optimizer.step(closure_for(theirs, theirs_optimizer)))
    assert ours_optimizer.step() is None and theirs_optimizer.step() is None
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def reference_accum_adamw(param, grads, lrs, k, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.1):
    """AccumAdamW written out element by element in float64, from accum_adamw.py's docstring: the
    moments move once a window, on the window's mean gradient; each step's update uses them as if
    g_t ended the window."""
    p = param.double().clone()
    m, v, window_sum = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs), 1):
        g = g.double()
        r = -(-t // k)  # the window this step belongs to, from 1
        p = p * (1 - lr * weight_decay)
        m_now, v_now = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m_now / (1 - beta1**r)) / ((v_now / (1 - beta2**r)).sqrt() + eps)
        window_sum = window_sum + g
        if t % k == 0:
            a = window_sum / k
            m, v, window_sum = (
                beta1 * m + (1 - beta1) * a,
                beta2 * v + (1 - beta2) * a * a,
                torch.zeros_like(p),
            )
    return p


@pytest.mark.parametrize("k", [1, 3, 4])
def test_update_equals_an_independent_elementwise_reference(k):
    params = make_params()
    grads = gradients(3 * k + 2)
    run(AccumAdamW(groups(params), accum_steps=k, **HYPER), params, grads)
    lrs = [lr_at(step) for step in range(len(grads))]
    expected = reference_accum_adamw(make_params()[0].detach(), [g[0] for g in grads], lrs, k)
    torch.testing.assert_close(params[0].detach().double(), expected, rtol=1e-5, atol=1e-6)
    no_decay = reference_accum_adamw(
        make_params()[1].detach(), [g[1] for g in grads], lrs, k, weight_decay=0.0
    )
    torch.testing.assert_close(params[1].detach().double(), no_decay, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 4])
def test_update_equals_decent_dps_accum_adamw(k):
    """Decent-DP 0.2.3's accum_adamw_foreach (its AccumAdamW class calls a torch-internal name torch
    2.11 renamed, so its update function is called directly) keeps Adam's moments pre-multiplied by
    beta; the same updates."""
    optim = pytest.importorskip("decent_dp.optim")
    ours = make_params()
    grads = gradients(3 * k + 2)
    run(AccumAdamW(groups(ours), accum_steps=k, **HYPER), ours, grads)
    theirs = [p.detach().clone() for p in make_params()]
    # exp_avg, exp_avg_sq, accum_grad
    state = [[torch.zeros_like(p) for p in theirs] for _ in range(3)]
    for step, gs in enumerate(grads):
        for group, decay in ((0, 0.1), (1, 0.0)):  # each parameter group as our groups() has it
            steps = [torch.tensor(step, dtype=torch.int64)]
            optim.accum_adamw_foreach(
                [theirs[group]],
                [gs[group]],
                [state[0][group]],
                [state[1][group]],
                [state[2][group]],
                steps,
                0.9,
                0.98,
                lr_at(step),
                decay,
                1e-8,
                k,
            )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)

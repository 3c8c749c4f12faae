"""AccumAdamW against torch.optim.AdamW: identical with accum_steps=1; with k, every step is the AdamW step whose
gradient history is the means of the completed k-step windows followed by the current gradient."""
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from minimal_fsdp.accum_adamw import AccumAdamW  # noqa: E402

HYPER = dict(betas=(0.9, 0.98), eps=1e-8)


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=generator)),
            torch.nn.Parameter(torch.randn(4, generator=generator))]


def groups(params):
    return [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]


def gradients(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)] for _ in range(steps)]


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
        # Reference: a fresh AdamW on a copy of the parameters is shown the completed windows' mean gradients
        # with lr 0 (moments only), then this step's gradient at this step's lr.
        probe = [torch.nn.Parameter(p.detach().clone()) for p in params]
        adamw = torch.optim.AdamW(groups(probe), foreach=True, **HYPER)
        for window in range(t // k):
            means = [torch.stack([grads[s][i] for s in range(window * k, window * k + k)]).mean(0) for i in range(2)]
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
    assert not torch.equal(params[0], make_params()[0])  # it moved, so the comparison is not vacuous


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

"""ClippedAdamW against torch's clip_grad_norm_ + AdamW: the same parameters, moments and state."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from minimal_fsdp.parallel.clipped_adamw import ClippedAdamW


def model_and_groups(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    return model


def groups(model):
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def backward(model, step, device):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(device)
    (model(x).pow(2).sum() * (step + 1)).backward()


def run_both(max_norm, steps=6, compile=False, device="cpu", before=None, shard=None):
    """Train a reference (clip_grad_norm_ then torch's AdamW) and ClippedAdamW side by side, the lr
    changing every step as a schedule does; returns both models, optimizers and the norms. shard:
    applied to both models (FSDP2's fully_shard)."""
    reference = model_and_groups().to(device)
    ours = copy.deepcopy(reference)
    if shard:
        shard(reference)
        shard(ours)
    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95))
    opt = ClippedAdamW(groups(ours), compile=compile, lr=1e-2, betas=(0.9, 0.95))
    if before:
        before(reference, ours, ref_opt, opt)
    norms = []
    for step in range(steps):
        for o in (ref_opt, opt):
            for group in o.param_groups:
                group["lr"] = 1e-2 * (1 - step / (2 * steps))
        backward(reference, step, device)
        backward(ours, step, device)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm or float("inf"))
        ref_opt.step()
        # a world of one: the local shards' norm is the global one
        norm = torch.nn.utils.get_total_norm([local(p.grad) for p in ours.parameters()])
        opt.step(grad_norm=norm, max_norm=max_norm)
        norms.append((expected.item(), norm.item()))
        ref_opt.zero_grad()
        opt.zero_grad()
    return reference, ours, ref_opt, opt, norms


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def assert_same(reference, ours, ref_opt, opt, atol=1e-6):
    for p, q in zip(reference.parameters(), ours.parameters()):
        torch.testing.assert_close(local(q), local(p), atol=atol, rtol=1e-5)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            theirs, mine = ref_opt.state[p][key], opt.state[q][key]
            assert type(mine) is type(theirs)  # DTensors where AdamW keeps DTensors
            torch.testing.assert_close(local(mine).cpu(), local(theirs).cpu(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
def test_the_clip_in_the_step_matches_clip_grad_norm_then_adamw(max_norm):
    reference, ours, ref_opt, opt, norms = run_both(max_norm)
    # the gradients (norms 5 to 60) were clipped: a factor other than 1 was applied
    assert max_norm == 0 or min(n for n, _ in norms) > 2 * max_norm
    assert_same(reference, ours, ref_opt, opt)
    # clipping made a difference, so the match above is not one of two unclipped runs
    if max_norm:
        unclipped = run_both(0.0)[1]
        assert any(
            not torch.allclose(p, q, atol=1e-4)
            for p, q in zip(ours.parameters(), unclipped.parameters())
        )


def test_a_plain_step_is_adamw_without_a_clip():
    reference = model_and_groups()
    ours = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95))
    opt = ClippedAdamW(groups(ours), compile=False, lr=1e-2, betas=(0.9, 0.95))
    for step in range(3):
        backward(reference, step, "cpu")
        backward(ours, step, "cpu")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert_same(reference, ours, ref_opt, opt)


def test_its_state_dict_is_adamws_and_loads_either_way():
    """A checkpoint of fused AdamW resumes under ClippedAdamW (and back) as if never switched."""

    def swap_state(reference, ours, ref_opt, opt):
        # two steps of plain AdamW on both, then the reference's state loaded into ours
        for step in range(2):
            backward(reference, 100 + step, "cpu")
            ref_opt.step()
            ref_opt.zero_grad()
        ours.load_state_dict(reference.state_dict())
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # not its tensors

    reference, ours, ref_opt, opt, _ = run_both(1.0, steps=3, before=swap_state)
    assert_same(reference, ours, ref_opt, opt)
    saved, expected = opt.state_dict(), ref_opt.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    for i, state in saved["state"].items():
        assert state.keys() == expected["state"][i].keys()
        assert state["step"].item() == expected["state"][i]["step"].item() == 5


def test_sharded_parameters_step_on_their_local_shards(one_rank_group):
    """FSDP2's DTensor parameters: the update on the local shards, the state DTensors as AdamW's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    reference, ours, ref_opt, opt, _ = run_both(1.0, shard=lambda m: fully_shard(m, mesh=mesh))
    assert isinstance(next(ours.parameters()), DTensor)
    assert_same(reference, ours, ref_opt, opt)


@pytest.mark.slow  # torch.compile on the CPU: about 20 s; the eager tests above are the quick check
def test_compiled_it_matches_clip_grad_norm_then_adamw(one_rank_group):
    assert_same(*run_both(1.0, compile=True)[:4])
    # FSDP2's DTensors: the compiled update writes their local shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    assert_same(*run_both(1.0, compile=True, shard=lambda m: fully_shard(m, mesh=mesh))[:4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_on_the_gpu_it_matches_clip_grad_norm_then_adamw():
    assert_same(*run_both(1.0, compile=True, device="cuda")[:4], atol=1e-5)

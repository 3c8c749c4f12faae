"""One GPU's bf16 copies beside fp32 master weights (bf16_weights.py), stepped through train_step
as the loop steps them, against the same mixed precision written out by hand: a bf16 model whose
gradients, summed in fp32, are clipped by clip_grad_norm_ and step fp32 weights by ClippedAdamW's
AdamW (itself checked against torch's in test_clipped_adamw.py). On the CPU (ClippedAdamW
uncompiled); the GPU runs it compiled."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from minimal_fsdp.checkpoint import checkpointer
from minimal_fsdp.parallel import parallelize
from minimal_fsdp.parallel.bf16_weights import BF16Weights
from minimal_fsdp.parallel.clipped_adamw import ClippedAdamW
from minimal_fsdp.parallel.parallelize import BF16WeightsSync
from minimal_fsdp.train import train_step

VOCAB, WIDTH = 32, 16
CPU = torch.device("cpu")


class Toy(nn.Module):
    """An embedding tied to the output layer (one parameter in two modules), a matrix with a bias,
    a norm-like vector."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x, y):
        h = torch.tanh(self.proj(self.embed(x))) * self.scale
        return F.cross_entropy(self.head(h).float().view(-1, VOCAB), y.view(-1))


def groups(model):
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def batches(step, micro):
    g = torch.Generator().manual_seed(step)
    return [
        (torch.randint(VOCAB, (2, 8), generator=g), torch.randint(VOCAB, (2, 8), generator=g))
        for _ in range(micro)
    ]


def ours(model):
    weights = BF16Weights(model)
    model.bf16_weights = weights
    optimizer = ClippedAdamW(groups(model), compile=False, weights=weights, lr=3e-2)
    return weights, optimizer, BF16WeightsSync(weights)


def by_hand(masters, steps, micro, clip):
    """The mixed precision written out: a bf16 model takes the fp32 weights, its gradients are
    summed in fp32, clipped and stepped by AdamW on the fp32 weights. Returns the norms."""
    compute = copy.deepcopy(masters).to(torch.bfloat16)
    optimizer = ClippedAdamW(groups(masters), compile=False, lr=3e-2)
    norms = []
    for step in range(steps):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), masters.parameters()):
                c.copy_(m)
        for m in masters.parameters():
            m.grad = torch.zeros_like(m)
        for x, y in batches(step, micro):
            compute.zero_grad()
            loss = compute(x, y)
            (loss / micro if micro > 1 else loss).backward()
            for c, m in zip(compute.parameters(), masters.parameters()):
                m.grad += c.grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(masters.parameters(), clip))
        optimizer.step(grad_norm=norms[-1], max_norm=0.0)  # clipped already
    return norms


@pytest.mark.parametrize("micro", [1, 3])
def test_train_step_with_bf16_copies_is_the_mixed_precision_written_out(micro):
    torch.manual_seed(0)
    model = Toy()
    reference = copy.deepcopy(model)
    weights, optimizer, sync = ours(model)
    clip, steps = 0.5, 4
    norms = []
    for step in range(steps):
        _, norm = train_step(model, optimizer, batches(step, micro), sync, clip, CPU)
        norms.append(norm)
    expected = by_hand(reference, steps, micro, clip)
    # the clip applied (a factor under 1), and the norm is fp32 from the bf16 gradients
    assert min(expected) > 2 * clip
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected), rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == torch.float32, name  # outside a step: the fp32 weights
        assert torch.equal(p, q), name
        # the step wrote the copy as it wrote the weight
        assert torch.equal(weights.copy_of[p], p.detach().bfloat16()), name
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert all(c.grad is None for c in weights.copies) and weights.sums is None  # zero_grad


@pytest.mark.slow  # compiles (inductor on the CPU)
def test_large_gradients_take_the_compiled_norm(monkeypatch):
    """From parallelize.COMPILED_NORM_BYTES up (here: any size) the norm is inductor's sum of
    squares: the norms and weights of the mixed precision written out, to fp32's rounding."""
    compiled, calls = parallelize._compiled_grad_norm, []

    def spied():
        norm = compiled()
        return lambda grads: calls.append(len(grads)) or norm(grads)

    monkeypatch.setattr(parallelize, "COMPILED_NORM_BYTES", 0)
    monkeypatch.setattr(parallelize, "_compiled_grad_norm", spied)
    torch.manual_seed(0)
    model = Toy()
    reference = copy.deepcopy(model)
    weights, optimizer, sync = ours(model)
    norms = [train_step(model, optimizer, batches(s, 1), sync, 0.5, CPU)[1] for s in range(3)]
    assert calls == [4, 4, 4]  # the tied embedding, proj's weight and bias, scale
    expected = by_hand(reference, 3, 1, 0.5)
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected), rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_outside_a_step_everything_sees_the_fp32_weights():
    torch.manual_seed(0)
    model = Toy()
    weights, optimizer, sync = ours(model)
    fp32 = dict(model.named_parameters())
    train_step(model, optimizer, batches(0, 1), sync, 1.0, CPU)
    assert dict(model.named_parameters()) == fp32
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    # evaluation computes in bf16 and gives the fp32 weights back at once
    x, y = batches(1, 1)[0]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x, y), bf16(x, y))
    assert dict(model.named_parameters()) == fp32
    # inside a step's forward and backward, the copies: their gradients, not the weights'
    loss = model(x, y)
    assert model.proj.weight is weights.copy_of[fp32["proj.weight"]]
    assert model.head.weight is model.embed.weight  # still tied
    loss.backward()
    assert fp32["proj.weight"].grad is None
    assert weights.copy_of[fp32["proj.weight"]].grad.dtype == torch.bfloat16
    sync.finish()
    assert dict(model.named_parameters()) == fp32


def test_a_load_or_another_optimizers_step_casts_the_copies_anew():
    torch.manual_seed(0)
    model = Toy()
    weights, optimizer, sync = ours(model)
    x, y = batches(0, 1)[0]
    train_step(model, optimizer, batches(0, 1), sync, 1.0, CPU)
    other = Toy()  # other values, loaded as a checkpoint or Hugging Face load would
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x, y), copy.deepcopy(other).to(torch.bfloat16)(x, y))
    # an optimizer that does not write the copies: the next forward casts them
    plain = torch.optim.SGD(model.parameters(), lr=1.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    plain.step()
    with torch.no_grad():
        assert torch.equal(model(x, y), copy.deepcopy(model).to(torch.bfloat16)(x, y))
        for p in model.parameters():
            assert torch.equal(weights.copy_of[p], p.bfloat16())


@pytest.mark.usefixtures("one_rank_group")
def test_a_resumed_run_steps_on_bit_for_bit(tmp_path):
    """A checkpoint (checkpointer.save and load, DCP's) holds the fp32 weights and AdamW's state;
    loaded into a new model, the copies are cast anew from them, and the next steps are the
    uninterrupted run's to the bit."""
    torch.manual_seed(0)
    model = Toy()
    weights, optimizer, sync = ours(model)
    for step in range(2):
        train_step(model, optimizer, batches(step, 1), sync, 0.5, CPU)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    path = checkpointer.save(tmp_path / "run", 2, None, None, {}, state=state)
    for step in range(2, 4):
        train_step(model, optimizer, batches(step, 1), sync, 0.5, CPU)

    torch.manual_seed(1)
    resumed = Toy()  # other initial values, replaced by the load
    _, resumed_optimizer, resumed_sync = ours(resumed)
    with torch.no_grad():
        resumed(*batches(0, 1)[0])  # its copies cast from the values the load replaces
    checkpointer.load(path, resumed, resumed_optimizer)
    for step in range(2, 4):
        train_step(resumed, resumed_optimizer, batches(step, 1), resumed_sync, 0.5, CPU)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(
            optimizer.state[p]["exp_avg_sq"], resumed_optimizer.state[q]["exp_avg_sq"]
        )

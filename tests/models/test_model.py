import zlib

import pytest
import torch

from minimal_fsdp.models.families import make_config
from minimal_fsdp.models.gpt import GPT, PRESETS, GPTConfig
from minimal_fsdp.models.llama import Llama, LlamaConfig
from minimal_fsdp.parallel.parallelize import init_weights

import reference


def tiny(**kw):
    return GPTConfig(
        **dict(dict(vocab_size=50, seq_length=16, num_layers=2, num_heads=2, embed_size=32), **kw)
    )


def llama_tiny():
    return LlamaConfig(
        vocab_size=50,
        seq_length=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_size=32,
        intermediate_size=48,
    )


@pytest.mark.parametrize(
    "model_cls,config", [(GPT, tiny), (Llama, llama_tiny)], ids=["gpt", "llama"]
)
def test_kv_cache_decoding_matches_full_forward(model_cls, config):
    model = model_cls(config()).eval()
    init_weights(model, 0, torch.device("cpu"))
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, "cpu", torch.float32)
    with torch.no_grad():
        incremental = [model(idx[:, :5], cache=cache)]  # prefill, then one token at a time
        incremental += [model(idx[:, t : t + 1], cache=cache) for t in range(5, 12)]
        full = [model(idx[:, : t + 1]) for t in range(4, 12)]
    for a, b in zip(incremental, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_init_is_a_function_of_seed_only():
    a, b, c = GPT(tiny()), GPT(tiny()), GPT(tiny())
    init_weights(a, 1, torch.device("cpu"))
    init_weights(b, 1, torch.device("cpu"))
    init_weights(c, 2, torch.device("cpu"))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and "ln_" not in name:
            assert not torch.equal(pa, pc), name
    std = a.blocks[0].mlp.fc.weight.std().item()
    assert 0.015 < std < 0.025  # GPT-2's N(0, 0.02)


@pytest.mark.parametrize(
    "model_cls,config", [(GPT, tiny), (Llama, llama_tiny)], ids=["gpt", "llama"]
)
def test_init_follows_the_rule_rederived_in_the_reference(model_cls, config):
    """init_weights against reference.initialize, written from the rule: per-name seeded N(0, 0.02),
    residual projections / sqrt(2 * layers), norms 1, biases 0."""
    ours, plain = model_cls(config()), model_cls(config())
    init_weights(ours, 5, torch.device("cpu"))
    reference.initialize(plain, 5, torch.device("cpu"))
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "preset,params",
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ],
)
def test_gpt2_presets_have_openai_parameter_counts(preset, params):
    with torch.device("meta"):
        model = GPT(make_config("gpt", preset))
    assert model.num_params(non_embedding=False) == params


def test_explicit_flags_override_the_preset():
    config = make_config("gpt", "gpt2", num_layers=3, vocab_size=None)
    assert (config.num_layers, config.embed_size, config.vocab_size) == (
        3,
        768,
        PRESETS["gpt2"]["vocab_size"],
    )


@pytest.mark.parametrize(
    "model_cls,config", [(GPT, tiny), (Llama, llama_tiny)], ids=["gpt", "llama"]
)
def test_loss_is_cross_entropy_of_the_logits(model_cls, config):
    """The loss equals F.cross_entropy of every position's logits (final norm's output times the
    tied or separate output matrix), and the logits returned without targets are the last
    position's."""
    model = model_cls(config()).eval()
    init_weights(model, 0, torch.device("cpu"))
    hidden = []
    norm = model.ln_f if model_cls is GPT else model.norm
    norm.register_forward_hook(lambda module, args, out: hidden.append(out))
    x, y = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        loss = model(x, y)
        last_logits = model(x)
    output = model.wte.weight if model_cls is GPT else model.lm_head.weight
    logits = hidden[0] @ output.T  # (2, 8, 50)
    torch.testing.assert_close(
        loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 50), y.reshape(-1))
    )
    torch.testing.assert_close(last_logits, logits[:, -1])
    assert 3.0 < loss.item() < 5.0  # about ln(50) at init


def test_init_takes_any_seed_a_run_takes():
    """(seed, name) seeds reach torch mod 2**64, so a large --seed works and a negative one keeps
    its values."""
    big, negative, same = GPT(tiny()), GPT(tiny()), GPT(tiny())
    # seed x 1,000,003 would overflow torch's 64 bits
    init_weights(big, 10**15, torch.device("cpu"))
    init_weights(negative, -5, torch.device("cpu"))
    # what the negative seed gave before the mod: torch's own reading
    for name, param in same.named_parameters():
        generator = torch.Generator().manual_seed(-5 * 1_000_003 + zlib.crc32(name.encode()))
        param.data.copy_(same.initial_value(name, param.shape, generator, torch.device("cpu")))
    for (name, pn), ps, pb in zip(negative.named_parameters(), same.parameters(), big.parameters()):
        assert torch.equal(pn, ps), name
        assert torch.isfinite(pb).all()

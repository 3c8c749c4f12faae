"""generate() in this process, on a one-rank group: what it asks of the attention kernels."""

import pytest
import torch

from minimal_fsdp.data.tokenizer import CharTokenizer
from minimal_fsdp.inference.generate import generate
from minimal_fsdp.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_rank_group")


def test_decoding_never_picks_cudnn_attention():
    """cuDNN's attention builds a plan for every new key length, and decoding brings a new one each
    token (9.4 s of a 200-token sample on an H100): generate() leaves it out; training (outside
    generate) keeps every kernel."""
    model = GPT(GPTConfig(vocab_size=8, seq_length=16, num_layers=1, num_heads=2, embed_size=8))
    seen = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: (
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        or forward(*args, **kwargs)
    )
    text = generate(model, CharTokenizer("abcdefgh"), "ab", num_tokens=20)
    # the prefill, then one forward for each token after the first
    assert len(text) == 22 and len(seen) == 20
    assert set(seen) == {(False, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored once generation is done


def cache_lengths(model):
    """The length of each KV cache generation makes, as it makes them."""
    lengths, new_cache = [], model.new_cache

    def recorded(*args):
        cache = new_cache(*args)
        lengths.append(cache.k[0].size(2))
        return cache

    model.new_cache = recorded
    return lengths


def plain_greedy(model, ids, num_tokens):
    """A full forward per token, no KV cache."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(model(torch.tensor([ids])).argmax(dim=-1).item())
    return ids


def test_the_kv_cache_holds_the_prompt_and_the_new_tokens_not_the_whole_context():
    """A Llama config with max_position_embeddings 2^24 made sample allocate a KV cache for the
    whole context to generate 5 tokens (over 8 GB). The cache is sized by prompt + num_tokens; the
    text is a plain decode's."""
    from minimal_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8, seq_length=2**16, num_layers=1, num_heads=2, num_kv_heads=1, embed_size=8
    )
    model = Llama(config)
    lengths, new_cache = [], model.new_cache
    model.new_cache = lambda *args: (
        lengths.append(new_cache(*args).k[0].size(2)) or new_cache(*args)
    )
    tokenizer = CharTokenizer("abcdefgh")
    text = generate(model, tokenizer, "abc", num_tokens=5, temperature=0)
    assert lengths == [3 + 5]
    assert text == tokenizer.decode(plain_greedy(model, tokenizer.encode("abc"), 5))


def test_generation_past_the_context_refills_a_cache_no_longer_than_it():
    model = GPT(GPTConfig(vocab_size=8, seq_length=8, num_layers=1, num_heads=2, embed_size=8))
    lengths, new_cache = [], model.new_cache
    model.new_cache = lambda *args: (
        lengths.append(new_cache(*args).k[0].size(2)) or new_cache(*args)
    )
    text = generate(model, CharTokenizer("abcdefgh"), "abc", num_tokens=20, temperature=0)
    assert len(text) == 23 and lengths[0] == 8 and all(n <= 8 for n in lengths) and len(lengths) > 1


def test_sampling_draws_from_the_top_k_tokens_at_the_temperatures_softmax():
    """_sample's top-k and temperature against their definitions: 20,000 seeded draws of one row of
    logits; only the k best tokens appear, with frequencies softmax(logits / T) over them."""
    from minimal_fsdp.inference.generate import _sample

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    draws = 20_000
    for temperature, top_k in [(1.0, 3), (0.5, 3), (2.0, 4), (1.0, 0)]:
        generator = torch.Generator().manual_seed(0)
        picked = _sample(logits.expand(draws, -1), temperature, top_k, generator)
        seen = torch.bincount(picked, minlength=6).double() / draws
        kept = logits.topk(top_k).indices if top_k else torch.arange(6)
        wanted = torch.zeros(6, dtype=torch.double)
        wanted[kept] = torch.softmax(logits[kept].double() / temperature, dim=0)
        assert torch.allclose(seen, wanted, atol=0.015), (temperature, top_k, seen, wanted)
    greedy = _sample(logits.expand(3, -1), 0.0, 3, torch.Generator().manual_seed(0))
    assert greedy.tolist() == [5, 5, 5]

"""What the lm-eval backend scores for a (context, continuation) request: the continuation's tokens
and no others, their log-probabilities summed. Checked in this process on a tiny model, through the
harness's own loglikelihood entry (the path a task's requests take), against the model's full logits
summed here; only the comparison with lm_eval's hf backend (test_evaluate.py, a launch) saw a
context scored too."""

import pytest
import torch

from minimal_fsdp.data.tokenizer import CharTokenizer

lm_eval = pytest.importorskip("lm_eval")

REQUESTS = [
    ("the king said", " yes."),
    ("a lady", ", good night"),
    ("x", "yz"),
    ("thee", " sweet king"),
]


def test_only_the_continuation_is_scored_and_summed(one_rank_group, monkeypatch):
    from lm_eval.api.instance import Instance

    from minimal_fsdp.eval.lm import ShardedLM, token_scores
    from minimal_fsdp.models.gpt import GPT, GPTConfig

    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.\n")
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=tokenizer.vocab_size,
            seq_length=32,
            num_layers=2,
            num_heads=2,
            embed_size=16,
            dropout=0.0,
        )
    )
    scored = []  # how many positions each forward call projects onto the vocabulary
    scores = token_scores
    monkeypatch.setattr(
        "minimal_fsdp.eval.lm.token_scores",
        lambda x, weight, targets: scored.append(len(targets[0])) or scores(x, weight, targets),
    )
    lm = ShardedLM(model, tokenizer, torch.device("cpu"), batch_size=1)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(REQUESTS)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    # a char tokenizer: one token per character of the continuation, one forward call per request
    assert sorted(scored) == sorted(len(continuation) for _, continuation in REQUESTS)
    with torch.no_grad():
        for (context, continuation), (logprob, _) in zip(REQUESTS, got):
            tokens = tokenizer.encode(context + continuation)
            logits = model.trunk(torch.tensor([tokens[:-1]])) @ model.wte.weight.T
            picked = logits[0].log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            assert logprob == pytest.approx(picked[-len(continuation) :].sum().item(), rel=1e-5)
            # the context's positions would change the sum: the check tells them apart
            if len(context) > 1:
                assert picked.sum().item() != pytest.approx(logprob, rel=1e-3)


def test_a_generation_is_cut_at_the_first_stop_string_in_the_text(one_rank_group):
    """One token that decodes to several words holds two stop strings, and one of them twice: the
    text ends before the earliest of them. (A char tokenizer stops one character after a stop, so
    only one is ever in its text: a cut at the last stop looked the same there.)"""
    from lm_eval.api.instance import Instance

    from minimal_fsdp.eval.lm import ShardedLM
    from minimal_fsdp.models.gpt import GPT, GPTConfig

    piece = "one, two. three\nfour. five"
    tokenizer = CharTokenizer(
        ["a", "b", piece]
    )  # its "characters" are words: a word-piece tokenizer
    model = GPT(
        GPTConfig(vocab_size=3, seq_length=16, num_layers=1, num_heads=1, embed_size=4, dropout=0)
    )
    favoured = torch.tensor([[0.0, 0.0, 1.0]])
    model.forward = lambda idx, targets=None, cache=None: favoured  # greedy picks `piece`
    lm = ShardedLM(model, tokenizer, torch.device("cpu"), progress=False)
    stops = {"\n then .": ["\n", "."], ". then \n": [".", "\n"], ". alone": ["."], "none": ["?"]}
    requests = [
        Instance("generate_until", {}, ("ab", {"until": until, "max_gen_toks": 2}), i)
        for i, until in enumerate(stops.values())
    ]
    assert lm.generate_until(requests, disable_tqdm=True) == [
        "one, two",
        "one, two",
        "one, two",
        piece + piece,
    ]


def test_generate_until_sizes_its_kv_cache_by_the_prompt_and_max_gen_toks(one_rank_group):
    """A model whose context is 2^12 positions (a Llama config's may say 2^24) asked for 3 tokens
    after a 2-token prompt: the cache holds 5 positions, not the whole context; the text is the
    same greedy decode."""
    from lm_eval.api.instance import Instance

    from minimal_fsdp.eval import lm as eval_lm
    from minimal_fsdp.models.gpt import GPT, GPTConfig

    tokenizer = CharTokenizer("abcdefgh")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, seq_length=2**12, num_layers=1, num_heads=2, embed_size=8))
    lengths, new_cache = [], model.new_cache
    model.new_cache = lambda *args: (
        lengths.append(new_cache(*args).k[0].size(2)) or new_cache(*args)
    )
    lm = eval_lm.ShardedLM(model, tokenizer, torch.device("cpu"), progress=False)
    request = Instance("generate_until", {}, ("ab", {"until": ["?"], "max_gen_toks": 3}), 0)
    (text,) = lm.generate_until([request], disable_tqdm=True)
    assert lengths == [2 + 3]
    ids = tokenizer.encode("ab")
    with torch.no_grad():
        for _ in range(3):
            ids.append(model(torch.tensor([ids])).argmax(dim=-1).item())
    assert text == tokenizer.decode(ids[2:])

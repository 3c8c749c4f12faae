"""Tiny tokenizers of each kind a Hugging Face model directory brings, built offline for the tests:
a byte-level BPE trained with `tokenizers` (as tokenizer.json, or as GPT-2's vocab.json +
merges.txt), a sentencepiece tokenizer.model (Llama 2) and a tiktoken-format tokenizer.model (Llama
3)."""

import base64
import contextlib
import io
import json
from pathlib import Path

from conftest import make_text

# Spaces (runs, leading, trailing), newlines (\n, \r\n, blank lines), tabs, digits and
# unseen unicode.
MIXED = [
    "ROMEO:\n  the  king's crown \u2014 na\u00efve caf\u00e9 \U0001f600\n\n\tend of it.  ",
    "KING: 42 or 1234567, 4.5e10\r\nthou   art\u00a0here \u4e2d\u6587 \u30c6\u30ad\u30b9\u30c8 "
    "\u1e9e",
    "x",
    "  leading spaces",
    "trailing newline\n",
]


def training_text():
    return make_text(20_000)


def bpe_tokenizer(vocab_size=400):
    """A byte-level BPE (GPT-2's scheme) with <|endoftext|> as its special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([training_text()], trainer)
    assert 300 <= tok.get_vocab_size() <= 500
    return tok


def write_tokenizer_json(directory):
    """tokenizer.json + tokenizer_config.json, as a hub download has them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": "<|endoftext|>",
            }
        )
    )
    return directory


def write_vocab_merges(directory):
    """GPT-2's older layout: vocab.json + merges.txt only (the eos token named by config.json, as
    the hub's gpt2)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe_tokenizer().model.save(str(directory))
    return directory


def write_sentencepiece(directory, vocab_size=300):
    from minimal_fsdp.data.tokenizer import train_tokenizer

    directory = Path(directory)
    train_tokenizer("sentencepiece", training_text(), vocab_size, directory / "sp")
    (directory / "tokenizer.model").write_bytes((directory / "sp" / "tokenizer.model").read_bytes())
    return directory


def tiktoken_ranks(vocab_size=350):
    """BPE ranks trained with tiktoken's own (educational) trainer on Llama 3's split pattern."""
    from tiktoken._educational import bpe_train

    from minimal_fsdp.data.tokenizer_files import LLAMA3_PATTERN

    with contextlib.redirect_stdout(io.StringIO()):
        return bpe_train(training_text()[:8000], vocab_size, LLAMA3_PATTERN, visualise=None)


def stub_gpt2_encoding(monkeypatch):
    """tiktoken's gpt2 encoding stood in for by a tiny one with GPT-2's split pattern (no gpt2 files
    offline); returns the stand-in."""
    import tiktoken

    from minimal_fsdp.data import tokenizer

    ranks = tiktoken_ranks()
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
    stub = tiktoken.Encoding(
        name="stub",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": len(ranks)},
    )
    monkeypatch.setattr(tokenizer, "gpt2_cached", lambda: True)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: stub)
    return stub


def write_tiktoken(directory):
    """Llama 3's tokenizer.model: "<base64 token> <rank>" lines; the special tokens are not in the
    file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = tiktoken_ranks()
    (directory / "tokenizer.model").write_bytes(
        b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items())
    )
    return directory, len(ranks)

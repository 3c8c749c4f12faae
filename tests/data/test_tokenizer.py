import base64
import json
import os
import pickle
import random
import subprocess
import sys

import pytest

from minimal_fsdp.data import tokenizer as tk
from minimal_fsdp.data.tokenizer import (
    CharTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_sentencepiece,
    load_tokenizer,
    train_tokenizer,
)

import tokenizer_dirs
from conftest import ROOT
from support import command


def sample_text(n_lines=1500, seed=0):
    rng = random.Random(seed)
    words = [
        "the",
        "king",
        "queen",
        "thou",
        "art",
        "my",
        "lord",
        "sweet",
        "night",
        "day",
        "love",
        "death",
        "sword",
        "crown",
        "hath",
        "doth",
        "O",
        "Romeo,",
        "farewell!",
        "42",
    ]
    return "\n".join(
        " ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(n_lines)
    )


def test_char_round_trip(tmp_path):
    text = sample_text(200)
    tok = train_tokenizer("char", text, None, tmp_path)
    assert tok.kind == "char" and tok.eot_id is None
    assert tok.chars == sorted(set(text)) and tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    meta = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert (
        meta["kind"] == "char"
        and meta["vocab_size"] == tok.vocab_size
        and meta["chars"] == tok.chars
    )
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.encode(text) == ids


def test_char_unknown_character():
    tok = CharTokenizer("abc ")
    with pytest.raises(TokenizerError, match="'z'"):
        tok.encode("a bz")


def test_sentencepiece_round_trip(tmp_path):
    text = sample_text()
    tok = train_tokenizer("sentencepiece", text, 300, tmp_path)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 300 and tok.eot_id is not None
    assert (tmp_path / "tokenizer.model").exists()
    assert json.loads((tmp_path / "tokenizer.json").read_text())["kind"] == "sentencepiece"
    ids = tok.encode(text)
    assert len(ids) < 0.8 * len(text)  # it learned merges, not just characters
    assert tok.decode(ids) == text
    # byte fallback: characters never seen in training still round-trip exactly
    odd = "Ünïcödé  spaces\ttabs\n\nand 😀"
    assert tok.decode(tok.encode(odd)) == odd
    again = load_tokenizer(tmp_path)
    assert isinstance(again, SentencePieceTokenizer) and again.encode(text) == ids
    assert load_sentencepiece(tmp_path / "tokenizer.model").encode(odd) == tok.encode(odd)


def test_sentencepiece_is_deterministic(tmp_path):
    text = sample_text(500)
    a = train_tokenizer("sentencepiece", text, 300, tmp_path / "a")
    b = train_tokenizer("sentencepiece", text, 300, tmp_path / "b")
    assert a.model_proto == b.model_proto


def test_sentencepiece_needs_vocab_size(tmp_path):
    with pytest.raises(TokenizerError, match="--vocab_size"):
        train_tokenizer("sentencepiece", sample_text(50), None, tmp_path)
    with pytest.raises(TokenizerError, match="--vocab_size"):
        train_tokenizer("sentencepiece", sample_text(50), 100, tmp_path)  # < 256 byte pieces


def test_unknown_kind(tmp_path):
    with pytest.raises(TokenizerError, match="--tokenizer"):
        train_tokenizer("wordpiece", "abc", None, tmp_path)


def test_load_tokenizer_reads_json_never_pickle(tmp_path, monkeypatch):
    CharTokenizer("hello").save(tmp_path)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load called"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    assert load_tokenizer(tmp_path).decode([0, 1]) == "eh"
    # a pickle where tokenizer.json should be is rejected as bad JSON, not unpickled
    (tmp_path / "tokenizer.json").write_bytes(pickle.dumps({"kind": "char"}))
    with pytest.raises(TokenizerError):
        load_tokenizer(tmp_path)


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def _forget_loaded_encodings(monkeypatch):
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})


def test_gpt2_offline_error(tmp_path, monkeypatch):
    # empty cache + every download failing at once: must raise TokenizerError quickly, not hang
    import tiktoken.load

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    _forget_loaded_encodings(monkeypatch)

    def offline(*a, **k):
        raise OSError("network is unreachable (simulated)")

    monkeypatch.setattr(tk.urllib.request, "urlopen", offline)
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(TokenizerError, match="--tokenizer gpt2") as e:
        train_tokenizer("gpt2", "", None, tmp_path / "tok")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "tok" / "tokenizer.json").exists()


def test_gpt2_download_error_after_probe(tmp_path, monkeypatch):
    # the host answers the probe but tiktoken's own download still fails
    import tiktoken.load

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    _forget_loaded_encodings(monkeypatch)
    monkeypatch.setattr(tk, "reachable", lambda url, timeout=5.0: True)

    def broken(*a, **k):
        raise ConnectionError("simulated")

    monkeypatch.setattr(tiktoken.load, "read_file", broken)
    with pytest.raises(TokenizerError, match="--tokenizer gpt2"):
        tk.GPT2Tokenizer()


def test_gpt2_round_trip(tmp_path):
    if not tk.gpt2_cached():
        pytest.skip(f"no cached tiktoken gpt2 files in {tk.tiktoken_cache_dir()!r}")
    tok = train_tokenizer("gpt2", "ignored", None, tmp_path)
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    text = "Hello world! <|endoftext|> is just text here."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and 50256 not in ids
    assert json.loads((tmp_path / "tokenizer.json").read_text())["kind"] == "gpt2"
    assert load_tokenizer(tmp_path).encode(text) == ids


def test_gpt2_wrapper_with_stub_encoding(tmp_path, monkeypatch):
    # no real gpt2 files offline: check our wrapper (ordinary encode, save/load) on a
    # byte-level stand-in
    import tiktoken

    stub = tiktoken.Encoding(
        name="stub",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )
    monkeypatch.setattr(tk, "gpt2_cached", lambda: True)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: stub)
    tok = train_tokenizer("gpt2", "ignored", None, tmp_path)
    assert tok.vocab_size == 257 and tok.eot_id == 256
    text = "héllo <|endoftext|> world"
    ids = tok.encode(text)
    assert 256 not in ids and tok.decode(ids) == text
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == {
        "kind": "gpt2",
        "vocab_size": 257,
    }
    assert load_tokenizer(tmp_path).encode(text) == ids


# -----------------------------------------------------------------------------
# a Hugging Face directory's own tokenizer, offline: each kind loads, and encodes as
# transformers does


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub, and an empty tiktoken cache: nothing may be fetched."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-tiktoken-cache"))
    monkeypatch.setattr(tk.urllib.request, "urlopen", lambda *a, **k: pytest.fail("network used"))


def auto_tokenizer(directory):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def assert_encodes_like(ours, theirs, texts):
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == text


def test_tokenizer_json(tmp_path, offline):
    directory = tokenizer_dirs.write_tokenizer_json(tmp_path / "hf")
    tok = load_tokenizer(directory)
    assert tok.kind == "hf" and 300 <= tok.vocab_size <= 500
    assert tok.eot_id == tok.tok.token_to_id("<|endoftext|>")  # named by tokenizer_config.json
    assert_encodes_like(tok, auto_tokenizer(directory), tokenizer_dirs.MIXED)
    # a special token's text in the data is ordinary text, as gpt2's encode_ordinary reads it
    assert tok.eot_id not in tok.encode("a <|endoftext|> b")


@pytest.mark.parametrize("asks", ["truncation", "fixed padding", "padding to a multiple"])
def test_a_tokenizer_jsons_truncation_and_padding_are_not_applied(tmp_path, offline, asks):
    """A tokenizer.json may carry settings for batches of model inputs (many carry a max_length of
    512); transformers applies them only when asked, and so do we: the file's truncation had cut
    every document to max_length tokens, and its padding added pad ids to the data."""
    from tokenizers import Tokenizer

    directory = tokenizer_dirs.write_tokenizer_json(tmp_path / "hf")
    plain = load_tokenizer(directory)
    asking = Tokenizer.from_file(str(directory / "tokenizer.json"))
    if asks == "truncation":
        asking.enable_truncation(3)
    elif asks == "fixed padding":
        asking.enable_padding(length=64)
    else:
        asking.enable_padding(pad_to_multiple_of=64)
    asking.save(str(directory / "tokenizer.json"))
    tok = load_tokenizer(directory)
    assert_encodes_like(tok, auto_tokenizer(directory), tokenizer_dirs.MIXED)
    assert tok.encode_batch(tokenizer_dirs.MIXED) == plain.encode_batch(tokenizer_dirs.MIXED)
    assert any(len(plain.encode(text)) > 3 for text in tokenizer_dirs.MIXED)


def test_vocab_json_and_merges_txt(tmp_path, offline):
    directory = tokenizer_dirs.write_vocab_merges(tmp_path / "gpt2")
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "eos_token_id": 0}))
    tok = load_tokenizer(directory)
    assert tok.kind == "hf" and tok.eot_id == 0  # <|endoftext|>, id 0 in this vocabulary
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer"})
    )
    assert_encodes_like(tok, auto_tokenizer(directory), tokenizer_dirs.MIXED)


def test_sentencepiece_tokenizer_model(tmp_path, offline):
    directory = tokenizer_dirs.write_sentencepiece(tmp_path / "llama2")
    tok = load_tokenizer(directory)
    assert isinstance(tok, SentencePieceTokenizer) and tok.eot_id == 2 and tok.bos_id == 1
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer"})
    )
    # transformers' (non-legacy) Llama tokenizer drops sentencepiece's dummy-prefix "▁" before a
    # leading space; on text that starts with a letter the two agree
    assert_encodes_like(
        tok, auto_tokenizer(directory), [t for t in tokenizer_dirs.MIXED if not t[0].isspace()]
    )


def test_llama3_tiktoken_tokenizer_model(tmp_path, offline):
    directory, num_ranks = tokenizer_dirs.write_tiktoken(tmp_path / "llama3")
    tok = load_tokenizer(directory)
    # Meta's 256 special tokens follow
    assert tok.kind == "tiktoken" and tok.vocab_size == num_ranks + 256
    # <|begin_of_text|>, <|end_of_text|>
    assert tok.bos_id == num_ranks and tok.eot_id == num_ranks + 1
    assert tok.decode([num_ranks + 9]) == "<|eot_id|>"
    # transformers converts a tiktoken file itself when told to build a fast tokenizer from it
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    assert_encodes_like(tok, auto_tokenizer(directory), tokenizer_dirs.MIXED)
    # config.json's ids name the special tokens, as a Llama 3 checkpoint's do
    (directory / "config.json").write_text(
        json.dumps({"eos_token_id": num_ranks + 9, "bos_token_id": num_ranks})
    )
    (directory / "tokenizer_config.json").unlink()
    assert load_tokenizer(directory).eot_id == num_ranks + 9


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_directory_tokenizers_save_and_load_as_json(tmp_path, offline, monkeypatch, kind):
    if kind == "hf":
        directory = tokenizer_dirs.write_tokenizer_json(tmp_path / "source")
    else:
        directory, _ = tokenizer_dirs.write_tiktoken(tmp_path / "source")
    tok = load_tokenizer(directory)
    tok.save(tmp_path / "saved")  # what a prepared dataset (and so a checkpoint) keeps
    assert json.loads((tmp_path / "saved" / "tokenizer.json").read_text())["kind"] == kind
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load called"))
    again = load_tokenizer(tmp_path / "saved")
    assert (again.kind, again.vocab_size, again.eot_id, again.bos_id, again.label) == (
        tok.kind,
        tok.vocab_size,
        tok.eot_id,
        tok.bos_id,
        tok.label,
    )
    assert all(again.encode(t) == tok.encode(t) for t in tokenizer_dirs.MIXED)


def test_a_directory_without_a_tokenizer_or_with_a_bad_one(tmp_path, offline):
    with pytest.raises(TokenizerError, match="holds no tokenizer: expected tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="cannot read sentencepiece model"):
        load_tokenizer(tmp_path)


# -----------------------------------------------------------------------------
# --tokenizer_dir: a directory's tokenizer for a fresh model, and for `minimal-fsdp prepare`


def test_tokenizer_dir_flag_rules():
    from minimal_fsdp.config.flags import ConfigError, parse_args

    assert parse_args(["--tokenizer_dir", "some/dir"]).tokenizer_dir == "some/dir"
    with pytest.raises(
        ConfigError, match="--tokenizer_dir replaces --tokenizer: drop --tokenizer gpt2"
    ):
        parse_args(["--tokenizer_dir", "some/dir", "--tokenizer", "gpt2"])
    with pytest.raises(
        ConfigError, match="prepared --dataset_path carries its own tokenizer: drop --tokenizer_dir"
    ):
        parse_args(["--tokenizer_dir", "some/dir", "--dataset_path", "data/x"])


@pytest.mark.slow
def test_a_fresh_model_trains_offline_with_llama3s_tokenizer(tmp_path, corpus):
    from minimal_fsdp.checkpoint import find
    from minimal_fsdp.checkpoint.meta import read_meta
    from minimal_fsdp.data.tokens import TokenData

    from conftest import TINY_MODEL, launch

    directory, num_ranks = tokenizer_dirs.write_tiktoken(tmp_path / "llama3")
    offline = {
        "HF_HUB_OFFLINE": "1",
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
    }
    launch(
        [
            "--tokenizer_dir",
            directory,
            "--dataset",
            "text",
            "--input_file",
            corpus,
            *TINY_MODEL,
            "--model",
            "llama",
            "--num_kv_heads",
            1,
            "--max_steps",
            2,
            "--eval_interval",
            0,
        ],
        ranks=2,
        cwd=tmp_path,
        env=offline,
    )
    tokenizer = load_tokenizer(directory)
    # named by the tokenizer's files
    data = TokenData(tmp_path / "data" / "corpus" / tokenizer.label)
    text = corpus.read_text()
    assert (
        data.tokenizer.kind == "tiktoken"
        and data.splits["train"][:500].tolist() == tokenizer.encode(text)[:500]
    )
    saved = find.latest(tmp_path / "checkpoints" / "corpus")
    # the tokenizer's vocabulary
    assert read_meta(saved)["model"]["vocab_size"] == num_ranks + 256
    # the checkpoint carries it
    assert load_tokenizer(saved).encode(text[:1000]) == tokenizer.encode(text[:1000])


def test_prepare_with_a_tokenizer_dir(tmp_path, offline):
    from minimal_fsdp.data.documents import encode_document, is_val
    from minimal_fsdp.data.tokens import TokenData

    directory = tokenizer_dirs.write_tokenizer_json(tmp_path / "hf")
    tokenizer = load_tokenizer(directory)
    documents = [
        sample_text(20, seed=i) + f"\ndocument {i} \u00e9\u00e8 \U0001f600" for i in range(40)
    ]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    out = command(
        "prepare",
        *[
            "--dataset",
            "text",
            "--input_file",
            str(tmp_path / "docs.jsonl"),
            "--tokenizer_dir",
            str(directory),
            "--data_dir",
            str(tmp_path / "data"),
            "--num_proc",
            "2",
        ],
    )
    assert out == tmp_path / "data" / "docs" / tokenizer.label
    data = TokenData(out)  # the workers tokenized with the tokenizer saved there
    expected = [
        t
        for i, d in enumerate(documents)
        if not is_val(i, 1337, 0.1)
        for t in encode_document(tokenizer, d)
    ]
    assert data.splits["train"].tolist() == expected and tokenizer.eot_id in expected


@pytest.mark.parametrize(
    "vocab_size,fix",
    [(300, r"use --vocab_size \d+ or more"), (100_000, "use a smaller --vocab_size, or more text")],
)
def test_sentencepiece_vocabulary_errors_say_which_way_to_go(vocab_size, fix):
    text = "".join(f"{chr(0x100 + i)} the king and the queen, line {i}\n" for i in range(400))
    with pytest.raises(tk.TokenizerError, match=fix) as raised:
        tk.train_tokenizer("sentencepiece", text, vocab_size, None)
    # never both directions at once
    assert ("or more text" in str(raised.value)) == (vocab_size > 1000)


def test_sentencepiece_learns_from_lines_longer_than_its_limit(tmp_path):
    """sentencepiece's trainer skips lines over 4192 bytes; a text of long lines (one document a
    line) used to leave it nothing ("!sentences_.empty()") at every --vocab_size. Long lines are cut
    into pieces first."""
    from minimal_fsdp.data import tokenizer

    long_lines = "\n".join(sample_text(2_000).replace("\n", " ") + f" line {i} é" for i in range(5))
    assert (
        min(len(line.encode()) for line in long_lines.splitlines()) > tokenizer.MAX_SENTENCE_BYTES
    )
    tok = train_tokenizer("sentencepiece", long_lines, 300, tmp_path)
    assert tok.vocab_size == 300 and tok.decode(tok.encode(long_lines)) == long_lines
    pieces = list(tokenizer._sentences(long_lines))
    assert all(len(p.encode()) <= tokenizer.MAX_SENTENCE_BYTES for p in pieces)
    assert "".join(pieces) == long_lines.replace("\n", "")  # cut, nothing lost


# -----------------------------------------------------------------------------
# bad or unusual tokenizer files: one line, and decoding as transformers decodes


def test_char_encoding_names_every_missing_character():
    """A prompt with several characters the vocabulary lacks names them all, not the first alone."""
    tok = CharTokenizer("abc ")
    with pytest.raises(TokenizerError) as error:
        tok.encode("a bzQz\u00e9x")
    message = str(error.value)
    assert message.startswith(
        "4 characters 'Q' (U+0051), 'x' (U+0078), 'z' (U+007A), '\u00e9' (U+00E9) are not in"
    )
    assert "\n" not in message


def bpe_json(**model):
    """A tiny tokenizer.json with a BPE model: vocabulary a, b, ab and one merge, changed by
    `model`."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": dict(
            {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "vocab": {"a": 0, "b": 1, "ab": 2},
                "merges": ["a b"],
            },
            **model,
        ),
    }


@pytest.mark.parametrize(
    "model, named",
    [
        # merges naming tokens the vocabulary lacks
        ({"merges": ["a b", "x y"]}, "Token `x` out of vocabulary"),
        # the library panics
        ({"continuing_subword_prefix": "##", "end_of_word_suffix": "</w>"}, "PanicException"),
    ],
)
def test_a_tokenizer_json_the_library_cannot_run_is_one_line(
    tmp_path, offline, model, named, capfd, monkeypatch
):
    monkeypatch.setenv("RUST_BACKTRACE", "1")  # read by the panic hook on each panic
    (tmp_path / "tokenizer.json").write_text(json.dumps(bpe_json(**model)))
    with pytest.raises(TokenizerError) as error:
        # at load, alike on every rank: not at the prompt, nor mid-training
        load_tokenizer(tmp_path)
    assert named in str(error.value) and "\n" not in str(error.value)
    # the library's own panic text and backtrace are not printed before the one line
    assert capfd.readouterr().err == ""


def test_what_the_library_writes_to_stderr_while_a_tokenizer_loads_is_passed_on(capfd):
    """Held only to drop a failure's panic text: a load that succeeds passes it on."""
    import os

    from minimal_fsdp.data import tokenizer_files

    with tokenizer_files._panic_text_held():
        os.write(2, b"a warning from the library\n")
    assert capfd.readouterr().err == "a warning from the library\n"


# A child that loads a tokenizer with 2 GiB more address space than its imports took: past that
# the Rust library's allocations fail and abort the child, not this test process.
LOAD_BOUNDED = """
import resource, sys
from minimal_fsdp.data.tokenizer import TokenizerError, load_tokenizer
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + 2 * 2**30, resource.RLIM_INFINITY))
try:
    print("loaded", load_tokenizer(sys.argv[1]).vocab_size)
except TokenizerError as e:
    print(e)
"""


def load_bounded(directory):
    """LOAD_BOUNDED run on `directory`: the child's CompletedProcess (stdout: its one line)."""
    return subprocess.run(
        [sys.executable, "-c", LOAD_BOUNDED, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab.json + merges.txt", "tokenizer.model"])
def test_a_token_id_past_the_largest_vocabulary_is_one_line(tmp_path, layout):
    """An id of 2^31 - 1 in a tokenizer.json loaded, then made `tokenizers` ask for 8 GB as it
    wrote the tokenizer out, and the process aborted (the fuzzer found it). Every directory
    layout now refuses an id past config/checks.py's largest vocabulary, in one line, at load."""
    big = 2**31 - 1
    vocab = {"a": 0, "b": 1, "ab": big}
    if layout == "tokenizer.json":
        (tmp_path / "tokenizer.json").write_text(json.dumps(bpe_json(vocab=vocab)))
    elif layout == "vocab.json + merges.txt":
        (tmp_path / "vocab.json").write_text(json.dumps(vocab))
        (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    else:  # Llama 3's tiktoken ranks: the 256 bytes, then one merge
        ranks = [(bytes([i]), i) for i in range(256)] + [(b"ab", big)]
        lines = [f"{base64.b64encode(t).decode()} {rank}" for t, rank in ranks]
        (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    child = load_bounded(tmp_path)
    assert child.returncode == 0, child.stderr[-2000:]
    out = child.stdout.strip()
    assert "\n" not in out and "2,147,483,647, past 16,777,215" in out, out
    assert layout.split()[0] in out, out  # names the file


def test_a_huge_padding_length_in_a_tokenizer_json_is_not_allocated(tmp_path):
    """Padding to 2^40 tokens, asked by the file, aborted the process at load as the library
    allocated it (no padding is applied any more:
    test_a_tokenizer_jsons_truncation_and_padding_are_not_applied)."""
    tj = bpe_json()
    tj["padding"] = {
        "strategy": {"Fixed": 2**40},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "a",
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    child = load_bounded(tmp_path)
    assert (child.returncode, child.stdout.strip()) == (0, "loaded 3"), child.stderr[-2000:]


def test_a_tokenizer_json_without_tokens_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(bpe_json(vocab={}, merges=[])))
    with pytest.raises(TokenizerError, match="tokenizer.json: it holds no tokens") as error:
        load_tokenizer(tmp_path)  # was max() of an empty sequence: a traceback
    assert "\n" not in str(error.value)


def test_merges_txt_naming_tokens_the_vocabulary_lacks_is_one_line(tmp_path, offline):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nb a\n")
    with pytest.raises(
        TokenizerError, match="cannot read .*vocab.json and merges.txt .*`ba` out of vocabulary"
    ):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab.json + merges.txt"])
def test_decoding_special_tokens_is_transformers_decoding(tmp_path, offline, layout):
    """Ids with special tokens among them (an end of text mid-sample) decode as transformers decodes
    them: the special token's text kept where it stands."""
    if layout == "tokenizer.json":
        directory = tokenizer_dirs.write_tokenizer_json(tmp_path / "hf")
    else:
        directory = tokenizer_dirs.write_vocab_merges(tmp_path / "hf")
        (directory / "config.json").write_text(
            json.dumps({"model_type": "gpt2", "eos_token_id": 0})
        )
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})
        )
    ours, theirs = load_tokenizer(directory), auto_tokenizer(directory)
    assert ours.eot_id is not None
    ids = [
        *ours.encode("the king"),
        ours.eot_id,
        *ours.encode(" ROMEO:\n"),
        ours.eot_id,
        ours.eot_id,
    ]
    assert ours.decode(ids) == theirs.decode(ids) and ours.decode(ids).count("<|endoftext|>") == 3

"""Tokenizers in other projects' files, as a model directory brings them: Hugging Face's
tokenizer.json (or GPT-2's vocab.json + merges.txt) through the `tokenizers` library, and Llama 3's
tiktoken-format tokenizer.model; the special tokens such a directory names; and what every tokenizer
shares (TokenizerError, the tokenizer.json that save() writes). tokenizer.py finds which one a
directory holds (load_tokenizer).
"""

import base64
import hashlib
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from minimal_fsdp.config.checks import WHOLE_RANGES
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.files import read_json, shown, write_atomic

SIDE_FILE_BYTES = 64 * 2**20  # tokenizer_config.json, config.json: a few KB (some carry templates)
# The largest vocabulary a model takes (config/checks.py). A tokenizer.json whose ids go past it is
# refused before the library writes it out: `tokenizers` (0.23) then lists every missing id up to
# the largest, so one id of 2^31 - 1 asked for 8 GB and aborted the process.
MAX_VOCAB = WHOLE_RANGES["vocab_size"][1]
# End-of-text tokens to look for when no tokenizer_config.json or config.json names one.
EOS_GUESSES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class TokenizerError(ConfigError):
    """A one-line, user-facing problem with the tokenizer settings or files."""


# The `tokenizers` library raises Exception for what it checks, and pyo3's PanicException (a
# BaseException) where its Rust code panics on a model it did not check (affixes or merges it cannot
# apply): both are caught, Ctrl-C is not.
INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)
PROBE = "Probe: a text, 0-9, a space and\na newline."


def _first_line(error):
    return shown((str(error).strip().splitlines() or [type(error).__name__])[0], 200)


@contextmanager
def _one_line(what):
    """A panic inside the library while it runs is a TokenizerError, not a traceback."""
    try:
        yield
    except (*INTERRUPTS, TokenizerError):
        raise
    except BaseException as e:  # noqa: BLE001
        raise TokenizerError(
            f"the Hugging Face tokenizer cannot {what} ({type(e).__name__}: {_first_line(e)})"
        ) from None


@contextmanager
def _panic_text_held():
    """A panic in the Rust library writes "thread ... panicked at" (and, with RUST_BACKTRACE, a
    backtrace) straight to file descriptor 2 before Python sees the PanicException: what is written
    there meanwhile is held in a file, dropped when the block fails (its one-line error carries the
    panic's message) and passed on when it succeeds."""
    sys.stderr.flush()
    saved = os.dup(2)
    failed = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not failed:
                held.seek(0)
                text = held.read()
                if text:
                    os.write(2, text)


def _hint(error):
    """What to do about a tokenizer.json the library refuses: only a format it does not know (an
    unknown variant or field) may be a newer library's; a token the file names but its vocabulary
    lacks, or any other inconsistency, is a damaged file."""
    text = str(error)
    if type(error) is not Exception:
        return "the `tokenizers` library cannot run its model"
    if "out of vocabulary" in text:
        return (
            "its merges (or added tokens) name a token its vocabulary lacks: the file is damaged "
            "or hand-edited; take it again from the model it came with"
        )
    if "variant" in text or "unknown field" in text:
        return "is `tokenizers` older than the one that wrote it? pip install -U tokenizers"
    return "the file does not hold a tokenizer the `tokenizers` library reads: take it again"


def _write_json(directory, meta):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False)


def _check_largest_id(largest, where):
    """largest, the largest token id of the tokenizer in `where`; one line if it holds no tokens
    (-1) or an id past MAX_VOCAB."""
    if not 0 <= largest < MAX_VOCAB:
        problem = (
            "it holds no tokens"
            if largest < 0
            else f"a token's id is {largest:,}, past {MAX_VOCAB - 1:,} (the largest vocabulary a "
            "model takes)"
        )
        raise TokenizerError(
            f"cannot read {where}: {problem}: the file is damaged; take it again from the model it "
            "came with"
        )
    return largest


def _largest_id(tok, where):
    """The largest token id of a `tokenizers` Tokenizer, checked (before the library writes it
    out: MAX_VOCAB)."""
    return _check_largest_id(max(tok.get_vocab(with_added_tokens=True).values(), default=-1), where)


def _digest(data):
    return hashlib.sha1(data if isinstance(data, bytes) else data.encode()).hexdigest()[:12]


# -----------------------------------------------------------------------------
# hf: a Hugging Face tokenizer.json, through the `tokenizers` library that defines the format


class HFTokenizer:
    """encode() adds no special tokens (no BOS) and reads a special token's text in the data (a
    literal "<|endoftext|>") as ordinary text, as gpt2's encode_ordinary does: documents are
    separated by eot_id only."""

    kind = "hf"

    def __init__(self, tokenizer_json, eos_token=None, bos_token=None, guess_eos=False):
        from tokenizers import Tokenizer

        try:
            with _panic_text_held():
                self.tok = Tokenizer.from_str(tokenizer_json)
                largest = _largest_id(self.tok, "this Hugging Face tokenizer.json")
                # A file's truncation and padding are for batches of model inputs; transformers
                # applies them only when asked, and nothing here asks: a max_length of 512 would
                # cut every document to its first 512 tokens, padding would add pad ids to the
                # data, and a padding length of 2^40 aborted the process as it allocated.
                self.tok.no_truncation()
                self.tok.no_padding()
                # a model the library cannot run panics here, not at the prompt or mid-training
                self.tok.encode(PROBE, add_special_tokens=False)
                # canonical, so the same tokenizer always gets the same label
                self.json = self.tok.to_str()
        except BaseException as e:  # noqa: BLE001 - parse errors (Exception) and panics alike
            if isinstance(e, (*INTERRUPTS, TokenizerError)):
                raise
            hint = _hint(e)
            raise TokenizerError(
                f"cannot read this Hugging Face tokenizer.json "
                f"({type(e).__name__}: {_first_line(e)}): {hint}"
            ) from None
        self.tok.encode_special_tokens = True
        self.vocab_size = largest + 1
        self.eos_token, self.bos_token = self._name(eos_token), self._name(bos_token)
        if self.eos_token is None and guess_eos:
            self.eos_token = next(
                (t for t in EOS_GUESSES if self.tok.token_to_id(t) is not None), None
            )
        self.eot_id, self.bos_id = self._id(self.eos_token), self._id(self.bos_token)
        self.label = "hf-" + _digest(self.json)

    def _name(self, token):
        """A token given by name or by id (as config.json gives them) -> its name, if it is in the
        vocabulary."""
        if isinstance(token, int):
            return self.tok.id_to_token(token)
        return token if token is not None and self.tok.token_to_id(token) is not None else None

    def _id(self, name):
        return None if name is None else self.tok.token_to_id(name)

    def encode(self, text):
        with _one_line("encode a text"):
            return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        """[encode(text) for text in texts], in the library's threads (no padding: __init__)."""
        with _one_line("encode a text"):
            encodings = self.tok.encode_batch(list(texts), add_special_tokens=False)
            return [encoding.ids for encoding in encodings]

    def decode(self, ids):
        with _one_line("decode token ids"):
            return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory):
        _write_json(
            directory,
            {
                "kind": self.kind,
                "vocab_size": self.vocab_size,
                "eos_token": self.eos_token,
                "bos_token": self.bos_token,
                "tokenizer": json.loads(self.json),
            },
        )


def _byte_level_bpe(directory, eos, bos):
    """GPT-2's vocab.json + merges.txt as a tokenizers BPE, the way transformers' GPT2TokenizerFast
    builds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = Path(directory)
    try:
        tok = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
    except BaseException as e:  # noqa: BLE001 - merges naming tokens the vocabulary lacks, ...
        if isinstance(e, INTERRUPTS):
            raise
        raise TokenizerError(
            f"cannot read {d}/vocab.json and merges.txt ({_first_line(e)})"
        ) from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _largest_id(tok, f"{d}/vocab.json")
    vocab = tok.get_vocab()
    named = [t for t in (eos, bos, *EOS_GUESSES) if isinstance(t, str) and t in vocab]
    tok.add_special_tokens(list(dict.fromkeys(named)))  # marks them special; their ids stay
    return HFTokenizer(tok.to_str(), eos, bos, guess_eos=True)


# -----------------------------------------------------------------------------
# tiktoken: Llama 3's tokenizer.model, lines of "<base64 token bytes> <rank>"; the special
# tokens are not in the file, they are numbered after its ranks (Meta's list, or
# tokenizer_config.json's added_tokens_decoder)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIAL))]


def parse_tiktoken(data, where="tokenizer.model"):
    """{token bytes: rank}. Not tiktoken.load.load_tiktoken_bpe: that one copies a local file into
    tiktoken's cache under its path and reads the copy next time, so a changed file at the same path
    would be read stale."""
    ranks = {}
    try:
        for line in data.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except ValueError:
        raise TokenizerError(
            f"{where} is neither a sentencepiece model nor tiktoken BPE ranks "
            f"(bad line {line[:60]!r})"
        ) from None
    return ranks


def _looks_like_tiktoken(data):
    first = data[: data.find(b"\n")] if b"\n" in data else data
    parts = first.split()
    return (
        len(parts) == 2
        and parts[1].isdigit()
        and all(c in b"+/=" or chr(c).isalnum() for c in parts[0])
    )


class TiktokenCalls:
    """Encoding and decoding through a tiktoken Encoding (self.enc): GPT-2's and a Llama 3
    tokenizer.model's."""

    def encode(self, text):
        # ordinary: a literal "<|endoftext|>" in the data is just text, not the special token
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts):
        """[encode(text) for text in texts], in tiktoken's threads (outside the GIL)."""
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids):
        return self.enc.decode(list(ids))


class TiktokenTokenizer(TiktokenCalls):
    kind = "tiktoken"

    def __init__(
        self, ranks_file, special_tokens, pattern=LLAMA3_PATTERN, eos_token=None, bos_token=None
    ):
        import tiktoken

        self.ranks_file = bytes(ranks_file)
        self.ranks, self.pattern, self.special_tokens = (
            parse_tiktoken(self.ranks_file),
            pattern,
            dict(special_tokens),
        )
        try:
            self.enc = tiktoken.Encoding(
                name="tokenizer.model",
                pat_str=pattern,
                mergeable_ranks=self.ranks,
                special_tokens=self.special_tokens,
            )
        except ValueError as e:
            raise TokenizerError(f"tiktoken cannot build this tokenizer.model: {e}") from None
        self.vocab_size = _check_largest_id(self.enc.n_vocab - 1, "tokenizer.model") + 1
        self.eos_token = eos_token if eos_token in self.special_tokens else None
        self.bos_token = bos_token if bos_token in self.special_tokens else None
        self.eot_id, self.bos_id = (
            self.special_tokens.get(self.eos_token),
            self.special_tokens.get(self.bos_token),
        )
        self.label = "tiktoken-" + _digest(self.ranks_file)

    def save(self, directory):
        _write_json(
            directory,
            {
                "kind": self.kind,
                "vocab_size": self.vocab_size,
                "model_file": "tokenizer.model",
                "pattern": self.pattern,
                "special_tokens": self.special_tokens,
                "eos_token": self.eos_token,
                "bos_token": self.bos_token,
            },
        )
        write_atomic(
            os.path.join(directory, "tokenizer.model"), lambda tmp: tmp.write_bytes(self.ranks_file)
        )


def _llama3_tokenizer(directory, data, eos, bos):
    config = _read_json(Path(directory) / "tokenizer_config.json")
    added = {v["content"]: int(k) for k, v in config.get("added_tokens_decoder", {}).items()}
    ranks = parse_tiktoken(data, f"{directory}/tokenizer.model")
    special = added or {name: len(ranks) + i for i, name in enumerate(LLAMA3_SPECIAL)}
    names = {i: name for name, i in special.items()}
    eos, bos = names.get(eos, eos), names.get(bos, bos)  # ids (config.json's) -> names
    return TiktokenTokenizer(
        data,
        special,
        LLAMA3_PATTERN,
        eos if eos in special else "<|end_of_text|>",
        bos if bos in special else "<|begin_of_text|>",
    )


# -----------------------------------------------------------------------------
# the special tokens a Hugging Face directory names


def _read_json(path):
    """A small JSON object beside a tokenizer (its config, special tokens), read as every file of
    ours is (files.read_json); {} where it is missing or unreadable."""
    try:
        return read_json(path, SIDE_FILE_BYTES, follow_links=True)
    except (OSError, ValueError):
        return {}


def special_tokens(directory):
    """(eos, bos) that a Hugging Face directory names: token strings from tokenizer_config.json or
    special_tokens_map.json, else ids from config.json; None where none is named."""
    d = Path(directory)

    def text(token):  # "</s>" or {"content": "</s>", ...}
        return token.get("content") if isinstance(token, dict) else token

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        found = _read_json(d / name)
        eos, bos = text(found.get("eos_token")), text(found.get("bos_token"))
        if eos or bos:
            return eos, bos
    config = _read_json(d / "config.json")

    def first(value):  # Llama 3.1 instruct lists several eos ids
        return (
            value[0]
            if isinstance(value, list) and value
            else value
            if isinstance(value, int)
            else None
        )

    return first(config.get("eos_token_id")), first(config.get("bos_token_id"))

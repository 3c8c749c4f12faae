"""
Tokenizers behind one tiny interface: .kind, .vocab_size, .eot_id (end of text, or None), .bos_id
(or None), .label (names a prepared dataset's directory), encode(text) -> list[int],
encode_batch(texts) (the same, in the library's threads where it has them), decode(ids) -> str,
save(directory).

Fit or fetched here (--tokenizer): char, gpt2 (tiktoken's BPE) and sentencepiece (trained on the
text). Brought by a directory (load_tokenizer; --tokenizer_dir, --hf_model), looked for in this
order:
    tokenizer.json            Hugging Face's, read by the `tokenizers` library        -> kind "hf"
    vocab.json + merges.txt   GPT-2's byte-level BPE files, built with `tokenizers`   -> kind "hf"
    tokenizer.model           a sentencepiece model (Llama 2)                         -> kind
                              "sentencepiece"
                              or Llama 3's tiktoken-format BPE ranks, via tiktoken    -> kind
                              "tiktoken"
All load offline. A saved tokenizer is our small 'tokenizer.json' naming its kind (plus
'tokenizer.model' for sentencepiece and tiktoken); a Hugging Face tokenizer is kept inside it as its
own JSON. Never pickle. The Hugging Face and tiktoken-format tokenizers live in tokenizer_files.py;
this module fits, fetches and finds.
"""

import hashlib
import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

# The tokenizers of other projects' files, and what all tokenizers share (re-exported: callers
# import them here).
from minimal_fsdp.data.tokenizer_files import (
    HFTokenizer,
    TiktokenCalls,
    TiktokenTokenizer,
    TokenizerError,
    _byte_level_bpe,
    _digest,
    _llama3_tokenizer,
    _looks_like_tiktoken,
    _write_json,
    special_tokens,
)
from minimal_fsdp.files import parse_json, read_bytes, read_text, shown, write_atomic

# A tokenizer file's cap: Llama 3's tokenizer.json is 9 MB, Gemma 3's 33 MB; a larger file is
# refused before it is read, so that refusing it takes no time (the tokenizers library would parse
# all of it first).
MAX_TOKENIZER_BYTES = 64 * 2**20
# the fields each saved kind reads without a default
KIND_NEEDS = {"hf": ("tokenizer",), "tiktoken": ("special_tokens", "pattern")}
MAX_CHARS = 2**21  # a char vocabulary: at most every Unicode code point
TOKENIZER_KINDS = ("char", "gpt2", "sentencepiece")  # what --tokenizer fits or fetches
SAVED_KINDS = TOKENIZER_KINDS + ("hf", "tiktoken")  # what our tokenizer.json may name


# -----------------------------------------------------------------------------
# char: one id per character, characters sorted by codepoint


class CharTokenizer:
    kind = "char"
    label = "char"
    eot_id = bos_id = None

    def __init__(self, chars):
        self.chars = sorted(set(chars))
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    def encode(self, text):
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError:
            missing = sorted(set(text) - self.stoi.keys())  # every one, so one fix covers them all
            shown = ", ".join(f"{ch!r} (U+{ord(ch):04X})" for ch in missing[:20])
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            one = len(missing) == 1
            raise TokenizerError(
                f"{'character' if one else f'{len(missing)} characters'} {shown}{more} "
                f"{'is' if one else 'are'} not in the --tokenizer char vocabulary built from the "
                f"training text: rebuild it from text that contains {'it' if one else 'them'}, "
                "or use --tokenizer gpt2 / sentencepiece"
            ) from None

    def encode_batch(self, texts):
        return [self.encode(text) for text in texts]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def save(self, directory):
        _write_json(
            directory, {"kind": self.kind, "vocab_size": self.vocab_size, "chars": self.chars}
        )


# -----------------------------------------------------------------------------
# gpt2: tiktoken's BPE. tiktoken downloads its two encoding files on first use
# (with no timeout), so we look for them in its cache before letting it try.

GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
GPT2_OFFLINE = (
    "--tokenizer gpt2 needs tiktoken's gpt2 encoding files, which could not be downloaded "
    "(offline?): copy a warm tiktoken cache into $TIKTOKEN_CACHE_DIR, use --tokenizer_dir with "
    "a downloaded GPT-2's directory (its tokenizer.json), or --tokenizer char / sentencepiece"
)


def tiktoken_cache_dir():
    # same lookup order as tiktoken.load.read_file_cached
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def gpt2_cached():
    """True if both gpt2 files are in tiktoken's cache (it names them by the sha1 of their URL)."""
    d = tiktoken_cache_dir()
    return d != "" and all(
        os.path.exists(os.path.join(d, hashlib.sha1(u.encode()).hexdigest())) for u in GPT2_URLS
    )


def reachable(url, timeout=5.0):
    """Whether a server answers at url: a quick HEAD (urllib honours proxy settings), so an
    unreachable host (an offline compute node) fails in seconds, not after minutes of retries."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        # the server answered (an error page): let the caller try and report what went wrong
        return True
    except OSError:
        return False


def _gpt2_encoding():
    import tiktoken

    if not gpt2_cached() and not reachable(GPT2_URLS[0]):
        raise TokenizerError(GPT2_OFFLINE)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests' connection/HTTP errors, hash mismatches, ...
        raise TokenizerError(f"{GPT2_OFFLINE} [{type(e).__name__}]") from e


class GPT2Tokenizer(TiktokenCalls):
    kind = "gpt2"
    label = "gpt2"

    def __init__(self):
        self.enc = _gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_id = self.bos_id = self.enc.eot_token  # 50256, GPT-2's bos and eos alike
        # tiktoken keeps these without public accessors; the Hugging Face export converts
        # them (hf/read.py)
        self.ranks, self.pattern, self.special_tokens = (
            self.enc._mergeable_ranks,
            self.enc._pat_str,
            self.enc._special_tokens,
        )

    def save(self, directory):
        _write_json(directory, {"kind": self.kind, "vocab_size": self.vocab_size})


# -----------------------------------------------------------------------------
# sentencepiece: wraps a serialized .model (ours, or a Llama 2 checkpoint's tokenizer.model)


class SentencePieceTokenizer:
    kind = "sentencepiece"

    def __init__(self, model_proto):
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        # an empty or damaged model (a piece that is not UTF-8) loads without a word, then fails at
        # the first decode: every piece is decoded once now (milliseconds for 32K pieces)
        self.sp.decode(self.sp.encode("Probe 0-9.") + list(range(self.sp.get_piece_size())))
        self.vocab_size = self.sp.get_piece_size()
        self.eot_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.label = "sentencepiece-" + _digest(self.model_proto)

    def encode(self, text):
        return self.sp.encode(text)

    def encode_batch(self, texts):
        """[encode(text) for text in texts], in sentencepiece's threads."""
        return self.sp.encode(list(texts))

    def decode(self, ids):
        return self.sp.decode(list(ids))

    def save(self, directory):
        _write_json(
            directory,
            {"kind": self.kind, "vocab_size": self.vocab_size, "model_file": "tokenizer.model"},
        )
        write_atomic(
            os.path.join(directory, "tokenizer.model"),
            lambda tmp: tmp.write_bytes(self.model_proto),
        )


def load_sentencepiece(model_file):
    try:
        return SentencePieceTokenizer(
            read_bytes(model_file, MAX_TOKENIZER_BYTES, follow_links=True)
        )
    except (OSError, RuntimeError, ValueError) as e:  # ValueError: a piece that is not UTF-8
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise TokenizerError(
            f"cannot read sentencepiece model {shown(model_file)}: {shown(why, 160)}"
        ) from None


# sentencepiece's trainer skips every line longer than this many bytes (its max_sentence_length); a
# text of long lines (a document per line) would leave it nothing to learn from. Raising that limit
# instead costs the trainer memory and time on huge lines, so long lines are cut into pieces this
# long, at a space where one is near.
MAX_SENTENCE_BYTES = 4192


def _sentences(text):
    """The text's non-blank lines, each cut into pieces of at most MAX_SENTENCE_BYTES bytes of
    UTF-8."""
    for line in text.splitlines():
        while len(line.encode()) > MAX_SENTENCE_BYTES:
            # whole characters only
            head = line.encode()[:MAX_SENTENCE_BYTES].decode("utf-8", "ignore")
            space = head.rfind(" ")
            cut = space + 1 if space > len(head) // 2 else len(head)
            if line[:cut].strip():
                yield line[:cut]
            line = line[cut:]
        if line.strip():
            yield line


def _train_sentencepiece(text, vocab_size):
    import io

    import sentencepiece as spm

    if not vocab_size:
        raise TokenizerError("--tokenizer sentencepiece needs --vocab_size (e.g. 8000)")
    lines = list(_sentences(text))
    spm.set_random_generator_seed(1337)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,  # any text encodes: unseen characters become bytes
            # rare characters go to bytes instead of taking vocab slots
            character_coverage=0.9995,
            normalization_rule_name="identity",  # decode(encode(text)) == text
            remove_extra_whitespaces=False,
            split_digits=True,
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,  # deterministic
            minloglevel=2,
        )
    except RuntimeError as e:
        # drop the C++ source location
        msg = " ".join(str(e).split()).split("] ", 1)[-1] or type(e).__name__
        needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", msg)
        # the 256 byte pieces, 3 special ones and the text's kept characters must all fit
        if needed:
            fix = f"use --vocab_size {needed.group(1)} or more"
        elif "too high" in msg:
            fix = "use a smaller --vocab_size, or more text to learn merges from"
        else:
            fix = "try another --vocab_size"
        raise TokenizerError(
            f"--tokenizer sentencepiece cannot train a vocabulary of {vocab_size} on this text: "
            f"{fix} (sentencepiece: {msg})"
        ) from e
    return SentencePieceTokenizer(model.getvalue())


# -----------------------------------------------------------------------------
# a directory's tokenizer


def has_tokenizer(directory):
    d = Path(directory)
    return (
        any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model"))
        or (d / "vocab.json").exists()
        and (d / "merges.txt").exists()
    )


def load_tokenizer(directory):
    """The tokenizer in `directory`: ours (a prepared dataset, a checkpoint, an export) or a Hugging
    Face model's (see the module docstring for the order of the files looked for)."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if path.exists():
        try:
            # the byte cap first: a huge file is refused before it is read (files.py)
            text = read_text(path, MAX_TOKENIZER_BYTES, follow_links=True)
            meta = parse_json(text, kind=None)
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise TokenizerError(
                f"cannot read {shown(path)} ({shown(why, 100)}): neither ours nor a Hugging Face "
                "tokenizer.json; re-run data preparation to create it"
            ) from None
        if isinstance(meta, dict) and "kind" not in meta and "model" in meta:
            return HFTokenizer(text, *special_tokens(d), guess_eos=True)
        return _load_saved(d, meta if isinstance(meta, dict) else {})
    eos, bos = special_tokens(d)
    if (d / "vocab.json").exists() and (d / "merges.txt").exists():
        return _byte_level_bpe(d, eos, bos)
    if (d / "tokenizer.model").exists():
        try:
            data = read_bytes(d / "tokenizer.model", MAX_TOKENIZER_BYTES, follow_links=True)
        except OSError as e:
            raise TokenizerError(f"cannot read {d / 'tokenizer.model'}: {e.strerror}") from None
        if _looks_like_tiktoken(data):
            return _llama3_tokenizer(d, data, eos, bos)
        return load_sentencepiece(d / "tokenizer.model")
    raise TokenizerError(
        f"{d} holds no tokenizer: expected tokenizer.json (ours or Hugging Face's), "
        "vocab.json + merges.txt, or tokenizer.model"
    )


def _load_saved(directory, meta):
    """Rebuild a tokenizer from the tokenizer.json (and tokenizer.model) that its save() wrote:
    every field it reads has the type save() writes, else TokenizerError naming it."""
    path = directory / "tokenizer.json"
    kind = meta.get("kind")
    for name, types in (
        ("model_file", str),
        ("tokenizer", dict),
        ("special_tokens", dict),
        ("pattern", str),
        ("eos_token", (str, type(None))),
        ("bos_token", (str, type(None))),
    ):
        value = meta.get(name)
        if (name in meta or name in KIND_NEEDS.get(kind, ())) and not isinstance(value, types):
            raise TokenizerError(
                f"{path}: {name} is {shown(json.dumps(value), 40)}, not what a {kind} tokenizer "
                "saves: re-run data preparation to create it"
            )
    if "model_file" in meta and not re.fullmatch(r"[\w.-]+", meta["model_file"]):
        raise TokenizerError(f"{path}: model_file is not a file name in {directory}")
    if kind == "char":
        tok = CharTokenizer(_char_vocabulary(path, meta.get("chars")))
    elif kind == "gpt2":
        tok = GPT2Tokenizer()
    elif kind == "sentencepiece":
        tok = load_sentencepiece(directory / meta.get("model_file", "tokenizer.model"))
    elif kind == "hf":
        tok = HFTokenizer(
            json.dumps(meta["tokenizer"]), meta.get("eos_token"), meta.get("bos_token")
        )
    elif kind == "tiktoken":
        model_file = directory / meta.get("model_file", "tokenizer.model")
        try:
            data = read_bytes(model_file, MAX_TOKENIZER_BYTES, follow_links=True)
        except OSError as e:
            raise TokenizerError(f"cannot read {model_file}: {e.strerror}") from None
        tok = TiktokenTokenizer(
            data,
            meta["special_tokens"],
            meta["pattern"],
            meta.get("eos_token"),
            meta.get("bos_token"),
        )
    else:
        raise TokenizerError(
            f"{path} has unknown tokenizer kind {kind!r} (expected one of {', '.join(SAVED_KINDS)})"
        )
    if "vocab_size" in meta and meta["vocab_size"] != tok.vocab_size:
        raise TokenizerError(
            f"{path} says vocab_size {meta['vocab_size']} but the loaded {kind} tokenizer "
            f"has {tok.vocab_size}: the tokenizer files do not match, re-run data preparation"
        )
    return tok


def _char_vocabulary(path, chars):
    """A char tokenizer.json's `chars`: distinct one-character strings (what save() writes), at
    most the vocabulary's cap; TokenizerError naming the field otherwise (decode would fail later,
    at the end of a run)."""
    if not isinstance(chars, list) or not chars or len(chars) > MAX_CHARS:
        raise TokenizerError(
            f"{path}: chars is {shown(json.dumps(chars), 40)}, not a list of 1 to {MAX_CHARS} "
            "characters: re-run data preparation to create it"
        )
    for i, ch in enumerate(chars):
        if not (isinstance(ch, str) and len(ch) == 1):
            raise TokenizerError(
                f"{path}: chars[{i}] is {shown(json.dumps(ch), 40)}, not one character: re-run "
                "data preparation to create it"
            )
    if len(set(chars)) != len(chars):
        raise TokenizerError(f"{path}: chars lists a character twice: re-run data preparation")
    return chars


def train_tokenizer(kind, text, vocab_size, directory):
    """Build a tokenizer of this kind (char and sentencepiece from text) and save it in
    directory."""
    if kind == "char":
        tok = CharTokenizer(text)
    elif kind == "gpt2":
        tok = GPT2Tokenizer()
    elif kind == "sentencepiece":
        tok = _train_sentencepiece(text, vocab_size)
    else:
        raise TokenizerError(
            f"--tokenizer must be one of {', '.join(TOKENIZER_KINDS)} (got {kind!r})"
        )
    tok.save(directory)
    return tok

"""
Tokenizers: char, gpt2 (tiktoken) and sentencepiece, behind one tiny interface:
.kind, .vocab_size, .eot_id, encode(text) -> list[int], decode(ids) -> str, save(directory).
A saved tokenizer is a plain 'tokenizer.json' (plus 'tokenizer.model' for sentencepiece); never pickle.
"""
import hashlib
import json
import os
import tempfile
import urllib.error
import urllib.request

from .config import ConfigError
from .files import write_atomic

TOKENIZER_KINDS = ("char", "gpt2", "sentencepiece")


class TokenizerError(ConfigError):
    """A one-line, user-facing problem with the tokenizer settings or files."""


def _write_json(directory, meta):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False)


# -----------------------------------------------------------------------------
# char: one id per character, characters sorted by codepoint

class CharTokenizer:
    kind = "char"
    eot_id = None

    def __init__(self, chars):
        self.chars = sorted(set(chars))
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    def encode(self, text):
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as e:
            ch = e.args[0]
            raise TokenizerError(
                f"character {ch!r} (U+{ord(ch):04X}) is not in the --tokenizer char vocabulary "
                f"built from the training text: rebuild it from text that contains it, "
                f"or use --tokenizer gpt2 / sentencepiece") from None

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def save(self, directory):
        _write_json(directory, {"kind": self.kind, "vocab_size": self.vocab_size, "chars": self.chars})


# -----------------------------------------------------------------------------
# gpt2: tiktoken's BPE. tiktoken downloads its two encoding files on first use
# (with no timeout), so we look for them in its cache before letting it try.

GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
GPT2_OFFLINE = ("--tokenizer gpt2 needs tiktoken's gpt2 encoding files, which could not be downloaded "
                "(offline?): copy a warm tiktoken cache into $TIKTOKEN_CACHE_DIR, "
                "or use --tokenizer char / sentencepiece")


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
    return d != "" and all(os.path.exists(os.path.join(d, hashlib.sha1(u.encode()).hexdigest()))
                           for u in GPT2_URLS)


def _can_download(url, timeout=5.0):
    # a quick HEAD (urllib honours proxy settings) so an unreachable host fails in seconds, not never
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True  # the server answered: let tiktoken try and report what went wrong
    except OSError:
        return False


def _gpt2_encoding():
    import tiktoken
    if not gpt2_cached() and not _can_download(GPT2_URLS[0]):
        raise TokenizerError(GPT2_OFFLINE)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests' connection/HTTP errors, hash mismatches, ...
        raise TokenizerError(f"{GPT2_OFFLINE} [{type(e).__name__}]") from e


class GPT2Tokenizer:
    kind = "gpt2"

    def __init__(self):
        self.enc = _gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_id = self.enc.eot_token    # 50256

    def encode(self, text):
        # ordinary: a literal "<|endoftext|>" in the data is just text, not the special token
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def save(self, directory):
        _write_json(directory, {"kind": self.kind, "vocab_size": self.vocab_size})


# -----------------------------------------------------------------------------
# sentencepiece: wraps a serialized .model (ours, or a Llama checkpoint's tokenizer.model)

class SentencePieceTokenizer:
    kind = "sentencepiece"

    def __init__(self, model_proto):
        import sentencepiece as spm
        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self.vocab_size = self.sp.get_piece_size()
        self.eot_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text):
        return self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode(list(ids))

    def save(self, directory):
        _write_json(directory, {"kind": self.kind, "vocab_size": self.vocab_size, "model_file": "tokenizer.model"})
        write_atomic(os.path.join(directory, "tokenizer.model"), lambda tmp: tmp.write_bytes(self.model_proto))


def load_sentencepiece(model_file):
    try:
        with open(model_file, "rb") as f:
            return SentencePieceTokenizer(f.read())
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"cannot read sentencepiece model {model_file}: {e}") from e


def _train_sentencepiece(text, vocab_size):
    import io
    import sentencepiece as spm
    if not vocab_size:
        raise TokenizerError("--tokenizer sentencepiece needs --vocab_size (e.g. 8000)")
    lines = [line for line in text.splitlines() if line.strip()]
    spm.set_random_generator_seed(1337)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model,
            model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True,                 # any text encodes: unseen characters become bytes
            character_coverage=0.9995,          # rare characters go to bytes instead of taking vocab slots
            normalization_rule_name="identity",  # decode(encode(text)) == text
            remove_extra_whitespaces=False, split_digits=True,
            num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,  # deterministic
            minloglevel=2)
    except RuntimeError as e:
        # e.g. vocab too small: byte_fallback alone takes 256 + 3 special ids
        msg = " ".join(str(e).split()).split("] ", 1)[-1] or type(e).__name__  # drop the C++ source location
        raise TokenizerError(f"--tokenizer sentencepiece training failed with --vocab_size {vocab_size}: {msg} "
                             f"(byte fallback alone needs 259 ids: use a larger --vocab_size or more text)") from e
    return SentencePieceTokenizer(model.getvalue())


# -----------------------------------------------------------------------------

def train_tokenizer(kind, text, vocab_size, directory):
    """Build a tokenizer of this kind (char and sentencepiece from text) and save it in directory."""
    if kind == "char":
        tok = CharTokenizer(text)
    elif kind == "gpt2":
        tok = GPT2Tokenizer()
    elif kind == "sentencepiece":
        tok = _train_sentencepiece(text, vocab_size)
    else:
        raise TokenizerError(f"--tokenizer must be one of {', '.join(TOKENIZER_KINDS)} (got {kind!r})")
    tok.save(directory)
    return tok


def load_tokenizer(directory):
    """Rebuild a tokenizer from the tokenizer.json (and tokenizer.model) that save() wrote."""
    path = os.path.join(directory, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path} ({type(e).__name__}): was this directory written by "
                             f"minimal_fsdp? re-run data preparation to create it") from e
    kind = meta.get("kind")
    if kind == "char":
        tok = CharTokenizer(meta["chars"])
    elif kind == "gpt2":
        tok = GPT2Tokenizer()
    elif kind == "sentencepiece":
        tok = load_sentencepiece(os.path.join(directory, meta.get("model_file", "tokenizer.model")))
    else:
        raise TokenizerError(f"{path} has unknown tokenizer kind {kind!r} (expected one of {', '.join(TOKENIZER_KINDS)})")
    if "vocab_size" in meta and meta["vocab_size"] != tok.vocab_size:
        raise TokenizerError(f"{path} says vocab_size {meta['vocab_size']} but the loaded {kind} tokenizer "
                             f"has {tok.vocab_size}: the tokenizer files do not match, re-run data preparation")
    return tok

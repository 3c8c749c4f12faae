"""Where documents come from, and which of them are held out for validation.

A source is read as a sequence of (index, text) documents: a .txt file is one document, a .jsonl
file holds one {"text": ...} object per line, a directory holds such files (read in sorted order),
and a Hugging Face dataset holds one document per row of its "text" column. Preparation (prepare.py)
and streaming (streaming.py) both read through here and tokenize with encode_document, so a streamed
run and a prepared one see the same documents, in the same order, as the same tokens.
"""

import hashlib
import json
import os
from pathlib import Path

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data.tokenizer import reachable
from minimal_fsdp.files import shown

OPENWEBTEXT = "Skylion007/openwebtext"
TEXT_SUFFIXES = (".txt", ".jsonl")
# Tokenizers without an end-of-text token (char) mark a document boundary with a blank line instead.
SEPARATOR_TEXT = "\n\n"
INSTALL_DATASETS = "pip install datasets (or pip install -e '.[data]')"
# sources up to this size are identified by a hash of their contents (under 0.2 s)
HASHED_BYTES = 64 * 2**20


def is_val(index, seed, val_fraction):
    """Document `index` is held out with probability val_fraction, decided by a hash of (seed,
    index) alone: a stream of unknown length splits the same way a prepared dataset did."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def encode_document(tokenizer, text):
    """A document's tokens followed by the end-of-text separator; an empty document has no tokens at
    all."""
    tokens = tokenizer.encode(text) if text else []
    if not tokens:
        return tokens
    return tokens + (
        [tokenizer.eot_id] if tokenizer.eot_id is not None else tokenizer.encode(SEPARATOR_TEXT)
    )


class FileDocuments:
    """Any file but .jsonl is one text document. `name` names the prepared directory, `source` the
    input."""

    def __init__(self, files, name, source):
        self.files, self.name, self.source = files, name, source

    def count(self):
        return None  # unknown without reading every .jsonl line

    def fingerprint(self):
        """What identifies these files' contents, recorded in a prepared dataset's meta.json so that
        another file of the same name, or the file edited since, is not taken for it: a hash of the
        contents where they are small enough to read at every start (HASHED_BYTES), else each file's
        path, size and modification time."""
        stats = [path.stat() for path in self.files]
        if sum(st.st_size for st in stats) <= HASHED_BYTES:
            digest = hashlib.sha256()
            for path in self.files:
                digest.update(path.read_bytes())
                digest.update(b"\0")
            return {"sha256": digest.hexdigest(), "bytes": sum(st.st_size for st in stats)}
        return {
            "files": [
                [str(path.resolve()), st.st_size, st.st_mtime_ns]
                for path, st in zip(self.files, stats)
            ]
        }

    def iter_from(self, start=0):
        """(index, text) for every document from `start` on; documents before it are skipped
        unparsed."""
        index = 0
        for path in self.files:
            if path.suffix != ".jsonl":
                if index >= start:
                    yield index, _read_utf8(path, path.read_bytes())
                index += 1
                continue
            with open(path, "rb") as lines:
                for number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    if index >= start:
                        yield index, _jsonl_text(line, path, number)
                    index += 1


def _read_utf8(path, raw, where=""):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}{where} is not UTF-8 text") from None


def _jsonl_text(line, path, number):
    try:
        row = json.loads(_read_utf8(path, line, f" line {number}"))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path} line {number} is not JSON ({e.msg}): a .jsonl file holds one "
            '{"text": ...} object per line'
        ) from None
    text = row.get("text") if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise ConfigError(
            f'{path} line {number} has no "text" string: a .jsonl file holds one '
            '{"text": ...} object per line'
        )
    return text


class HFDocuments:
    """The "text" column of a Hugging Face dataset: a map-style one (on disk, memory-mapped) or an
    iterable one streamed from the hub."""

    def __init__(self, dataset, name, source):
        self.dataset, self.name, self.source = dataset, name, source
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "text" not in columns:
            raise ConfigError(
                f'the Hugging Face dataset {source} has no "text" column (it has '
                f'{", ".join(columns)})'
            )

    def count(self):
        return len(self.dataset) if hasattr(self.dataset, "__len__") else None

    def iter_from(self, start=0):
        if hasattr(self.dataset, "__len__"):
            # column slices: fast reads from Arrow
            for low in range(start, len(self.dataset), 1000):
                for offset, text in enumerate(self.dataset[low : low + 1000]["text"]):
                    yield low + offset, text or ""
        else:
            rows = self.dataset.skip(start) if start else self.dataset
            for offset, row in enumerate(rows, start):
                yield offset, row.get("text") or ""


def _is_hf_save(path):
    return any(
        (path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")
    )


def _load_from_disk(path):
    datasets = _import_datasets(f"reading the Hugging Face dataset {path}")
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the Hugging Face dataset saved in {path}: {e}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError(
                f"{path} holds splits {', '.join(dataset)} but no 'train' split to read"
            )
        dataset = dataset["train"]
    return HFDocuments(dataset, path.stem, str(path))


def _load_from_hub(name, streaming):
    """NAME or NAME:CONFIG (e.g. allenai/c4:en), its train split."""
    datasets = _import_datasets(f"loading {name} from the Hugging Face hub")
    repo, _, config = name.partition(":")
    from huggingface_hub import constants  # datasets depends on it

    # else minutes of retries, then this
    if not constants.HF_HUB_OFFLINE and not reachable(constants.ENDPOINT):
        raise ConfigError(
            f"{name!r} is no local file or directory, and the Hugging Face hub "
            f"({constants.ENDPOINT}) "
            "is unreachable (offline?): save the dataset where there is network "
            "(datasets.load_dataset(...).save_to_disk(DIR)) and pass DIR, or set HF_HUB_OFFLINE=1 "
            "to use a copy in the Hugging Face cache"
        )
    try:
        dataset = datasets.load_dataset(repo, config or None, split="train", streaming=streaming)
    except Exception as e:  # hub, network and format errors all mean the same thing to the user
        reason = shown(" ".join(str(e).split())[:200])
        raise ConfigError(
            f"{name!r} is no local file or directory, and could not be loaded from the Hugging "
            f"Face hub ({reason}): is the name right and the hub reachable? Offline, save it where "
            "there is network (datasets.load_dataset(...).save_to_disk(DIR)) and pass DIR, or set "
            "HF_HUB_OFFLINE=1 to use a copy in the Hugging Face cache"
        ) from None
    return HFDocuments(dataset, repo.rstrip("/").split("/")[-1], name)


def _import_datasets(purpose):
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{purpose} needs the datasets package: {INSTALL_DATASETS}") from None
    return datasets


def open_documents(source, flag, streaming=False, hub=True):
    """Documents from a local text or .jsonl file, a directory of .txt/.jsonl files, a save_to_disk
    directory, or (if hub) a hub name (NAME or NAME:CONFIG): downloaded, or with streaming=True read
    as it downloads.
    `flag` names the option in error messages."""
    source = str(source)
    path = Path(source)
    if path.is_file():
        return FileDocuments([path], path.stem, str(path))
    if path.is_dir():
        if _is_hf_save(path):
            return _load_from_disk(path)
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(
                f"{flag} {path} holds no .txt or .jsonl files and is not a Hugging Face dataset "
                "saved with save_to_disk"
            )
        return FileDocuments(files, path.stem, str(path))
    if os.path.lexists(path):  # there, but neither a file nor a directory (through any link)
        kind = (
            "a link to nothing"
            if not path.exists()
            else "not a regular file (a FIFO, device or socket)"
        )
        raise ConfigError(
            f"{flag} {source} is {kind}: name a text or .jsonl file, or a directory of them"
        )
    if (
        not hub
        or source.startswith((".", "/", "~"))
        or source.endswith(TEXT_SUFFIXES)
        or source.count("/") > 1
    ):
        raise ConfigError(f"{flag} {source} does not exist")
    return _load_from_hub(source, streaming)

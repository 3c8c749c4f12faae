"""Documents -> train.bin, val.bin (flat token memmaps), meta.json and the tokenizer's files.

    minimal-fsdp prepare --dataset openwebtext --tokenizer gpt2 --val_fraction 0.0005
    minimal-fsdp prepare --dataset text --input_file my_docs/ --tokenizer gpt2
    minimal-fsdp prepare --dataset hf --input_file ./saved_dataset --tokenizer sentencepiece \
        --vocab_size 8000
    python basic_training.py --dataset_path data/openwebtext/gpt2 ...

Each document is tokenized and followed by the end-of-text token, in source order; a document goes
to val.bin when documents.is_val says so. A source of exactly one document (a single text file, like
Shakespeare) is instead split by characters: its last --val_fraction is val.

One front end, prepare(), serves both `minimal-fsdp prepare` (commands/prepare.py) and training
(for_training: Shakespeare or one --input_file, prepared on first use).
"""

import collections
import itertools
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from minimal_fsdp.config.checks import MAX_WHOLE, WHOLE_RANGES
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data.documents import (
    OPENWEBTEXT,
    SEPARATOR_TEXT,
    FileDocuments,
    encode_document,
    is_val,
    open_documents,
)
from minimal_fsdp.data.tokenizer import load_tokenizer, train_tokenizer
from minimal_fsdp.files import read_json, write_atomic

SHIPPED_SHAKESPEARE = Path(__file__).resolve().parents[2] / "data" / "shakespeare" / "input.txt"
# BPE merges are learned from the first this many characters of train
SENTENCEPIECE_SAMPLE_CHARS = 20_000_000
BATCH_DOCUMENTS = 256  # documents per task sent to a tokenizing worker
# a prepared meta.json: a few hundred bytes, or a line per file of a large source
META_BYTES = 2**20
META_DEPTH = 8  # what we write nests 3 levels (source_fingerprint.files[i])


def token_dtype(vocab_size):
    """uint16 halves the files when every id fits in it (GPT-2's 50257 do)."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def output_dir(data_dir, name, tokenizer, vocab_size):
    """<data_dir>/<name>/<tokenizer>: one source, prepared once per tokenizer."""
    return (
        Path(data_dir)
        / name
        / (tokenizer + (f"-{vocab_size}" if tokenizer == "sentencepiece" else ""))
    )


def shakespeare_documents(data_dir):
    """<data_dir>/shakespeare/input.txt if you put a text there, else the tinyshakespeare text
    shipped in the repository (data/shakespeare/input.txt: 1.1 MB, public domain), so the default
    run needs no network."""
    for path in (Path(data_dir) / "shakespeare" / "input.txt", SHIPPED_SHAKESPEARE):
        if path.is_file():
            return FileDocuments([path], "shakespeare", str(path))
    raise ConfigError(
        f"no Shakespeare text at {Path(data_dir) / 'shakespeare' / 'input.txt'} (the repository's "
        f"copy {SHIPPED_SHAKESPEARE} is missing too): put a UTF-8 text there, or use --dataset "
        "text --input_file PATH"
    )


def prepare_bins(
    documents, tokenizer_kind, vocab_size, out, val_fraction, seed, num_proc=1, tokenizer=None
):
    """Tokenize `documents` into `out`; returns the meta dict. meta.json is written last, so its
    presence means the bins are complete. A given `tokenizer` (a --hf_model's) is used as it is
    instead of fitting one of `tokenizer_kind`. A failure leaves no directory behind that was not
    there before."""
    out = Path(out)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        return _prepare_bins(
            documents, tokenizer_kind, vocab_size, out, val_fraction, seed, num_proc, tokenizer
        )
    except BaseException as e:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        # a full disk, a file size limit, no permission: one line, not a traceback
        if isinstance(e, OSError):
            raise ConfigError(
                f"preparing {out} failed: {e.strerror or e}"
                f"{f': {e.filename}' if e.filename else ''}"
            ) from None
        raise


def _prepare_bins(
    documents, tokenizer_kind, vocab_size, out, val_fraction, seed, num_proc, tokenizer
):
    head = list(itertools.islice(documents.iter_from(0), 2))
    if not head:
        raise ConfigError(f"{documents.source} holds no documents")
    if len(head) == 1:
        return _prepare_one_text(
            head[0][1], documents, tokenizer_kind, vocab_size, out, val_fraction, tokenizer
        )
    if tokenizer is None:
        tokenizer = _fit_tokenizer(tokenizer_kind, documents, vocab_size, out, val_fraction, seed)
    else:
        tokenizer.save(out)
    dtype = token_dtype(tokenizer.vocab_size)
    tokens, docs = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    tmp = {split: out / f"{split}.bin.tmp" for split in tokens}
    try:
        with (
            open(tmp["train"], "wb") as train,
            open(tmp["val"], "wb") as val,
            tqdm(
                total=documents.count(),
                unit="doc",
                desc=f"tokenizing {documents.name}",
                mininterval=1.0,
            ) as bar,
        ):
            files = {"train": train, "val": val}
            for index, ids in _tokenize(documents, out, dtype, num_proc):
                bar.update(1)
                if len(ids):
                    split = "val" if is_val(index, seed, val_fraction) else "train"
                    files[split].write(ids.tobytes())
                    tokens[split] += len(ids)
                    docs[split] += 1
        for split in tokens:
            if not tokens[split]:
                fix = (
                    "raise --val_fraction or add documents"
                    if split == "val"
                    else "lower --val_fraction"
                )
                raise ConfigError(
                    f"no document of {documents.source} went to {split} ({sum(docs.values())} "
                    f"non-empty documents, --val_fraction {val_fraction}): {fix}"
                )
        for split in tokens:
            os.replace(tmp[split], out / f"{split}.bin")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return _write_meta(
        out,
        tokenizer,
        dtype,
        tokens,
        documents,
        split="documents",
        val_fraction=val_fraction,
        seed=seed,
        train_documents=docs["train"],
        val_documents=docs["val"],
    )


def _prepare_one_text(
    text, documents, tokenizer_kind, vocab_size, out, val_fraction, tokenizer=None
):
    source = documents.source
    if len(text) < 100:
        raise ConfigError(f"{source} holds {len(text)} characters: too little text to train on")
    split = int(len(text) * (1 - val_fraction))
    # Characters come from the whole text so val never holds an unknown one; BPE learns from train
    # only.
    fit_on = text if tokenizer_kind == "char" else text[:split]
    if tokenizer is None:
        tokenizer = train_tokenizer(tokenizer_kind, fit_on, vocab_size, out)
    else:
        tokenizer.save(out)
    dtype = token_dtype(tokenizer.vocab_size)
    tokens = {}
    for split_name, part in (("train", text[:split]), ("val", text[split:])):
        ids = np.array(tokenizer.encode(part), dtype=dtype)
        write_atomic(out / f"{split_name}.bin", ids.tofile)
        tokens[split_name] = len(ids)
    return _write_meta(
        out, tokenizer, dtype, tokens, documents, split="characters", val_fraction=val_fraction
    )


def _write_meta(out, tokenizer, dtype, tokens, documents, **extra):
    meta = {
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "train_tokens": tokens["train"],
        "val_tokens": tokens["val"],
        "source": documents.source,
        **_fingerprint(documents),
        **extra,
    }
    write_atomic(out / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
    return meta


def _fingerprint(documents):
    """{"source_fingerprint": ...} for local files (documents.FileDocuments.fingerprint), else
    nothing."""
    fingerprint = getattr(documents, "fingerprint", None)
    return {"source_fingerprint": fingerprint()} if fingerprint else {}


def read_prepared_meta(directory):
    """A prepared dataset's meta.json, read as a checkpoint's is (it may come from anyone): a
    regular file of at most META_BYTES, nested at most META_DEPTH deep, a JSON object whose fields
    have their types and ranges. ConfigError otherwise, one line naming the field."""
    directory = Path(directory)
    fix = f"delete {directory} to prepare it again"
    try:
        meta = read_json(directory / "meta.json", META_BYTES, META_DEPTH)
    except OSError as e:
        raise ConfigError(
            f"{directory / 'meta.json'} cannot be read ({e.strerror or e}): {fix}"
        ) from None
    except ValueError as e:
        raise ConfigError(f"{directory / 'meta.json'} {e}: {fix}") from None
    for name, (low, high) in (
        ("vocab_size", WHOLE_RANGES["vocab_size"]),
        ("train_tokens", (0, MAX_WHOLE)),
        ("val_tokens", (0, MAX_WHOLE)),
    ):
        value = meta.get(name)
        if type(value) is not int or not low <= value <= high:
            raise ConfigError(
                f"{directory / 'meta.json'}: {name} is {json.dumps(value)[:40]}, not a whole "
                f"number in [{low}, {high}]: {fix}"
            )
    for name, kind, optional in (
        ("tokenizer", str, False),
        ("dtype", str, False),
        ("source", str, True),
        ("source_fingerprint", dict, True),
    ):
        if not isinstance(meta.get(name), kind) and not (optional and name not in meta):
            raise ConfigError(
                f"{directory / 'meta.json'}: {name} is {json.dumps(meta.get(name))[:40]}, not a "
                f"{'string' if kind is str else 'JSON object'}: {fix}"
            )
    return meta


def check_prepared(out, documents, fix):
    """Refuse a prepared dataset that was made from other contents than `documents` now hold:
    another file of the same name, or this file edited since. Reusing it would train on the old text
    without a word; preparing it again silently would change the data under any run that resumes
    from it. `fix`: how to prepare anew."""
    meta = read_prepared_meta(out)
    now = _fingerprint(documents).get("source_fingerprint")
    if (
        meta.get("source_fingerprint") is not None
        and now is not None
        and meta["source_fingerprint"] != now
    ):
        raise ConfigError(
            f"{out} was prepared from {meta.get('source')} as it was then, and {documents.source} "
            f"differs from it now (another file of the same name, or edited since): {fix}"
        )


def _fit_tokenizer(kind, documents, vocab_size, out, val_fraction, seed):
    if kind == "char":
        # every character of every document (val too, so val holds no unknown one) plus the
        # separator's
        chars = set(SEPARATOR_TEXT)
        for _, text in tqdm(
            documents.iter_from(0),
            total=documents.count(),
            unit="doc",
            desc="characters",
            mininterval=1.0,
        ):
            chars.update(text)
        return train_tokenizer(kind, "".join(chars), vocab_size, out)
    sample = []
    if kind == "sentencepiece":
        size = 0
        for index, text in documents.iter_from(0):
            if not is_val(index, seed, val_fraction):
                sample.append(text)
                size += len(text)
                if size >= SENTENCEPIECE_SAMPLE_CHARS:
                    break
    return train_tokenizer(kind, "\n".join(sample), vocab_size, out)


# Tokenizing workers rebuild the tokenizer from its saved files: tiktoken/sentencepiece objects
# don't pickle.
_worker = {}


def _start_worker(directory, dtype):
    _worker["tokenizer"], _worker["dtype"] = load_tokenizer(directory), dtype


def _encode_batch(batch):
    return [
        (index, np.array(encode_document(_worker["tokenizer"], text), dtype=_worker["dtype"]))
        for index, text in batch
    ]


def _tokenize(documents, directory, dtype, num_proc):
    """(index, token array) per document, in order, tokenized by num_proc processes."""
    texts = documents.iter_from(0)
    batches = iter(lambda: list(itertools.islice(texts, BATCH_DOCUMENTS)), [])
    if num_proc <= 1:
        _start_worker(directory, dtype)
        for batch in batches:
            yield from _encode_batch(batch)
        return
    # A bounded window of tasks in flight: Pool.imap would read the whole source into its queue up
    # front.
    with multiprocessing.Pool(
        num_proc, initializer=_start_worker, initargs=(str(directory), dtype)
    ) as pool:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= 4 * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


# -----------------------------------------------------------------------------
# the one front end: `minimal-fsdp prepare` (commands/prepare.py) and training (for_training)


def open_source(dataset, input_file, data_dir):
    """The documents of --dataset: the Shakespeare text, openwebtext (from the hub, or
    --input_file's local copy), or --input_file (a hub dataset for --dataset hf)."""
    if dataset == "shakespeare":
        return shakespeare_documents(data_dir)
    if dataset == "openwebtext":
        return open_documents(input_file or OPENWEBTEXT, "--input_file")
    return open_documents(input_file, "--input_file", hub=dataset == "hf")


def named_dir(data_dir, name, tokenizer_kind, vocab_size, tokenizer=None):
    """<data_dir>/<name>/<tokenizer>: one text, prepared once per tokenizer. A given tokenizer
    (--tokenizer_dir's, a --hf_model's) names the directory by its label: its kind, and for
    sentencepiece, Hugging Face and tiktoken ones also a hash of its files."""
    if tokenizer is None:
        return output_dir(data_dir, name, tokenizer_kind, vocab_size)
    return Path(data_dir) / name / tokenizer.label


def prepare(
    documents, out, again, tokenizer_kind, vocab_size, val_fraction, seed, num_proc=1,
    tokenizer=None,
):  # fmt: skip
    """`out` prepared from `documents`: tokenized now (returns the meta dict), or found prepared
    already from these same contents (returns None; `again` says how to prepare anew where they
    changed)."""
    out = Path(out)
    if (out / "meta.json").exists():
        check_prepared(out, documents, again)
        return None
    return prepare_bins(
        documents,
        tokenizer_kind,
        vocab_size,
        out,
        val_fraction,
        seed,
        num_proc,
        tokenizer=tokenizer,
    )


def dataset_dir(data, tokenizer=None):
    """Training's data directory (`data`: config.sections.Data): --dataset_path, else
    data/<dataset>/<tokenizer> (named_dir)."""
    if data.dataset_path:
        return Path(data.dataset_path)
    name = "shakespeare" if data.dataset == "shakespeare" else Path(data.input_file).stem
    return named_dir(data.data_dir, name, data.tokenizer, data.vocab_size, tokenizer)


def for_training(data, tokenizer=None):
    """Training's prepared dataset directory: --dataset_path as it is, else Shakespeare or
    --input_file tokenized on first use with `tokenizer` if given, else the --tokenizer kind fit on
    the text. Runs on rank 0 only (big datasets: prepare them ahead with `minimal-fsdp prepare`)."""
    out = dataset_dir(data, tokenizer)
    if data.dataset_path:
        if (out / "meta.json").exists():
            return out
        raise ConfigError(
            f"--dataset_path {out} has no meta.json: prepare it first (minimal-fsdp prepare "
            f"--dataset text --input_file SOURCE --output {out}), or add --streaming to read "
            "a .jsonl/Hugging Face dataset directly"
        )
    documents = open_source(data.dataset, data.input_file, data.data_dir)
    again = (
        f"delete {out} to prepare it again (runs that trained on it resume on the new text), or "
        "pass another --data_dir"
    )
    prepare(
        documents,
        out,
        again,
        data.tokenizer,
        data.vocab_size,
        data.val_fraction,
        data.seed,
        tokenizer=tokenizer,
    )
    return out

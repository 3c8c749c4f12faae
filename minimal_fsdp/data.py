"""Text -> token memmaps (train.bin, val.bin, meta.json), and deterministic per-rank batches from them."""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError
from .sources import SourceError, fetch_shakespeare
from .tokenizer import load_tokenizer, train_tokenizer


def dataset_dir(cfg, tokenizer=None):
    """data/<dataset>/<tokenizer>: one text, prepared once per tokenizer. A given tokenizer (a --hf_model's)
    names the directory by its kind, and a sentencepiece one also by its model file's hash."""
    name = "shakespeare" if cfg.dataset == "shakespeare" else Path(cfg.input_file).stem
    if tokenizer is not None:
        label = tokenizer.kind
        if tokenizer.kind == "sentencepiece":
            label += "-" + hashlib.sha1(tokenizer.model_proto).hexdigest()[:12]
    else:
        label = cfg.tokenizer + (f"-{cfg.vocab_size}" if cfg.tokenizer == "sentencepiece" else "")
    return Path(cfg.data_dir) / name / label


def _read_text(cfg):
    if cfg.dataset == "shakespeare":
        path = Path(cfg.data_dir) / "shakespeare" / "input.txt"
        try:
            fetch_shakespeare(path)
        except SourceError as e:
            raise ConfigError(str(e)) from None
    else:
        path = Path(cfg.input_file)
        if not path.is_file():
            raise ConfigError(f"--input_file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    if len(text) < 100:
        raise ConfigError(f"{path} holds {len(text)} characters: too little text to train on")
    return text


def _write_atomic(path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def prepare(cfg, tokenizer=None):
    """Tokenize the dataset into flat memmaps unless that was done already; returns the dataset directory.
    Uses `tokenizer` if given, else builds the --tokenizer kind from the text.
    Runs on rank 0 only; meta.json is written last, so its presence means the bins are complete."""
    out = dataset_dir(cfg, tokenizer)
    if (out / "meta.json").exists():
        return str(out)
    text = _read_text(cfg)
    split = int(len(text) * (1 - cfg.val_fraction))
    out.mkdir(parents=True, exist_ok=True)
    # Characters come from the whole text so val never holds an unknown one; BPE learns from train only.
    fit_on = text if cfg.tokenizer == "char" else text[:split]
    if tokenizer is None:
        tokenizer = train_tokenizer(cfg.tokenizer, fit_on, cfg.vocab_size, out)
    else:
        tokenizer.save(out)
    ids = {"train": tokenizer.encode(text[:split]), "val": tokenizer.encode(text[split:])}
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    for split_name, tokens in ids.items():
        _write_atomic(out / f"{split_name}.bin", lambda p: np.array(tokens, dtype=dtype).tofile(p))
    meta = {"tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name,
            "train_tokens": len(ids["train"]), "val_tokens": len(ids["val"])}
    _write_atomic(out / "meta.json", lambda p: p.write_text(json.dumps(meta, indent=1)))
    return str(out)


class TokenData:
    """Read-only token memmaps plus the batch sampler.

    A batch is a pure function of (seed, split, rank, step): ranks draw different sequences, a resumed run
    draws exactly what the uninterrupted one would have, and a test can rebuild any rank's batch.
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.tokenizer = load_tokenizer(self.directory)
        self.splits = {}
        for split in ("train", "val"):
            path = self.directory / f"{split}.bin"
            tokens = np.memmap(path, dtype=self.meta["dtype"], mode="r")
            if len(tokens) != self.meta[f"{split}_tokens"]:
                raise ConfigError(f"{path} holds {len(tokens)} tokens but meta.json says "
                                  f"{self.meta[f'{split}_tokens']}: delete {self.directory} to prepare it again")
            self.splits[split] = tokens

    def check(self, seq_length, vocab_size):
        """Same files and flags on every rank, so every rank reaches the same verdict before any collective."""
        shortest = min(len(t) for t in self.splits.values())
        if seq_length + 1 > shortest:
            raise ConfigError(f"--seq_length {seq_length} needs at least {seq_length + 1} tokens per split, "
                              f"but the smaller split of {self.directory} has {shortest}")
        if self.meta["vocab_size"] > vocab_size:
            raise ConfigError(f"the {self.meta['tokenizer']} tokenizer has {self.meta['vocab_size']} tokens but "
                              f"--vocab_size is {vocab_size}: token ids would be out of range")

    def num_tokens(self, split):
        return len(self.splits[split])

    def get_batch(self, split, step, rank, batch_size, seq_length, seed):
        tokens = self.splits[split]
        stream = ((seed * 2 + (split == "train")) * 1_000_003 + rank) * 1_000_000_007 + step
        generator = torch.Generator().manual_seed(stream % 2**63)
        starts = torch.randint(len(tokens) - seq_length, (batch_size,), generator=generator).tolist()
        rows = np.stack([tokens[s:s + seq_length + 1] for s in starts]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

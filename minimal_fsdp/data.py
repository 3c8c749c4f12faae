"""Prepared token memmaps (train.bin, val.bin, meta.json) and the sampler that reads batches from them.

`python -m minimal_fsdp.data prepare ...` prepares a dataset ahead of training (see prepare.py); training
prepares Shakespeare or one --input_file itself on first use.
"""
import functools
import json
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError
from .documents import open_documents
from .prepare import output_dir, prepare_bins, shakespeare_documents
from .tokenizer import load_tokenizer

TOKEN_DTYPES = ("uint16", "uint32")


def dataset_dir(cfg, tokenizer=None):
    """--dataset_path, else data/<dataset>/<tokenizer>: one text, prepared once per tokenizer. A given
    tokenizer (--tokenizer_dir's, a --hf_model's) names the directory by its label: its kind, and for
    sentencepiece, Hugging Face and tiktoken ones also a hash of its files."""
    if cfg.dataset_path:
        return Path(cfg.dataset_path)
    name = "shakespeare" if cfg.dataset == "shakespeare" else Path(cfg.input_file).stem
    if tokenizer is None:
        return output_dir(cfg.data_dir, name, cfg.tokenizer, cfg.vocab_size)
    return Path(cfg.data_dir) / name / tokenizer.label


def prepare(cfg, tokenizer=None):
    """Tokenize the dataset into flat memmaps unless that was done already; returns the dataset directory.
    Uses `tokenizer` if given, else builds the --tokenizer kind from the text. Runs on rank 0 only
    (big datasets: prepare them ahead with `python -m minimal_fsdp.data prepare`)."""
    out = dataset_dir(cfg, tokenizer)
    if (out / "meta.json").exists():
        return str(out)
    if cfg.dataset_path:
        raise ConfigError(f"--dataset_path {out} has no meta.json: prepare it first (python -m minimal_fsdp.data "
                          f"prepare --dataset text --input SOURCE --output {out}), or add --streaming to read "
                          "a .jsonl/Hugging Face dataset directly")
    if cfg.dataset == "shakespeare":
        documents = shakespeare_documents(cfg.data_dir)
    else:
        documents = open_documents(cfg.input_file, "--input_file", hub=False)
    prepare_bins(documents, cfg.tokenizer, cfg.vocab_size, out, cfg.val_fraction, cfg.seed, tokenizer=tokenizer)
    return str(out)


@functools.lru_cache(maxsize=4)  # a batch can straddle two epochs; evaluation reads val in between
def epoch_order(seed, split, num_blocks, epoch):
    """The order in which an epoch visits the blocks of a split: a permutation seeded by (seed, split, epoch)."""
    return np.random.default_rng([seed % 2**63, split == "train", epoch]).permutation(num_blocks)


class TokenData:
    """Read-only token memmaps plus the batch sampler.

    A split of N tokens holds (N - 1) // seq_length blocks: block k is tokens[k*seq_length : (k+1)*seq_length + 1]
    (inputs and their next-token targets), so each token is a target once per epoch. Each epoch visits all
    blocks in its own seeded order; the global stream of block positions is dealt out in micro-batches,
    rank by rank. So the ranks never share a block within an epoch, every block is seen once per epoch,
    and a batch is a pure function of (seed, split, micro-batch index, rank, world size): a resumed run
    draws exactly what the uninterrupted one would have, and a test can rebuild any rank's batch.
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.tokenizer = load_tokenizer(self.directory)
        # (micro-batch index, global block position) the train sampler counts from; moved by restore()
        self.origin = (0, 0)
        dtype = self.meta.get("dtype")
        if dtype not in TOKEN_DTYPES or np.iinfo(dtype).max < self.meta["vocab_size"] - 1:
            raise ConfigError(f"{self.directory}/meta.json says dtype {dtype!r}, which cannot hold "
                              f"{self.meta['vocab_size']} token ids: delete {self.directory} to prepare it again")
        self.splits = {split: self._open(split, dtype) for split in ("train", "val")}

    def _open(self, split, dtype):
        path = self.directory / f"{split}.bin"
        expected = self.meta[f"{split}_tokens"]
        size = path.stat().st_size if path.exists() else 0
        if size != expected * np.dtype(dtype).itemsize:
            hint = ""
            for other in TOKEN_DTYPES:
                if other != dtype and size == expected * np.dtype(other).itemsize:
                    hint = f" (its size fits {expected} {other} tokens: was it written as {other}?)"
            raise ConfigError(f"{path} holds {size} bytes but meta.json says {expected} {dtype} tokens "
                              f"({expected * np.dtype(dtype).itemsize} bytes){hint}: delete {self.directory} "
                              "to prepare it again")
        return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)

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

    def get_batch(self, split, index, rank, world_size, batch_size, seq_length, seed):
        """Micro-batch `index` of `rank`: (inputs, targets), each batch_size x seq_length."""
        tokens = self.splits[split]
        num_blocks = (len(tokens) - 1) // seq_length
        first = self._block_position(split, index, world_size, batch_size) + rank * batch_size
        rows = []
        for position in range(first, first + batch_size):
            epoch, k = divmod(position, num_blocks)
            start = int(epoch_order(seed, split, num_blocks, epoch)[k]) * seq_length
            rows.append(tokens[start:start + seq_length + 1])
        rows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def _block_position(self, split, index, world_size, batch_size):
        """Position in the global block stream where micro-batch `index` starts (rank 0's first block)."""
        origin_index, origin_position = self.origin if split == "train" else (0, 0)
        return origin_position + (index - origin_index) * world_size * batch_size

    def position(self, index, world_size, batch_size):
        """What a checkpoint saved before micro-batch `index` records: train blocks dealt out so far."""
        return {"train_blocks_seen": self._block_position("train", index, world_size, batch_size)}

    def restore(self, position, index):
        """Continue the block stream where a checkpoint left it, even if the world size or batch size
        changed since. Checkpoints without a position continue at `index` with today's layout."""
        if position and "train_blocks_seen" in position:
            self.origin = (index, position["train_blocks_seen"])


if __name__ == "__main__":
    from .prepare import main
    main()

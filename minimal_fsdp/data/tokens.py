"""Prepared token memmaps (train.bin, val.bin, meta.json) and the sampler that reads batches from
them.

prepare.py writes them: ahead of training (`minimal-fsdp prepare`), or on first use for Shakespeare
or one --input_file (prepare.for_training).
"""

import functools
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

import numpy as np
import torch

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data.prepare import read_prepared_meta
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.files import read_bytes, read_json, write_atomic

TOKEN_DTYPES = ("uint16", "uint32")
TOKEN_CHUNK = 2**24  # token ids whose maximum is taken at once (32 MB of uint16)
TOKEN_CACHE = ".largest_token.json"  # each split's largest token id, under the file's fingerprint


def _check_kinds(directory):
    """Refuse a prepared directory holding something other than files and directories (a FIFO, a
    device, a socket, or a link to one): the tokenizer libraries would block on it, or read without
    end."""
    for entry in directory.iterdir():
        try:
            # through a link: a link to a regular file (on another disk) is fine
            mode = entry.stat().st_mode
        except OSError:
            continue  # a dangling link: what is missing is reported where it is needed
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConfigError(
                f"{entry} is not a regular file (a FIFO, device or socket): a prepared dataset "
                f"holds none; delete {directory} to prepare it again"
            )


def cache_key():
    """This user's secret for the caches beside a dataset: 32 random bytes in
    $XDG_CACHE_HOME/minimal_fsdp/cache.key (~/.cache by default; mode 0600), made on first use.
    None where it cannot be kept: then nothing is cached."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minimal_fsdp"
    path = folder / "cache.key"
    try:
        key = read_bytes(path, 64)
        return key if len(key) == 32 else None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, lambda tmp: _write_private(tmp, secrets.token_bytes(32)))
        return read_bytes(path, 64)
    except OSError:
        return None


def _write_private(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _seal(key, name, fingerprint, top):
    return hmac.new(key, json.dumps([name, *fingerprint, top]).encode(), "sha256").hexdigest()


def largest_token(path, tokens):
    """The largest token id in `tokens` (path's memmap), or None when empty: the maximum of each
    chunk of TOKEN_CHUNK ids, read once and cached beside the file (TOKEN_CACHE) under its
    fingerprint (size, modification and change times, inode). The fingerprint alone can be forged
    (size, mtime and inode are all writable, and the cache file is anyone's who can write the
    dataset), so each entry is sealed with an HMAC under this user's secret (cache_key): an entry
    this user's runs did not write is counted again, never trusted."""
    if not len(tokens):
        return None
    info = path.stat()
    fingerprint = [info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns]
    cache = path.with_name(TOKEN_CACHE)
    key = cache_key()
    try:
        cached = read_json(cache, 2**16, 4).get(path.name) if key else None
        if (
            isinstance(cached, list)
            and len(cached) == 6
            and cached[:4] == fingerprint
            and type(cached[4]) is int
            and isinstance(cached[5], str)
            and hmac.compare_digest(cached[5], _seal(key, path.name, fingerprint, cached[4]))
        ):
            return cached[4]
    except (OSError, ValueError):
        pass  # none yet, or unreadable: counted again
    top = max(int(tokens[i : i + TOKEN_CHUNK].max()) for i in range(0, len(tokens), TOKEN_CHUNK))
    if key is None:
        return top
    try:
        saved = read_json(cache, 2**16, 4) if cache.exists() else {}
    except (OSError, ValueError):
        saved = {}
    entry = fingerprint + [top, _seal(key, path.name, fingerprint, top)]
    try:
        write_atomic(
            cache, lambda tmp: tmp.write_text(json.dumps(dict(saved, **{path.name: entry})))
        )
    except OSError:
        pass  # a read-only dataset: counted again at the next start
    return top


@functools.lru_cache(maxsize=4)  # a batch can straddle two epochs; evaluation reads val in between
def epoch_order(seed, split, num_blocks, epoch):
    """The order in which an epoch visits the blocks of a split: a permutation seeded by (seed,
    split, epoch)."""
    return np.random.default_rng([seed % 2**63, split == "train", epoch]).permutation(num_blocks)


@functools.lru_cache(maxsize=4)
def epoch_offset(seed, epoch, seq_length):
    """Where an epoch's train blocks start, in [0, seq_length): a new cut every epoch, so the model
    does not see the same windows again and again (val keeps offset 0: the same batches every
    evaluation)."""
    return int(np.random.default_rng([seed % 2**63, 2, epoch]).integers(seq_length))


class TokenData:
    """Read-only token memmaps plus the batch sampler.

    A split of N tokens has M = N - 1 targets and holds M // seq_length blocks per epoch: block k of
    epoch e starts at offset_e + k * seq_length (wrapping around the end of the split) and holds
    seq_length + 1 tokens, inputs and their next-token targets. The offset is drawn per epoch for
    train (0 for val), so windows differ between epochs while each token is a target at most once
    per epoch (all but M % seq_length of them). Each epoch visits its blocks in its own seeded
    order; the global stream of block positions is dealt out in micro-batches, rank by rank. So
    ranks never share a block within an epoch, and a batch is a pure function of (seed, split,
    position in the stream, rank, world size): a resumed run draws exactly what the uninterrupted
    one would have, and a test can rebuild any rank's batch.

    bind() fixes the run's constants (rank, world size, batch, accumulation, sequence length, seed);
    then train_batches(step) gives an optimizer step's micro-batches and state_dict(step) the
    position to resume from.
    """

    def __init__(self, directory):
        self.directory = Path(directory)
        self.meta = read_prepared_meta(self.directory)
        _check_kinds(self.directory)
        self.tokenizer = load_tokenizer(self.directory)
        # (optimizer step, global block position) the train sampler counts from
        self.origin = (0, 0)
        dtype = self.meta.get("dtype")
        if dtype not in TOKEN_DTYPES or np.iinfo(dtype).max < self.meta["vocab_size"] - 1:
            raise ConfigError(
                f"{self.directory}/meta.json says dtype {dtype!r}, which cannot hold "
                f"{self.meta['vocab_size']} token ids: delete {self.directory} to prepare it again"
            )
        self.splits = {split: self._open(split, dtype) for split in ("train", "val")}
        for split, tokens in self.splits.items():
            top = largest_token(self.directory / f"{split}.bin", tokens)
            if top is not None and top >= self.meta["vocab_size"]:
                raise ConfigError(
                    f"{self.directory / f'{split}.bin'} holds token id {top}, but its tokenizer "
                    f"has {self.meta['vocab_size']} tokens (ids below {self.meta['vocab_size']}): "
                    f"delete {self.directory} to prepare it again"
                )

    def _open(self, split, dtype):
        path = self.directory / f"{split}.bin"
        expected = self.meta[f"{split}_tokens"]
        if expected and not path.exists():  # an empty split needs no file
            raise ConfigError(
                f"{path} is missing (meta.json says it holds {expected} {dtype} tokens): delete "
                f"{self.directory} to prepare it again"
            )
        size = path.stat().st_size if path.exists() else 0
        if size != expected * np.dtype(dtype).itemsize:
            hint = ""
            for other in TOKEN_DTYPES:
                if other != dtype and size == expected * np.dtype(other).itemsize:
                    hint = f" (its size fits {expected} {other} tokens: was it written as {other}?)"
            raise ConfigError(
                f"{path} holds {size} bytes but meta.json says {expected} {dtype} tokens "
                f"({expected * np.dtype(dtype).itemsize} bytes){hint}: delete {self.directory} "
                "to prepare it again"
            )
        return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)

    def check(self, seq_length, vocab_size):
        """Same files and flags on every rank, so every rank reaches the same verdict before any
        collective."""
        shortest = min(len(t) for t in self.splits.values())
        if seq_length + 1 > shortest:
            raise ConfigError(
                f"--seq_length {seq_length} needs at least {seq_length + 1} tokens per split, "
                f"but the smaller split of {self.directory} has {shortest}"
            )
        if self.meta["vocab_size"] > vocab_size:
            raise ConfigError(
                f"the {self.meta['tokenizer']} tokenizer has {self.meta['vocab_size']} tokens but "
                f"--vocab_size is {vocab_size}: token ids would be out of range"
            )

    def describe(self):
        source = self.meta.get("source", "?")
        size = f", {Path(source).stat().st_size / 1e6:.1f} MB" if Path(source).is_file() else ""
        return (
            f"data: {self.directory}: {self.meta['train_tokens']:,} train and "
            f"{self.meta['val_tokens']:,} val {self.meta['tokenizer']} tokens of {source}{size}"
        )

    def bind(self, seq_length, batch_size, grad_accum_steps, rank, world_size, seed):
        """The run's constants. Same on every rank, so a refusal comes alike everywhere: a train
        split with fewer blocks than one optimizer step deals out would hand ranks the same block in
        one step, and an "epoch" of that step would be more than one pass."""
        self.seq_length, self.batch_size, self.accum = seq_length, batch_size, grad_accum_steps
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.blocks_per_step = world_size * batch_size * grad_accum_steps
        blocks = self._num_blocks("train")
        if blocks < self.blocks_per_step:
            raise ConfigError(
                f"the train split of {self.directory} holds {blocks} block(s) of --seq_length "
                f"{seq_length}, fewer than one optimizer step deals out ({world_size} rank(s) x "
                f"--batch_size {batch_size} x --grad_accum_steps {grad_accum_steps} = "
                f"{self.blocks_per_step}), "
                "so ranks would train on the same blocks: add text, or lower --seq_length, "
                "--batch_size or --grad_accum_steps, or run on fewer ranks"
            )

    def steps_per_epoch(self):
        """Optimizer steps in one pass over the train blocks (at least 1: bind refuses a split
        smaller than one step)."""
        return self._num_blocks("train") // self.blocks_per_step

    def _num_blocks(self, split):
        return (len(self.splits[split]) - 1) // self.seq_length

    def train_batches(self, step):
        """The micro-batches (inputs, targets) of optimizer step `step` on this rank."""
        origin_step, origin_position = self.origin
        first = origin_position + (step - origin_step) * self.blocks_per_step
        per_micro = self.world_size * self.batch_size
        return [
            self._batch("train", first + micro * per_micro + self.rank * self.batch_size)
            for micro in range(self.accum)
        ]

    def val_batch(self, index):
        """Validation batch `index` of this rank (the same ones at every evaluation)."""
        return self._batch("val", (index * self.world_size + self.rank) * self.batch_size)

    def _batch(self, split, first):
        """batch_size blocks from position `first` of the split's block stream: (inputs,
        targets)."""
        tokens, T = self.splits[split], self.seq_length
        # a block's inputs start anywhere in [0, targets); it wraps around the end
        targets = len(tokens) - 1
        num_blocks = targets // T
        epochs, ks = np.divmod(np.arange(first, first + self.batch_size), num_blocks)
        starts = np.empty_like(ks)
        for epoch in np.unique(epochs):  # one, or two where the batch straddles an epoch's end
            mine = epochs == epoch
            offset = epoch_offset(self.seed, int(epoch), T) if split == "train" else 0
            starts[mine] = (
                offset + epoch_order(self.seed, split, num_blocks, int(epoch))[ks[mine]] * T
            ) % targets
        index = starts[:, None] + np.arange(T + 1)
        # Past the last token the block goes on at token 1: the last token's target is the first
        # target again.
        index[index > targets] -= targets
        rows = torch.from_numpy(tokens[index].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self, step):
        """Where the train stream stands before optimizer step `step`: blocks dealt out so far."""
        origin_step, origin_position = self.origin
        return {"train_blocks_seen": origin_position + (step - origin_step) * self.blocks_per_step}

    def load_state_dict(self, state, step):
        """Continue the block stream where a checkpoint left it, at optimizer step `step`, even if
        the world size or batch size changed since."""
        self.origin = (step, state["train_blocks_seen"])

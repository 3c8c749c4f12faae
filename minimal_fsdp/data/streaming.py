"""Train straight from documents (--dataset_path SOURCE --streaming): no preparation step.

Rank r of W reads the documents with index % W == r (documents.py numbers them in source order),
tokenizes them on the fly, and packs them, each followed by the end-of-text separator, into one
endless stream of tokens, pass after pass. Batches take consecutive blocks of it, cut as TokenData
cuts a split: block k is stream[k*seq_length : (k+1)*seq_length + 1]. A document goes to validation
when documents.is_val says so, as in a prepared dataset, so a rank's stream equals the prepared
train tokens of its documents.

Train batches are read ahead on a thread, so tokenizing overlaps with the training step wherever the
step waits on the device and the tokenizer lets go of the GIL. A stream cannot be indexed, so the
position (pass, document, token offset) of every rank is saved in each checkpoint's meta.json, and a
resumed run reopens each rank's stream there: it sees exactly the tokens the uninterrupted run would
have seen. Resuming needs the same world size, which decides the sharding.
"""

import atexit
import collections
import queue
import threading

import numpy as np
import torch
import torch.distributed as dist

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data.documents import encode_document, is_val, open_documents
from minimal_fsdp.data.tokenizer import load_tokenizer, train_tokenizer
from minimal_fsdp.launch import failures


class TokenStream:
    """The tokens of the documents `select` picks, in order, pass after pass; resumable at any
    token."""

    def __init__(self, documents, tokenizer, select, position=(0, 0, 0), what="documents"):
        self.documents, self.tokenizer, self.select, self.what = documents, tokenizer, select, what
        start_pass, start_document, self.offset = position
        # (pass, document index, tokens): read, not fully consumed
        self.segments = collections.deque()
        self.available = 0  # tokens in segments
        self.next_position = tuple(position)  # where reading resumes once segments are used up
        self.reader = self._read(start_pass, start_document)

    def _read(self, pass_number, start):
        while True:
            found = False
            for index, text in self.documents.iter_from(start):
                if self.select(index):
                    tokens = encode_document(self.tokenizer, text)
                    if tokens:
                        found = True
                        self.next_position = (pass_number, index + 1, 0)
                        yield pass_number, index, np.array(tokens, dtype=np.int64)
            if not found and start == 0:
                raise ConfigError(f"{self.documents.source} holds no {self.what}")
            pass_number, start = pass_number + 1, 0

    def position(self):
        """(pass, document index, tokens of that document already consumed) of the next token."""
        if self.segments:
            pass_number, index, _ = self.segments[0]
            return pass_number, index, self.offset
        return self.next_position

    def take(self, length, advance):
        """The next `length` tokens; then move on by `advance` (< length: blocks overlap by the
        difference)."""
        while self.available - self.offset < length:
            segment = next(self.reader)
            self.segments.append(segment)
            self.available += len(segment[2])
        parts, need, skip = [], length, self.offset
        for _, _, tokens in self.segments:
            part = tokens[skip : skip + need]
            parts.append(part)
            need, skip = need - len(part), 0
            if not need:
                break
        self.offset += advance
        while self.segments and self.offset >= len(self.segments[0][2]):
            finished = self.segments.popleft()[2]
            self.offset -= len(finished)
            self.available -= len(finished)
        return np.concatenate(parts)


def _take_batch(stream, batch_size, seq_length):
    rows = torch.from_numpy(
        np.stack([stream.take(seq_length + 1, seq_length) for _ in range(batch_size)])
    )
    return rows[:, :-1], rows[:, 1:]


class Prefetcher:
    """Takes a stream's next batches on a thread, each with the stream position right after it, so
    that a checkpoint records what training consumed, not what was read ahead."""

    def __init__(self, stream, batch_size, seq_length, depth=16):
        self.shape = (batch_size, seq_length)
        self.queue = queue.Queue(depth)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(stream,), daemon=True)
        self.thread.start()
        # A daemon thread killed inside a tokenizer's C++ code at interpreter exit aborts
        # the process.
        atexit.register(self.close)

    def _fill(self, stream):
        while not self.stopped.is_set():
            try:
                item = (_take_batch(stream, *self.shape), stream.position())
            except Exception as e:  # handed to the training thread, which raises it
                item = (e, None)
            while not self.stopped.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if item[1] is None:
                return

    def next(self):
        batch, position = self.queue.get()
        if position is None:
            raise batch
        return batch, position

    def close(self):
        self.stopped.set()
        self.thread.join()
        atexit.unregister(self.close)


def _same_on_every_rank(fn, *args):
    """Run fn on every rank; if it fails anywhere, every rank raises the first failure (so none is
    left waiting in a later collective)."""
    try:
        outcome = (fn(*args), None)
    except ConfigError as e:
        outcome = (None, f"rank {dist.get_rank()}: {e}")
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, outcome[1])
    first = next((f for f in problems if f is not None), None)
    if first is not None:
        raise ConfigError(first)
    return outcome[0]


def _save_tokenizer_of(directory, streaming_dir):
    """The tokenizer in `directory`, saved under <data_dir>/streaming/<its label>; returns where."""
    tokenizer = load_tokenizer(directory)
    out = f"{streaming_dir}/{tokenizer.label}"
    tokenizer.save(out)
    return out


def _save_gpt2_tokenizer(directory):
    train_tokenizer("gpt2", "", None, directory)
    return str(directory)


class StreamingData:
    """The same interface as tokens.TokenData (meta, tokenizer, directory, check, bind,
    steps_per_epoch, train_batches, val_batch, state_dict, load_state_dict), read from a stream.
    Train batches come in order."""

    def __init__(self, documents, tokenizer, tokenizer_dir, rank, world_size, val_fraction, seed):
        self.documents, self.tokenizer, self.directory = documents, tokenizer, tokenizer_dir
        self.rank, self.world_size, self.val_fraction, self.seed = (
            rank,
            world_size,
            val_fraction,
            seed,
        )
        self.meta = {"tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size}
        self.train_position = (0, 0, 0)  # right after the last train batch handed out
        self.prefetcher = None
        self.next_step = 0  # the optimizer step whose micro-batches the stream gives next
        self.val_stream = None
        # evaluation always reads the same first val batches, so they are kept
        self.val_batches = []

    @classmethod
    def open(cls, data, env):
        """Collective: every rank opens the source and the tokenizer, or every rank raises the same
        error."""
        # saved again in our own files, which checkpoints copy (a Hugging Face directory's
        if data.tokenizer_dir:
            # vocab.json or tokenizer_config.json would not travel with them)
            tokenizer_dir = failures.run_on_main(
                _save_tokenizer_of, data.tokenizer_dir, f"{data.data_dir}/streaming"
            )
        elif data.tokenizer == "gpt2":  # saved once, so checkpoints carry it for generation
            tokenizer_dir = failures.run_on_main(
                _save_gpt2_tokenizer, f"{data.data_dir}/streaming/gpt2"
            )
        else:
            raise ConfigError(
                f"--streaming cannot fit a --tokenizer {data.tokenizer} on a stream: use "
                "--tokenizer gpt2, or --tokenizer_dir DIR with the tokenizer of a prepared dataset "
                "or checkpoint"
            )
        tokenizer = _same_on_every_rank(load_tokenizer, tokenizer_dir)
        documents = _same_on_every_rank(open_documents, data.dataset_path, "--dataset_path", True)
        return cls(
            documents,
            tokenizer,
            tokenizer_dir,
            env.rank,
            env.world_size,
            data.val_fraction,
            data.seed,
        )

    def _stream(self, split, position=(0, 0, 0)):
        rank, world, seed, fraction = self.rank, self.world_size, self.seed, self.val_fraction
        select = lambda index: (  # noqa: E731
            index % world == rank and is_val(index, seed, fraction) == (split == "val")
        )
        share = "raise --val_fraction" if split == "val" else "lower --val_fraction"
        what = (
            f"{split} documents for rank {rank} of {world} (rank r streams documents r, r + "
            f"{world}, ..., and --val_fraction {fraction} of them are val): {share}, add "
            "documents, or run on fewer ranks; or prepare the data with minimal-fsdp prepare, "
            "which fills every rank from one file"
        )
        return TokenStream(self.documents, self.tokenizer, select, position, what)

    def check(self, seq_length, vocab_size):
        """Collective: every rank's shard yields a train and a val block, or every rank raises."""
        if self.meta["vocab_size"] > vocab_size:
            raise ConfigError(
                f"the {self.meta['tokenizer']} tokenizer has {self.meta['vocab_size']} tokens but "
                f"--vocab_size is {vocab_size}: token ids would be out of range"
            )

        # A fresh stream per split, read until the first block: a source too small to fill one
        # repeats its documents pass after pass, which is fine, but a rank with no document at all
        # has nothing to repeat.
        def first_blocks():
            for split in ("train", "val"):
                self._stream(split).take(seq_length + 1, seq_length)

        _same_on_every_rank(first_blocks)

    def describe(self):
        return (
            f"data: streaming {self.documents.source} with the {self.tokenizer.kind} tokenizer "
            f"from {self.directory}"
        )

    def bind(self, seq_length, batch_size, grad_accum_steps, rank, world_size, seed):
        """The run's batch shape (rank, world size and seed came with open())."""
        self.seq_length, self.batch_size, self.accum = seq_length, batch_size, grad_accum_steps

    def steps_per_epoch(self):
        return None  # unknown: a stream's length is only known at its end

    def train_batches(self, step):
        """The micro-batches of optimizer step `step`; steps must be asked for in order."""
        if step != self.next_step:
            raise RuntimeError(
                f"a stream is read in order: step {self.next_step} is next, not {step}"
            )
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(
                self._stream("train", self.train_position), self.batch_size, self.seq_length
            )
        batches = []
        for _ in range(self.accum):
            batch, self.train_position = self.prefetcher.next()
            batches.append(batch)
        self.next_step += 1
        return batches

    def val_batch(self, index):
        """Validation batch `index`: the same first batches of this rank's val documents every
        time."""
        if self.val_stream is None:
            self.val_stream = self._stream("val")
        while len(self.val_batches) <= index:
            self.val_batches.append(_take_batch(self.val_stream, self.batch_size, self.seq_length))
        return self.val_batches[index]

    def close(self):
        """Stop reading ahead (at the latest when the process exits)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def state_dict(self, step):
        """Collective: every rank's stream position before step `step`, for rank 0 to write into the
        checkpoint."""
        if step != self.next_step:
            raise RuntimeError(f"the stream is at step {self.next_step}, not {step}")
        positions = [None] * self.world_size
        dist.all_gather_object(positions, list(self.train_position))
        return {"stream": positions}

    def load_state_dict(self, state, step):
        """Reopen this rank's stream where the checkpoint left it. Same flags and meta.json on every
        rank, so every rank reaches the same verdict."""
        if "stream" not in state:
            raise ConfigError(
                "the checkpoint holds no stream position (it was not written by a --streaming "
                "run): use another --run_name, or --restart_checkpoint_file from a --streaming run"
            )
        saved = state["stream"]
        if len(saved) != self.world_size:
            raise ConfigError(
                f"this --streaming run was saved on {len(saved)} rank(s) and each rank's documents "
                f"depend on it: resume it on {len(saved)} rank(s), not {self.world_size}"
            )
        self.close()
        self.train_position = tuple(saved[self.rank])
        self.next_step = step

import json

import numpy as np
import pytest
import torch

from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.data import TokenData, prepared_dir as prepare
from minimal_fsdp.tokenizer import CharTokenizer


def cfg_for(corpus, tmp_path, *extra):
    return parse_args(["--dataset", "text", "--input_file", str(corpus), "--data_dir", str(tmp_path / "data"), *extra])


def numbered_dataset(directory, train_tokens, val_tokens=200):
    """A prepared dataset whose train token at position p is p itself, so a batch says which blocks it holds."""
    directory.mkdir(parents=True)
    vocab = max(train_tokens, val_tokens)
    CharTokenizer([chr(0x100 + i) for i in range(vocab)]).save(directory)
    np.arange(train_tokens, dtype=np.uint16).tofile(directory / "train.bin")
    np.arange(val_tokens, dtype=np.uint16).tofile(directory / "val.bin")
    meta = {"tokenizer": "char", "vocab_size": vocab, "dtype": "uint16", "train_tokens": train_tokens,
            "val_tokens": val_tokens}
    (directory / "meta.json").write_text(json.dumps(meta))
    return TokenData(directory)


def rows_of(data, step, rank, world, batch, seq=10, seed=3, accum=1):
    """Rank `rank`'s rows of optimizer step `step` of a numbered dataset: each row lists the token positions it
    holds (inputs then the last target)."""
    data.bind(seq, batch, accum, rank, world, seed)
    rows = []
    for x, y in data.train_batches(step):
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        rows += torch.cat([x, y[:, -1:]], dim=1).tolist()
    last = len(data.splits["train"]) - 1
    for row in rows:  # seq + 1 consecutive tokens, going on at token 1 after the last one
        assert all(b == a + 1 or (a == last and b == 1) for a, b in zip(row, row[1:])), row
    return rows


def targets_of(rows):
    return [t for row in rows for t in row[1:]]


def test_prepare_writes_bins_meta_and_tokenizer(corpus, tmp_path):
    out = prepare(cfg_for(corpus, tmp_path))
    meta = json.loads((tmp_path / "data" / "corpus" / "char" / "meta.json").read_text())
    data = TokenData(out)
    text = corpus.read_text()
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)  # char: one token per character
    assert meta["dtype"] == "uint16"
    train = np.fromfile(f"{out}/train.bin", dtype=np.uint16)
    assert data.tokenizer.decode(train[:200].tolist()) == text[:200]
    assert prepare(cfg_for(corpus, tmp_path)) == out  # second call reuses the prepared bins


def test_batches_are_deterministic_and_differ_across_ranks(corpus, tmp_path):
    data = TokenData(prepare(cfg_for(corpus, tmp_path)))

    def batch(step, rank, seed):
        data.bind(16, 4, 1, rank, 2, seed)
        return data.train_batches(step)[0]
    a, b, c, d, e = batch(3, 0, 1), batch(3, 0, 1), batch(3, 1, 1), batch(4, 0, 1), batch(3, 0, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0]) and not torch.equal(a[0], e[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_each_epoch_makes_every_token_a_target_at_most_once_in_new_windows(tmp_path):
    """301 tokens: 300 targets, 30 blocks of 10 per epoch. Every epoch cuts its windows at its own offset, so the
    windows differ between epochs while no target repeats within one, across ranks too; each epoch misses
    fewer targets than one block holds (here none: 300 = 30 x 10)."""
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)
    world, batch = 3, 4  # 12 blocks per step: epochs end mid-batch, and that must not matter
    steps = [[rows_of(data, step, rank, world, batch) for rank in range(world)] for step in range(10)]
    stream = [row for step in steps for rank_rows in step for row in rank_rows]  # the global block order
    epochs = [stream[:30], stream[30:60], stream[60:90]]
    for epoch in epochs:
        assert sorted(targets_of(epoch)) == list(range(1, 301))
    starts = [{row[0] % 10 for row in epoch} for epoch in epochs]
    assert all(len(s) == 1 for s in starts) and len(set.union(*starts)) > 1  # one cut per epoch; cuts differ
    for step in (0, 1):  # within an epoch, ranks never share a target
        ranks = [set(targets_of(steps[step][rank])) for rank in range(world)]
        assert not (ranks[0] & ranks[1] or ranks[0] & ranks[2] or ranks[1] & ranks[2])


def test_a_split_holds_only_whole_blocks(tmp_path):
    """300 tokens hold 299 targets: 29 blocks of 10, not 30; the 9 targets left over differ from epoch to epoch."""
    data = numbered_dataset(tmp_path / "numbered", train_tokens=300)
    stream = [row for step in range(58) for row in rows_of(data, step, 0, 1, 1)]  # two epochs
    first, second = targets_of(stream[:29]), targets_of(stream[29:])
    assert len(set(first)) == len(first) == 290 and len(set(second)) == 290
    assert set(first) != set(second)


def test_validation_batches_are_the_same_at_every_evaluation(tmp_path):
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301, val_tokens=201)
    data.bind(10, 2, 1, 1, 2, 3)
    x, y = data.val_batch(0)
    again = data.val_batch(0)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert all(int(first) % 10 == 0 for first in x[:, 0])  # val windows start at multiples of the length


def test_resume_mid_epoch_continues_the_block_stream_exactly(tmp_path):
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)
    world, batch = 2, 3
    uninterrupted = [row for step in range(8) for rank in range(world) for row in rows_of(data, step, rank, world, batch)]
    saved = data.state_dict(5)  # a checkpoint after 5 steps, mid-epoch (30 blocks, 6 per step)
    assert saved == {"train_blocks_seen": 30}

    same = TokenData(data.directory)
    same.load_state_dict(json.loads(json.dumps(saved)), 5)  # through JSON, as meta.json stores it
    assert [row for rank in range(world) for row in rows_of(same, 5, rank, world, batch)] == uninterrupted[30:36]

    # Resumed on 3 ranks with batch 2 and another step numbering: the same blocks come next.
    rescaled = TokenData(data.directory)
    rescaled.load_state_dict(saved, 7)
    resumed = [row for step in (7, 8) for rank in range(3) for row in rows_of(rescaled, step, rank, 3, 2)]
    assert resumed == uninterrupted[30:42]
    assert uninterrupted[30:36] != uninterrupted[:6]  # not vacuous: a restart from 0 would differ
    assert rows_of(rescaled, 7, 0, 3, 1, accum=2) == resumed[:1] + resumed[3:4]  # accumulation: micro-steps


def test_sentencepiece_prepares_with_its_vocab(corpus, tmp_path):
    data = TokenData(prepare(cfg_for(corpus, tmp_path, "--tokenizer", "sentencepiece", "--vocab_size", "300")))
    assert data.meta["tokenizer"] == "sentencepiece" and data.meta["vocab_size"] == 300
    assert data.meta["train_tokens"] < len(corpus.read_text())  # merges make fewer tokens than characters


def test_checks_catch_bad_lengths_and_vocab(corpus, tmp_path):
    data = TokenData(prepare(cfg_for(corpus, tmp_path)))
    with pytest.raises(ConfigError, match="--seq_length 100000"):
        data.check(100_000, 1000)
    with pytest.raises(ConfigError, match="--vocab_size is 5"):
        data.check(32, 5)
    data.check(32, data.meta["vocab_size"])


def test_bin_that_disagrees_with_meta_is_refused(corpus, tmp_path):
    out = prepare(cfg_for(corpus, tmp_path))
    with open(f"{out}/val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ConfigError, match="meta.json says"):
        TokenData(out)


def test_bin_whose_dtype_disagrees_with_meta_is_refused(tmp_path):
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)
    expected = rows_of(data, 2, 1, 2, 3)
    meta = dict(data.meta, dtype="uint32")
    (data.directory / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="was it written as uint16"):
        TokenData(data.directory)
    (data.directory / "meta.json").write_text(json.dumps(dict(meta, dtype="uint16", vocab_size=70_000)))
    with pytest.raises(ConfigError, match="dtype 'uint16', which cannot hold 70000 token ids"):
        TokenData(data.directory)
    # the same tokens written as uint32 (a vocabulary past 65536) read back the same
    np.fromfile(data.directory / "train.bin", dtype=np.uint16).astype(np.uint32).tofile(data.directory / "train.bin")
    np.fromfile(data.directory / "val.bin", dtype=np.uint16).astype(np.uint32).tofile(data.directory / "val.bin")
    (data.directory / "meta.json").write_text(json.dumps(meta))
    assert rows_of(TokenData(data.directory), 2, 1, 2, 3) == expected


def test_dataset_path_must_be_prepared(tmp_path):
    with pytest.raises(ConfigError, match="has no meta.json: prepare it first"):
        prepare(parse_args(["--dataset_path", str(tmp_path)]))


@pytest.mark.parametrize("content,message", [(None, "does not exist"), ("", "too little text"),
                                             (b"\xff\xfe\x00bad", "not UTF-8")])
def test_unpreparable_input_is_one_line(tmp_path, content, message):
    path = tmp_path / "input.txt"
    if isinstance(content, bytes):
        path.write_bytes(content * 100)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        prepare(cfg_for(path, tmp_path))


def test_training_prepares_a_jsonl_input_file_by_documents(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "words " * (i % 13 + 3)}) + "\n" for i in range(60)))
    data = TokenData(prepare(cfg_for(docs, tmp_path)))
    assert data.meta["split"] == "documents" and data.meta["train_documents"] + data.meta["val_documents"] == 60
    assert data.directory == tmp_path / "data" / "docs" / "char"
    assert data.tokenizer.decode(data.splits["train"][:30].tolist()).startswith("document ")

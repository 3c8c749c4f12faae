import json

import numpy as np
import pytest
import torch

from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.data import TokenData, prepare
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


def blocks_of(data, index, rank, world, batch, seq=10, seed=3):
    x, y = data.get_batch("train", index, rank, world, batch, seq, seed)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(y[:, -1], x[:, -1] + 1)  # a block is seq + 1 consecutive tokens
    return [int(first) // seq for first in x[:, 0]]


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
    a = data.get_batch("train", 3, 0, 2, 4, 16, seed=1)
    b = data.get_batch("train", 3, 0, 2, 4, 16, seed=1)
    c = data.get_batch("train", 3, 1, 2, 4, 16, seed=1)
    d = data.get_batch("train", 4, 0, 2, 4, 16, seed=1)
    e = data.get_batch("train", 3, 0, 2, 4, 16, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0]) and not torch.equal(a[0], e[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_each_epoch_covers_every_block_once_without_overlap_across_ranks(tmp_path):
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)  # 30 blocks of 10 (+1) tokens
    world, batch = 3, 4  # 12 blocks per micro-step: epochs end mid-batch, and that must not matter
    dealt = [[blocks_of(data, index, rank, world, batch) for rank in range(world)] for index in range(10)]
    stream = [block for step in dealt for rank_blocks in step for block in rank_blocks]  # global order
    first, second = stream[:30], stream[30:60]
    assert sorted(first) == list(range(30)) and sorted(second) == list(range(30))
    assert first != second  # each epoch has its own order
    for index in (0, 1):  # within an epoch, ranks never share a block
        ranks = [set(dealt[index][rank]) for rank in range(world)]
        assert not (ranks[0] & ranks[1] or ranks[0] & ranks[2] or ranks[1] & ranks[2])


def test_a_split_holds_only_blocks_with_all_their_targets(tmp_path):
    """300 tokens hold 29 blocks of 10 + 1 tokens, not 30: the 30th block's last target would lie past the end."""
    data = numbered_dataset(tmp_path / "numbered", train_tokens=300)
    stream = [block for index in range(30) for block in blocks_of(data, index, 0, 1, 1)]  # an epoch and a block
    assert sorted(stream[:29]) == list(range(29))


def test_resume_mid_epoch_continues_the_block_stream_exactly(tmp_path):
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)
    world, batch = 2, 3
    uninterrupted = [b for index in range(8) for rank in range(world) for b in blocks_of(data, index, rank, world, batch)]
    saved = data.position(5, world, batch)  # a checkpoint after 5 micro-steps, mid-epoch (30 blocks, 6 per step)
    assert saved == {"train_blocks_seen": 30}

    same = TokenData(data.directory)
    same.restore(json.loads(json.dumps(saved)), 5)  # through JSON, as meta.json stores it
    assert [b for rank in range(world) for b in blocks_of(same, 5, rank, world, batch)] == uninterrupted[30:36]

    # Resumed on 3 ranks with batch 2 and a different micro-step numbering: the same blocks come next.
    rescaled = TokenData(data.directory)
    rescaled.restore(saved, 7)
    resumed = [b for index in (7, 8) for rank in range(3) for b in blocks_of(rescaled, index, rank, 3, 2)]
    assert resumed == uninterrupted[30:42]
    assert uninterrupted[30:36] != uninterrupted[:6]  # not vacuous: a restart from 0 would differ


def test_sentencepiece_prepares_with_its_vocab(corpus, tmp_path):
    data = TokenData(prepare(cfg_for(corpus, tmp_path, "--tokenizer", "sentencepiece", "--vocab_size", "300")))
    assert data.meta["tokenizer"] == "sentencepiece" and data.meta["vocab_size"] == 300
    assert data.num_tokens("train") < len(corpus.read_text())  # merges make fewer tokens than characters


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
    expected = blocks_of(data, 2, 1, 2, 3)
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
    assert blocks_of(TokenData(data.directory), 2, 1, 2, 3) == expected


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

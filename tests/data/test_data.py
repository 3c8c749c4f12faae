"""data/tokens.py: preparing a dataset (where it goes, from what, once; sentencepiece's vocabulary;
a JSONL input by documents), the documented sampling order (every token a target at most once per
epoch, in new windows; the seeds reference.py also uses; the same batches after a resume mid-epoch;
ranks disjoint), and the checks on a prepared dataset (lengths, vocabulary, dtype, a stale or
foreign file): each refusal one line."""

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.data import prepare as preparing
from minimal_fsdp.data import tokens
from minimal_fsdp.data.prepare import dataset_dir
from minimal_fsdp.data.tokenizer import CharTokenizer
from minimal_fsdp.data.tokens import (
    TOKEN_CACHE,
    TokenData,
    epoch_offset,
    epoch_order,
    largest_token,
)


def prepared_dir(cfg, tokenizer=None):
    """Training's prepared dataset (data.prepare.for_training), checked as run.open_data checks it
    on rank 0."""
    out = preparing.for_training(cfg, tokenizer)
    tokens.TokenData(out)
    return str(out)


prepare = prepared_dir


def cfg_for(corpus, tmp_path, *extra):
    return parse_args(
        [
            "--dataset",
            "text",
            "--input_file",
            str(corpus),
            "--data_dir",
            str(tmp_path / "data"),
            *extra,
        ]
    )


def numbered_dataset(directory, train_tokens, val_tokens=200):
    """A prepared dataset whose train token at position p is p itself, so a batch says which blocks
    it holds."""
    directory.mkdir(parents=True)
    vocab = max(train_tokens, val_tokens)
    CharTokenizer([chr(0x100 + i) for i in range(vocab)]).save(directory)
    np.arange(train_tokens, dtype=np.uint16).tofile(directory / "train.bin")
    np.arange(val_tokens, dtype=np.uint16).tofile(directory / "val.bin")
    meta = {
        "tokenizer": "char",
        "vocab_size": vocab,
        "dtype": "uint16",
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    return TokenData(directory)


def rows_of(data, step, rank, world, batch, seq=10, seed=3, accum=1):
    """Rank `rank`'s rows of optimizer step `step` of a numbered dataset: each row lists the token
    positions it holds (inputs then the last target)."""
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
    out = prepared_dir(cfg_for(corpus, tmp_path))
    meta = json.loads((tmp_path / "data" / "corpus" / "char" / "meta.json").read_text())
    data = TokenData(out)
    text = corpus.read_text()
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)  # char: one token per character
    assert meta["dtype"] == "uint16"
    train = np.fromfile(f"{out}/train.bin", dtype=np.uint16)
    assert data.tokenizer.decode(train[:200].tolist()) == text[:200]
    assert prepared_dir(cfg_for(corpus, tmp_path)) == out  # second call reuses the prepared bins


def test_batches_are_deterministic_and_differ_across_ranks(corpus, tmp_path):
    data = TokenData(prepared_dir(cfg_for(corpus, tmp_path)))

    def batch(step, rank, seed):
        data.bind(16, 4, 1, rank, 2, seed)
        return data.train_batches(step)[0]

    a, b, c, d, e = batch(3, 0, 1), batch(3, 0, 1), batch(3, 1, 1), batch(4, 0, 1), batch(3, 0, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (
        not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0]) and not torch.equal(a[0], e[0])
    )
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_each_epoch_makes_every_token_a_target_at_most_once_in_new_windows(tmp_path):
    """301 tokens: 300 targets, 30 blocks of 10 per epoch. Every epoch cuts its windows at its own
    offset, so the windows differ between epochs while no target repeats within one, across ranks
    too; each epoch misses fewer targets than one block holds (here none: 300 = 30 x 10)."""
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)
    world, batch = 3, 4  # 12 blocks per step: epochs end mid-batch, and that must not matter
    steps = [
        [rows_of(data, step, rank, world, batch) for rank in range(world)] for step in range(10)
    ]
    # the global block order
    stream = [row for step in steps for rank_rows in step for row in rank_rows]
    epochs = [stream[:30], stream[30:60], stream[60:90]]
    for epoch in epochs:
        assert sorted(targets_of(epoch)) == list(range(1, 301))
    starts = [{row[0] % 10 for row in epoch} for epoch in epochs]
    # one cut per epoch; cuts differ
    assert all(len(s) == 1 for s in starts) and len(set.union(*starts)) > 1
    for step in (0, 1):  # within an epoch, ranks never share a target
        ranks = [set(targets_of(steps[step][rank])) for rank in range(world)]
        assert not (ranks[0] & ranks[1] or ranks[0] & ranks[2] or ranks[1] & ranks[2])


def test_a_split_holds_only_whole_blocks(tmp_path):
    """300 tokens hold 299 targets: 29 blocks of 10, not 30; the 9 targets left over differ from
    epoch to epoch."""
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
    # val windows start at multiples of the length
    assert all(int(first) % 10 == 0 for first in x[:, 0])


def test_resume_mid_epoch_continues_the_block_stream_exactly(tmp_path):
    data = numbered_dataset(tmp_path / "numbered", train_tokens=301)
    world, batch = 2, 3
    uninterrupted = [
        row
        for step in range(8)
        for rank in range(world)
        for row in rows_of(data, step, rank, world, batch)
    ]
    saved = data.state_dict(5)  # a checkpoint after 5 steps, mid-epoch (30 blocks, 6 per step)
    assert saved == {"train_blocks_seen": 30}

    same = TokenData(data.directory)
    same.load_state_dict(json.loads(json.dumps(saved)), 5)  # through JSON, as meta.json stores it
    assert [
        row for rank in range(world) for row in rows_of(same, 5, rank, world, batch)
    ] == uninterrupted[30:36]

    # Resumed on 3 ranks with batch 2 and another step numbering: the same blocks come next.
    rescaled = TokenData(data.directory)
    rescaled.load_state_dict(saved, 7)
    resumed = [
        row for step in (7, 8) for rank in range(3) for row in rows_of(rescaled, step, rank, 3, 2)
    ]
    assert resumed == uninterrupted[30:42]
    assert uninterrupted[30:36] != uninterrupted[:6]  # not vacuous: a restart from 0 would differ
    # accumulation: micro-steps
    assert rows_of(rescaled, 7, 0, 3, 1, accum=2) == resumed[:1] + resumed[3:4]


def test_sentencepiece_prepares_with_its_vocab(corpus, tmp_path):
    data = TokenData(
        prepared_dir(
            cfg_for(corpus, tmp_path, "--tokenizer", "sentencepiece", "--vocab_size", "300")
        )
    )
    assert data.meta["tokenizer"] == "sentencepiece" and data.meta["vocab_size"] == 300
    # merges make fewer tokens than characters
    assert data.meta["train_tokens"] < len(corpus.read_text())


def test_checks_catch_bad_lengths_and_vocab(corpus, tmp_path):
    data = TokenData(prepared_dir(cfg_for(corpus, tmp_path)))
    with pytest.raises(ConfigError, match="--seq_length 100000"):
        data.check(100_000, 1000)
    with pytest.raises(ConfigError, match="--vocab_size is 5"):
        data.check(32, 5)
    data.check(32, data.meta["vocab_size"])


def test_bin_that_disagrees_with_meta_is_refused(corpus, tmp_path):
    out = prepared_dir(cfg_for(corpus, tmp_path))
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
    (data.directory / "meta.json").write_text(
        json.dumps(dict(meta, dtype="uint16", vocab_size=70_000))
    )
    with pytest.raises(ConfigError, match="dtype 'uint16', which cannot hold 70000 token ids"):
        TokenData(data.directory)
    # the same tokens written as uint32 (a vocabulary past 65536) read back the same
    np.fromfile(data.directory / "train.bin", dtype=np.uint16).astype(np.uint32).tofile(
        data.directory / "train.bin"
    )
    np.fromfile(data.directory / "val.bin", dtype=np.uint16).astype(np.uint32).tofile(
        data.directory / "val.bin"
    )
    (data.directory / "meta.json").write_text(json.dumps(meta))
    assert rows_of(TokenData(data.directory), 2, 1, 2, 3) == expected


def test_dataset_path_must_be_prepared(tmp_path):
    with pytest.raises(ConfigError, match="has no meta.json: prepare it first"):
        prepared_dir(parse_args(["--dataset_path", str(tmp_path)]))


@pytest.mark.parametrize(
    "content,message",
    [(None, "does not exist"), ("", "too little text"), (b"\xff\xfe\x00bad", "not UTF-8")],
)
def test_unpreparable_input_is_one_line(tmp_path, content, message):
    path = tmp_path / "input.txt"
    if isinstance(content, bytes):
        path.write_bytes(content * 100)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        prepared_dir(cfg_for(path, tmp_path))


def test_training_prepares_a_jsonl_input_file_by_documents(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": f"document {i}: " + "words " * (i % 13 + 3)}) + "\n"
            for i in range(60)
        )
    )
    data = TokenData(prepared_dir(cfg_for(docs, tmp_path)))
    assert (
        data.meta["split"] == "documents"
        and data.meta["train_documents"] + data.meta["val_documents"] == 60
    )
    assert data.directory == tmp_path / "data" / "docs" / "char"
    assert data.tokenizer.decode(data.splits["train"][:30].tolist()).startswith("document ")


def test_dataset_dir_names_the_text_and_the_tokenizer(tmp_path):
    d = str(tmp_path)
    assert dataset_dir(parse_args(["--data_dir", d])) == tmp_path / "shakespeare" / "char"
    assert dataset_dir(
        parse_args(["--data_dir", d, "--dataset", "text", "--input_file", "x/my.text.txt"])
    ) == (tmp_path / "my.text" / "char")
    assert dataset_dir(
        parse_args(["--data_dir", d, "--tokenizer", "sentencepiece", "--vocab_size", 300])
    ) == (tmp_path / "shakespeare" / "sentencepiece-300")
    given = SimpleNamespace(label="hf-abc123")
    assert (
        dataset_dir(parse_args(["--data_dir", d]), given) == tmp_path / "shakespeare" / "hf-abc123"
    )
    assert dataset_dir(
        parse_args(["--data_dir", d, "--dataset", "text", "--input_file", "a/b.txt"]), given
    ) == (tmp_path / "b" / "hf-abc123")
    assert dataset_dir(parse_args(["--dataset_path", "prepared/here"]), given) == Path(
        "prepared/here"
    )


@pytest.fixture
def prepare_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(
        preparing, "shakespeare_documents", lambda data_dir: ("shakespeare", data_dir)
    )
    monkeypatch.setattr(preparing, "open_documents", lambda *a, **k: ("open", a, k))
    monkeypatch.setattr(preparing, "prepare_bins", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(tokens, "TokenData", lambda directory: None)  # nothing prepared to check
    return calls


def test_prepared_dir_prepares_shakespeare_once(tmp_path, prepare_calls):
    cfg = parse_args(["--data_dir", str(tmp_path), "--seed", 7, "--val_fraction", 0.2])
    out = tmp_path / "shakespeare" / "char"
    assert prepared_dir(cfg) == str(out)
    assert prepare_calls == [
        ((("shakespeare", str(tmp_path)), "char", None, out, 0.2, 7, 1), {"tokenizer": None})
    ]
    out.mkdir(parents=True)
    (out / "meta.json").write_text(
        '{"tokenizer": "char", "vocab_size": 9, "dtype": "uint16", "train_tokens": 1, '
        '"val_tokens": 1}'
    )
    assert prepared_dir(cfg) == str(out) and len(prepare_calls) == 1  # prepared already: reused


def test_prepared_dir_reads_the_input_file_locally_with_the_given_tokenizer(
    tmp_path, prepare_calls
):
    cfg = parse_args(
        ["--data_dir", str(tmp_path), "--dataset", "text", "--input_file", "in/notes.jsonl"]
    )
    tokenizer = SimpleNamespace(label="sentencepiece-1a2b")
    out = tmp_path / "notes" / "sentencepiece-1a2b"
    assert prepared_dir(cfg, tokenizer) == str(out)
    ((args, kwargs),) = prepare_calls
    # never the network
    assert args[0] == ("open", ("in/notes.jsonl", "--input_file"), {"hub": False})
    assert args[3] == out and kwargs == {"tokenizer": tokenizer}


def test_an_unprepared_dataset_path_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as raised:
        prepared_dir(parse_args(["--dataset_path", str(tmp_path)]))
    assert str(raised.value) == (
        f"--dataset_path {tmp_path} has no meta.json: prepare it first (minimal-fsdp prepare "
        f"--dataset text --input_file SOURCE --output {tmp_path}), or add --streaming to read a "
        ".jsonl/Hugging Face dataset directly"
    )


def test_epoch_order_and_offset_follow_the_documented_seeds():
    """[seed mod 2^63, 1 for train / 0 for val, epoch] and [seed mod 2^63, 2, epoch], as
    reference.py rebuilds batches; a negative --seed works and means seed mod 2^63."""
    for seed, epoch in ((5, 0), (5, 3), (-1, 1), (2**63 + 9, 2)):
        s = seed % 2**63
        assert list(epoch_order(seed, "train", 50, epoch)) == list(
            np.random.default_rng([s, 1, epoch]).permutation(50)
        )
        assert list(epoch_order(seed, "val", 50, epoch)) == list(
            np.random.default_rng([s, 0, epoch]).permutation(50)
        )
        assert epoch_offset(seed, epoch, 64) == int(
            np.random.default_rng([s, 2, epoch]).integers(64)
        )
    assert list(epoch_order(-1, "train", 50, 0)) == list(epoch_order(2**63 - 1, "train", 50, 0))


def test_a_vocabulary_fills_its_token_dtype_exactly(tmp_path):
    full = numbered_dataset(tmp_path / "full", train_tokens=300)
    (full.directory / "meta.json").write_text(json.dumps(dict(full.meta, vocab_size=65536)))
    TokenData(full.directory)  # ids 0..65535 fit uint16
    (full.directory / "meta.json").write_text(json.dumps(dict(full.meta, vocab_size=65537)))
    with pytest.raises(ConfigError, match="which cannot hold 65537 token ids"):
        TokenData(full.directory)


def test_check_needs_one_token_more_than_seq_length_per_split(tmp_path):
    d = numbered_dataset(tmp_path / "d", train_tokens=300, val_tokens=40)
    d.check(39, 300)  # 40 tokens: 39 inputs and their targets
    with pytest.raises(ConfigError) as raised:
        d.check(40, 300)
    assert str(raised.value) == (
        f"--seq_length 40 needs at least 41 tokens per split, but the smaller split of "
        f"{d.directory} has 40"
    )
    with pytest.raises(ConfigError) as raised:
        d.check(8, 299)
    assert (
        str(raised.value)
        == "the char tokenizer has 300 tokens but --vocab_size is 299: token ids would be out of "
        "range"
    )


def test_describe_names_the_data_and_its_source(tmp_path):
    d = numbered_dataset(tmp_path / "d", train_tokens=1234, val_tokens=56)
    assert d.describe() == f"data: {d.directory}: 1,234 train and 56 val char tokens of ?"
    source = tmp_path / "source.txt"
    source.write_bytes(b"x" * 1_050_000)
    (d.directory / "meta.json").write_text(json.dumps(dict(d.meta, source=str(source))))
    assert TokenData(d.directory).describe() == (
        f"data: {d.directory}: 1,234 train and 56 val char tokens of {source}, 1.1 MB"
    )
    (d.directory / "meta.json").write_text(json.dumps(dict(d.meta, source="hf:some/dataset")))
    assert TokenData(d.directory).describe().endswith("char tokens of hf:some/dataset")


def test_batches_equal_the_reference_sampler_across_epochs_ranks_and_splits(tmp_path):
    from reference import PreparedTokens

    d = numbered_dataset(tmp_path / "data" / "d", train_tokens=301, val_tokens=95)
    reference = PreparedTokens(tmp_path / "data")
    for rank in range(2):
        d.bind(10, 3, 2, rank, 2, 11)
        for step in range(4):  # 30 blocks, 12 per step: steps 2 and 3 straddle epochs
            for micro, (x, y) in enumerate(d.train_batches(step)):
                rx, ry = reference.batch("train", step * 2 + micro, rank, 2, 3, 10, 11)
                assert x.tolist() == rx.tolist() and y.tolist() == ry.tolist(), (rank, step, micro)
        for index in range(3):
            assert (
                d.val_batch(index)[0].tolist()
                == reference.batch("val", index, rank, 2, 3, 10, 11)[0].tolist()
            )


def test_steps_per_epoch_counts_whole_blocks(tmp_path):
    exact = numbered_dataset(tmp_path / "exact", train_tokens=301)  # 300 targets: 30 blocks of 10
    exact.bind(10, 3, 1, 0, 1, 0)
    assert exact.steps_per_epoch() == 10
    short = numbered_dataset(tmp_path / "short", train_tokens=300)  # 299 targets: 29 blocks
    short.bind(10, 3, 1, 0, 1, 0)
    assert short.steps_per_epoch() == 9
    short.bind(10, 29, 1, 0, 1, 0)  # one step is one epoch, exactly
    assert short.steps_per_epoch() == 1


@pytest.mark.parametrize(
    "tokens,blocks,world,batch,accum", [(12, 1, 3, 1, 1), (300, 29, 2, 16, 2), (300, 29, 1, 10, 3)]
)
def test_a_split_smaller_than_one_step_is_refused_in_one_line(
    tmp_path, tokens, blocks, world, batch, accum
):
    """The issue's case first: one block on three ranks was dealt to all three every step, as "6
    epochs of 1 steps"."""
    short = numbered_dataset(tmp_path / "short", train_tokens=tokens)
    for rank in range(world):  # alike on every rank
        with pytest.raises(ConfigError) as raised:
            short.bind(10, batch, accum, rank, world, 0)
        assert str(raised.value).startswith(
            f"the train split of {tmp_path / 'short'} holds {blocks} block(s) of --seq_length 10, "
            "fewer than one optimizer "
            f"step deals out ({world} rank(s) x --batch_size {batch} x --grad_accum_steps {accum} "
            f"= {world * batch * accum})"
        ) and "\n" not in str(raised.value)


def test_state_dict_counts_blocks_from_where_the_run_resumed(tmp_path):
    d = numbered_dataset(tmp_path / "d", train_tokens=301)
    d.bind(10, 3, 2, 0, 2, 0)  # 12 blocks a step
    assert d.state_dict(5) == {"train_blocks_seen": 60}
    d.load_state_dict({"train_blocks_seen": 100}, 4)
    assert d.state_dict(4) == {"train_blocks_seen": 100} and d.state_dict(6) == {
        "train_blocks_seen": 124
    }


def test_a_bin_of_the_wrong_size_is_refused_with_its_sizes(tmp_path):
    d = numbered_dataset(tmp_path / "d", train_tokens=300, val_tokens=50)
    with open(d.directory / "val.bin", "ab") as f:
        f.write(b"\0" * 3)  # 103 bytes: neither 50 uint16 nor 50 uint32 tokens
    with pytest.raises(ConfigError) as raised:
        TokenData(d.directory)
    assert str(raised.value) == (
        f"{d.directory}/val.bin holds 103 bytes but meta.json says 50 uint16 tokens "
        f"(100 bytes): delete {d.directory} to prepare it again"
    )


def test_splits_are_read_only_and_an_empty_split_needs_no_file(tmp_path):
    d = numbered_dataset(tmp_path / "d", train_tokens=300, val_tokens=50)
    assert not d.splits["train"].flags.writeable and not d.splits["val"].flags.writeable
    (d.directory / "val.bin").unlink()
    (d.directory / "meta.json").write_text(json.dumps(dict(d.meta, val_tokens=0)))
    empty = TokenData(d.directory).splits["val"]
    assert empty.shape == (0,) and empty.dtype == np.uint16
    (d.directory / "val.bin").write_bytes(b"")  # an empty file is read the same way
    empty = TokenData(d.directory).splits["val"]
    assert empty.shape == (0,) and empty.dtype == np.uint16


def _text_cfg(tmp_path, path):
    return parse_args(["--data_dir", str(tmp_path / "data"), "--input_file", str(path)])


def test_another_file_of_the_same_name_is_not_taken_for_the_prepared_one(tmp_path):
    """data/<name>/char is named by the file's name; meta.json records what the contents were, so
    another my.txt (elsewhere, different text) is refused instead of silently training on the first
    one's tokens."""
    from conftest import make_text

    first, second, copy = (
        tmp_path / "a" / "my.txt",
        tmp_path / "b" / "my.txt",
        tmp_path / "c" / "my.txt",
    )
    for path, seed in ((first, 0), (second, 1), (copy, 0)):
        path.parent.mkdir()
        path.write_text(make_text(5_000, seed=seed))
    out = prepared_dir(_text_cfg(tmp_path, first))
    assert prepared_dir(_text_cfg(tmp_path, copy)) == out  # the same text elsewhere: the same data
    with pytest.raises(ConfigError) as raised:
        prepared_dir(_text_cfg(tmp_path, second))
    assert str(raised.value).startswith(
        f"{out} was prepared from {first} as it was then, and {second} differs"
    )
    assert f"delete {out} to prepare it again" in str(raised.value)


def test_an_edited_file_is_not_reused_stale(tmp_path):
    from conftest import make_text

    path = tmp_path / "my.txt"
    path.write_text(make_text(5_000))
    out = prepared_dir(_text_cfg(tmp_path, path))
    assert prepared_dir(_text_cfg(tmp_path, path)) == out  # unchanged: reused
    with open(path, "a") as f:
        f.write("KING:\nan added line.\n")
    with pytest.raises(ConfigError, match="differs from it now"):
        prepared_dir(_text_cfg(tmp_path, path))


def test_a_large_source_is_identified_by_path_size_and_time(tmp_path, monkeypatch):
    import os

    from minimal_fsdp.data import documents

    monkeypatch.setattr(documents, "HASHED_BYTES", 10)
    path = tmp_path / "big.txt"
    path.write_text("x" * 100)
    files = documents.open_documents(path, "--input_file", hub=False)
    st = path.stat()
    assert files.fingerprint() == {"files": [[str(path.resolve()), 100, st.st_mtime_ns]]}
    later = st.st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))
    assert files.fingerprint() != {"files": [[str(path.resolve()), 100, st.st_mtime_ns]]}


# ---- a prepared directory is as hostile as a checkpoint: each refusal one line, nothing hangs ----


@pytest.mark.parametrize(
    "text,problem",
    [
        ("[1, 2]", "meta.json holds a JSON list, not an object"),
        (
            '{"tokenizer": "char", "dtype": "uint16", "train_tokens": 300, "val_tokens": 200}',
            "meta.json: vocab_size is null, not a whole number in [1, 16777216]",
        ),
        (
            '{"tokenizer": "char", "vocab_size": "300", "dtype": "uint16", "train_tokens": 300, '
            '"val_tokens": 200}',
            'meta.json: vocab_size is "300", not a whole number in [1, 16777216]',
        ),
        (
            '{"tokenizer": "char", "vocab_size": 300, "dtype": "uint16", "train_tokens": 300, '
            '"val_tokens": 200, "source": ["a"]}',
            'meta.json: source is ["a"], not a string',
        ),
        ("[" * 100_000 + "]" * 100_000, "meta.json nests deeper than 8 levels"),
    ],
)
def test_a_hostile_prepared_meta_json_is_refused_in_one_line(tmp_path, text, problem):
    numbered_dataset(tmp_path / "d", train_tokens=300)
    (tmp_path / "d" / "meta.json").write_text(text)
    with pytest.raises(ConfigError) as raised:
        TokenData(tmp_path / "d")
    assert (
        str(raised.value)
        == f"{tmp_path / 'd'}/{problem}: delete {tmp_path / 'd'} to prepare it again"
    )


def test_token_ids_beyond_the_vocabulary_are_refused_and_the_maximum_is_cached(tmp_path):
    d = numbered_dataset(tmp_path / "d", train_tokens=300)  # ids 0..299 of a 300-token vocabulary
    cache = json.loads((tmp_path / "d" / TOKEN_CACHE).read_text())
    assert cache["train.bin"][4] == 299 and cache["val.bin"][4] == 199
    # read from the cache
    assert largest_token(tmp_path / "d" / "train.bin", np.zeros(300, np.uint16)) == 299
    tokens = np.arange(300, dtype=np.uint16)
    tokens[123] = 300  # one id at the vocabulary's size: an embedding row that does not exist
    tokens.tofile(tmp_path / "d" / "train.bin")
    # a changed file is read again, whatever its time
    os.utime(tmp_path / "d" / "train.bin", ns=(1, 1))
    with pytest.raises(ConfigError) as raised:
        TokenData(d.directory)
    assert str(raised.value) == (
        f"{tmp_path / 'd' / 'train.bin'} holds token id 300, but its tokenizer has 300 "
        f"tokens (ids below 300): delete {tmp_path / 'd'} to prepare it again"
    )


def bounded(function, seconds=60):
    """function() on a thread, or a failure if it is still running after `seconds` (it hangs)."""
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_catch(function)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s"
    return outcome[0]


def _catch(function):
    try:
        return function()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model", "train.bin"])
def test_a_fifo_in_a_prepared_directory_is_refused_without_blocking(tmp_path, name):
    numbered_dataset(tmp_path / "d", train_tokens=300)
    (tmp_path / "d" / name).unlink(missing_ok=True)
    os.mkfifo(tmp_path / "d" / name)
    error = bounded(lambda: TokenData(tmp_path / "d"))
    assert isinstance(error, ConfigError) and str(error) == (
        f"{tmp_path / 'd' / name} is not a regular file (a FIFO, device or socket): a prepared "
        f"dataset holds none; delete {tmp_path / 'd'} to prepare it again"
    )


def test_a_fifo_or_device_as_input_file_is_named_for_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nothing")
    for name, kind in [
        ("fifo.txt", "not a regular file (a FIFO, device or socket)"),
        ("zero.txt", "not a regular file (a FIFO, device or socket)"),
        ("gone.txt", "a link to nothing"),
    ]:
        error = bounded(lambda: prepared_dir(cfg_for(tmp_path / name, tmp_path)))
        assert isinstance(error, ConfigError) and str(error) == (
            f"--input_file {tmp_path / name} is {kind}: name a text or .jsonl file, or a directory "
            f"of them"
        )

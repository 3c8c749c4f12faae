"""--dataset_path SOURCE --streaming: the same tokens as prepared bins, sharded by document,
resumable."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.data.documents import HFDocuments, encode_document, is_val, open_documents
from minimal_fsdp.data.streaming import StreamingData
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.data.tokens import TokenData

from conftest import TINY_MODEL, launch
from support import make_documents, run_cli, write_jsonl

SEQ = 32


@pytest.fixture
def prepared(tmp_path):
    """200 documents as .jsonl files, and the same prepared with the char tokenizer."""
    documents = make_documents()
    source = write_jsonl(tmp_path / "docs", documents)
    out = run_cli(
        "--dataset",
        "text",
        "--input_file",
        source,
        "--tokenizer",
        "char",
        "--output",
        tmp_path / "prepared",
    )
    return documents, source, TokenData(out)


def stream_for(source, data, rank, world, flag="--dataset_path"):
    stream = StreamingData(
        open_documents(str(source), flag),
        data.tokenizer,
        data.directory,
        rank,
        world,
        val_fraction=0.1,
        seed=1337,
    )
    stream.bind(SEQ, 4, 1, rank, world, 1337)
    return stream


def streamed_tokens(stream, batches, start=0):
    """The rank's token stream as the batches hold it: blocks overlap by the one token they
    share."""
    blocks = [stream.train_batches(step)[0] for step in range(start, start + batches)]
    return np.concatenate([x.reshape(-1, SEQ) for x, _ in blocks]).reshape(-1)


def prepared_documents(documents, data):
    """The prepared train bin cut back into its documents (their tokens, end-of-text included)."""
    cut, offset = {}, 0
    for i, text in enumerate(documents):
        if not is_val(i, 1337, 0.1):
            length = len(encode_document(data.tokenizer, text))
            cut[i] = data.splits["train"][offset : offset + length]
            offset += length
    assert offset == data.meta["train_tokens"]
    return cut


def test_one_rank_streams_exactly_the_prepared_train_bin(prepared):
    documents, source, data = prepared
    stream = stream_for(source, data, 0, 1)
    train = np.asarray(data.splits["train"], dtype=np.int64)
    blocks = (len(train) - 1) // SEQ
    # past the end: the second pass starts over
    tokens = streamed_tokens(stream, batches=blocks // 4 + 20)
    assert np.array_equal(tokens[: len(train)], train)
    assert np.array_equal(tokens[len(train) : len(train) + 500], train[:500])


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_streams_the_prepared_tokens_of_its_documents(prepared, world):
    documents, source, data = prepared
    cut = prepared_documents(documents, data)
    for rank in range(world):
        expected = np.concatenate(
            [tokens for i, tokens in cut.items() if i % world == rank]
        ).astype(np.int64)
        tokens = streamed_tokens(
            stream_for(source, data, rank, world), batches=len(expected) // (4 * SEQ)
        )
        assert len(tokens) > len(expected) - 4 * SEQ
        assert np.array_equal(tokens, expected[: len(tokens)]), rank


def test_val_batches_come_from_the_held_out_documents(prepared):
    documents, source, data = prepared
    stream = stream_for(source, data, 1, 2)
    x, y = stream.val_batch(0)
    val = np.concatenate(
        [
            encode_document(data.tokenizer, d)
            for i, d in enumerate(documents)
            if i % 2 == 1 and is_val(i, 1337, 0.1)
        ]
    )
    assert np.array_equal(x.reshape(-1)[:SEQ], val[:SEQ]) and torch.equal(x[:, 1:], y[:, :-1])
    assert stream.val_batch(0) is stream.val_batch(0)  # cached


def test_resume_mid_stream_sees_the_same_next_batch(prepared):
    documents, source, data = prepared
    world = 2
    runs = [stream_for(source, data, rank, world) for rank in range(world)]
    for step in range(7):
        for run in runs:
            run.train_batches(step)
    # as meta.json holds it
    saved = json.loads(json.dumps({"stream": [list(run.train_position) for run in runs]}))
    expected = [[run.train_batches(step)[0][0] for step in (7, 8)] for run in runs]
    for rank in range(world):
        resumed = stream_for(source, data, rank, world)
        resumed.load_state_dict(saved, 7)
        # saving again right away keeps it
        assert resumed.train_position == tuple(saved["stream"][rank])
        for step, batch in zip((7, 8), expected[rank]):
            assert torch.equal(resumed.train_batches(step)[0][0], batch)
        fresh = stream_for(source, data, rank, world).train_batches(0)[0][0]
        assert not torch.equal(fresh, expected[rank][0])  # not vacuous: starting over would differ


def test_resume_refuses_another_world_size_or_a_missing_position(prepared):
    documents, source, data = prepared
    stream = stream_for(source, data, 0, 3)
    with pytest.raises(ConfigError, match="saved on 2 rank"):
        stream.load_state_dict({"stream": [[0, 0, 0], [0, 1, 0]]}, 4)
    with pytest.raises(ConfigError, match="holds no stream position"):
        stream.load_state_dict({"train_blocks_seen": 40}, 4)
    with pytest.raises(RuntimeError, match="read in order"):
        stream.train_batches(3)


def test_hugging_face_dataset_streams_like_jsonl(prepared, tmp_path):
    datasets = pytest.importorskip("datasets")
    documents, source, data = prepared
    dataset = datasets.Dataset.from_dict({"text": documents})
    dataset.save_to_disk(str(tmp_path / "hf"))
    # read as the hub streams
    hub_like = HFDocuments(dataset.to_iterable_dataset(num_shards=4), "iterable", "iterable")
    for rank in range(2):
        from_jsonl = streamed_tokens(stream_for(source, data, rank, 2), batches=35)
        from_disk = streamed_tokens(stream_for(tmp_path / "hf", data, rank, 2), batches=35)
        assert np.array_equal(from_disk, from_jsonl)
        streamed = StreamingData(
            hub_like, data.tokenizer, data.directory, rank, 2, val_fraction=0.1, seed=1337
        )
        streamed.bind(SEQ, 4, 1, rank, 2, 1337)
        assert np.array_equal(streamed_tokens(streamed, batches=30), from_jsonl[: 30 * 4 * SEQ])
        positions = [None, None]
        positions[rank] = list(streamed.train_position)
        resumed = StreamingData(
            hub_like, data.tokenizer, data.directory, rank, 2, val_fraction=0.1, seed=1337
        )
        resumed.bind(SEQ, 4, 1, rank, 2, 1337)
        resumed.load_state_dict({"stream": positions}, 30)  # skips ahead in the iterable dataset
        assert np.array_equal(
            streamed_tokens(resumed, batches=5, start=30), from_jsonl[30 * 4 * SEQ :]
        )


def test_flags_that_cannot_stream_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--streaming needs --max_steps"):
        parse_args(["--dataset_path", "x.jsonl", "--streaming", "--max_steps", "0"])
    with pytest.raises(ConfigError, match="--streaming needs --dataset_path"):
        parse_args(["--streaming"])
    cfg = parse_args(["--dataset_path", "x.jsonl", "--streaming", "--tokenizer", "char"])
    with pytest.raises(ConfigError, match="cannot fit a --tokenizer char on a stream"):
        StreamingData.open(cfg, env=None)


def stream_args(tmp_path, source, tokenizer_dir, run_name, *extra):
    return [
        "--dataset_path",
        source,
        "--streaming",
        "--tokenizer_dir",
        tokenizer_dir,
        *TINY_MODEL,
        "--dropout",
        "0.0",
        "--max_steps",
        6,
        "--checkpoint_interval",
        3,
        "--eval_interval",
        3,
        "--log_interval",
        1,
        "--run_name",
        run_name,
        *extra,
    ]


def logged(tmp_path, run_name):
    rows = [
        json.loads(line)
        for line in (tmp_path / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.slow
def test_streaming_trains_and_a_resumed_run_continues_exactly(prepared, tmp_path):
    documents, source, data = prepared
    launch(stream_args(tmp_path, source, data.directory, "whole"), ranks=2, cwd=tmp_path)
    step_3 = tmp_path / "checkpoints" / "whole" / "step_3"
    positions = json.loads((step_3 / "meta.json").read_text())["state"]["data"]["stream"]
    assert len(positions) == 2 and positions[0] != positions[1]
    # the checkpoint carries the stream's tokenizer
    assert load_tokenizer(step_3).chars == data.tokenizer.chars
    launch(
        stream_args(
            tmp_path, source, data.directory, "resumed", "--restart_checkpoint_file", step_3
        ),
        ranks=2,
        cwd=tmp_path,
    )
    whole, resumed = logged(tmp_path, "whole"), logged(tmp_path, "resumed")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([whole[s] for s in (4, 5, 6)], abs=1e-6)


@pytest.mark.slow  # a 2-rank launch
def test_a_rank_without_documents_stops_every_rank_with_one_error(tmp_path, prepared):
    documents, source, data = prepared
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": documents[0]}) + "\n")
    result = launch(
        stream_args(tmp_path, tmp_path / "one.jsonl", data.directory, "tiny"),
        ranks=2,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    # The message says what to change: the held-out share, the documents, or the ranks.
    assert re.search(
        r"holds no (val documents for rank \d of 2 .*: raise|train documents for rank \d of 2 .*: "
        r"lower) --val_fraction, add documents, or run on fewer ranks",
        errors[0],
    ), errors[0]


@pytest.mark.usefixtures("one_rank_group")
def test_open_splits_the_documents_by_global_rank_not_local_rank(prepared, tmp_path):
    """Only a multi-host launch has ranks whose local rank differs from their rank: here a fake one
    (rank 3 of 4, local rank 1 of 2 on its host), so that a split by local rank shows on one
    machine, in this process."""
    documents, source, data = prepared
    env = SimpleNamespace(rank=3, world_size=4, local_rank=1, local_world_size=2)
    cfg = parse_args(
        [
            "--dataset_path",
            str(source),
            "--streaming",
            "--tokenizer_dir",
            str(data.directory),
            "--max_steps",
            "1",
            "--data_dir",
            str(tmp_path / "data"),
            "--val_fraction",
            "0.1",
        ]
    )
    opened = StreamingData.open(cfg, env)
    opened.bind(SEQ, 4, 1, 3, 4, 1337)
    expected = stream_for(source, data, 3, 4).train_batches(0)[0][0]
    assert torch.equal(opened.train_batches(0)[0][0], expected)
    # not vacuous
    assert not torch.equal(expected, stream_for(source, data, 1, 4).train_batches(0)[0][0])


def test_each_rank_streams_the_documents_of_its_global_rank_across_hosts(one_rank_group, tmp_path):
    """Two hosts of two ranks: ranks 2 and 3 are local ranks 0 and 1 of the second host, and must
    read documents 2, 6, ... and 3, 7, ..., not the first host's. In this process, with the launch's
    layout written out (the multi-host launches check it where network namespaces can be made)."""
    from minimal_fsdp.data.tokenizer import CharTokenizer
    from minimal_fsdp.launch.environment import DistEnv

    documents = make_documents(40)
    source = write_jsonl(tmp_path / "docs", documents)
    CharTokenizer("".join(documents)).save(tmp_path / "tokenizer")
    flags = ["--dataset_path", source, "--streaming", "--tokenizer_dir", tmp_path / "tokenizer"]
    cfg = parse_args([*map(str, flags), "--data_dir", str(tmp_path / "data")])
    read = {}
    for rank, local_rank in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        env = DistEnv(rank, 4, local_rank, 2, 2, torch.device("cpu"), "gloo", "srun", (2, 2))
        data = StreamingData.open(cfg, env)
        read[rank] = {
            index
            for split in ("train", "val")
            for index in range(len(documents))
            if data._stream(split).select(index)
        }
        assert read[rank] == set(range(rank, len(documents), 4)), (rank, sorted(read[rank]))

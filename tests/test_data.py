import json

import numpy as np
import pytest
import torch

from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.data import TokenData, prepare


def cfg_for(corpus, tmp_path, *extra):
    return parse_args(["--dataset", "text", "--input_file", str(corpus), "--data_dir", str(tmp_path / "data"), *extra])


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
    a = data.get_batch("train", 3, 0, 4, 16, seed=1)
    b = data.get_batch("train", 3, 0, 4, 16, seed=1)
    c = data.get_batch("train", 3, 1, 4, 16, seed=1)
    d = data.get_batch("train", 4, 0, 4, 16, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


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

"""minimal-fsdp prepare: documents from JSONL/text files and Hugging Face datasets -> bins."""

import os
import subprocess
import sys

import numpy as np
import pytest

from minimal_fsdp.checkpoint import find, meta
from minimal_fsdp.commands import prepare as prepare_command
from minimal_fsdp.config.commands import PrepareFlags
from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.config.parser import parse
from minimal_fsdp.data import documents, prepare
from minimal_fsdp.data.documents import encode_document, is_val, open_documents
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.data.tokens import TokenData

from conftest import ROOT, TINY_MODEL, launch, make_text
from support import make_documents, run_cli, write_jsonl


def expected_split(documents, tokenizer, split, seed=1337, val_fraction=0.1):
    """What a split's bin must hold: its documents in order, each followed by the end-of-text
    separator."""
    picked = [
        text
        for i, text in enumerate(documents)
        if is_val(i, seed, val_fraction) == (split == "val")
    ]
    return [t for text in picked for t in encode_document(tokenizer, text)], len(picked)


def test_jsonl_directory_prepares_documents_with_separators(tmp_path):
    documents = make_documents()
    source = write_jsonl(tmp_path / "docs", documents)
    out = run_cli(
        "--dataset",
        "text",
        "--input_file",
        source,
        "--tokenizer",
        "char",
        "--data_dir",
        tmp_path / "data",
    )
    assert out == tmp_path / "data" / "docs" / "char"
    data = TokenData(out)
    for split in ("train", "val"):
        tokens, count = expected_split(documents, data.tokenizer, split)
        assert data.splits[split].tolist() == tokens
        assert data.meta[f"{split}_documents"] == count and count > 0
    assert data.meta["dtype"] == "uint16" and data.meta["split"] == "documents"
    text = data.tokenizer.decode(data.splits["train"][:2000].tolist())
    first_train = next(d for i, d in enumerate(documents) if not is_val(i, 1337, 0.1))
    # char has no end-of-text token: a blank line separates
    assert text.startswith(first_train + "\n\n")


def test_process_pool_writes_the_same_bins(tmp_path):
    source = write_jsonl(tmp_path / "docs", make_documents(120))
    one = run_cli(
        "--dataset",
        "text",
        "--input_file",
        source,
        "--tokenizer",
        "char",
        "--output",
        tmp_path / "one",
    )
    two = run_cli(
        "--dataset",
        "text",
        "--input_file",
        source,
        "--tokenizer",
        "char",
        "--output",
        tmp_path / "two",
        num_proc=2,
    )
    for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_hugging_face_dataset_prepares_like_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    documents = make_documents(150, seed=1)
    datasets.Dataset.from_dict({"text": documents, "id": list(range(150))}).save_to_disk(
        str(tmp_path / "hf")
    )
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": documents})}).save_to_disk(
        str(tmp_path / "dd")
    )
    write_jsonl(tmp_path / "jsonl", documents, files=3)
    common = ["--tokenizer", "sentencepiece", "--vocab_size", 300, "--seed", 5]
    outs = [
        run_cli(
            "--dataset", "hf", "--input_file", tmp_path / "hf", "--output", tmp_path / "a", *common
        ),
        run_cli(
            "--dataset", "hf", "--input_file", tmp_path / "dd", "--output", tmp_path / "b", *common
        ),
        run_cli(
            "--dataset",
            "text",
            "--input_file",
            tmp_path / "jsonl",
            "--output",
            tmp_path / "c",
            *common,
        ),
    ]
    bins = [[(out / f"{split}.bin").read_bytes() for split in ("train", "val")] for out in outs]
    assert bins[0] == bins[1] == bins[2]
    data = TokenData(outs[0])
    eot = data.tokenizer.eot_id
    assert eot is not None and data.meta["tokenizer"] == "sentencepiece"
    train_docs = [d for i, d in enumerate(documents) if not is_val(i, 5, 0.1)]
    # one end-of-text after each document
    assert int((data.splits["train"] == eot).sum()) == len(train_docs)
    first_end = int(np.argmax(data.splits["train"] == eot))
    assert data.tokenizer.decode(data.splits["train"][:first_end].tolist()) == train_docs[0]


def test_single_text_splits_by_characters_like_training_does(tmp_path, corpus):
    out = run_cli(
        "--dataset",
        "text",
        "--input_file",
        corpus,
        "--tokenizer",
        "char",
        "--data_dir",
        tmp_path / "data",
    )
    text = corpus.read_text()
    data = TokenData(out)
    assert data.meta["split"] == "characters" and data.meta["train_tokens"] == int(len(text) * 0.9)
    assert data.tokenizer.decode(data.splits["val"].tolist()) == text[int(len(text) * 0.9) :]


def test_dtype_follows_the_vocabulary():
    assert prepare.token_dtype(50_257) == np.uint16 and prepare.token_dtype(65_536) == np.uint16
    assert prepare.token_dtype(65_537) == np.uint32 and prepare.token_dtype(128_256) == np.uint32


@pytest.mark.parametrize(
    "files,message",
    [
        ({}, "holds no .txt or .jsonl files"),
        ({"a.jsonl": ""}, "holds no documents"),
        ({"a.jsonl": '{"text": "fine"}\n{"text": broken\n'}, "a.jsonl line 2 is not JSON"),
        (
            {"a.jsonl": '{"text": "fine"}\n{"content": "x"}\n'},
            'a.jsonl line 2 has no "text" string',
        ),
        (
            {"a.jsonl": '{"text": "one document"}\n{"text": "and another"}\n'},
            "no document of .* went to val",
        ),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, files, message):
    source = tmp_path / "docs"
    source.mkdir()
    for name, content in files.items():
        (source / name).write_text(content)
    with pytest.raises(ConfigError, match=message):
        prepare_command.main(
            parse(
                PrepareFlags,
                [
                    "--dataset",
                    "text",
                    "--input_file",
                    str(source),
                    "--tokenizer",
                    "char",
                    "--output",
                    str(tmp_path / "out"),
                ],
            )
        )


def test_missing_datasets_package_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError, match=r"needs the datasets package: pip install datasets"):
        prepare_command.main(parse(PrepareFlags, ["--dataset", "openwebtext"]))


def test_openwebtext_offline_is_one_line(tmp_path):
    pytest.importorskip("datasets")
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home")
    )
    result = subprocess.run(
        [sys.executable, "-m", "minimal_fsdp", "prepare", "--dataset", "openwebtext"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert (
        len(errors) == 1 and "Skylion007/openwebtext" in errors[0] and "save_to_disk" in errors[0]
    )
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_trainer_reads_a_prepared_directory(tmp_path):
    source = write_jsonl(tmp_path / "docs", make_documents())
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
    launch(
        [
            "--dataset_path",
            out,
            *TINY_MODEL,
            "--max_steps",
            3,
            "--eval_interval",
            0,
            "--log_interval",
            1,
        ],
        ranks=2,
        cwd=tmp_path,
    )
    saved = find.latest(tmp_path / "checkpoints" / "prepared")
    assert meta.read_meta(saved)["state"]["data"] == {"train_blocks_seen": 3 * 2 * 4}
    assert load_tokenizer(saved).chars == TokenData(out).tokenizer.chars


def test_hub_names_reach_load_dataset_with_their_config(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(repo, config, split, streaming):
        calls.append((repo, config, split, streaming))
        return datasets.Dataset.from_dict({"text": make_documents(40)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    # the hub "answers"; the fake serves it
    monkeypatch.setattr(documents, "reachable", lambda url: True)
    run_cli(
        "--dataset",
        "hf",
        "--input_file",
        "allenai/c4:en",
        "--tokenizer",
        "char",
        "--data_dir",
        tmp_path / "data",
    )
    assert calls == [("allenai/c4", "en", "train", False)]
    assert (tmp_path / "data" / "c4" / "char" / "meta.json").exists()
    open_documents("Skylion007/openwebtext", "--dataset_path", streaming=True)
    assert calls[-1] == ("Skylion007/openwebtext", None, "train", True)


def test_the_prepare_command_refuses_an_edited_source(tmp_path):
    path = tmp_path / "my.txt"
    path.write_text(make_text(5_000))
    args = [
        "--dataset",
        "text",
        "--input_file",
        str(path),
        "--data_dir",
        str(tmp_path / "data"),
        "--num_proc",
        "1",
    ]
    prepare_command.main(parse(PrepareFlags, args))
    prepare_command.main(parse(PrepareFlags, args))  # unchanged: "prepared already"
    path.write_text(make_text(5_000, seed=3))
    with pytest.raises(
        ConfigError,
        match="differs from it now .*: delete .* to prepare it again, or pass another --output",
    ):
        prepare_command.main(parse(PrepareFlags, args))

"""inference/load.py, the one way a trained model is loaded (sample, evaluate, export and
`--max_epochs -1`), and generation's streaming and bounds. Hostile exports (a FIFO, links to a
device or out of the directory, a config.json that disagrees with the tensors, a second weights
file, a deeply nested header), a tokenizer larger than the model's vocabulary and an absurd
--num_tokens each end in one `error:` line, exit 2, without a hang; a run directory whose newest
checkpoint fails only its checksums is sampled and exported from the older good one."""

import json
import os
import shutil
import signal
import struct
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.checkpoint import find
from minimal_fsdp.data.tokenizer import CharTokenizer, load_tokenizer
from minimal_fsdp.hf import export
from minimal_fsdp.inference import load
from minimal_fsdp.inference.generate import TextStream

import support
import tokenizer_dirs
from conftest import TINY_MODEL, launch, make_text
from support import scramble_a_tensor

PROMPT = "KING:"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny char GPT trained in one process: checkpoints at steps 2 and 4."""
    work = tmp_path_factory.mktemp("load")
    (work / "corpus.txt").write_text(make_text(20_000))
    launch(
        [
            "--dataset",
            "text",
            "--input_file",
            "corpus.txt",
            *TINY_MODEL,
            "--max_steps",
            4,
            "--checkpoint_interval",
            2,
            "--eval_interval",
            0,
        ],
        ranks=1,
        cwd=work,
    )
    return work / "checkpoints" / "corpus"


@pytest.fixture
def no_hang():
    """A bound on a hang (a FIFO read forever, a generation of hours): the test fails instead of
    waiting."""

    def hung(*_):
        raise TimeoutError("still running after 120 s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def command(single_process, capfd, monkeypatch, no_hang):
    """`minimal-fsdp NAME ...` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(name, *argv):
        capfd.readouterr()
        try:
            support.command(name, *argv)
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capfd.readouterr()
        return SimpleNamespace(code=code, out=out, err=err)

    return run


def one_error_line(result):
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.err
    assert "Traceback" not in result.err and "Traceback" not in result.out
    return lines[0]


@pytest.fixture
def exported(tmp_path):
    """An export as `minimal-fsdp export` writes it (model.safetensors with our names and the model
    type, our config.json, the char tokenizer), of a freshly initialized tiny GPT: no training."""
    from safetensors.torch import save_file

    from minimal_fsdp.models.gpt import GPT, GPTConfig

    tokenizer = CharTokenizer(make_text(5_000))
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size, seq_length=32, num_layers=2, num_heads=2, embed_size=32
    )
    torch.manual_seed(0)
    state = {name: tensor.contiguous() for name, tensor in GPT(config).state_dict().items()}
    out = tmp_path / "exported"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "model_type": "gpt"})
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    tokenizer.save(out)
    return out


def deep_header(path):
    header = b'{"__metadata__": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def link_outside(path, outside):
    shutil.move(path, outside)
    path.symlink_to(outside)


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, **changes)))


HOSTILE = {  # what is done to the export -> what the one line names
    "fifo": (
        lambda d, tmp: os.mkfifo(d / "more.safetensors"),
        "more.safetensors would be read beside it",
    ),
    "device": (
        lambda d, tmp: (
            (d / "model.safetensors").unlink() or (d / "model.safetensors").symlink_to("/dev/zero")
        ),
        "model.safetensors cannot be read as safetensors (OSError",
    ),
    "outside": (
        lambda d, tmp: link_outside(d / "model.safetensors", tmp / "elsewhere.safetensors"),
        "model.safetensors cannot be read as safetensors (OSError",
    ),
    "shape": (lambda d, tmp: edit_config(d, embed_size=64), "has shape"),
    "twice": (
        lambda d, tmp: shutil.copy(d / "model.safetensors", d / "model-00001.safetensors"),
        "model-00001.safetensors would be read beside it",
    ),
    "deep": (
        lambda d, tmp: deep_header(d / "model.safetensors"),
        "header nests deeper than 3 levels",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_export_is_one_line(exported, tmp_path, command, case):
    make, named = HOSTILE[case]
    make(exported, tmp_path)
    line = one_error_line(command("sample", exported, "--prompt", PROMPT, "--num_tokens", 3))
    assert line.startswith(f"error: {exported}") and named in line


def test_a_hostile_export_as_hf_model_is_one_line(exported, tmp_path, command):
    """basic_training.py --hf_model DIR --max_epochs -1 on our export loads it the same way."""
    os.mkfifo(exported / "more.safetensors")
    line = one_error_line(
        command(
            "train",
            "--hf_model",
            exported,
            "--max_epochs",
            -1,
            "--num_tokens",
            3,
            "--prompt",
            PROMPT,
        )
    )
    assert "more.safetensors would be read beside it" in line


@pytest.mark.slow
def test_our_export_loads_the_checkpoints_weights(run_dir, tmp_path, command):
    export.export(run_dir / "step_4", tmp_path / "ours")
    checkpoint = command("sample", run_dir / "step_4", "--prompt", PROMPT, "--num_tokens", 12)
    ours = command("sample", tmp_path / "ours", "--prompt", PROMPT, "--num_tokens", 12)
    assert (
        checkpoint.code == ours.code == 0
        and ours.out == checkpoint.out
        and ours.out.startswith(PROMPT)
    )
    assert "(export)" in ours.err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(exported, command):
    vocab = json.loads((exported / "config.json").read_text())["vocab_size"]
    # more characters than the model has rows
    chars = "".join(chr(0x4E00 + i) for i in range(vocab + 5))
    CharTokenizer(chars).save(exported)
    line = one_error_line(command("sample", exported, "--prompt", chars[-1], "--num_tokens", 3))
    assert f"has {vocab + 5} tokens, but the model's vocabulary is {vocab}" in line


def test_an_absurd_num_tokens_is_one_line(exported, command):
    line = one_error_line(command("sample", exported, "--prompt", PROMPT, "--num_tokens", 10**10))
    assert line == (
        "error: --num_tokens 10000000000 is more than this model generates in 1000 contexts of 32 "
        "tokens (32000): ask for fewer"
    )


@pytest.mark.slow
def test_a_run_directory_whose_newest_checkpoint_fails_its_checksums_gives_the_older(
    run_dir, tmp_path, command
):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    shard = sorted((run / "step_4").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum tells
    shard.write_bytes(bytes(data))
    assert find.verify(run / "step_4", checksums=False) is None and find.verify(run / "step_4")
    out = command("sample", run, "--prompt", PROMPT, "--num_tokens", 3)
    assert out.code == 0, out.err
    assert (
        f"generating from {run / 'step_2'} (checkpoint, step 2)" in out.err and "step_4" in out.err
    )
    export.export(run, tmp_path / "exported")  # export finds it alike
    assert json.loads((tmp_path / "exported" / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "exported" / "model.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "2"


@pytest.mark.slow
def test_sample_export_and_generation_only_pass_over_shards_that_fail_to_load_as_resume_does(
    run_dir, tmp_path, command
):
    """Undecodable shard bytes under recomputed checksums pass every check and fail only when
    loaded: sample, export and --max_epochs -1 traced back there (62-117 lines). Now each takes the
    previous complete checkpoint after the one line resume gives; one named itself is an error."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    scramble_a_tensor(run / "step_4")
    assert find.verify(run / "step_4") is None
    skip = f"warning: skipping checkpoint {run / 'step_4'}: loading it failed ("

    def skipped_once(err):
        lines = [line for line in err.splitlines() if "step_4" in line]
        return len(lines) == 1 and lines[0].startswith(skip) and "Traceback" not in err

    out = command("sample", run, "--prompt", PROMPT, "--num_tokens", 3)
    assert out.code == 0 and skipped_once(out.err), out.err
    assert f"generating from {run / 'step_2'} (checkpoint, step 2)" in out.err
    out = command(
        "train",
        "--checkpoint_dir",
        tmp_path,
        "--run_name",
        "run",
        "--max_epochs",
        -1,
        "--num_tokens",
        3,
        "--prompt",
        PROMPT,
    )
    assert out.code == 0 and skipped_once(out.err), out.err
    assert f"generating from {run / 'step_2'} (checkpoint, step 2)" in out.out
    out = command("export", run, tmp_path / "exported")
    assert out.code == 0 and skipped_once(out.err), out.err
    from safetensors import safe_open

    with safe_open(str(tmp_path / "exported" / "model.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "2"
    # named itself, it is not replaced
    for main, args in [
        ("sample", ["--prompt", PROMPT, "--num_tokens", 3]),
        ("export", [tmp_path / "again"]),
    ]:
        line = one_error_line(command(main, run / "step_4", *args))
        assert line.startswith(f"error: {run / 'step_4'}: {run / 'step_4'}: loading it failed (")


def test_the_text_is_streamed_as_it_is_generated(exported, command, monkeypatch):
    pieces, write = [], load.printer()
    monkeypatch.setattr(load, "printer", lambda: lambda text: pieces.append(text) or write(text))
    out = command("sample", exported, "--prompt", PROMPT, "--num_tokens", 12)
    assert out.code == 0, out.err
    assert pieces[0] == PROMPT and len(pieces) == 13  # the prompt, then each character as it comes
    assert "".join(pieces) + "\n" == out.out and len(out.out) == len(PROMPT) + 13


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_streamed_pieces_add_up_to_the_whole_decode(tmp_path, kind):
    """Tokens whose text depends on their neighbours (sentencepiece's leading space, a character
    split over byte-level tokens) stream to exactly the text decoded at once."""
    if kind == "byte-level":
        tokenizer = load_tokenizer(tokenizer_dirs.write_tokenizer_json(tmp_path))
    else:
        tokenizer = load_tokenizer(tokenizer_dirs.write_sentencepiece(tmp_path))
    generator = torch.Generator().manual_seed(0)
    for text in tokenizer_dirs.MIXED:
        ids = tokenizer.encode(text)
        ids += torch.randint(0, tokenizer.vocab_size, (40,), generator=generator).tolist()
        for start in (0, 1, len(ids) // 2):
            pieces = []
            stream = TextStream(tokenizer, ids[:start], pieces.append)
            for token in ids[start:]:
                stream.add(token)
            whole = tokenizer.decode(ids)
            stream.finish(whole)
            assert "".join(pieces) == whole

"""run.py as a newcomer meets it: a run as long as --max_steps says, the run's length said at the
start, a rerun of a finished run and a resume with changed flags said in one line each, the default
text shipped with the repository, and nothing fetched or left behind when the network is not there.
Runs in this process, one rank."""

import dataclasses
import json
from pathlib import Path

import pytest

from minimal_fsdp import run
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.config.sections import Generation, Resume
from minimal_fsdp.data import documents, prepare, tokenizer
from minimal_fsdp.data.tokens import TokenData

from conftest import TINY_MODEL, make_text
from support import command


@pytest.fixture
def single(single_process, tmp_path):
    """A plain `python basic_training.py` in tmp_path, with a small text: 10,800 train characters
    hold 84 blocks of 128, 5 steps of 16 blocks."""
    (tmp_path / "small.txt").write_text(make_text(12_000))


def train(capsys, *flags):
    command(
        "train",
        *[
            "--dataset",
            "text",
            "--input_file",
            "small.txt",
            *TINY_MODEL,
            "--seq_length",
            "128",
            "--batch_size",
            "16",
            "--eval_interval",
            "0",
            "--log_interval",
            "1",
            *map(str, flags),
        ],
    )
    return capsys.readouterr().out


def logged_steps(run_name):
    rows = (Path("logs") / run_name / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, rows) if "loss" in r]


@pytest.mark.slow  # trains several epochs in this process: seconds
def test_max_steps_runs_that_many_steps_over_several_epochs(single, capsys):
    out = train(capsys, "--max_steps", 12, "--run_name", "long")
    assert "training 12 steps = 2.4 epochs of 5 steps (--max_steps)" in out
    assert logged_steps("long") == list(range(1, 13)) and "done: step 12 of 12" in out


@pytest.mark.slow
def test_max_epochs_alone_or_first_ends_the_run(single, capsys):
    assert "training 10 steps = 2 epochs of 5 steps (--max_epochs)" in train(
        capsys, "--max_epochs", 2, "--max_steps", 0, "--run_name", "epochs"
    )
    assert "training 5 steps = 1 epoch of 5 steps (--max_epochs)" in train(
        capsys, "--max_epochs", 1, "--max_steps", 12, "--run_name", "first"
    )
    with pytest.raises(ConfigError, match="--max_steps 0 .no cap. needs --max_epochs"):
        parse_args(["--max_steps", "0"])


@pytest.mark.slow
def test_a_finished_run_and_changed_flags_are_said_in_one_line(single, capsys):
    train(capsys, "--max_steps", 4, "--lr_decay_steps", 8, "--run_name", "again")
    out = train(capsys, "--max_steps", 4, "--lr_decay_steps", 8, "--run_name", "again")
    assert (
        "checkpoints/again/step_4 finished its run at step 4: nothing to train. Pass a larger "
        "--max_steps" in out
    )
    out = train(
        capsys,
        "--max_steps",
        6,
        "--lr_decay_steps",
        8,
        "--lr",
        "0.001",
        "--batch_size",
        8,
        "--reduce_precision",
        "bf16",
        "--run_name",
        "again",
    )
    assert (
        "resuming checkpoints/again/step_4 with changed flags: --lr 0.003 -> 0.001, --batch_size "
        "16 -> 8, --reduce_precision auto -> bf16" in out
    )
    assert logged_steps("again") == [1, 2, 3, 4, 5, 6]


def test_the_default_text_is_the_shipped_tinyshakespeare(tmp_path):
    # nothing under data_dir: the repository's copy
    docs = prepare.shakespeare_documents(tmp_path / "data")
    assert (
        docs.source == str(prepare.SHIPPED_SHAKESPEARE)
        and prepare.SHIPPED_SHAKESPEARE.stat().st_size == 1_115_394
    )
    mine = tmp_path / "data" / "shakespeare" / "input.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text(make_text(5_000))
    # a text of your own wins
    assert prepare.shakespeare_documents(tmp_path / "data").source == str(mine)
    out = prepare.prepare_bins(docs, "char", None, tmp_path / "prepared", 0.1, 1337)
    assert out["train_tokens"] + out["val_tokens"] == 1_115_394
    line = TokenData(tmp_path / "prepared").describe()
    assert (
        "1,003,854 train and 111,540 val char tokens" in line
        and "data/shakespeare/input.txt, 1.1 MB" in line
    )


def test_an_unreachable_hub_fails_at_once_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(documents, "reachable", lambda url: False)
    pytest.importorskip("datasets")
    with pytest.raises(ConfigError, match="hub .* is unreachable .offline.."):
        documents.open_documents("someone/some_dataset", "--input_file")
    # A tokenizer that needs the network fails before anything is written: no empty directory
    # is left.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(tokenizer, "reachable", lambda url: False)
    with pytest.raises(SystemExit):
        command(
            "prepare",
            *["--dataset", "shakespeare", "--tokenizer", "gpt2", "--data_dir", str(tmp_path / "d")],
        )
    assert not (tmp_path / "d" / "shakespeare" / "gpt2").exists()


def test_a_bug_on_rank_0_is_exit_1_with_its_traceback_and_bad_input_stays_exit_2(
    single, capsys, monkeypatch
):
    """run_on_main keeps the error class: a ConfigError on rank 0 is bad input everywhere (exit 2,
    one line); any other exception is a bug (exit 1, rank 0's traceback, then one line)."""

    def broken(name):
        raise KeyError("a bug")

    monkeypatch.setattr(run.hub, "resolve", broken)
    flags = [
        "--dataset",
        "text",
        "--input_file",
        "small.txt",
        "--hf_model",
        "gpt2",
        "--max_steps",
        "1",
    ]
    with pytest.raises(SystemExit) as exit_code:
        command("train", *flags)
    err = capsys.readouterr().err
    assert exit_code.value.code == 1 and "Traceback" in err and "KeyError: 'a bug'" in err
    assert err.splitlines()[-1] == "error: rank 0 failed: KeyError: 'a bug'"

    def bad_input(name):
        raise ConfigError("--hf_model gpt2: not found")

    monkeypatch.setattr(run.hub, "resolve", bad_input)
    with pytest.raises(SystemExit) as exit_code:
        command("train", *flags)
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and err == "error: --hf_model gpt2: not found\n"


def test_a_prompt_the_data_cannot_encode_is_refused_and_the_default_prompt_only_drops_the_sample(
    capsys,
):
    """check_prompt, before training: a --prompt with characters the data lacks is refused, naming
    the flag, the prompt, a missing character and the way out; the default prompt only drops the
    sample, in one line on rank 0; --num_tokens 0 asks for no sample. (tests/launch/test_errors.py
    launches the refusal on two ranks in the full tier.)"""
    from types import SimpleNamespace

    from support import names

    lower = tokenizer.CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.;'\n")
    rank0 = SimpleNamespace(is_main=True)

    def generation(*flags):
        return Generation.of(parse_args(list(flags)))

    with pytest.raises(ConfigError) as error:
        run.check_prompt(generation("--prompt", "HAMLET", "--num_tokens", "20"), lower, rank0)
    names(str(error.value), "--prompt", "'HAMLET'", "'H'", "--num_tokens")
    assert "\n" not in str(error.value)

    assert run.check_prompt(generation("--prompt", "hamlet"), lower, rank0) is True
    capsys.readouterr()
    assert run.check_prompt(generation(), lower, rank0) is False
    notes = capsys.readouterr().out.splitlines()
    assert len(notes) == 1 and notes[0].startswith("no sample at the end: the default --prompt")
    assert run.check_prompt(generation(), lower, SimpleNamespace(is_main=False)) is False
    assert capsys.readouterr().out == ""  # said once, by rank 0
    assert run.check_prompt(generation("--num_tokens", "0"), lower, rank0) is False


def test_the_resume_section_holds_the_flags_a_resumed_run_is_checked_on():
    """check_resumable names a changed flag from sections.Resume: every TRAINING_FLAGS is in it,
    besides the two it refuses or reports on."""
    fields = [f.name for f in dataclasses.fields(Resume)]
    assert fields == ["data_parallel", "max_steps", *run.TRAINING_FLAGS]

"""Bad input, launched on several ranks: exit code 2 and one `error:` line on stderr naming the flag
(or file) at fault, no traceback, no rank left hanging (the launch timeout would fire)."""

import pytest

from conftest import TINY_MODEL, launch
from support import command, names


def run_bad(args, tmp_path, ranks=2, env=None):
    result = launch(args, ranks=ranks, cwd=tmp_path, timeout=120, env=env, check=False)
    assert result.returncode == 2, result.stderr[-3000:]  # bad input, not a bug (1)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]  # printed once, by rank 0
    assert "Traceback" not in result.stderr
    return errors[0]


@pytest.mark.parametrize(
    "args,ranks,words",
    [
        (["--sharding", "zero-shard"], 2, ["--sharding", "'zero-shard'"]),
        (["--precision", "fp16"], 2, ["--precision", "'fp16'"]),
        (["--batch_size", "0"], 2, ["--batch_size"]),
        (
            ["--sharding", "hybrid-full-shard", "--shard_group_size", "2"],
            3,
            ["--sharding", "--shard_group_size", "3"],
        ),
        (
            ["--max_epochs", "-1", "--run_name", "never_trained"],
            2,
            ["--max_epochs", "checkpoints/never_trained"],
        ),
        (["--dataset", "text", "--input_file", "missing.txt"], 2, ["--input_file", "missing.txt"]),
    ],
)
@pytest.mark.slow
def test_bad_flags(tmp_path, args, ranks, words):
    names(run_bad(args, tmp_path, ranks), *words)


@pytest.mark.slow  # a 2-rank launch; quick: test_launch_errors.py's one-rank error
def test_seq_length_longer_than_data(tmp_path):
    (tmp_path / "small.txt").write_text("to be or not to be, that is the question. " * 20)
    names(
        run_bad(
            ["--dataset", "text", "--input_file", "small.txt", "--seq_length", "512"], tmp_path
        ),
        "--seq_length",
        "512",
    )


@pytest.mark.slow  # quick in process: tests/data/test_data.py
def test_vocab_smaller_than_tokenizer(tmp_path, corpus):
    names(
        run_bad(
            ["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--vocab_size", "8"],
            tmp_path,
        ),
        "--vocab_size",
        "8",
    )


@pytest.mark.slow
def test_seq_length_longer_than_checkpoint_context(tmp_path, corpus, single_process):

    # The checkpoint, trained in this process (one rank, as `python basic_training.py`): no launch
    # of its own.
    command(
        "train",
        *list(
            map(
                str,
                [
                    "--dataset",
                    "text",
                    "--input_file",
                    corpus,
                    *TINY_MODEL,
                    "--max_steps",
                    1,
                    "--eval_interval",
                    0,
                ],
            )
        ),
    )
    assert (tmp_path / "checkpoints" / "corpus" / "latest").read_text().strip() == "step_1"
    names(
        run_bad(["--run_name", "corpus", "--max_epochs", "-1", "--seq_length", "64"], tmp_path),
        "--seq_length",
        "64",
        "32",
    )


@pytest.mark.slow  # quick in process: tests/data/test_tokenizer.py
def test_gpt2_tokenizer_offline_without_cache(tmp_path, corpus):
    offline = {
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "http_proxy": "http://127.0.0.1:9",
    }
    names(
        run_bad(
            ["--dataset", "text", "--input_file", corpus, "--tokenizer", "gpt2"],
            tmp_path,
            env=offline,
        ),
        "--tokenizer",
        "gpt2",
        "offline",
    )


@pytest.mark.parametrize(
    "args,words",
    [
        # within --batch_size's range (a checkpoint's), beyond any machine's memory for its
        # token ids
        (["--batch_size", "16000000", "--seq_length", "1024"], ["--batch_size", "16000000"]),
        (["--vocab_size", "16000000"], ["--vocab_size", "16,000,000", "logits"]),  # a CPU's logits
        # the parameters
        (["--embed_size", "262144", "--num_heads", "1"], ["--embed_size", "parameters"]),
    ],
)
@pytest.mark.slow
def test_sizes_beyond_the_machine_are_refused_before_allocating(tmp_path, corpus, args, words):
    names(run_bad(["--input_file", corpus, *TINY_MODEL, *args], tmp_path), *words, "GiB")


def lowercase_text(tmp_path):
    path = tmp_path / "lower.txt"
    path.write_text(
        "to be or not to be, that is the question; whether 'tis nobler in the mind to suffer.\n"
        * 60
    )
    return path


@pytest.mark.slow
def test_the_default_prompt_outside_the_vocabulary_skips_the_sample_with_one_line(tmp_path):
    """A character vocabulary without capitals cannot encode the default prompt 'ROMEO:': the run
    trains and saves, says so in one line, and exits 0 instead of failing after training."""
    result = launch(
        [
            "--input_file",
            lowercase_text(tmp_path),
            *TINY_MODEL,
            "--num_tokens",
            "20",
            "--max_steps",
            2,
        ],
        ranks=2,
        cwd=tmp_path,
        timeout=240,
    )
    notes = [line for line in result.stdout.splitlines() if line.startswith("no sample at the end")]
    assert len(notes) == 1 and "--prompt" in notes[0] and "-" * 40 not in result.stdout
    assert (tmp_path / "checkpoints" / "lower" / "latest").exists()


@pytest.mark.slow  # quick in process: tests/test_run.py
def test_a_prompt_outside_the_vocabulary_is_refused_before_training(tmp_path):
    line = run_bad(
        [
            "--input_file",
            lowercase_text(tmp_path),
            *TINY_MODEL,
            "--num_tokens",
            "20",
            "--prompt",
            "HAMLET",
        ],
        tmp_path,
    )
    names(line, "--prompt", "'HAMLET'", "'H'", "--num_tokens")
    assert not list((tmp_path / "checkpoints").glob("*/step_*"))  # nothing trained


@pytest.mark.slow  # a 2-rank launch
def test_ctrl_c_before_training_is_one_line(tmp_path, corpus):
    """A SIGINT outside the training loop (here: before it, at startup) ends the run with one line,
    not a KeyboardInterrupt traceback from every rank. Each rank sends itself a real SIGINT before
    training."""
    from conftest import ROOT

    wrapper = tmp_path / "interrupted.py"
    wrapper.write_text(
        "import os, runpy, signal, sys\n"
        "from minimal_fsdp import run\n"
        "real = run.train_model\n"
        "def interrupted(*args):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*args)\n"
        "run.train_model = interrupted\n"
        f"sys.argv[0] = {str(ROOT / 'basic_training.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    result = launch(
        ["--input_file", corpus, *TINY_MODEL],
        ranks=2,
        cwd=tmp_path,
        timeout=120,
        check=False,
        entry=wrapper,
    )
    assert result.returncode == 130 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [
        "error: interrupted (Ctrl-C) before or after training: nothing saved"
    ]


@pytest.mark.slow
def test_ctrl_c_during_a_long_first_step_exits_at_once_with_one_line(tmp_path, corpus):
    """The first step compiles for minutes on a CPU; a Ctrl-C then was heard only after it (and
    nothing was said). Each rank sends itself a real SIGINT in its first step, which then sleeps as
    a compile would: the run ends at once with rank 0's one line, and leaves no lock behind."""
    from conftest import ROOT

    wrapper = tmp_path / "long_first_step.py"
    wrapper.write_text(
        "import os, runpy, signal, sys, time\n"
        "import torch.distributed as dist\n"
        "from minimal_fsdp import train\n"
        "def compiling(*args, **kwargs):\n"
        "    dist.barrier()\n"  # as a Ctrl-C: every rank at once, all in the first step
        "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(600)\n"
        "train.train_step = compiling\n"
        f"sys.argv[0] = {str(ROOT / 'basic_training.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    result = launch(
        ["--input_file", corpus, *TINY_MODEL, "--run_name", "long"],
        ranks=2,
        cwd=tmp_path,
        timeout=120,
        check=False,
        entry=wrapper,
    )  # the timeout: a bound on a hang only
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = [
        line
        for line in result.stderr.splitlines()
        if "SIGINT" in line or line.startswith("error: ")
    ]
    assert said == ["SIGINT (Ctrl-C): stopping before the first step: nothing to save"], (
        result.stderr[-3000:]
    )
    assert not list(tmp_path.glob("*/long/.lock")) and (tmp_path / "logs" / "long").exists()

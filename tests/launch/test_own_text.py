"""The README's first hour: the quick start, then training on your own text. A run's default
--run_name names what it trains on, so the own-text command after the quick start trains instead of
meeting the quick start's checkpoint; a run directory that does hold another model is refused before
the data is prepared, naming what differs."""

import pytest

from minimal_fsdp.config.flags import parse_args

from conftest import TINY_MODEL, launch, make_text


@pytest.mark.parametrize(
    "flags,name",
    [
        ([], "shakespeare"),
        (["--input_file", "my.txt"], "my"),
        (["--input_file", "corpora/docs/"], "docs"),
        (["--input_file", "my.txt", "--model_preset", "gpt2"], "my-gpt2"),
        (["--dataset_path", "/data/owt", "--streaming", "--max_steps", "5"], "owt"),
        (["--input_file", "my.txt", "--run_name", "mine"], "mine"),
    ],
)
def test_the_default_run_name_names_the_data(flags, name):
    assert parse_args(flags).run_name == name


def short(*flags):
    return [*TINY_MODEL, "--max_steps", "2", "--eval_interval", "0", "--no-tensorboard", *flags]


@pytest.mark.slow
def test_own_text_after_the_quick_start_trains_and_a_real_collision_is_refused_before_preparing(
    tmp_path,
):
    launch(short(), ranks=1, cwd=tmp_path)  # the quick start, short: checkpoints/shakespeare
    (tmp_path / "my.txt").write_text(make_text(20_000))
    own = launch(short("--input_file", "my.txt", "--prompt", "KING"), ranks=1, cwd=tmp_path)
    assert "checkpoints/my" in own.stdout and (tmp_path / "checkpoints" / "my" / "step_2").is_dir()
    # Text with other characters, into the quick start's run directory on purpose.
    (tmp_path / "other.txt").write_text(make_text(20_000).upper() + "0123456789")
    refused = launch(
        short("--input_file", "other.txt", "--run_name", "shakespeare"),
        ranks=2,
        cwd=tmp_path,
        check=False,
    )
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert (
        "holds a model trained on --dataset shakespeare (--tokenizer char, vocabulary 65)"
        in errors[0]
    )
    assert "this run trains on --input_file other.txt" in errors[0]
    assert not (tmp_path / "data" / "other").exists()  # refused before the data was prepared

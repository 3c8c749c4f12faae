"""config/flags.py: the flags, their sections and help, and bad input as the user sees it (exit code
2, one `error:` line naming the flag), before torch is imported. Each flag's checks:
tests/config/test_config_validation.py."""

import pytest

from minimal_fsdp.config.checks import validate_world
from minimal_fsdp.config.flags import build_parser, parse_args
from minimal_fsdp.models.families import config_from_flags
from minimal_fsdp.models.gpt import GPT

from support import names, one_error_line, refused


def test_defaults_parse():
    cfg = parse_args([])
    assert cfg.sharding == "full-shard" and cfg.precision == "float32" and not cfg.generate_only


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, action.dest


@pytest.mark.parametrize(
    "argv,flags",
    [
        (["--sharding", "half-shard"], ["--sharding"]),
        (["--precision", "fp16"], ["--precision"]),
        (["--batch_size", "0"], ["--batch_size"]),
        (["--batch_size", "-3"], ["--batch_size"]),
        (["--dataset", "text"], ["--dataset", "--input_file"]),
        (["--tokenizer", "sentencepiece"], ["--tokenizer", "--vocab_size"]),
        (["--embed_size", "30", "--num_heads", "4"], ["--embed_size", "--num_heads"]),
        (["--no_such_flag"], ["--no_such_flag"]),
        (["--recompute", "selective"], ["--recompute", "--activation_checkpoints"]),
        (["--activation_checkpoints", "--recompute", "some"], ["--recompute"]),
        (["--model_preset", "llama2-7b", "--no-bias"], ["--bias", "--no-bias"]),
        (["--hf_model", "gpt2", "--no-bias"], ["--bias", "--hf_model"]),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, argv, flags):
    refused(capsys, argv, *flags)


def test_hybrid_needs_divisible_world(capsys):
    cfg = parse_args(["--sharding", "hybrid-full-shard", "--shard_group_size", "4"])
    names(
        one_error_line(capsys, validate_world, cfg, 6, 6),
        "--sharding",
        "--shard_group_size",
        "6",
        "4",
    )
    validate_world(cfg, 8, 4)


def test_boolean_flags_toggle():
    cfg = parse_args(["--cpu_offload", "--meta_init", "--activation_checkpoints", "--compile"])
    assert cfg.cpu_offload and cfg.meta_init and cfg.activation_checkpoints and cfg.compile


@pytest.mark.parametrize("flag,biases", [([], True), (["--bias"], True), (["--no-bias"], False)])
def test_no_bias_builds_a_gpt_without_biases(flag, biases):
    config = config_from_flags(parse_args(["--vocab_size", "65"] + flag))
    names = [name for name, _ in GPT(config).named_parameters()]
    assert any(name.endswith(".bias") for name in names) == biases
    assert len(names) == (config.num_layers * 12 + 4 if biases else config.num_layers * 6 + 3)


def test_input_file_alone_means_the_text_dataset():
    assert parse_args(["--input_file", "my.txt"]).dataset == "text"


@pytest.mark.parametrize(
    "argv",
    [
        ["--dataset", "shakespeare", "--input_file", "my.txt"],
        ["--dataset=shakespeare", "--input_file", "my.txt"],
    ],
)
def test_input_file_with_shakespeare_named_is_refused(capsys, argv):
    refused(capsys, argv, "--input_file", "--dataset")


def test_input_file_with_shakespeare_from_a_config_file_is_refused(capsys, tmp_path):
    (tmp_path / "run.toml").write_text('[data]\ndataset = "shakespeare"\n')
    refused(
        capsys,
        ["--config", tmp_path / "run.toml", "--input_file", "my.txt"],
        "--input_file",
        "--dataset",
    )


@pytest.mark.parametrize(
    "typo,suggestion",
    [
        ("--max_stpes", "--max_steps"),
        ("--batchsize", "--batch_size"),
        ("--max_step", "--max_steps"),
        ("--lr_decay=5", "--lr_decay_steps"),
    ],
)
def test_a_mistyped_or_abbreviated_flag_gets_the_nearest_one(capsys, typo, suggestion):
    """Abbreviations are refused too: `--max_step 5` would otherwise quietly mean --max_steps."""
    line = refused(capsys, [typo, "5"], typo.split("=")[0], suggestion)
    # the typo first, then the suggestion
    assert line.index(typo.split("=")[0]) < line.index(suggestion)


def test_help_groups_flags_by_section_and_shows_defaults():
    from minimal_fsdp.config.flags import SECTIONS

    text = build_parser().format_help()
    headings = [text.index(f"[{section}]:") for section in SECTIONS]
    assert headings == sorted(headings)  # in the sections' order, each once
    model_part = text[headings[1] : headings[2]]
    assert "--embed_size" in model_part and "--batch_size" not in model_part
    assert "(default: 16)" in " ".join(text[text.index("--batch_size N") :].split()[:20])
    assert "(default: off)" in " ".join(text[text.index("--compile, --no-compile") :].split()[:30])


def _entry(*args):
    """basic_training.py in a fresh interpreter; returns (exit code, stderr, whether torch was
    imported)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    probe = (
        "import runpy, sys; sys.argv = ['basic_training.py', *sys.argv[1:]]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "finally:\n    print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *args], cwd=root, capture_output=True, text=True, timeout=120
    )
    return result.returncode, result.stderr, result.stderr.rstrip().endswith("\nTORCH")


@pytest.mark.parametrize(
    "argv,flags",
    [
        (["--max_stpes", "5"], ["--max_stpes", "--max_steps"]),
        (["--batch_size", "0"], ["--batch_size"]),
        (["--streaming"], ["--streaming", "--dataset_path"]),
    ],
)
def test_flag_errors_answer_in_one_line_without_importing_torch(argv, flags):
    """A mistyped flag (the parser) or a bad value (validation) ends basic_training.py with exit
    code 2 and one `error:` line naming the flag, before torch is imported."""
    code, err, torch_imported = _entry(*argv)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and not torch_imported and len(errors) == 1 and "Traceback" not in err
    names(errors[0], *flags)


def test_help_answers_without_importing_torch():
    code, err, torch_imported = _entry("--help")
    assert code == 0 and not torch_imported


def test_config_imports_nothing_heavy():
    """choices.py and config/flags.py sit below everything else: no torch, and no module of the
    package that imports it (fp8, parallelize, gossip, the models), so no import cycle can form
    through them."""
    import subprocess
    import sys

    probe = (
        "import sys; import minimal_fsdp.config.flags, minimal_fsdp.config.commands\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
        "'numpy'))\n"
        "               or m.startswith('minimal_fsdp.') and not "
        "m.startswith('minimal_fsdp.config'))\n"
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_the_choices_are_the_ones_the_modules_act_on():
    from minimal_fsdp.config import choices
    from minimal_fsdp.parallel import gossip

    assert gossip.TOPOLOGIES is choices.TOPOLOGIES

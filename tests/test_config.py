import pytest

from minimal_fsdp.config import ConfigError, build_parser, parse_args, validate_world
from minimal_fsdp.model import GPT
from minimal_fsdp.models import config_from_flags


def test_defaults_parse():
    cfg = parse_args([])
    assert cfg.sharding == "full-shard" and cfg.precision == "float32" and not cfg.generate_only


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, action.dest


@pytest.mark.parametrize("argv,message", [
    (["--sharding", "half-shard"], "invalid choice"),
    (["--precision", "fp16"], "invalid choice"),
    (["--batch_size", "0"], "--batch_size must be positive"),
    (["--batch_size", "-3"], "--batch_size must be positive"),
    (["--dataset", "text"], "--input_file"),
    (["--tokenizer", "sentencepiece"], "--vocab_size"),
    (["--embed_size", "30", "--num_heads", "4"], "divisible"),
    (["--no_such_flag"], "unrecognized"),
    (["--recompute", "selective"], "--recompute selective applies with --activation_checkpoints"),
    (["--activation_checkpoints", "--recompute", "some"], "invalid choice"),
    (["--model_preset", "llama2-7b", "--no-bias"], "--bias/--no-bias is a gpt flag"),
    (["--hf_model", "gpt2", "--no-bias"], "--bias cannot change the shape of --hf_model"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_args(argv)
    assert "\n" not in str(e.value)


def test_hybrid_needs_divisible_world():
    cfg = parse_args(["--sharding", "hybrid-full-shard", "--shard_group_size", "4"])
    with pytest.raises(ConfigError, match="divisible by --shard_group_size \\(got 6 and 4\\)"):
        validate_world(cfg, 6, 6)
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


@pytest.mark.parametrize("argv", [["--dataset", "shakespeare", "--input_file", "my.txt"],
                                  ["--dataset=shakespeare", "--input_file", "my.txt"]])
def test_input_file_with_shakespeare_named_is_refused(argv):
    with pytest.raises(ConfigError, match="^--input_file is the file of --dataset text: drop --dataset shakespeare"):
        parse_args(argv)


def test_input_file_with_shakespeare_from_a_config_file_is_refused(tmp_path):
    (tmp_path / "run.toml").write_text('[data]\ndataset = "shakespeare"\n')
    with pytest.raises(ConfigError, match="drop --dataset shakespeare"):
        parse_args(["--config", tmp_path / "run.toml", "--input_file", "my.txt"])


@pytest.mark.parametrize("typo,suggestion", [("--max_stpes", "--max_steps"), ("--batchsize", "--batch_size"),
                                             ("--max_step", "--max_steps"), ("--lr_decay=5", "--lr_decay_steps")])
def test_a_mistyped_or_abbreviated_flag_gets_the_nearest_one(typo, suggestion):
    """Abbreviations are refused too: `--max_step 5` would otherwise quietly mean --max_steps."""
    with pytest.raises(ConfigError) as raised:
        parse_args([typo, "5"])
    assert str(raised.value).startswith(f"unrecognized flag {typo.split('=')[0]} (did you mean {suggestion}?)")


def test_help_groups_flags_by_section_and_shows_defaults():
    from minimal_fsdp.config import SECTIONS
    text = build_parser().format_help()
    headings = [text.index(f"[{section}]:") for section in SECTIONS]
    assert headings == sorted(headings)  # in the sections' order, each once
    model_part = text[headings[1]:headings[2]]
    assert "--embed_size" in model_part and "--batch_size" not in model_part
    assert "(default: 16)" in " ".join(text[text.index("--batch_size N"):].split()[:20])
    assert "(default: off)" in " ".join(text[text.index("--compile, --no-compile"):].split()[:30])


def _entry(*args):
    """basic_training.py in a fresh interpreter; returns (exit code, stderr, whether torch was imported)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    probe = ("import runpy, sys; sys.argv = ['basic_training.py', *sys.argv[1:]]\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "finally:\n    print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", probe, *args], cwd=root, capture_output=True, text=True,
                            timeout=120)
    return result.returncode, result.stderr, result.stderr.rstrip().endswith("\nTORCH")


def test_help_and_flag_errors_answer_without_importing_torch():
    code, err, torch_imported = _entry("--max_stpes", "5")
    assert code == 2 and not torch_imported
    assert err.splitlines()[0] == ("error: unrecognized flag --max_stpes (did you mean --max_steps?); "
                                   "`python basic_training.py --help` lists them")
    code, err, torch_imported = _entry("--help")
    assert code == 0 and not torch_imported


def test_config_imports_nothing_heavy():
    """choices.py and config.py sit below everything else: no torch, and no module of the package that imports
    it (fp8, parallelize, gossip, the models), so no import cycle can form through them."""
    import subprocess
    import sys
    probe = ("import sys; import minimal_fsdp.config\n"
             "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy'))\n"
             "               or m.startswith('minimal_fsdp.') and m not in ('minimal_fsdp.config', "
             "'minimal_fsdp.config_checks', 'minimal_fsdp.choices'))\n"
             "print(heavy)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_choices_are_the_ones_the_modules_act_on():
    from minimal_fsdp import choices, fp8, gossip
    assert fp8.RECIPES is choices.FP8_RECIPES and gossip.TOPOLOGIES is choices.TOPOLOGIES

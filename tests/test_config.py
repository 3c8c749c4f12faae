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

"""The flags' validation (config/checks.py, by section), flag by flag: every refusal is bad input as
the user sees it (exit code 2, one `error:` line naming the flag), and the values just inside each
bound are accepted. A bad value caught here is a run that would otherwise train on, silently wrong,
or fail deep inside torch with a traceback."""

import dataclasses
import importlib.util

import pytest

from minimal_fsdp.config.checks import parse_duration, validate, validate_world
from minimal_fsdp.config.flags import ConfigError, parse_args

import support
from support import named, names, one_error_line

POSITIVE = [
    "batch_size",
    "grad_accum_steps",
    "num_layers",
    "num_heads",
    "embed_size",
    "seq_length",
    "vocab_size",
    "shard_group_size",
    "log_interval",
    "eval_batches",
    "lr_decay_steps",
    "num_kv_heads",
    "intermediate_size",
    "accum_steps",
]
NON_NEGATIVE = [
    "max_steps",
    "num_tokens",
    "checkpoint_interval",
    "eval_interval",
    "warmup_steps",
    "keep_last",
    "skip_nonfinite",
    "global_average_every",
]


@pytest.fixture
def refused(capsys):
    """refused(argv, *words): parse_args(argv) ends with exit code 2 and one `error:` line naming
    each word."""
    return lambda argv, *words: support.refused(capsys, argv, *words)


@pytest.mark.parametrize("name", POSITIVE)
def test_counts_must_be_positive(refused, name):
    refused([f"--{name}", 0], f"--{name}", "0")
    refused([f"--{name}", -2], f"--{name}", "-2")


def test_counts_of_one_are_accepted():
    parse_args(
        [
            "--model",
            "llama",
            *[a for n in POSITIVE for a in (f"--{n}", "1")],
            "--data_parallel",
            "decentralized",
        ]
    )


@pytest.mark.parametrize("name", NON_NEGATIVE)
def test_intervals_and_limits_must_not_be_negative(refused, name):
    refused([f"--{name}", -1], f"--{name}", "-1")


def test_intervals_and_limits_of_zero_are_accepted():
    parse_args([a for n in NON_NEGATIVE for a in (f"--{n}", "0")] + ["--max_epochs", 1])


def test_time_limit(refused):
    refused(["--time_limit", "1h"], "--time_limit", "HH:MM:SS")
    refused(["--time_limit", "1:-2"], "--time_limit", "HH:MM:SS")
    assert parse_args(["--time_limit", "0:01:30"]).time_limit_seconds == 90
    assert parse_args([]).time_limit_seconds is None
    assert [parse_duration(t) for t in ("0", "2:03", "1:00:01", "10:0:0")] == [0, 123, 3601, 36000]
    for bad in ("", "1:2:3:4", "a:b", "1.5"):
        with pytest.raises(ConfigError) as raised:
            parse_duration(bad)
        names(str(raised.value), "--time_limit")


@pytest.mark.parametrize(
    "argv,flags",
    [
        (["--lr", 0], ["--lr"]),
        (["--lr", "nan"], ["--lr"]),
        (["--lr", "inf"], ["--lr"]),
        (["--min_lr", -0.001], ["--min_lr"]),
        (["--lr", 0.01, "--min_lr", 0.02], ["--min_lr", "--lr"]),
        (["--beta1", 1], ["--beta1"]),
        (["--beta1", -0.1], ["--beta1"]),
        (["--beta2", 1.5], ["--beta2"]),
        (["--seed", 2**63], ["--seed"]),
        (["--seed", -(2**63) - 1], ["--seed"]),
        (["--weight_decay", -0.1], ["--weight_decay"]),
        (["--grad_clip", -1], ["--grad_clip"]),
        (["--dropout", 1], ["--dropout"]),
        (["--val_fraction", 0], ["--val_fraction"]),
        (["--val_fraction", 1], ["--val_fraction"]),
        (["--temperature", -0.5], ["--temperature"]),
        (["--top_k", -1], ["--top_k"]),
        (["--collective_timeout", 0], ["--collective_timeout"]),
        (["--collective_timeout", 1e300], ["--collective_timeout"]),
        (["--max_epochs", 0], ["--max_epochs"]),
        (["--max_epochs", -2], ["--max_epochs"]),
        (["--max_steps", 0], ["--max_steps", "--max_epochs"]),
        (["--streaming", "--dataset_path", "d", "--max_steps", 0], ["--streaming", "--max_steps"]),
    ],
)
def test_numbers_that_would_corrupt_training_are_refused(refused, argv, flags):
    refused(argv, *flags)


def test_numbers_at_their_bounds_are_accepted():
    cfg = parse_args(
        [
            "--lr",
            1e-9,
            "--min_lr",
            1e-9,
            "--beta1",
            0,
            "--beta2",
            0.999,
            "--weight_decay",
            0,
            "--grad_clip",
            0,
            "--dropout",
            0,
            "--val_fraction",
            0.999,
            "--temperature",
            0,
            "--top_k",
            0,
            "--collective_timeout",
            0.001,
            "--max_epochs",
            -1,
        ]
    )
    assert cfg.generate_only
    parse_args(["--min_lr", 0, "--max_epochs", 1, "--max_steps", 0])
    parse_args(["--max_epochs", 3])
    assert not parse_args(["--max_epochs", 1]).generate_only and not parse_args([]).generate_only


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "a\0b", " a", "a "])
def test_run_name_is_one_plain_directory_name(refused, name):
    refused(["--run_name", name], "--run_name")


@pytest.mark.parametrize(
    "argv,flags",
    [
        (["--dataset", "text"], ["--dataset", "--input_file"]),
        (["--streaming", "--max_steps", 5], ["--streaming", "--dataset_path"]),
        (["--tokenizer_dir", "t", "--dataset_path", "d"], ["--dataset_path", "--tokenizer_dir"]),
        (["--tokenizer_dir", "t", "--tokenizer", "gpt2"], ["--tokenizer_dir", "--tokenizer"]),
        (["--tokenizer", "sentencepiece"], ["--tokenizer", "--vocab_size"]),
        (["--cuda_graphs"], ["--cuda_graphs", "--compile"]),
        (["--fp8_recipe", "rowwise"], ["--fp8_recipe", "--precision"]),
        (["--fp8_layers", "all"], ["--fp8_layers", "--precision"]),
        (["--recompute", "selective"], ["--recompute", "--activation_checkpoints"]),
        (["--embed_size", 30, "--num_heads", 4], ["--embed_size", "--num_heads"]),
        (["--hf_model", "gpt2", "--num_heads", 4], ["--num_heads", "--hf_model"]),
        (
            ["--hf_model", "gpt2", "--max_epochs", -1, "--restart_checkpoint_file", "c"],
            ["--max_epochs", "--hf_model", "--restart_checkpoint_file"],
        ),
        (["--num_kv_heads", 2], ["--num_kv_heads", "--model"]),
        (["--model", "gpt", "--intermediate_size", 64], ["--intermediate_size", "--model"]),
        (["--model", "llama", "--bias"], ["--bias"]),
        (["--model", "gpt", "--model_preset", "llama3-8b"], ["--model_preset", "--model"]),
        (["--accum_steps", 2], ["--accum_steps", "--data_parallel"]),
        (["--save_average"], ["--save_average", "--data_parallel"]),
        (["--global_average_every", 4], ["--global_average_every", "--data_parallel"]),
        (
            ["--data_parallel", "decentralized", "--sharding", "grad-shard"],
            ["--data_parallel", "--sharding"],
        ),
        (
            ["--data_parallel", "decentralized", "--cpu_offload"],
            ["--cpu_offload", "--data_parallel"],
        ),
        (
            ["--data_parallel", "decentralized", "--fsdp_unit", "block"],
            ["--fsdp_unit", "--data_parallel"],
        ),
        (
            ["--data_parallel", "decentralized", "--reduce_precision", "bf16"],
            ["--reduce_precision", "--data_parallel"],
        ),
        (["--eval_tasks", "t", "--eval_tasks_interval", -1], ["--eval_tasks_interval"]),
        (["--eval_tasks", "t", "--eval_tasks_limit", 0], ["--eval_tasks_limit"]),
        (
            ["--eval_tasks", "t", "--data_parallel", "decentralized"],
            ["--eval_tasks", "--data_parallel"],
        ),
    ],
)
def test_flags_that_do_not_go_together_are_refused(refused, argv, flags):
    refused(argv, *flags)


def test_flags_that_go_together_are_accepted():
    parse_args(["--dataset", "text", "--input_file", "x.txt"])
    parse_args(["--streaming", "--dataset_path", "d", "--max_steps", 5, "--tokenizer_dir", "t"])
    parse_args(["--tokenizer_dir", "t"])
    parse_args(["--tokenizer", "sentencepiece", "--vocab_size", 300])
    # the prepared data has its tokenizer
    parse_args(["--tokenizer", "sentencepiece", "--dataset_path", "d"])
    parse_args(["--cuda_graphs", "--compile"])
    parse_args(["--recompute", "selective", "--activation_checkpoints"])
    parse_args(["--embed_size", 32, "--num_heads", 4])
    parse_args(["--hf_model", "gpt2", "--seq_length", 64, "--dropout", 0.1, "--max_epochs", -1])
    # trains on from the checkpoint
    parse_args(["--hf_model", "gpt2", "--restart_checkpoint_file", "c"])
    # llama's preset
    parse_args(["--model_preset", "llama3-8b", "--num_kv_heads", 2, "--intermediate_size", 64])
    parse_args(["--model", "llama", "--num_kv_heads", 2])
    parse_args(["--no-bias"])
    parse_args(
        [
            "--data_parallel",
            "decentralized",
            "--accum_steps",
            2,
            "--global_average_every",
            8,
            "--save_average",
            "--sharding",
            "no-shard",
        ]
    )
    parse_args(["--eval_tasks", "t", "--eval_tasks_interval", 0, "--eval_tasks_limit", 0.5])
    parse_args(["--eval_tasks_interval", -1])  # read only with --eval_tasks


@pytest.mark.parametrize(
    "argv,named_first,named_later",
    [
        (
            ["--hf_model", "gpt2", "--max_epochs", -2, "--restart_checkpoint_file", "c"],
            "--max_epochs",
            "--hf_model",
        ),
        (["--embed_size", 30, "--num_heads", 0], "--num_heads", "--embed_size"),
        (["--lr", "nan", "--min_lr", 0.1], "--lr", "--min_lr"),
    ],
)
def test_a_flag_is_checked_before_others_are_read_with_it(refused, argv, named_first, named_later):
    """Where two mistakes meet, the one a later check would trust is named alone: a bad --max_epochs
    before what only generation allows, a count before a divisibility, --lr before --min_lr is
    compared with it."""
    assert not named(refused(argv, named_first), named_later)


def test_fp8_needs_torchao_unless_only_generating(refused, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    refused(["--precision", "fp8"], "--precision", "torchao")
    parse_args(["--precision", "fp8", "--max_epochs", -1])
    parse_args(["--precision", "fp8", "--fp8_recipe", "rowwise", "--max_epochs", -1])


@pytest.mark.parametrize("name", ["wandb", "tensorboard"])
def test_logging_flags_need_their_package(refused, monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a)
    )
    refused([f"--{name}"], f"--{name}", f"pip install {name}")
    parse_args([f"--no-{name}"])
    # the flags' own mistakes come first
    refused([f"--{name}", "--num_kv_heads", 2], "--num_kv_heads")


def test_device_xla_needs_torch_xla_and_refuses_what_it_cannot_do(refused, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torch_xla" else real(n, *a)
    )
    refused(["--device", "xla"], "--device", "torch_xla")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "torch_xla" else real(n, *a)
    )
    parse_args(["--device", "xla"])
    for argv in (
        ["--sharding", "no-shard"],
        ["--shard_group_size", 2],
        ["--data_parallel", "decentralized"],
        ["--cpu_offload"],
        ["--meta_init"],
        ["--compile"],
        ["--recompute", "selective", "--activation_checkpoints"],
        ["--fsdp_unit", "model"],
    ):
        refused(["--device", "xla", *argv], argv[0], "--device")
    # fine without xla
    parse_args(["--sharding", "no-shard", "--cpu_offload", "--meta_init", "--compile"])


def test_world_checks(capsys):
    validate_world(parse_args([]), 3, 3, [3])
    xla = dataclasses.replace(parse_args([]), device="xla")
    validate_world(xla, 4, 1, [1, 1, 1, 1])
    # 2 ranks on one host
    names(one_error_line(capsys, validate_world, xla, 4, 2, [2, 2]), "--device", "2")
    hybrid = parse_args(["--sharding", "hybrid-full-shard"])
    validate_world(hybrid, 8, 4, [4, 4])
    # nodes of 4 and 2 ranks: no shard group size fits both
    names(
        one_error_line(capsys, validate_world, hybrid, 6, 4, [4, 2]),
        "--sharding",
        "--shard_group_size",
        "2, 4",
    )
    names(
        one_error_line(capsys, validate_world, hybrid, 6, 4, [4, 4]),
        "--sharding",
        "--shard_group_size",
        "6",
        "4",
    )
    grouped = parse_args(["--sharding", "hybrid-grad-shard", "--shard_group_size", 3])
    validate_world(grouped, 6, 4, [4, 2])  # a group size makes node sizes irrelevant
    names(
        one_error_line(capsys, validate_world, grouped, 8, 4, [4, 4]),
        "--sharding",
        "--shard_group_size",
        "8",
        "3",
    )
    # only hybrid sharding groups ranks
    validate_world(parse_args(["--shard_group_size", 3]), 8, 4, [4, 4])


@pytest.mark.parametrize(
    "text,words",
    [
        (
            "zzz = 1\n",
            ["zzz", "launch", "generate"],
        ),  # outside any section: the sections are listed
        ("lr = 0.1\n", ["lr", "[train]"]),  # outside any section: its own is named
        ("[training]\nlr = 0.1\n", ["[training]", "train"]),
        ("[train]\nqqqqqq = 1\n", ["train.qqqqqq"]),
        ("[launch]\nconfgi = 'x'\n", ["launch.confgi"]),
        (
            "[train]\nbatchsize = 3\n",
            ["train.batchsize", "batch_size"],
        ),  # the nearest key suggested
    ],
)
def test_config_file_keys_and_sections_are_named_in_one_line(refused, tmp_path, text, words):
    path = tmp_path / "run.toml"
    path.write_text(text)
    refused(["--config", path], "--config", str(path), *words)


def test_config_is_never_a_key_nor_suggested(refused, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[launch]\nconfgi = 'x'\n")
    assert "config?" not in refused(["--config", path], "launch.confgi")


@pytest.mark.parametrize("flag", ["--data_dir", "--checkpoint_dir", "--log_dir"])
def test_a_directory_flag_naming_a_file_is_refused(refused, tmp_path, flag):
    (tmp_path / "afile").write_text("x")
    refused([flag, tmp_path / "afile"], flag, str(tmp_path / "afile"))


def test_a_config_with_input_file_and_another_dataset_is_refused(capsys):
    import dataclasses

    # built in code, not parsed: no implication
    cfg = dataclasses.replace(parse_args([]), input_file="my.txt")
    names(one_error_line(capsys, validate, cfg), "--input_file", "--dataset", "shakespeare")


def test_a_gpu_recipe_on_a_cpu_is_warned_about_and_pointed_at_the_cpu_recipe():
    from minimal_fsdp.config.checks import cpu_recipe_warning

    gpu = parse_args(["--compile", "--precision", "bf16"])
    line = cpu_recipe_warning(gpu, "cpu")
    assert (
        line.startswith("warning: --compile and --precision bf16 on a CPU")
        and "shakespeare_tiny.toml" in line
    )
    assert (
        cpu_recipe_warning(gpu, "cuda") is None
        and cpu_recipe_warning(parse_args([]), "cpu") is None
    )


def test_sizes_are_checked_against_free_memory(capsys, monkeypatch):
    from minimal_fsdp.config import checks

    monkeypatch.setattr(checks, "host_memory_available", lambda: 2**30)
    # 200000 x 129 ids x 8 bytes x 3 copies x 2 processes: 1.15 GiB
    cfg = parse_args(["--batch_size", "200000"])
    names(
        one_error_line(capsys, checks.check_sizes, cfg, 128, 1000, 2, None),
        "--batch_size",
        "1.15 GiB",
        "1 GiB",
        "--grad_accum_steps",
    )
    # a small batch fits
    checks.check_sizes(parse_args([]), 128, 1000, processes=2, device_free=None)
    # 300M fp32 parameters in each of 2 processes: 2.24 GiB
    names(
        one_error_line(capsys, checks.check_sizes, parse_args([]), 128, 300_000_000, 2, 2**30),
        "300,000,000",
        "2.24 GiB",
        "--meta_init",
    )
    checks.check_sizes(
        parse_args(["--meta_init"]), 128, 300_000_000, processes=2, device_free=2**30, ranks=8
    )  # a shard of it fits
    # a CPU's logits: 16 x 128 x 50,304 fp32, three copies (logits, log-softmax, gradient), 2
    # processes: 2.3 GiB
    cfg = parse_args(["--batch_size", "16"])
    names(
        one_error_line(
            capsys, checks.check_sizes, cfg, 128, 1000, 2, 2**31, "cpu", 1, False, 50_304
        ),
        "--vocab_size 50,304",
        "--batch_size 16",
        "2.3 GiB",
    )
    # CUDA's fused loss: not held
    checks.check_sizes(cfg, 128, 1000, 2, 2**31, "cuda", vocab_size=50_304)
    checks.check_sizes(cfg, 128, 1000, 2, 2**33, "cpu", vocab_size=50_304)  # fits in 8 GiB

"""config.py's validation, flag by flag: every refusal with its whole one-line message, and the values just
inside each bound accepted. A bad value caught here is a run that would otherwise train on, silently wrong, or
fail deep inside torch with a traceback."""
import importlib.util

import pytest

from minimal_fsdp import config
from minimal_fsdp.config import ConfigError, parse_args, parse_duration, validate_world

POSITIVE = ["batch_size", "grad_accum_steps", "num_layers", "num_heads", "embed_size", "seq_length", "vocab_size",
            "shard_group_size", "log_interval", "eval_batches", "lr_decay_steps", "num_kv_heads",
            "intermediate_size", "accum_steps"]
NON_NEGATIVE = ["max_steps", "num_tokens", "checkpoint_interval", "eval_interval", "warmup_steps", "keep_last",
                "skip_nonfinite"]


def refused(argv, message):
    with pytest.raises(ConfigError) as raised:
        parse_args([str(a) for a in argv])
    assert str(raised.value) == message


@pytest.mark.parametrize("name", POSITIVE)
def test_counts_must_be_positive(name):
    refused([f"--{name}", 0], f"--{name} must be positive (got 0)")
    refused([f"--{name}", -2], f"--{name} must be positive (got -2)")


def test_counts_of_one_are_accepted():
    parse_args(["--model", "llama", *[a for n in POSITIVE for a in (f"--{n}", "1")], "--data_parallel",
                "decentralized"])


@pytest.mark.parametrize("name", NON_NEGATIVE)
def test_intervals_and_limits_must_not_be_negative(name):
    refused([f"--{name}", -1], f"--{name} must be 0 or positive (got -1)")


def test_intervals_and_limits_of_zero_are_accepted():
    parse_args([a for n in NON_NEGATIVE for a in (f"--{n}", "0")] + ["--max_epochs", 1])


def test_time_limit():
    refused(["--time_limit", "1h"], "--time_limit must look like HH:MM:SS (got '1h')")
    refused(["--time_limit", "1:-2"], "--time_limit must look like HH:MM:SS (got '1:-2')")
    assert parse_args(["--time_limit", "0:01:30"]).time_limit_seconds == 90
    assert parse_args([]).time_limit_seconds is None
    assert [parse_duration(t) for t in ("0", "2:03", "1:00:01", "10:0:0")] == [0, 123, 3601, 36000]
    for bad in ("", "1:2:3:4", "a:b", "1.5"):
        with pytest.raises(ConfigError, match="^--time_limit must look like HH:MM:SS"):
            parse_duration(bad)


@pytest.mark.parametrize("argv,message", [
    (["--lr", 0], "--lr must be a finite number > 0 (got 0.0)"),
    (["--lr", "nan"], "--lr must be a finite number > 0 (got nan)"),
    (["--lr", "inf"], "--lr must be a finite number > 0 (got inf)"),
    (["--min_lr", -0.001], "--min_lr must be a finite number >= 0 (got -0.001)"),
    (["--lr", 0.01, "--min_lr", 0.02], "--min_lr 0.02 is above --lr 0.01: the schedule decays from --lr to --min_lr"),
    (["--beta1", 1], "--beta1 must be a finite number in [0, 1) (got 1.0)"),
    (["--beta1", -0.1], "--beta1 must be a finite number in [0, 1) (got -0.1)"),
    (["--beta2", 1.5], "--beta2 must be a finite number in [0, 1) (got 1.5)"),
    (["--seed", 2**63], f"--seed must be an integer in [-2**63, 2**63) (got {2**63})"),
    (["--seed", -2**63 - 1], f"--seed must be an integer in [-2**63, 2**63) (got {-2**63 - 1})"),
    (["--weight_decay", -0.1], "--weight_decay must be a finite number >= 0 (got -0.1)"),
    (["--grad_clip", -1], "--grad_clip must be a finite number >= 0 (got -1.0) (0 disables clipping)"),
    (["--dropout", 1], "--dropout must be a finite number in [0, 1) (got 1.0)"),
    (["--val_fraction", 0], "--val_fraction must be a finite number in (0, 1) (got 0.0)"),
    (["--val_fraction", 1], "--val_fraction must be a finite number in (0, 1) (got 1.0)"),
    (["--temperature", -0.5], "--temperature must be a finite number >= 0 (got -0.5) (0: greedy)"),
    (["--top_k", -1], "--top_k must be a finite number >= 0 (got -1) (0: all tokens)"),
    (["--collective_timeout", 0], "--collective_timeout must be a finite number in (0, 1e+06) (got 0.0) (seconds)"),
    (["--collective_timeout", 1e300], "--collective_timeout must be a finite number in (0, 1e+06) (got 1e+300) (seconds)"),
    (["--max_epochs", 0], "--max_epochs must be positive, or -1 to only generate (got 0)"),
    (["--max_epochs", -2], "--max_epochs must be positive, or -1 to only generate (got -2)"),
    (["--max_steps", 0], "--max_steps 0 (no cap) needs --max_epochs to set the run's length"),
    (["--streaming", "--dataset_path", "d", "--max_steps", 0],
     "--streaming needs --max_steps: a stream's length is unknown, so epochs cannot end the run"),
])
def test_numbers_that_would_corrupt_training_are_refused(argv, message):
    refused(argv, message)


def test_numbers_at_their_bounds_are_accepted():
    cfg = parse_args(["--lr", 1e-9, "--min_lr", 1e-9, "--beta1", 0, "--beta2", 0.999, "--weight_decay", 0,
                      "--grad_clip", 0, "--dropout", 0, "--val_fraction", 0.999, "--temperature", 0, "--top_k", 0,
                      "--collective_timeout", 0.001, "--max_epochs", -1])
    assert cfg.generate_only
    parse_args(["--min_lr", 0, "--max_epochs", 1, "--max_steps", 0])
    parse_args(["--max_epochs", 3])
    assert not parse_args(["--max_epochs", 1]).generate_only and not parse_args([]).generate_only


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "a\0b", " a", "a "])
def test_run_name_is_one_plain_directory_name(name):
    refused(["--run_name", name], f"--run_name must be one plain directory name, without '/' (got {name!r})")


@pytest.mark.parametrize("argv,message", [
    (["--dataset", "text"], "--dataset text needs --input_file PATH"),
    (["--streaming", "--max_steps", 5], "--streaming needs --dataset_path (the documents to stream)"),
    (["--tokenizer_dir", "t", "--dataset_path", "d"],
     "a prepared --dataset_path carries its own tokenizer: drop --tokenizer_dir"),
    (["--tokenizer_dir", "t", "--tokenizer", "gpt2"], "--tokenizer_dir replaces --tokenizer: drop --tokenizer gpt2"),
    (["--tokenizer", "sentencepiece"], "--tokenizer sentencepiece needs --vocab_size (the BPE vocabulary to train)"),
    (["--cuda_graphs"], "--cuda_graphs replays the compiled model: add --compile"),
    (["--fp8_recipe", "rowwise"], "--fp8_recipe rowwise applies with --precision fp8: add it"),
    (["--recompute", "selective"], "--recompute selective applies with --activation_checkpoints: add it"),
    (["--embed_size", 30, "--num_heads", 4], "--embed_size must be divisible by --num_heads (got 30 and 4)"),
    (["--hf_model", "gpt2", "--num_heads", 4],
     "--num_heads cannot change the shape of --hf_model gpt2 (only --seq_length, to shorten the context, and "
     "--dropout apply)"),
    (["--hf_model", "gpt2", "--max_epochs", -1, "--restart_checkpoint_file", "c"],
     "--max_epochs -1 with --hf_model generates from the Hugging Face model: drop --restart_checkpoint_file, or "
     "drop --hf_model to generate from the checkpoint"),
    (["--num_kv_heads", 2], "--num_kv_heads is a llama flag: add --model llama, or drop it"),
    (["--model", "gpt", "--intermediate_size", 64], "--intermediate_size is a llama flag: add --model llama, or drop it"),
    (["--model", "llama", "--bias"], "--bias/--no-bias is a gpt flag (llama has no biases): drop it"),
    (["--model", "gpt", "--model_preset", "llama3-8b"],
     "--model_preset llama3-8b is not a gpt preset (those are tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl): drop "
     "--model or pick one of them"),
    (["--accum_steps", 2], "--accum_steps applies to --data_parallel decentralized only"),
    (["--save_average"], "--save_average applies to --data_parallel decentralized only"),
    (["--data_parallel", "decentralized", "--sharding", "grad-shard"],
     "--data_parallel decentralized keeps a whole replica on every rank: drop --sharding grad-shard"),
    (["--data_parallel", "decentralized", "--cpu_offload"],
     "--cpu_offload offloads FSDP shards; --data_parallel decentralized has none: drop it"),
    (["--data_parallel", "decentralized", "--fsdp_unit", "block"],
     "--fsdp_unit says what FSDP gathers; --data_parallel decentralized has no FSDP: drop it"),
])
def test_flags_that_do_not_go_together_are_refused(argv, message):
    refused(argv, message)


def test_flags_that_go_together_are_accepted():
    parse_args(["--dataset", "text", "--input_file", "x.txt"])
    parse_args(["--streaming", "--dataset_path", "d", "--max_steps", 5, "--tokenizer_dir", "t"])
    parse_args(["--tokenizer_dir", "t"])
    parse_args(["--tokenizer", "sentencepiece", "--vocab_size", 300])
    parse_args(["--tokenizer", "sentencepiece", "--dataset_path", "d"])  # the prepared data has its tokenizer
    parse_args(["--cuda_graphs", "--compile"])
    parse_args(["--recompute", "selective", "--activation_checkpoints"])
    parse_args(["--embed_size", 32, "--num_heads", 4])
    parse_args(["--hf_model", "gpt2", "--seq_length", 64, "--dropout", 0.1, "--max_epochs", -1])
    parse_args(["--hf_model", "gpt2", "--restart_checkpoint_file", "c"])  # trains on from the checkpoint
    parse_args(["--model_preset", "llama3-8b", "--num_kv_heads", 2, "--intermediate_size", 64])  # llama's preset
    parse_args(["--model", "llama", "--num_kv_heads", 2])
    parse_args(["--no-bias"])
    parse_args(["--data_parallel", "decentralized", "--accum_steps", 2, "--save_average", "--sharding", "no-shard"])


def test_fp8_needs_torchao_unless_only_generating(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    refused(["--precision", "fp8"], "--precision fp8 needs torchao: pip install -e \".[fp8]\" (offline: see docs/fp8.md)")
    parse_args(["--precision", "fp8", "--max_epochs", -1])
    parse_args(["--precision", "fp8", "--fp8_recipe", "rowwise", "--max_epochs", -1])


@pytest.mark.parametrize("name", ["wandb", "tensorboard"])
def test_logging_flags_need_their_package(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))
    refused([f"--{name}"], f"--{name} needs the {name} package: pip install {name}")
    parse_args([f"--no-{name}"])


def test_device_xla_needs_torch_xla_and_refuses_what_it_cannot_do(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch_xla" else real(n, *a))
    refused(["--device", "xla"],
            "--device xla needs torch_xla: pip install -e '.[xla]' (torch_xla 2.9 with torch 2.9)")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "torch_xla" else real(n, *a))
    parse_args(["--device", "xla"])
    for argv in (["--sharding", "no-shard"], ["--shard_group_size", 2], ["--data_parallel", "decentralized"],
                 ["--cpu_offload"], ["--meta_init"], ["--compile"], ["--recompute", "selective",
                                                                    "--activation_checkpoints"],
                 ["--fsdp_unit", "model"]):
        name = argv[0][2:]
        refused(["--device", "xla", *argv], f"--{name} is not available with --device xla, which shards every "
                "parameter over all devices with SPMD and compiles each step whole (docs/xla.md): drop it")
    parse_args(["--sharding", "no-shard", "--cpu_offload", "--meta_init", "--compile"])  # fine without xla


def test_world_checks():
    validate_world(parse_args([]), 3, 3, [3])
    xla = parse_args([])
    xla.device = "xla"
    validate_world(xla, 4, 1, [1, 1, 1, 1])
    with pytest.raises(ConfigError) as raised:
        validate_world(xla, 4, 2, [2, 2])
    assert str(raised.value) == (
        "--device xla runs one process per host, which drives all of the host's devices, but 2 ranks share this "
        "host: launch one rank per host (mpiexec -n HOSTS -ppn 1, or plain python on one host)")
    hybrid = parse_args(["--sharding", "hybrid-full-shard"])
    validate_world(hybrid, 8, 4, [4, 4])
    with pytest.raises(ConfigError) as raised:
        validate_world(hybrid, 6, 4, [4, 2])
    assert str(raised.value) == (
        "--sharding hybrid-full-shard shards over the ranks of a node, but nodes run different numbers of ranks "
        "(2, 4): start as many on every node, or set --shard_group_size")
    with pytest.raises(ConfigError) as raised:
        validate_world(hybrid, 6, 4, [4, 4])
    assert str(raised.value) == ("--sharding hybrid-full-shard needs world size divisible by --shard_group_size "
                                 "(got 6 and 4)")
    grouped = parse_args(["--sharding", "hybrid-grad-shard", "--shard_group_size", 3])
    validate_world(grouped, 6, 4, [4, 2])  # a group size makes node sizes irrelevant
    with pytest.raises(ConfigError, match=r"^--sharding hybrid-grad-shard needs world size divisible by "
                                          r"--shard_group_size \(got 8 and 3\)$"):
        validate_world(grouped, 8, 4, [4, 4])
    validate_world(parse_args(["--shard_group_size", 3]), 8, 4, [4, 4])  # only hybrid sharding groups ranks


@pytest.mark.parametrize("text,message", [
    ("zzz = 1\n", "'zzz' is outside any section; sections are launch, model, parallel, decentralized, data, train, "
                  "checkpoint, log, generate"),
    ("lr = 0.1\n", "'lr' is outside any section; put it under [train]"),
    ("[training]\nlr = 0.1\n", "unknown section [training]; sections are launch, model, parallel, decentralized, "
                               "data, train, checkpoint, log, generate"),
    ("[train]\nqqqqqq = 1\n", "unknown key train.qqqqqq"),
    ("[launch]\nconfgi = 'x'\n", "unknown key launch.confgi"),  # --config is never a key: not offered either
    ("[train]\nbatchsize = 3\n", "unknown key train.batchsize (did you mean batch_size?)"),
])
def test_config_file_keys_and_sections_are_named_in_one_line(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        parse_args(["--config", path])
    assert str(raised.value) == f"--config {path}: {message}"


@pytest.mark.parametrize("flag", ["--data_dir", "--checkpoint_dir", "--log_dir"])
def test_a_directory_flag_naming_a_file_is_refused(tmp_path, flag):
    (tmp_path / "afile").write_text("x")
    refused([flag, tmp_path / "afile"], f"{flag} {tmp_path / 'afile'} is a file, not a directory: name a directory "
                                        "(or a path that does not exist yet)")


def test_a_config_with_input_file_and_another_dataset_is_refused():
    import dataclasses
    cfg = dataclasses.replace(parse_args([]), input_file="my.txt")  # built in code, not parsed: no implication
    with pytest.raises(ConfigError, match="^--input_file is the file of --dataset text: drop --dataset shakespeare$"):
        config.validate(cfg)


def test_a_gpu_recipe_on_a_cpu_is_warned_about_and_pointed_at_the_cpu_recipe():
    from minimal_fsdp.config_checks import cpu_recipe_warning
    gpu = parse_args(["--compile", "--precision", "bf16"])
    line = cpu_recipe_warning(gpu, "cpu")
    assert line.startswith("warning: --compile and --precision bf16 on a CPU") and "shakespeare_tiny.toml" in line
    assert cpu_recipe_warning(gpu, "cuda") is None and cpu_recipe_warning(parse_args([]), "cpu") is None


def test_sizes_are_checked_against_free_memory(monkeypatch):
    from minimal_fsdp import config_checks
    monkeypatch.setattr(config_checks, "host_memory_available", lambda: 2**30)
    cfg = parse_args(["--batch_size", "200000"])  # 200000 x 129 ids x 8 bytes x 3 copies x 2 processes
    with pytest.raises(ConfigError, match=r"^--batch_size 200000: a batch of 200000 x 129 token ids takes 1.15 GiB "
                                          r"of host memory over this host's 2 process\(es\), more than the 1 GiB free"):
        config_checks.check_sizes(cfg, 128, 1000, processes=2, device_free=None)
    config_checks.check_sizes(parse_args([]), 128, 1000, processes=2, device_free=None)  # a small batch fits
    with pytest.raises(ConfigError, match=r"the model \(300,000,000 parameters\) takes 2.24 GiB in fp32 on this host's cpu"):
        config_checks.check_sizes(parse_args([]), 128, 300_000_000, processes=2, device_free=2**30)
    config_checks.check_sizes(parse_args(["--meta_init"]), 128, 300_000_000, processes=2, device_free=2**30,
                              ranks=8)  # a shard of it fits

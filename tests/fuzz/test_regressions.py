"""What the fuzzer (and the outside pass of 2026-11-29) found, each as a named test that fails on
the bug: issue 64's cases 1, 2, 3, 4, 6, 7, 9a and 12 and its four "passing, but wrong" items, then
what the fuzzer found beside them. Each runs in this process, in under a second or two."""

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from minimal_fsdp.__main__ import COMMANDS
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.config.parser import parse
from minimal_fsdp.data import tokenizer as tk
from minimal_fsdp.data.tokens import TOKEN_CACHE, TokenData
from minimal_fsdp.launch import discovery
from minimal_fsdp.launch.run_lock import LOCK_NAME, RunLock
from minimal_fsdp.tools.plot import read_metrics

import fuzzing
from conftest import TINY_MODEL, make_text
from support import command

POSITIONAL = {
    "sample": ["ckpt"],
    "evaluate": ["ckpt", "--tasks", "t"],
    "export": ["ckpt", "out"],
    "plot": ["logs/run"],
    "cluster": ["--", "true"],
}


def refused(call, *words):
    """call() raises ConfigError: one printable line naming each of words."""
    with pytest.raises(ConfigError) as raised:
        call()
    return fuzzing.one_line(raised.value, *words)


def config(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


# ---- case 1: a --config that is a symbolic-link loop ----


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_case_1_a_config_symlink_loop_is_one_line_in_every_command(tmp_path, command):
    fuzzing.place(tmp_path / "run.toml", "loop")
    argv = ["--config", str(tmp_path / "run.toml"), *POSITIONAL.get(command, [])]
    line = refused(lambda: parse(COMMANDS[command][0], argv), "--config", "run.toml")
    assert "symbolic links" in line


def test_case_1_a_config_link_to_a_file_is_still_read(tmp_path):
    (tmp_path / "real.toml").write_text("[train]\nlr = 0.5\n")
    (tmp_path / "run.toml").symlink_to("real.toml")
    assert parse_args(["--config", str(tmp_path / "run.toml")]).lr == 0.5


# ---- case 2: a TOML integer too large for a float flag ----


@pytest.mark.parametrize(
    "command, section, key",
    [
        ("train", "train", "lr"),
        ("sample", "generate", "temperature"),
        ("prepare", "data", "val_fraction"),
        ("cluster", "cluster", "loss"),
    ],
)
def test_case_2_a_401_digit_integer_for_a_float_flag_is_one_line(tmp_path, command, section, key):
    path = config(tmp_path, f"[{section}]\n{key} = {'9' * 401}\n")
    argv = ["--config", path, *POSITIONAL.get(command, [])]
    refused(lambda: parse(COMMANDS[command][0], argv), f"{section}.{key}", "float's range")


def test_case_2_an_integer_past_pythons_digit_limit_is_one_line(tmp_path):
    path = config(tmp_path, f"[train]\nmax_steps = {'9' * 5000}\n")
    refused(lambda: parse_args(["--config", path]), "--config", "digits")


# ---- case 3: a NUL in a path read from --config ----


@pytest.mark.parametrize(
    "command, section, key",
    [("train", "log", "log_dir"), ("train", "data", "data_dir"), ("export", "export", "out")],
)
def test_case_3_a_nul_in_a_path_is_refused_and_never_echoed_raw(tmp_path, command, section, key):
    path = config(tmp_path, f'[{section}]\n{key} = "a\\u0000b"\n')
    argv = ["--config", path] + (["ckpt"] if command == "export" else [])
    line = refused(lambda: parse(COMMANDS[command][0], argv), f"{section}.{key}", "NUL")
    assert "\0" not in line and "a\\x00b" in line


def test_case_3_control_characters_of_a_bad_value_are_escaped(tmp_path):
    path = config(tmp_path, '[data]\nval_fraction = "\\u001b[31m"\n')
    line = refused(lambda: parse_args(["--config", path]), "data.val_fraction")
    assert "\x1b" not in line and "\\x1b" in line


# ---- case 4: cluster's --loss inf/nan, --hosts 100000 ----


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--loss", "inf"], "--loss"),
        (["--loss", "nan"], "--loss"),
        (["--loss", "101"], "--loss"),
        (["--hosts", "100000"], "--hosts"),
        (["--hosts", "0"], "--hosts"),
        (["--slots", "0"], "--slots"),
    ],
)
def test_case_4_cluster_refuses_bad_numbers_before_building_anything(flags, named):
    refused(lambda: parse(COMMANDS["cluster"][0], [*flags, "--", "true"]), named)


def test_case_4_a_float_flag_of_any_command_must_be_finite():
    refused(lambda: parse(COMMANDS["plan"][0], ["--mfu", "nan"]), "--mfu")
    refused(lambda: parse(COMMANDS["evaluate"][0], ["x", "--tasks", "t", "--limit", "inf"]))


# ---- case 6: a forged .largest_token.json ----


def dataset(d, tokens, vocab=8):
    d.mkdir()
    tk.CharTokenizer("abcdefgh"[:vocab]).save(d)
    np.array(tokens, np.uint16).tofile(d / "train.bin")
    np.array([0, 1, 2], np.uint16).tofile(d / "val.bin")
    meta = dict(tokenizer="char", vocab_size=vocab, dtype="uint16", val_tokens=3)
    (d / "meta.json").write_text(json.dumps(dict(meta, train_tokens=len(tokens))))


def test_case_6_a_forged_token_cache_with_the_true_fingerprint_is_not_trusted(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dataset(tmp_path / "d", [0, 1, 2, 500])  # 500: past the 8-token vocabulary
    forged = {}
    for name in ("train.bin", "val.bin"):
        info = os.stat(tmp_path / "d" / name)
        fingerprint = [info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns]
        forged[name] = fingerprint + [2, "0" * 64]  # every layout this file had: 4 and 6 fields
        forged[name + "-old"] = [info.st_size, info.st_mtime_ns, info.st_ino, 2]
    forged["train.bin"] = forged.pop("train.bin-old")
    (tmp_path / "d" / TOKEN_CACHE).write_text(json.dumps(forged))
    refused(lambda: TokenData(tmp_path / "d"), "train.bin", "token id 500")
    forged["train.bin"] = forged["val.bin"][:4] + [2, "0" * 64]
    (tmp_path / "d" / TOKEN_CACHE).write_text(json.dumps(forged))
    refused(lambda: TokenData(tmp_path / "d"), "train.bin", "token id 500")


def test_case_6_the_cache_this_user_wrote_is_still_used(tmp_path, monkeypatch):
    from minimal_fsdp.data import tokens

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dataset(tmp_path / "d", [0, 1, 2, 7])
    TokenData(tmp_path / "d")
    cached = json.loads((tmp_path / "d" / TOKEN_CACHE).read_text())
    assert cached["train.bin"][4] == 7 and len(cached["train.bin"]) == 6
    # read from the cache, not counted: the memmap given here holds other ids
    assert tokens.largest_token(tmp_path / "d" / "train.bin", np.zeros(4, np.uint16)) == 7


# ---- case 7: a char tokenizer.json whose chars are not one-character strings ----


@pytest.mark.parametrize(
    "chars, field",
    [([1, 2, 3], "chars[0]"), (["ab", "c"], "chars[0]"), (["a", ""], "chars[1]"), ([], "chars")],
)
def test_case_7_char_tokenizer_chars_must_be_single_characters(tmp_path, chars, field):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": chars}))
    refused(lambda: tk.load_tokenizer(tmp_path), "tokenizer.json", field)


# ---- case 9a: an HF tokenizer.json far larger than any real one ----


def test_case_9a_a_272_mb_tokenizer_json_is_refused_before_it_is_read(tmp_path):
    from minimal_fsdp.hf import read as hf

    path = tmp_path / "tokenizer.json"
    with open(path, "wb") as f:
        f.truncate(272 * 2**20)  # sparse: what the check costs does not depend on the bytes
    line = refused(lambda: tk.load_tokenizer(tmp_path), "tokenizer.json", "bytes")
    assert str(tk.MAX_TOKENIZER_BYTES) in line
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    refused(lambda: hf.load_tokenizer(tmp_path), "tokenizer.json", "bytes")


# ---- case 12: plot's metrics.jsonl ----


@pytest.mark.parametrize(
    "text, words",
    [
        (b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3}\n', ["line 2", "not JSON"]),
        (b"[" * 5000 + b"]" * 5000 + b"\n", ["line 1", "nests deeper"]),
        (b'{"step": 1, "loss": "\xff"}\n', ["line 1", "UnicodeDecodeError"]),
        (b"[1, 2]\n", ["line 1", "not an object"]),
        (b'{"loss": 2.0}\n', ["line 1", "step"]),
        (b'{"step": "3", "loss": 2.0}\n', ["line 1", "step"]),
        (b'{"step": -1, "loss": 2.0}\n', ["line 1", "step"]),
        (b'{"step": 1, "loss": "' + b"x" * (3 * 2**20) + b'"}\n', ["line 1", "bytes"]),
    ],
)
def test_case_12_a_bad_metrics_line_is_one_line_naming_it(tmp_path, text, words):
    (tmp_path / "metrics.jsonl").write_bytes(text)
    refused(lambda: read_metrics(tmp_path), "metrics.jsonl", *words)


def test_case_12_a_last_line_cut_short_is_skipped_with_a_warning(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == {"loss": ([1], [2.0])}
    assert "warning:" in capsys.readouterr().err


def test_case_12_a_fifo_for_metrics_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    with fuzzing.bounded(timeout=10):
        refused(lambda: read_metrics(tmp_path), "metrics.jsonl", "not a regular file")


# ---- passing, but wrong ----


def test_num_tokens_beyond_the_model_is_refused_before_training(single_process, tmp_path, capsys):
    (tmp_path / "small.txt").write_text(make_text(12_000))
    flags = ["--dataset", "text", "--input_file", "small.txt", *TINY_MODEL, "--seq_length", "128"]
    with pytest.raises(SystemExit) as exited:
        command("train", *flags, "--max_steps", 2, "--num_tokens", 10000000000, "--run_name", "n")
    printed = capsys.readouterr()
    assert exited.value.code == 2 and "error: --num_tokens 10000000000" in printed.err
    assert not list(Path("checkpoints/n").glob("step_*")) and "step 1" not in printed.out


def test_a_run_name_with_a_newline_is_refused():
    refused(lambda: parse_args(["--run_name", "a\nb"]), "--run_name")
    refused(lambda: parse_args(["--run_name", "a\tb"]), "--run_name")


def test_merges_naming_unknown_tokens_are_called_damaged_not_an_old_library(tmp_path):
    from tokenizers import Tokenizer, models

    tok = json.loads(Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")])).to_str())
    tok["model"]["merges"] = [["a", "zz"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    line = refused(lambda: tk.load_tokenizer(tmp_path), "vocabulary lacks")
    assert "pip install" not in line


def test_a_missing_val_bin_is_called_missing(tmp_path):
    dataset(tmp_path / "d", [0, 1, 2, 3])
    (tmp_path / "d" / "val.bin").unlink()
    line = refused(lambda: TokenData(tmp_path / "d"), "val.bin", "is missing")
    assert "0 bytes" not in line


# ---- what the fuzzer found beside the cases ----


def test_a_lock_whose_pid_is_infinite_is_taken_over_or_refused_in_one_line(tmp_path):
    """json reads 1e400 as inf; int(inf) raised OverflowError while checking the holder."""
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": 1e400, "start": 5})
    )
    lock = RunLock({"--checkpoint_dir": tmp_path})
    try:
        lock.acquire(wait=0)
    except ConfigError as e:
        fuzzing.one_line(e)
    finally:
        lock.release()


def test_slurm_tasks_per_node_is_read_without_expanding_its_repeats():
    assert discovery.tasks_on_node("4(x2),3", 1) == 4
    assert discovery.tasks_on_node("4(x2),3", 2) == 3
    with fuzzing.bounded(timeout=10, memory=2**28):
        assert discovery.tasks_on_node(f"2(x{10**9 - 1})", 5) == 2
    refused(lambda: discovery.tasks_on_node("x(x2)", 0), "tasks per node")


def test_launcher_variables_that_describe_no_world_are_one_line():
    env = {"RANK": "0", "WORLD_SIZE": "-2", "MASTER_ADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": "1"}
    refused(lambda: discovery.discover("torchrun", env), "torchrun")
    env = dict(env, WORLD_SIZE="2", LOCAL_WORLD_SIZE="0")
    refused(lambda: discovery.discover("torchrun", env), "torchrun")


def test_a_pbs_nodefile_that_is_a_fifo_or_not_utf8_is_one_line(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "binary").write_bytes(b"node\xff\n")
    for name in ("fifo", "binary"):
        monkeypatch.setenv("PBS_NODEFILE", str(tmp_path / name))
        with fuzzing.bounded(timeout=10):
            refused(lambda: discovery.pbs_layout(2), "PBS_NODEFILE")


def test_an_empty_sentencepiece_model_is_refused_when_loaded(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"kind": "sentencepiece"}')
    (tmp_path / "tokenizer.model").write_bytes(b"")
    refused(lambda: tk.load_tokenizer(tmp_path), "tokenizer.model")


def test_a_raw_pickle_optimizer_step_is_named_without_torchs_terminal_escapes(
    tmp_path, one_rank_group
):
    """torch's refusal of a raw pickle (weights_only) holds ANSI escapes (ESC[1m): the checkpoint's
    one line escaped them, not echoed them raw. Found by test_optimizer_raw_pickles."""
    import pickle
    import shutil

    import torch
    from test_fuzz_checkpoint import optimizer_entries, recorded, spliced

    from minimal_fsdp.checkpoint import find as checkpoint_find

    from support import save_three

    run, _, _ = save_three(tmp_path)
    path = run / "step_2"
    metadata, entries = optimizer_entries(path, "steps")
    fqn = entries[0][0]
    for name, data in spliced(path, metadata, fqn, pickle.dumps(torch.tensor(1.0), 2)).items():
        (path / name).write_bytes(data)
        recorded(path, name)
    problem = checkpoint_find.verify(path)
    assert fqn in problem and "does not load" in problem
    fuzzing.one_line(problem, fqn)
    shutil.rmtree(run)


def test_a_meta_json_key_with_a_control_character_is_named_escaped():
    """A checkpoint's meta.json whose model holds a key "\\x1f" was named with the byte raw. Found
    by test_meta_json."""
    from minimal_fsdp.checkpoint.meta import MetaError, model_problem

    fuzzing.one_line(model_problem("gpt", {"\x1f": None}), "model.\\x1f")
    fuzzing.one_line(MetaError("meta.json: a\x1b[1mb\n"), "meta.json")


def test_an_optimizer_setting_past_floats_range_is_one_problem_not_an_overflow():
    """A param group's betas holding an integer past float's range raised OverflowError in the
    check. Found by test_optimizer_numbers[settings]."""
    from minimal_fsdp.checkpoint.find import _setting_problem

    for key, value in [("betas", [10**400, 0.95]), ("lr", 10**400), ("weight_decay", -(10**400))]:
        problem = _setting_problem(f"optim.param_groups.0.{key}", value, {"beta1": 0.9})
        if key != "lr":
            assert problem and "not" in problem


@pytest.mark.parametrize(
    "text", ['[source]\n"\\u001f" = 0\n', '["\\u001b[1m"]\na = 1\n', '"\\u001f" = 0\n']
)
def test_a_config_key_or_section_with_a_control_character_is_named_escaped(tmp_path, text):
    """An unknown key "\\x1f" of a --config was named with the byte raw. Found by
    test_config_evaluate under --full."""
    argv = ["--config", config(tmp_path, text), *POSITIONAL["evaluate"]]
    refused(lambda: parse(COMMANDS["evaluate"][0], argv), "--config")


def test_sampling_past_a_context_of_one_position_keeps_one_token(one_rank_group):
    """A config.json of max_position_embeddings 1: generation past the context kept its newer
    "half" (0 tokens: all of them) and overflowed the cache. Found by
    test_sample_allocates_what_the_request_needs under --full."""
    import torch

    from minimal_fsdp.inference.generate import generate
    from minimal_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(
            vocab_size=8, seq_length=1, num_layers=1, num_heads=2, num_kv_heads=1, embed_size=8
        )
    )
    text = generate(model, tk.CharTokenizer("abcdefgh"), "a", 3, temperature=0)
    assert len(text) == 4


@pytest.mark.parametrize(
    "model_type, field, value",
    [
        ("gpt2", "activation_function", "gelu\x86\x95\x1b[2J"),
        ("llama", "hidden_act", "silu\x85\x00"),
        ("llama", "hidden_act", ["relu"] * 5000),
    ],
)
def test_a_config_json_activation_is_named_escaped_and_cut_short(
    tmp_path, model_type, field, value
):
    """Found by test_hf_model_directory (2026-12-01): config.json's activation quoted raw in the
    refusal, C1 control characters (\\x86) and all; a Llama's hidden_act, any JSON value, whole."""
    from minimal_fsdp.hf.read import read_config

    sizes = {
        "gpt2": {"n_positions": 8, "n_embd": 8, "n_head": 2, "vocab_size": 16, "n_layer": 1},
        "llama": {
            "max_position_embeddings": 8,
            "hidden_size": 8,
            "num_attention_heads": 2,
            "vocab_size": 16,
            "num_hidden_layers": 1,
            "intermediate_size": 16,
        },
    }[model_type]
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": model_type, **sizes, field: value})
    )
    line = refused(lambda: read_config(tmp_path), "activation", "does not implement")
    assert len(line) < 600


def test_a_config_json_model_type_of_any_size_is_one_short_line(tmp_path):
    """Found beside the activation above: a model_type that is a long list was quoted whole, a
    700-KB line."""
    from minimal_fsdp.hf.read import read_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": ["gpt\x85"] * 100_000}))
    line = refused(lambda: read_config(tmp_path), "supported are")
    assert len(line) < 400

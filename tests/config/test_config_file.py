"""--config run.toml: defaults < file < command line; bad files are one-line errors naming
section.key."""

import dataclasses

import pytest

from minimal_fsdp.config.flags import SECTIONS, Config, parse_args, to_toml

from conftest import ROOT
from support import refused


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_file_overrides_defaults_and_flags_override_file(tmp_path):
    path = write(
        tmp_path,
        '[train]\nbatch_size = 3\nlr = 1\n[parallel]\nsharding = "grad-shard"\ncpu_offload = true\n'
        '[model]\nnum_layers = 2\n',
    )
    cfg = parse_args(["--config", path, "--batch_size", "5", "--no-cpu_offload"])
    assert cfg.batch_size == 5 and cfg.cpu_offload is False  # command line wins
    assert cfg.sharding == "grad-shard" and cfg.num_layers == 2  # file wins over defaults
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # TOML's 1 is a fine float
    assert cfg.max_steps == Config.max_steps  # untouched: default
    assert cfg.config == str(path)


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_args(
        [
            "--sharding",
            "hybrid-grad-shard",
            "--prompt",
            'He said "hi"\n\tthen ü',
            "--lr",
            "1e-5",
            "--num_layers",
            "3",
            "--compile",
            "--temperature",
            "0",
        ]
    )
    again = parse_args(["--config", write(tmp_path, to_toml(cfg))])
    assert dataclasses.replace(again, config=None) == cfg


@pytest.mark.parametrize(
    "text,words",
    [
        (
            "[train]\nbatchsize = 3\n",
            ["train.batchsize", "batch_size"],
        ),  # the nearest key suggested
        ("[model]\nlr = 0.1\n", ["model.lr", "[train]"]),  # its own section named
        ("lr = 0.1\n", ["lr", "[train]"]),
        ("[training]\nlr = 0.1\n", ["[training]"]),
        ('[train]\nbatch_size = "16"\n', ["train.batch_size", "an integer"]),
        ("[train]\nbatch_size = 1.5\n", ["train.batch_size", "an integer"]),
        ("[train]\nbatch_size = true\n", ["train.batch_size", "an integer"]),
        ("[parallel]\ncompile = 1\n", ["parallel.compile", "true or false"]),
        # the choices listed
        ('[parallel]\nsharding = "zero-3"\n', ["parallel.sharding", "full-shard", "no-shard"]),
        ("[train]\nlr = [1, 2]\n", ["train.lr", "a number"]),
        ("[train]\nbatch_size = \n", []),  # not TOML: the parser's own line
        ('[launch]\nconfig = "other.toml"\n', ["launch.config"]),
    ],
)
def test_bad_file_is_one_line_error_naming_the_file(capsys, tmp_path, text, words):
    path = write(tmp_path, text)
    refused(capsys, ["--config", path], "--config", str(path), *words)


def test_values_from_a_file_are_validated_as_flags_are(capsys, tmp_path):
    refused(capsys, ["--config", write(tmp_path, "[train]\nbatch_size = 0\n")], "--batch_size")


def test_missing_file(capsys, tmp_path):
    refused(capsys, ["--config", tmp_path / "nope.toml"], "--config", str(tmp_path / "nope.toml"))


def test_sections_are_the_fields_sections():
    assert SECTIONS == (
        "launch",
        "model",
        "parallel",
        "decentralized",
        "data",
        "train",
        "checkpoint",
        "log",
        "generate",
    )


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    tomllib = pytest.importorskip("tomllib")
    tables = tomllib.loads(path.read_text())
    # such a recipe names its own --input_file
    text = tables.get("data", {}).get("dataset") == "text"
    cfg = parse_args(["--config", path, *(["--input_file", "corpus.txt"] if text else [])])
    for table in tables.values():
        for key, value in table.items():
            assert getattr(cfg, key) == value, key


def test_readme_links_the_flag_reference():
    """Every flag is documented in docs/flags.md (generated: tests/config/test_flags_doc.py checks
    it is current); the README, kept short, points there."""
    assert "docs/flags.md" in (ROOT / "README.md").read_text()

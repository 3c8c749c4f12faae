"""--config run.toml: defaults < file < command line; bad files are one-line errors naming section.key."""
import dataclasses

import pytest

from conftest import ROOT
from minimal_fsdp.config import SECTIONS, Config, ConfigError, parse_args, to_toml


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_file_overrides_defaults_and_flags_override_file(tmp_path):
    path = write(tmp_path, '[train]\nbatch_size = 3\nlr = 1\n[parallel]\nsharding = "grad-shard"\ncpu_offload = true\n'
                           '[model]\nnum_layers = 2\n')
    cfg = parse_args(["--config", path, "--batch_size", "5", "--no-cpu_offload"])
    assert cfg.batch_size == 5 and cfg.cpu_offload is False  # command line wins
    assert cfg.sharding == "grad-shard" and cfg.num_layers == 2  # file wins over defaults
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # TOML's 1 is a fine float
    assert cfg.max_steps == Config.max_steps  # untouched: default
    assert cfg.config == str(path)


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_args(["--sharding", "hybrid-grad-shard", "--prompt", 'He said "hi"\n\tthen ü', "--lr", "1e-5",
                      "--num_layers", "3", "--compile", "--temperature", "0"])
    again = parse_args(["--config", write(tmp_path, to_toml(cfg))])
    assert dataclasses.replace(again, config=None) == cfg


@pytest.mark.parametrize("text,message", [
    ("[train]\nbatchsize = 3\n", "unknown key train.batchsize (did you mean batch_size?)"),
    ("[model]\nlr = 0.1\n", "model.lr belongs in [train]"),
    ("lr = 0.1\n", "'lr' is outside any section; put it under [train]"),
    ("[training]\nlr = 0.1\n", "unknown section [training]"),
    ('[train]\nbatch_size = "16"\n', "train.batch_size must be an integer (got '16')"),
    ("[train]\nbatch_size = 1.5\n", "train.batch_size must be an integer (got 1.5)"),
    ("[train]\nbatch_size = true\n", "train.batch_size must be an integer (got True)"),
    ("[parallel]\ncompile = 1\n", "parallel.compile must be true or false (got 1)"),
    ('[parallel]\nsharding = "zero-3"\n', "parallel.sharding must be one of full-shard, "),
    ("[train]\nlr = [1, 2]\n", "train.lr must be a number"),
    ("[train]\nbatch_size = \n", "Invalid value"),
    ('[launch]\nconfig = "other.toml"\n', "unknown key launch.config"),
    ("[train]\nbatch_size = 0\n", "--batch_size must be positive"),  # the usual validation still runs
])
def test_bad_file_is_one_line_error(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", write(tmp_path, text)])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.toml: No such file"):
        parse_args(["--config", tmp_path / "nope.toml"])


def test_sections_are_the_fields_sections():
    assert SECTIONS == ("launch", "model", "parallel", "decentralized", "data", "train", "checkpoint", "log",
                        "generate")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    tomllib = pytest.importorskip("tomllib")
    tables = tomllib.loads(path.read_text())
    text = tables.get("data", {}).get("dataset") == "text"  # such a recipe names its own --input_file
    cfg = parse_args(["--config", path, *(["--input_file", "corpus.txt"] if text else [])])
    for table in tables.values():
        for key, value in table.items():
            assert getattr(cfg, key) == value, key


def test_readme_links_the_flag_reference():
    """Every flag is documented in docs/flags.md (generated: tests/test_flags_doc.py checks it is current);
    the README, kept short, points there."""
    assert "docs/flags.md" in (ROOT / "README.md").read_text()

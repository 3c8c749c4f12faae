"""docs/flags.md is what minimal_fsdp/tools/flags_doc.py writes today: a section for every command
of `minimal-fsdp`, each naming every field of the command's flags dataclass, as its --help does."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from minimal_fsdp.__main__ import COMMANDS
from minimal_fsdp.config.commands import PrepareFlags
from minimal_fsdp.config.flags import SECTIONS, Config, build_parser, load_config_file
from minimal_fsdp.config.parser import build_parser as build_command_parser
from minimal_fsdp.config.parser import sections
from minimal_fsdp.tools import flags_doc

from conftest import ROOT

FIELDS = [f.name for f in dataclasses.fields(Config)]


def section_of(doc, command):
    """The text of `command`'s section: from its heading to the next command's."""
    start = doc.index(f"\n## minimal-fsdp {command}\n")
    end = doc.find("\n## minimal-fsdp ", start + 1)
    return doc[start:] if end < 0 else doc[start:end]


def test_committed_flags_md_is_current(tmp_path):
    # The command the failure message names, run as a user would, into a scratch file.
    out = tmp_path / "flags.md"
    subprocess.run(
        [sys.executable, "-m", "minimal_fsdp.tools.flags_doc", str(out)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert flags_doc.DOC.read_text(encoding="utf-8") == out.read_text(encoding="utf-8"), (
        "docs/flags.md differs from what minimal_fsdp/tools/flags_doc.py writes from the flags "
        f"dataclasses: regenerate it with `{flags_doc.REGENERATE}` and commit docs/flags.md"
    )


def test_every_command_has_its_section_in_the_table_order():
    doc = flags_doc.DOC.read_text(encoding="utf-8")
    assert re.findall(r"^## minimal-fsdp (\w+)$", doc, re.M) == list(COMMANDS)
    for name in COMMANDS:
        assert f"(#minimal-fsdp-{name})" in doc, (
            f"{name} missing from the list of commands atop docs/flags.md"
        )


def test_every_command_section_names_each_flag_and_section_of_its_dataclass():
    """Each command's section lists its dataclass's sections in order and a row for every field,
    positional arguments in capitals; a command that takes training's flags points to train's
    section instead."""
    doc = flags_doc.render()
    for name, (cls, _, _) in COMMANDS.items():
        text = section_of(doc, name)
        if cls is Config and name != "train":
            assert "(#minimal-fsdp-train)" in text and "| flag |" not in text, name
            continue
        assert re.findall(r"^### \[(\w+)\]$", text, re.M) == list(sections(cls)), name
        rows = re.findall(r"^\| `(?:-- )?(?:--)?(\w+)", text, re.M)
        assert rows == [
            f.name.upper() if f.metadata["positional"] else f.name
            for section in sections(cls)
            for f in dataclasses.fields(cls)
            if f.metadata["section"] == section
        ], name
        options = {s for a in build_command_parser(cls)._actions for s in a.option_strings}
        for f in dataclasses.fields(cls):
            if not f.metadata["positional"]:
                assert f"--{f.name}" in options, (
                    f"{name}: --{f.name} in docs/flags.md but not in --help"
                )


def test_every_field_is_in_help_and_in_flags_md():
    parser = build_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    help_text, doc = (
        parser.format_help(),
        section_of(flags_doc.DOC.read_text(encoding="utf-8"), "train"),
    )
    for f in dataclasses.fields(Config):
        names = [f"--{f.name}"] + ([f"--no-{f.name}"] if f.type is bool else [])
        for name in names:
            assert name in options and re.search(rf"{name}\b", help_text), (
                f"{name} missing from --help"
            )
            assert f"`{name}`" in doc, f"{name} missing from docs/flags.md"
    # and nothing in --help that is not a Config field
    assert {a.dest for a in parser._actions} - {"help"} == set(FIELDS)


def test_rows_follow_the_dataclass():
    doc = section_of(flags_doc.render(), "train")
    assert re.findall(r"^### \[(\w+)\]$", doc, re.M) == list(SECTIONS)
    # grouped by section, in the dataclass's order
    assert re.findall(r"^\| `--(\w+)`", doc, re.M) == FIELDS
    row = next(line for line in doc.splitlines() if line.startswith("| `--sharding`"))
    assert row.split(" | ")[1:4] == [
        "str",
        "`full-shard`",
        ", ".join(
            f"`{c}`"
            for c in (
                "full-shard",
                "grad-shard",
                "no-shard",
                "hybrid-full-shard",
                "hybrid-grad-shard",
            )
        ),
    ]
    assert "| `--compile`, `--no-compile` | bool | off |" in doc
    assert "| `--tensorboard`, `--no-tensorboard` | bool | on |" in doc
    assert "step_\\<N>" in doc  # escaped, else Markdown reads <N> as an HTML tag and drops it


def test_other_commands_rows():
    doc = flags_doc.render()
    assert "| `SOURCE` | str | required |" in section_of(doc, "sample")
    assert "| `--prompt` | str | empty |" in section_of(doc, "sample")
    assert "| `-- COMMAND ...` | list | required |" in section_of(doc, "cluster")
    assert "| `RUN_DIR ...` | list | required |" in section_of(doc, "plot")
    assert "| `--format` | str | `safetensors` | `safetensors`, `hf` |" in section_of(doc, "export")


def test_a_default_computed_from_the_machine_is_written_as_what_it_means():
    """prepare's --num_proc defaults to the CPU count: the file must not change with the machine."""
    num_proc = next(f for f in dataclasses.fields(PrepareFlags) if f.name == "num_proc")
    assert num_proc.default == (os.cpu_count() or 1)
    assert "| `--num_proc` | int | the CPU count |" in section_of(flags_doc.render(), "prepare")


def test_toml_example_is_a_valid_config_file(tmp_path):
    example = re.search(
        r"```toml\n(.*?)```", flags_doc.DOC.read_text(encoding="utf-8"), re.S
    ).group(1)
    path = tmp_path / "run.toml"
    path.write_text(example)
    assert load_config_file(path) == {
        "model_preset": "gpt2",
        "vocab_size": 50304,
        "precision": "bf16",
        "compile": True,
    }


def test_help_prints_the_usage_and_writes_no_file(tmp_path, capsys, monkeypatch):
    """`flags_doc --help` prints its usage; it is not taken for the path to write."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        flags_doc.main(["--help"])
    assert e.value.code == 0
    assert "usage: python -m minimal_fsdp.tools.flags_doc" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []

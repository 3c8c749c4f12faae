"""docs/flags.md is what minimal_fsdp/tools/flags_doc.py writes today, and names every Config field, as --help does."""
import dataclasses
import os
import re
import subprocess
import sys

from conftest import ROOT
from minimal_fsdp.tools import flags_doc
from minimal_fsdp.config.flags import SECTIONS, Config, build_parser, load_config_file

FIELDS = [f.name for f in dataclasses.fields(Config)]


def test_committed_flags_md_is_current(tmp_path):
    # The command the failure message names, run as a user would, into a scratch file.
    out = tmp_path / "flags.md"
    subprocess.run([sys.executable, "-m", "minimal_fsdp.tools.flags_doc", str(out)], check=True, capture_output=True,
                   cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert flags_doc.DOC.read_text(encoding="utf-8") == out.read_text(encoding="utf-8"), (
        "docs/flags.md differs from what minimal_fsdp/tools/flags_doc.py writes from minimal_fsdp/config/flags.py: "
        f"regenerate it with `{flags_doc.REGENERATE}` and commit docs/flags.md")


def test_every_field_is_in_help_and_in_flags_md():
    parser = build_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    help_text, doc = parser.format_help(), flags_doc.DOC.read_text(encoding="utf-8")
    for f in dataclasses.fields(Config):
        names = [f"--{f.name}"] + ([f"--no-{f.name}"] if f.type is bool else [])
        for name in names:
            assert name in options and re.search(rf"{name}\b", help_text), f"{name} missing from --help"
            assert f"`{name}`" in doc, f"{name} missing from docs/flags.md"
    # and nothing in --help that is not a Config field
    assert {a.dest for a in parser._actions} - {"help"} == set(FIELDS)


def test_rows_follow_the_dataclass():
    doc = flags_doc.render()
    assert re.findall(r"^## \[(\w+)\]$", doc, re.M) == list(SECTIONS)
    assert re.findall(r"^\| `--(\w+)`", doc, re.M) == FIELDS  # grouped by section, in the dataclass's order
    row = next(line for line in doc.splitlines() if line.startswith("| `--sharding`"))
    assert row.split(" | ")[1:4] == ["str", "`full-shard`", ", ".join(
        f"`{c}`" for c in ("full-shard", "grad-shard", "no-shard", "hybrid-full-shard", "hybrid-grad-shard"))]
    assert "| `--compile`, `--no-compile` | bool | off |" in doc
    assert "| `--tensorboard`, `--no-tensorboard` | bool | on |" in doc
    assert "step_\\<N>" in doc  # escaped, else Markdown reads <N> as an HTML tag and drops it


def test_toml_example_is_a_valid_config_file(tmp_path):
    example = re.search(r"```toml\n(.*?)```", flags_doc.DOC.read_text(encoding="utf-8"), re.S).group(1)
    path = tmp_path / "run.toml"
    path.write_text(example)
    assert load_config_file(path) == {"model_preset": "gpt2", "vocab_size": 50304, "precision": "bf16",
                                      "compile": True}

"""Writes docs/flags.md, the flag reference, from the `Config` dataclass, so the document cannot drift from the
code: `python -m minimal_fsdp.tools.flags_doc [PATH]`, run in a checkout. tests/config/test_flags_doc.py fails when the
committed file is stale.
"""
import dataclasses
import sys
from pathlib import Path

from minimal_fsdp.config.flags import SECTIONS, Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
REGENERATE = "python -m minimal_fsdp.tools.flags_doc"

INTRO = f"""<!-- Generated from minimal_fsdp/config/flags.py by `{REGENERATE}`; edit there, not here. -->
# Flags

Every flag of `basic_training.py`, with its type, default and choices; `python basic_training.py --help`
prints the same help texts. A boolean flag has a `--no-` form (`--no-compile`) to turn off what a config file
turned on.

## Config files

`--config run.toml` sets flags from a file. Its tables are the sections below, its keys the flag names without
`--` (any flag but `config`), and each value has the flag's type:

```toml
[model]
model_preset = "gpt2"
vocab_size = 50304

[parallel]
precision = "bf16"
compile = true
```

Flags given on the command line override the file, which overrides the defaults (defaults < `--config` <
command line). A key that is not a flag, a key in the wrong section, or a value of the wrong type or outside
the flag's choices stops the run with one line that names it. Python 3.10 needs `tomli` for this. The resolved
flags are written to `<log_dir>/<run_name>/config.toml`, itself a valid `--config` file: rerun with it to
repeat the run. `configs/` holds examples.
"""


def _cell(value):
    return str(value).replace("|", "\\|").replace("<", "\\<")  # '|' would end the cell, '<N>' reads as HTML


def _default(value):
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def render():
    lines = [INTRO]
    for section in SECTIONS:
        lines += [f"## [{section}]", "", "| flag | type | default | choices | what it does |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(Config):
            if f.metadata["section"] == section:
                name = f"`--{f.name}`, `--no-{f.name}`" if f.type is bool else f"`--{f.name}`"
                choices = ", ".join(f"`{c}`" for c in f.metadata["choices"] or ())
                lines.append(f"| {name} | {f.type.__name__} | {_default(f.default)} | {choices} | "
                             f"{_cell(f.metadata['help'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else DOC
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

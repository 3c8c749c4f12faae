"""Writes docs/flags.md, the flag reference of every command, from the commands' flags dataclasses
(`Config` for training, config/commands.py for the others; __main__.py's COMMANDS names them), so
the document cannot drift from the code: `python -m minimal_fsdp.tools.flags_doc [PATH]`, run in a
checkout. tests/config/test_flags_doc.py fails when the committed file is stale.
"""

import argparse
import dataclasses
import os
from pathlib import Path

from minimal_fsdp.__main__ import COMMANDS
from minimal_fsdp.config.flags import Config
from minimal_fsdp.config.parser import sections

DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
REGENERATE = "python -m minimal_fsdp.tools.flags_doc"
# Defaults computed from the machine that imports the flags: written as what they mean, so the file
# is the same wherever it is generated.
MACHINE_DEFAULTS = {"num_proc": (os.cpu_count() or 1, "the CPU count")}

INTRO = f"""<!-- Generated from the flags dataclasses (minimal_fsdp/config/flags.py, \
config/commands.py) by
`{REGENERATE}`; edit there, not here. -->
# Flags

One command line runs everything: `minimal-fsdp COMMAND [--config FILE.toml] [--FLAG VALUE ...]` \
(the console
script; `python -m minimal_fsdp COMMAND` is the same, and `python basic_training.py` is \
`minimal-fsdp train`).
`minimal-fsdp --help` lists the commands; below is every flag of each, with its type, default and \
choices, as
`minimal-fsdp COMMAND --help` prints them (without importing torch). A boolean flag has a `--no-` \
form
(`--no-compile`) to turn off what a config file turned on. An argument in capitals (`SOURCE`) is \
given without
`--`, in its place on the command line, or in the config file under its name.

Commands: {", ".join(f"[`{name}`](#minimal-fsdp-{name})" for name in COMMANDS)}.

## Config files

`--config run.toml` sets flags from a file, for every command. Its tables are the command's \
sections below
(`[model]`, `[parallel]`, ...), its keys the flag names without `--` (any flag but `config`), and \
each value
has the flag's type:

```toml
[model]
model_preset = "gpt2"
vocab_size = 50304

[parallel]
precision = "bf16"
compile = true
```

Flags given on the command line override the file, which overrides the defaults (defaults < \
`--config` <
command line). A key that is not a flag, a key in the wrong section, or a value of the wrong type \
or outside
the flag's choices stops the command with one line that names it. Python 3.10 needs `tomli` for \
this. A
training run writes its resolved flags to `<log_dir>/<run_name>/config.toml`, itself a valid \
`--config` file:
rerun with it to repeat the run. `sample`, `prepare`, `plan` and `progress` also read such a file, \
ignoring the
training keys they do not take. `configs/` holds examples.
"""


def _cell(value):
    # '|' would end the cell, '<N>' reads as HTML
    return str(value).replace("|", "\\|").replace("<", "\\<")


def _default(f):
    if f.metadata["required"]:
        return "required"
    value = f.default
    if f.name in MACHINE_DEFAULTS and value == MACHINE_DEFAULTS[f.name][0]:
        return MACHINE_DEFAULTS[f.name][1]
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _name(f):
    if f.metadata["positional"]:
        many = " ..." if f.type is list else ""
        return (
            f"`-- {f.name.upper()}{many}`"
            if f.metadata["nargs"] == "..."
            else f"`{f.name.upper()}{many}`"
        )
    return f"`--{f.name}`, `--no-{f.name}`" if f.type is bool else f"`--{f.name}`"


def _table(cls, level):
    lines = []
    for section in sections(cls):
        lines += [
            f"{level} [{section}]",
            "",
            "| flag | type | default | choices | what it does |",
            "|---|---|---|---|---|",
        ]
        for f in dataclasses.fields(cls):
            if f.metadata["section"] == section:
                choices = ", ".join(f"`{c}`" for c in f.metadata["choices"] or ())
                lines.append(
                    f"| {_name(f)} | {f.type.__name__} | {_default(f)} | {choices} | "
                    f"{_cell(f.metadata['help'])} |"
                )
        lines.append("")
    return lines


def command_section(name):
    """The lines of one command's section: what it does, how it is typed, its flags by section."""
    cls, module, summary = COMMANDS[name]
    lines = [f"## minimal-fsdp {name}", ""]
    if cls is Config and name != "train":
        # Same flags as training: the table is train's, not repeated.
        return lines + [
            f"{summary[0].upper()}{summary[1:]} (`{module}`): they are "
            "[`minimal-fsdp train`](#minimal-fsdp-train)'s flags, below.",
            "",
        ]
    usage = getattr(cls, "USAGE", None) or " ".join(
        [
            cls.PROG,
            *(_name(f).strip("`") for f in dataclasses.fields(cls) if f.metadata["positional"]),
            "[--FLAG VALUE ...]",
        ]
    )
    lines += [_cell(getattr(cls, "DESCRIPTION", summary)), "", f"`{usage}` (`{module}`)", ""]
    if cls is not Config:
        lines += ["`--config FILE.toml`: flag values from a file, in the sections below.", ""]
    return lines + _table(cls, "###")


def render():
    lines = [INTRO]
    for name in COMMANDS:
        lines += command_section(name)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog=REGENERATE, description="Write the flag reference of every command (docs/flags.md)."
    )
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help=f"default: {DOC}")
    path = parser.parse_args(argv).path
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

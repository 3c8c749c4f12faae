"""Fuzzing `--config FILE.toml` of every command (config/parser.py): the file's kind (a symbolic
link loop, a FIFO, a directory...), its bytes, and its tables and values (numbers past every bound,
text with NUL and newlines) drawn for each command's own flags. Each parse either gives flags that
every consumer can use (finite numbers inside 64 bits, no NUL in text, a run name on one line, hosts
with addresses, a loss percentage), or one line naming --config's file."""

import dataclasses
import ipaddress
import math
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from minimal_fsdp.__main__ import COMMANDS
from minimal_fsdp.config.parser import parse

import fuzzing

# what a command needs besides the file, given on the command line
POSITIONAL = {
    "sample": ["ckpt"],
    "evaluate": ["ckpt", "--tasks", "t"],
    "export": ["ckpt", "out"],
    "plot": ["logs/run"],
    "cluster": ["--", "true"],
}


def usable(name, parsed):
    """Parsed flags that every part of the command can use as they are."""
    for f in dataclasses.fields(parsed):
        value = getattr(parsed, f.name)
        if isinstance(value, float):
            assert math.isfinite(value), f"--{f.name} {value} accepted"
        if isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**63, f"--{f.name} {value} accepted: past 64 bits"
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                assert "\0" not in text, f"--{f.name} {text!r} accepted: a NUL no path can hold"
    if name in ("train", "progress"):
        assert parsed.run_name.isprintable(), f"--run_name {parsed.run_name!r} accepted"
    if name == "cluster":
        for i in range(parsed.hosts):  # virtual_cluster.Cluster's addresses
            ipaddress.IPv4Address(f"10.77.0.{i + 1}")
        assert parsed.loss is None or 0 <= parsed.loss <= 100, f"--loss {parsed.loss} accepted"


def check_command(name, tables, raw, kind, positional):
    cls = COMMANDS[name][0]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.toml")
        text = fuzzing.toml_document(tables).encode("utf-8", "surrogatepass")
        fuzzing.place(path, kind, raw if raw is not None else text)
        argv = ["--config", path] + (POSITIONAL.get(name, []) if positional else [])
        # a path that cannot be read names --config; a value read from it names its own flag
        parsed = fuzzing.holds(lambda: parse(cls, argv), "--" if kind != "file" else "")
        if parsed is not None:
            usable(name, parsed)


def config_example(name):
    cls = COMMANDS[name][0]
    return st.tuples(
        fuzzing.config_tables(cls),
        st.one_of(
            st.none(),
            st.none(),
            st.none(),
            fuzzing.config_tables(cls).map(fuzzing.toml_document).flatmap(fuzzing.mutated),
        ),
        fuzzing.path_kinds(),
        st.booleans(),
    )


def path_tables(cls):
    """{section: {key: value}} with one to three of a command's text flags (paths mostly: log_dir,
    data_dir, export's out, cluster's node_local...) drawn with NUL and control characters."""
    fields = [
        f
        for f in dataclasses.fields(cls)
        if f.type in (str, list) and not f.metadata["choices"] and f.name != "config"
    ]

    @st.composite
    def build(draw):
        tables = {}
        for f in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
            value = draw(fuzzing.path_text())
            tables.setdefault(f.metadata["section"], {})[f.name] = (
                [value] if f.type is list else value
            )
        return tables

    return build()


def number_flags(cls):
    """A command line of one to four of a command's number flags, each with a hostile value."""
    fields = [
        f for f in dataclasses.fields(cls) if f.type in (int, float) and not f.metadata["choices"]
    ]

    @st.composite
    def build(draw):
        argv = []
        for f in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=4, unique=True)):
            argv += [f"--{f.name}", draw(fuzzing.flag_text(f.type))]
        return argv

    return build()


def check_argv(name, argv):
    parsed = fuzzing.holds(lambda: parse(COMMANDS[name][0], argv + POSITIONAL.get(name, [])))
    if parsed is not None:
        usable(name, parsed)


def _fuzz_paths(name):
    @settings(max_examples=fuzzing.scaled(2, 150))
    @given(path_tables(COMMANDS[name][0]), st.booleans())
    def test(tables, positional):
        check_command(name, tables, None, "file", positional)

    test.__name__ = f"test_config_paths_{name}"
    test.__doc__ = f"`minimal-fsdp {name} --config FILE`: text and path values with NUL, newlines."
    return test


def _fuzz_numbers(name):
    @settings(max_examples=fuzzing.scaled(2, 150))
    @given(number_flags(COMMANDS[name][0]))
    def test(argv):
        check_argv(name, argv)

    test.__name__ = f"test_flags_numbers_{name}"
    test.__doc__ = f"`minimal-fsdp {name} --flag N`: numbers at and past every bound, inf, nan."
    return test


def _fuzz(name):
    @settings(max_examples=fuzzing.scaled(8, 400))
    @given(config_example(name))
    def test(example):
        check_command(name, *example)

    test.__name__ = f"test_config_{name}"
    test.__doc__ = f"`minimal-fsdp {name} --config FILE`: any file, any tables, any values."
    return test


for _name in COMMANDS:
    globals()[f"test_config_{_name}"] = _fuzz(_name)
    globals()[f"test_config_paths_{_name}"] = _fuzz_paths(_name)
    if any(f.type in (int, float) for f in dataclasses.fields(COMMANDS[_name][0])):
        globals()[f"test_flags_numbers_{_name}"] = _fuzz_numbers(_name)

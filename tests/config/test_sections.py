"""config/sections.py: the sections a library function takes instead of the whole training Config.
Each is made of training's own flags (no name declared twice), built from any command's flags with
training's defaults for the flags that command leaves out; no command builds a training Config, and
nothing is written into a Config once it is built."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from minimal_fsdp.config.commands import EvaluateFlags, SampleFlags
from minimal_fsdp.config.flags import Config, parse_args
from minimal_fsdp.config.parser import parse
from minimal_fsdp.config.sections import Generation, Launch, Parallel, Section

PACKAGE = Path(__file__).resolve().parents[2] / "minimal_fsdp"
SECTIONS = tuple(Section.__subclasses__())


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_a_section_is_made_of_training_flags(section):
    flags = {f.name for f in dataclasses.fields(Config)}
    assert {f.name for f in dataclasses.fields(section)} - flags <= {"generate_only"}


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_a_section_of_the_training_config_holds_its_values(section):
    cfg = parse_args(["--seed", "7", "--sharding", "no-shard", "--input_file", "notes.txt"])
    got = section.of(cfg)
    assert all(getattr(got, f.name) == getattr(cfg, f.name) for f in dataclasses.fields(section))


def test_a_command_gets_its_own_flags_and_training_defaults_for_the_rest():
    flags = parse(SampleFlags, ["ckpt", "--precision", "bf16", "--seed", "3", "--top_k", "5"])
    parallel = Parallel.of(flags, generate_only=True)
    assert parallel.precision == "bf16" and parallel.generate_only
    assert parallel.sharding == Config().sharding and parallel.compile is False
    assert Generation.of(flags) == Generation(
        prompt="", num_tokens=flags.num_tokens, temperature=flags.temperature, top_k=5, seed=3
    )
    assert Launch.of(flags) == Launch.of(Config())
    evaluate = parse(EvaluateFlags, ["ckpt", "--tasks", "t", "--sharding", "no-shard"])
    assert Parallel.of(evaluate).sharding == "no-shard"
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.precision = "float32"
    assert issubclass(Parallel, Section)


def test_no_command_builds_a_training_config_and_none_is_written_after_it_is_built():
    built = [
        p.name
        for p in sorted((PACKAGE / "commands").glob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Config"
    ]
    assert not built
    written = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"object\.__setattr__\(", p.read_text())
    ]
    assert not written

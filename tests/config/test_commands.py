"""`minimal-fsdp COMMAND` (minimal_fsdp/__main__.py): every command's --help shows its defaults
without importing torch; every command reads --config and the command line overrides it; the config
reader refuses hostile files in one line (config/parser.py)."""

import dataclasses
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from minimal_fsdp.__main__ import COMMANDS
from minimal_fsdp.config import commands
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.config.flags import Config
from minimal_fsdp.config.parser import build_parser, flag, parse

from conftest import ROOT

# A small --config file per command and one flag given on the command line as well: the command
# line wins.
CONFIGS = {
    "train": (
        '[train]\nbatch_size = 4\n[model]\nembed_size = 32\n',
        ["--batch_size", "8"],
        {"batch_size": 8, "embed_size": 32},
    ),
    "sample": (
        '[source]\nsource = "ckpt"\n[generate]\nnum_tokens = 7\ntop_k = 3\n',
        ["--top_k", "5"],
        {"source": "ckpt", "num_tokens": 7, "top_k": 5},
    ),
    "evaluate": (
        '[source]\nsource = "ckpt"\n[evaluate]\ntasks = ["a", "b"]\nbatch_size = 4\n',
        ["--tasks", "c"],
        {"tasks": ["c"], "batch_size": 4, "source": "ckpt"},
    ),
    "export": (
        '[export]\ncheckpoint = "ckpt"\nout = "o"\nformat = "hf"\n',
        ["ckpt2", "o2"],
        {"checkpoint": "ckpt2", "out": "o2", "format": "hf"},
    ),
    "prepare": (
        '[data]\ndataset = "text"\ninput_file = "a.txt"\n[prepare]\nnum_proc = 3\n',
        ["--num_proc", "1"],
        {"dataset": "text", "input_file": "a.txt", "num_proc": 1},
    ),
    "progress": (
        '[launch]\nrun_name = "r"\n[checkpoint]\ncheckpoint_dir = "c"\n',
        ["--run_name", "s"],
        {"run_name": "s", "checkpoint_dir": "c"},
    ),
    "plan": (
        '[plan]\ngpus = 4\ngpu_memory = "40GB"\n[model]\nmodel_preset = "gpt2"\n',
        ["--gpus", "8"],
        {"gpus": 8, "gpu_memory": "40GB", "model_preset": "gpt2"},
    ),
    "cluster": (
        '[cluster]\nhosts = 3\ncommand = ["true"]\n',
        ["--hosts", "4", "--", "false"],
        {"hosts": 4},
    ),
    "plot": (
        '[plot]\nrun_dir = ["logs/a"]\nout = "x.png"\n',
        ["logs/b"],
        {"run_dir": ["logs/b"], "out": "x.png"},
    ),
}


def python(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def test_every_command_has_a_config_case():
    assert set(CONFIGS) == set(COMMANDS)


def test_the_command_list_names_every_command_in_one_line_each():
    result = python("-m", "minimal_fsdp", "--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert sum(line.split()[:1] == [name] for line in result.stdout.splitlines()) == 1, name
    result = python("-m", "minimal_fsdp", "trian")
    assert result.returncode == 2 and result.stderr.startswith("error: no command 'trian'")


def test_every_help_shows_defaults_without_importing_torch():
    """Each command's --help in a fresh interpreter: exit 0, every flag with a default shows it, no
    torch."""
    probe = (
        "import sys, runpy\nsys.argv = ['minimal-fsdp', *sys.argv[1:]]\ntry:\n"
        "    runpy.run_module('minimal_fsdp', run_name='__main__')\nexcept SystemExit as e:\n"
        "    print('EXIT', e.code)\nprint('TORCH' if 'torch' in sys.modules else 'NO TORCH')"
    )
    for name, (flags, _, _) in COMMANDS.items():
        result = python("-c", probe, name, "--help")
        out = result.stdout
        assert out.rstrip().endswith("EXIT 0\nNO TORCH"), (name, out[-300:], result.stderr[-2000:])
        text = re.sub(r"-\s+", "-", " ".join(out.split()))  # argparse wraps lines at hyphens too
        defaults = [
            f for f in dataclasses.fields(flags) if f.default is not None and f.name != "config"
        ]
        # (a help text may say what unset means)
        assert text.count("(default: ") >= len(defaults), name
        for f in defaults:
            shown = ("on" if f.default else "off") if f.type is bool else str(f.default)
            assert f"(default: {shown})" in text, (name, f.name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_command_reads_config_and_the_command_line_overrides_it(tmp_path, monkeypatch, name):
    text, argv, expected = CONFIGS[name]
    (tmp_path / "run.toml").write_text(text)
    (tmp_path / "a.txt").write_text("hello")
    monkeypatch.chdir(tmp_path)
    flags = COMMANDS[name][0]
    parsed = parse(flags, ["--config", "run.toml", *argv])
    assert {key: getattr(parsed, key) for key in expected} == expected
    alone = parse(flags, ["--config", "run.toml"] + (["x"] if name == "plot" else []))
    assert {k for k in expected if getattr(alone, k) != expected[k]}, (
        "the file alone gives other values"
    )


def test_a_runs_config_file_plans_that_run(monkeypatch):
    """configs/llama2_7b_4gpu.toml sends you to the planner: its training keys are ignored, the
    shared ones read."""
    plan = parse(
        commands.PlanFlags, ["--config", ROOT / "configs" / "llama2_7b_4gpu.toml", "--gpus", "4"]
    )
    assert (
        plan.model_preset,
        plan.precision,
        plan.batch_size,
        plan.grad_accum_steps,
        plan.compile,
    ) == ("llama2-7b", "bf16", 2, 4, True)


def test_a_key_no_command_knows_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text("[plan]\ngpuss = 4\n")
    with pytest.raises(ConfigError, match=r"unknown key plan\.gpuss \(did you mean gpus\?\)"):
        parse(commands.PlanFlags, ["--config", tmp_path / "bad.toml"])


def test_a_missing_positional_is_one_line(capsys):
    with pytest.raises(ConfigError, match="minimal-fsdp export needs CHECKPOINT"):
        parse(commands.ExportFlags, [])


def test_the_hardcoded_choices_are_the_modules():
    from minimal_fsdp.config.choices import TOKENIZER_KINDS
    from minimal_fsdp.data import tokenizer
    from minimal_fsdp.hf.export import DTYPES
    from minimal_fsdp.tools.step_time import CARDS

    assert commands.GPU_TYPES == tuple(CARDS) and tokenizer.TOKENIZER_KINDS == TOKENIZER_KINDS
    assert commands.EXPORT_DTYPES == tuple(DTYPES)


def _one_line(path):
    """`minimal-fsdp plan --config path` in a fresh interpreter: (exit code, stderr lines)."""
    result = python("-m", "minimal_fsdp", "plan", "--config", path)
    return result.returncode, result.stderr.splitlines()


def test_a_fifo_config_is_refused_in_one_line_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "fifo.toml")
    code, lines = _one_line(tmp_path / "fifo.toml")  # the timeout only bounds a hang
    assert (
        code == 2
        and len(lines) == 1
        and lines[0].startswith("error: --config")
        and "not a regular" in lines[0]
    )


def test_a_deeply_nested_config_is_refused_in_one_line(tmp_path):
    (tmp_path / "deep.toml").write_text("[plan]\ngpus = " + "[" * 5000 + "]" * 5000 + "\n")
    code, lines = _one_line(tmp_path / "deep.toml")
    assert code == 2 and len(lines) == 1 and "nest too deeply" in lines[0], lines[:3]


def test_a_link_to_a_device_is_refused_in_one_line(tmp_path):
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    code, lines = _one_line(tmp_path / "zero.toml")
    assert code == 2 and len(lines) == 1 and "not a regular" in lines[0], lines[:3]


def test_a_link_to_a_regular_file_is_read(tmp_path):
    (tmp_path / "real.toml").write_text("[plan]\ngpus = 2\n")
    (tmp_path / "link.toml").symlink_to(tmp_path / "real.toml")
    assert parse(commands.PlanFlags, ["--config", tmp_path / "link.toml"]).gpus == 2


TRAINING = {f.name: f for f in dataclasses.fields(Config)}
# The flags a command takes from training but changes on purpose (config/commands.py says why
# beside each): any other difference of default or choices is a flag that drifted from training's.
DIFFERS = {
    ("SampleFlags", "precision"): {"choices"},
    ("SampleFlags", "prompt"): {"default"},
    ("EvaluateFlags", "precision"): {"choices"},
    ("EvaluateFlags", "batch_size"): {"default", "section"},
    ("PrepareFlags", "dataset"): {"default", "choices", "required"},
    ("PrepareFlags", "val_fraction"): {"default"},
    ("PlanFlags", "batch_size"): {"default"},
    ("PlanFlags", "precision"): {"default"},
}


def training_flags_of_commands():
    """(command's dataclass, field) for every field of another command that training has too."""
    for cls in dict.fromkeys(flags for flags, _, _ in COMMANDS.values() if flags is not Config):
        for f in dataclasses.fields(cls):
            if f.name in TRAINING:
                yield cls, f


def test_every_training_flag_a_command_takes_is_shared_with_trainings_type():
    pairs = list(training_flags_of_commands())
    assert len(pairs) >= 40, "the commands take training's flags (precision, seed, batch_size...)"
    for cls, f in pairs:
        assert f.metadata.get("shared") == f.name, (
            f"{cls.__name__}.{f.name} is training's flag declared again: take it with "
            f'`{f.name}: {f.type.__name__} = shared("{f.name}", ...)`'
        )
        assert f.type is TRAINING[f.name].type, (cls.__name__, f.name)


def test_a_shared_flag_is_trainings_but_for_what_it_overrides():
    differs = {}
    for cls, f in training_flags_of_commands():
        trained, overrides = TRAINING[f.name], set(f.metadata["overrides"])
        assert (f.default == trained.default) == ("default" not in overrides), (cls, f.name)
        for key, value in trained.metadata.items():
            assert (f.metadata[key] == value) != (key in overrides), (cls.__name__, f.name, key)
        if overrides - {"help"}:
            differs[cls.__name__, f.name] = overrides - {"help"}
    assert differs == DIFFERS


def test_shared_reads_trainings_field_when_the_command_is_declared(monkeypatch):
    """Training's default, choices, section and help changed in Config change the command's too."""

    @dataclasses.dataclass(frozen=True)
    class Changed(Config):
        top_k: int = flag(7, "changed", (7, 8), "elsewhere")

    monkeypatch.setattr(commands, "Config", Changed)
    f = commands.shared("top_k")
    assert (f.default, f.metadata["choices"], f.metadata["section"], f.metadata["help"]) == (
        7,
        (7, 8),
        "elsewhere",
        "changed",
    )
    f = commands.shared("top_k", "mine", default=8)
    assert (f.default, f.metadata["help"], f.metadata["choices"]) == (8, "mine", (7, 8))
    assert set(f.metadata["overrides"]) == {"default", "help"}
    with pytest.raises(TypeError, match="no such field"):
        commands.shared("top_kk")
    with pytest.raises(TypeError, match="choise"):
        commands.shared("top_k", choise=(1,))


def test_no_flag_is_declared_twice_in_the_source():
    """What `grep -n ': .* = flag(' minimal_fsdp/config/*.py` shows: each name once; a command
    takes training's with `NAME: T = shared("NAME")`, naming itself."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "minimal_fsdp" / "config").glob("*.py")))
    declared = Counter(re.findall(r"^ +(\w+): \w+ = flag\(", text, re.M))
    assert set(TRAINING) <= set(declared), "the pattern no longer finds the declarations"
    # export's OUT (a directory, positional) and plot's --out (a PNG): two flags of one name
    assert [name for name, n in declared.items() if n > 1] == ["out"]
    assert "out" not in TRAINING
    taken = re.findall(r'^ +(\w+): \w+ = shared\(\s*"(\w+)"', text, re.M)
    # the rest come whole with their sections (@takes_sections: sample's generate, plan's model)
    assert len(taken) >= 20 and all(name == arg for name, arg in taken), taken


def test_a_flag_added_to_a_section_reaches_the_command_that_takes_it(monkeypatch):
    """A flag added to training's [generate] (Config's field alone) is a flag of a command that
    takes the section, with training's default, choices and help: no edit to the command."""

    @dataclasses.dataclass(frozen=True)
    class Grown(Config):
        top_p: float = flag(0.9, "nucleus sampling's mass", (0.9, 1.0), "generate")

    monkeypatch.setattr(commands, "Config", Grown)

    @dataclasses.dataclass(frozen=True)
    @commands.takes_sections("generate", prompt=dict(default=""))
    class Sampling:
        seed: int = commands.shared("seed")

    fields = {f.name: f for f in dataclasses.fields(Sampling)}
    # the section's flags first, in training's order, then the class's own
    assert list(fields) == ["prompt", "num_tokens", "temperature", "top_k", "top_p", "seed"]
    top_p = fields["top_p"]
    assert (top_p.default, top_p.type, top_p.metadata["choices"], top_p.metadata["help"]) == (
        0.9,
        float,
        (0.9, 1.0),
        "nucleus sampling's mass",
    )
    assert top_p.metadata["shared"] == "top_p" and top_p.metadata["overrides"] == ()
    assert fields["prompt"].default == "" and fields["prompt"].metadata["overrides"] == ("default",)
    # argparse, --help and the TOML reader see it as any other flag
    assert parse(Sampling, ["--top_p", "1.0"]).top_p == 1.0
    assert "--top_p {0.9,1.0}" in build_parser(Sampling).format_help()


def test_takes_sections_leaves_out_but_and_what_the_class_declares(tmp_path):
    @dataclasses.dataclass(frozen=True)
    @commands.takes_sections("generate", but=("top_k",))
    class Sampling:
        temperature: float = commands.shared("temperature", "mine", default=0.0)
        other: int = flag(3, "the class's own", section="mine")

    fields = {f.name: f for f in dataclasses.fields(Sampling)}
    assert list(fields) == ["prompt", "num_tokens", "temperature", "other"]
    assert (fields["temperature"].default, fields["temperature"].metadata["help"]) == (0.0, "mine")
    (tmp_path / "f.toml").write_text("[generate]\ntop_k = 3\n")
    with pytest.raises(ConfigError, match="unknown key generate.top_k"):
        parse(Sampling, ["--config", tmp_path / "f.toml"])
    with pytest.raises(TypeError, match="no section"):
        commands.takes_sections("generation")
    with pytest.raises(TypeError, match="top_kk"):
        commands.takes_sections("generate", but=("top_kk",))
    with pytest.raises(TypeError, match="declares temperature itself"):
        commands.takes_sections("generate", temperature=dict(default=1.0))(Sampling)


def test_sample_and_plan_take_their_sections_whole():
    """sample takes training's [generate] and plan its [model] but the flags that change no plan."""
    for cls, section, left_out in (
        (commands.SampleFlags, "generate", set()),
        (commands.PlanFlags, "model", {"dropout", "document_mask"}),
    ):
        taken = {f.name for f in dataclasses.fields(cls) if f.metadata["section"] == section}
        trained = {f.name for f in dataclasses.fields(Config) if f.metadata["section"] == section}
        assert taken == trained - left_out, cls

"""progress.py, the job chains' `minimal-fsdp progress [training flags]`: it imports no torch; it
answers as find.newest_complete without checksums (verify's cheap checks) does on intact,
damaged, torn and hostile checkpoints; it never counts a checkpoint that resume skips for a missing,
resized, replaced or damaged file; and, as documented, it counts one whose meta.json was edited to
describe a model the shards do not hold."""

import os
import shutil
import subprocess
import sys

import pytest

from minimal_fsdp.checkpoint import find
from minimal_fsdp.checkpoint.meta import read_meta

from conftest import ROOT
from support import HOSTILE_META, command, console, edited, flip_a_byte, meta_of, run, saved  # noqa: F401 (fixtures)

# What only verify's unpickled .metadata shows: progress counts these, the training run skips them.
SHARDS_DISAGREE = {"layers the shards lack", "another width"}


def flags(run):
    return ["--checkpoint_dir", str(run.parent), "--run_name", run.name]


def verified(run_dir):
    """ "STEP LAST_STEP" of the newest checkpoint that passes verify's cheap checks, as progress
    prints it."""
    path = find.newest_complete(run_dir, checksums=False)
    if path is None:
        return "0 none\n"
    meta = read_meta(path)
    return f"{meta['step']} {meta['state']['schedule'].get('last_step') or 'none'}\n"


def answers(run, console, **flag_values):
    """(progress's stdout and stderr, the verified answer), each from one call."""
    argv = flags(run) + [str(v) for pair in flag_values.items() for v in ("--" + pair[0], pair[1])]
    out, err = console()
    command("progress", *argv)
    console()
    return (
        out.getvalue(),
        err.getvalue(),
        verified(run.parent / flag_values.get("run_name", run.name)),
    )


def test_progress_answers_as_checkpoint_progress_does(run, console):
    assert answers(run, console)[::2] == ("3 100\n", "3 100\n")
    # the shards' bytes: neither reads them (resume does)
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    assert answers(run, console)[::2] == ("3 100\n", "3 100\n")
    (run / "step_3" / "rng_0.pt").unlink()
    mine, said, theirs = answers(run, console)
    assert (mine, theirs) == ("2 none\n", "2 none\n")
    assert (
        said
        == f"warning: skipping checkpoint {run / 'step_3'}: rng_0.pt: No such file or directory\n"
    )
    meta = meta_of(run / "step_2")
    del meta["format"], meta["state"]
    edited(run / "step_2", lambda m: (m.clear(), m.update(meta, last_step=50)))  # format 1
    assert answers(run, console)[::2] == ("2 50\n", "2 50\n")
    assert answers(run, console, run_name="other")[::2] == ("0 none\n", "0 none\n")


@pytest.mark.parametrize("case", HOSTILE_META)
def test_a_hostile_meta_json_is_skipped_in_verifys_words(run, console, case):
    edit, problem = HOSTILE_META[case]
    edited(run / "step_3", edit)
    out, err = console()
    command("progress", *flags(run))
    if case in SHARDS_DISAGREE:  # documented: meta.json agrees with itself, only the shards tell
        assert (out.getvalue(), err.getvalue()) == ("3 100\n", "")
        # so resume skips it
        assert find.verify(run / "step_3", checksums=False) == problem
    else:
        assert out.getvalue() == "2 none\n"
        assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"


def truncate(file):
    os.truncate(file, file.stat().st_size - 1)


def grow(file):
    with open(file, "ab") as f:
        f.write(b"\0")


def link(file):
    file.unlink()
    file.symlink_to(file.parent.parent / "step_2" / file.name)


def fifo(file):
    file.unlink()
    os.mkfifo(file)


# What a file system can do to a saved file, and the line progress skips the checkpoint with.
DAMAGE = {
    "a truncated shard": (
        "__0_0.distcp",
        truncate,
        "__0_0.distcp has {size_less_1} bytes, {size} when saved",
    ),
    "a grown shard": (
        "__0_0.distcp",
        grow,
        "__0_0.distcp has {size_plus_1} bytes, {size} when saved",
    ),
    "a missing .metadata": (".metadata", os.unlink, ".metadata: No such file or directory"),
    "a damaged .metadata": (
        ".metadata",
        flip_a_byte,
        ".metadata does not match its checksum: the file was damaged after it was saved",
    ),
    "a damaged RNG file": (
        "rng_0.pt",
        flip_a_byte,
        "rng_0.pt does not match its checksum: the file was damaged after it was saved",
    ),
    "an RNG file linked elsewhere": ("rng_0.pt", link, "rng_0.pt is not a regular file"),
    # never opened
    "a tokenizer file turned FIFO": (
        "tokenizer.json",
        fifo,
        "tokenizer.json is not a regular file",
    ),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_file_resume_would_refuse_makes_progress_skip_its_checkpoint(run, console, case):
    name, damage, problem = DAMAGE[case]
    file = run / "step_3" / name
    size = file.stat().st_size
    damage(file)
    out, err = console()
    command("progress", *flags(run))
    assert out.getvalue() == "2 none\n"
    problem = problem.format(size=size, size_less_1=size - 1, size_plus_1=size + 1)
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"
    assert find.latest(run) == run / "step_2"  # resume skips it too


def test_a_torn_save_is_never_counted_and_an_uncommitted_one_comes_after_latest(run, console):
    # crashed before its rename: not a step_<N>
    shutil.copytree(run / "step_3", run / ".tmp-step_4")
    shutil.copytree(run / "step_3", run / "step_5")
    (run / "step_5" / "meta.json").unlink()  # a directory torn some other way
    # renamed, but `latest` not yet moved: not committed
    shutil.copytree(run / "step_3", run / "step_4")
    edited(run / "step_4", lambda m: m.update(step=4))
    out, err = console()
    command("progress", *flags(run))
    # resume's order: what `latest` names first
    assert out.getvalue() == "3 100\n" and err.getvalue() == ""
    assert find.latest(run) == run / "step_3"
    (run / "latest").unlink()
    out, err = console()
    command("progress", *flags(run))
    assert out.getvalue() == "4 100\n"
    assert (
        err.getvalue()
        == f"warning: skipping checkpoint {run / 'step_5'}: meta.json is missing or unreadable\n"
    )


def test_a_checkpoint_from_before_meta_json_listed_its_files_is_checked_by_verify(run, console):
    for step in (2, 3):
        edited(run / f"step_{step}", lambda m: m.pop("files"))
    assert answers(run, console)[::2] == ("3 100\n", "3 100\n")
    (run / "step_3" / "rng_0.pt").unlink()
    mine, said, theirs = answers(run, console)
    assert (mine, theirs) == ("2 none\n", "2 none\n")
    assert (
        said == f"warning: skipping checkpoint {run / 'step_3'}: rng_0.pt is missing or unreadable "
        "(FileNotFoundError)\n"
    )


def python(*args, cwd):
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def imported(importtime_lines):
    """The modules `python -X importtime` reports."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_lines.splitlines()
        if line.startswith("import time:")
    }


def test_the_command_imports_no_torch_and_answers_bad_flags_in_one_line(run, tmp_path):
    result = python(
        "-X",
        "importtime",
        "-m",
        "minimal_fsdp",
        "progress",
        *flags(run),
        "--precision",
        "bf16",
        cwd=tmp_path,
    )
    assert (result.returncode, result.stdout) == (0, "3 100\n"), result.stderr[-2000:]
    modules = imported(result.stderr)
    # what it reads with
    assert {"minimal_fsdp.checkpoint.dirs", "minimal_fsdp.checkpoint.meta"} <= modules
    assert not {m for m in modules if m.split(".")[0] == "torch"}
    result = python(
        "-X",
        "importtime",
        "-m",
        "minimal_fsdp",
        "progress",
        *flags(run),
        "--lr",
        "-1",
        cwd=tmp_path,
    )
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --lr"), (
        result.stderr[-2000:]
    )
    assert not {m for m in imported(result.stderr) if m.split(".")[0] == "torch"}


def test_help_shows_progress_usage_not_trains(capsys):
    """`minimal-fsdp progress --help` takes train's flags under its own usage line."""
    from minimal_fsdp.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["progress", "--help"])
    assert e.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith("usage: minimal-fsdp progress ") and "train" not in usage

"""A run directory's checkpoints, read without torch: its step_<N> directories, the `latest`/`best`
markers, the order to try them in, and whether each file meta.json records is as saved (size,
CRC-32). checkpoint/find.py checks checkpoints fully; progress.py (the job chains) with what is here
and meta.json's schema alone."""

import re
import stat
import sys
import zlib
from pathlib import Path

from minimal_fsdp.files import open_regular

STEP_NAME = re.compile(r"step_(\d+)")


def marker(run_dir, name, warn=True):
    """The checkpoint a marker (`latest`, `best`) names, or None if there is none. A marker that
    does not hold exactly the name of a step_<N> beside it (damaged bytes, a path into another run)
    is reported and ignored."""
    file = Path(run_dir) / name
    if not file.is_file():
        return None
    try:
        with open(file, "rb") as f:
            text = f.read(65).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if not STEP_NAME.fullmatch(text):
        if warn:
            print(
                f"warning: ignoring {file}: it does not name a step_<N> checkpoint of this run",
                file=sys.stderr,
                flush=True,
            )
        return None
    return Path(run_dir) / text


def step_dirs(run_dir):
    """The run's step_<N> directories, newest first. A symbolic link is none of them: it may lead
    into another run, or to an older checkpoint of this one (a resume from it would roll back
    without a word), and pruning must never follow it."""
    found = [
        p
        for p in Path(run_dir).glob("step_*")
        if STEP_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]
    return sorted(found, key=step_of, reverse=True)


def step_of(path):
    return int(Path(path).name[5:])


def candidates(run_dir):
    """A run's checkpoints in the order to try them: the one `latest` names (the last commit), then
    older ones, newest first, then newer ones (a save that crashed between its rename and its
    commit, or another timeline's, when a run was restarted from an older checkpoint)."""
    run_dir = Path(run_dir)
    marked = marker(run_dir, "latest")
    others = [p for p in step_dirs(run_dir) if p != marked]
    if marked is None:
        return others
    older = [p for p in others if step_of(p) < step_of(marked)]
    return [marked] + older + [p for p in others if step_of(p) > step_of(marked)]


def skipping(path, problem):
    """Report, in one line, a checkpoint passed over for one that is complete."""
    print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)


def crc32(path, chunk=16 * 2**20):
    crc = 0
    with open_regular(path) as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def files_problem(path, recorded, share=(0, 1), read=lambda name: True):
    """Why the files meta.json records ({name: [size, CRC-32]}) are not as saved, or None: each a
    regular file of its size, with its CRC-32 where read(name). `share`, (index, count): this
    caller's share of the files, when several processes split the reading."""
    index, count = share
    for name in sorted(recorded)[index::count]:
        size, crc = recorded[name]
        file = Path(path) / name
        try:
            if not stat.S_ISREG(file.lstat().st_mode):
                return f"{name} is not a regular file"
            if file.stat().st_size != size:
                return f"{name} has {file.stat().st_size} bytes, {size} when saved"
            if read(name) and crc32(file) != crc:
                return (
                    f"{name} does not match its checksum: the file was damaged after it was saved"
                )
        except OSError as e:
            return f"{name}: {e.strerror or e}"
    return None

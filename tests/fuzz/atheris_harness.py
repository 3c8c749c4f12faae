"""Coverage-guided fuzzing (atheris, libFuzzer) of the parsers that are our own code rather than a
library's: the --config reader and its flag checks, files.parse_json's depth scan, plot's
metrics.jsonl reader, the char tokenizer.json schema, SLURM's tasks-per-node form and the run lock's
holder. Not run by pytest or CI: it runs until stopped (or -runs=N, -max_total_time=S) and keeps
what it found in the corpus folder given.

    python -m tests.fuzz.atheris_harness config [CORPUS_DIR] [-max_total_time=60]
    python -m tests.fuzz.atheris_harness --list

The property is the Hypothesis fuzzer's (tests/fuzz/fuzzing.py): a value, or ConfigError in one
printable line; anything else is a crash libFuzzer reports with the input that caused it, which then
becomes a test in tests/fuzz/test_regressions.py.
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

# only our modules: instrumenting torch (imported by the tokenizer's package) would take minutes
with atheris.instrument_imports(include=["minimal_fsdp"]):
    from minimal_fsdp.__main__ import COMMANDS
    from minimal_fsdp.config.choices import ConfigError
    from minimal_fsdp.config.parser import parse
    from minimal_fsdp.data import tokenizer as tk
    from minimal_fsdp.files import parse_json
    from minimal_fsdp.launch import discovery
    from minimal_fsdp.launch.run_lock import RunLock
    from minimal_fsdp.tools.plot import read_metrics

WORK = Path(tempfile.mkdtemp(prefix="atheris-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def _one_line(error):
    text = str(error)
    if not text or not all(c.isprintable() for c in text):
        raise AssertionError(f"not one printable line: {text[:200]!r}")


def _file(name, data):
    path = WORK / name
    path.write_bytes(data)
    return path


def config(data):
    fdp = atheris.FuzzedDataProvider(data)
    name = sorted(COMMANDS)[fdp.ConsumeIntInRange(0, len(COMMANDS) - 1)]
    path = _file("run.toml", fdp.ConsumeBytes(fdp.remaining_bytes()))
    extra = {"sample": ["x"], "evaluate": ["x", "--tasks", "t"], "export": ["x", "y"]}
    parse(COMMANDS[name][0], ["--config", str(path), *extra.get(name, [])])


def json_text(data):
    parse_json(data, 8, kind=None)


def metrics(data):
    _file("metrics.jsonl", data)
    read_metrics(WORK)


def char_tokenizer(data):
    _file("tokenizer.json", data)
    tok = tk.load_tokenizer(WORK)
    tok.encode(tok.decode(list(range(min(tok.vocab_size, 64)))))


def tasks_per_node(data):
    fdp = atheris.FuzzedDataProvider(data)
    discovery.tasks_on_node(fdp.ConsumeUnicodeNoSurrogates(40), fdp.ConsumeIntInRange(0, 10**6))


def lock(data):
    run = WORK / "run"
    run.mkdir(exist_ok=True)
    _file("run/.lock", data)
    held = RunLock({"--checkpoint_dir": run})
    try:
        held.acquire(wait=0)
    finally:
        held.release()
        (run / ".lock").unlink(missing_ok=True)


TARGETS = {
    "config": config,
    "json": json_text,
    "metrics": metrics,
    "char_tokenizer": char_tokenizer,
    "tasks_per_node": tasks_per_node,
    "lock": lock,
}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(
            f"usage: python -m tests.fuzz.atheris_harness {{{','.join(TARGETS)}}} [libFuzzer args]"
        )
        sys.exit(0 if "--list" in sys.argv else 2)
    target = TARGETS[sys.argv[1]]

    def one_input(data):
        try:
            target(data)
        except ConfigError as e:
            _one_line(e)

    os.environ.setdefault("XDG_CACHE_HOME", str(WORK / "cache"))
    atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

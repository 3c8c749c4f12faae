"""The command line: `minimal-fsdp COMMAND [flags]` (the console script) or `python -m minimal_fsdp
COMMAND`.

COMMANDS is the whole table: a command's name -> its flags dataclass, the module of commands/ whose
main(flags) runs it, and one line of help. A command's flags are parsed once (config.parser) before
its module is imported, so --help and bad flags answer without importing torch; the module's main
then gets the parsed flags.
"""

import importlib
import os
import sys

from minimal_fsdp.config.commands import (
    ClusterFlags,
    EvaluateFlags,
    ExportFlags,
    PlanFlags,
    PlotFlags,
    PrepareFlags,
    SampleFlags,
)
from minimal_fsdp.config.flags import Config, launcher_rank, one_line_errors
from minimal_fsdp.config.parser import parse

COMMANDS = {
    "train": (
        Config,
        "minimal_fsdp.commands.train",
        "pre-train a GPT or Llama with FSDP2 (as basic_training.py)",
    ),
    "sample": (
        SampleFlags,
        "minimal_fsdp.commands.sample",
        "text from a checkpoint, an export or a Hugging Face model",
    ),
    "evaluate": (
        EvaluateFlags,
        "minimal_fsdp.commands.evaluate",
        "lm-evaluation-harness tasks on a trained model",
    ),
    "export": (
        ExportFlags,
        "minimal_fsdp.commands.export",
        "a checkpoint -> safetensors or a Hugging Face directory",
    ),
    "prepare": (
        PrepareFlags,
        "minimal_fsdp.commands.prepare",
        "tokenize a dataset into train.bin and val.bin",
    ),
    "progress": (
        Config,
        "minimal_fsdp.commands.progress",
        "how far a run has trained (STEP LAST_STEP), for job "
        "chains; takes the run's training flags",
    ),
    "plan": (
        PlanFlags,
        "minimal_fsdp.commands.plan",
        "memory and step time of every strategy: what fits",
    ),
    "cluster": (
        ClusterFlags,
        "minimal_fsdp.commands.cluster",
        "virtual hosts on one machine, to rehearse a multi-node job (root)",
    ),
    "plot": (PlotFlags, "minimal_fsdp.commands.plot", "a run's loss curves as a PNG"),
}

# Commands that run in one process. Started by a launcher on several ranks (`mpiexec -n 2
# minimal-fsdp export`), rank 0 runs the command and the others exit at once: each would write the
# same files.
ONE_PROCESS = ("export", "prepare", "progress", "plan", "cluster", "plot")


def usage():
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, _, summary) in COMMANDS.items()]
    return (
        "usage: minimal-fsdp COMMAND [--config FILE.toml] [--FLAG VALUE ...]   (python -m "
        "minimal_fsdp: the same)\n\ncommands:\n" + "\n".join(lines) + "\n\n`minimal-fsdp COMMAND "
        "--help` lists a command's flags, with their defaults."
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] not in COMMANDS:
        if launcher_rank() == 0:  # every rank of a launch got the same command line
            names = ", ".join(COMMANDS)
            print(f"error: no command {argv[0]!r}; commands: {names}", file=sys.stderr, flush=True)
        sys.exit(2)
    if argv[0] in ONE_PROCESS and launcher_rank() != 0:
        sys.exit(0)
    flags, module, summary = COMMANDS[argv[0]]
    description = None if flags is not Config or argv[0] == "train" else summary
    parsed = one_line_errors(parse)(flags, argv[1:], f"minimal-fsdp {argv[0]}", description)
    # torch's C++ warnings off unless asked for (read when torch loads, so here): after a rank's one
    # `error:` line, a rank still asking the rendezvous store whose host has ended would add c10d's
    # warning and a C++ stack (docs/launch.md, "When a launch goes wrong").
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # torch, where the command needs it, comes in here; bad input found later is one line too
    one_line_errors(importlib.import_module(module).main)(parsed)


if __name__ == "__main__":
    main()

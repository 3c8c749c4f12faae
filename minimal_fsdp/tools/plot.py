"""A run's loss curves as a PNG, from its metrics.jsonl; several runs on one plot to compare them:

    minimal-fsdp plot logs/shakespeare              # writes logs/shakespeare/loss.png
    minimal-fsdp plot logs/shakespeare --out a.png
    minimal-fsdp plot logs/bf16 logs/fp8 --out bf16_vs_fp8.png   # default: logs/loss.png

Needs matplotlib (pip install matplotlib, or pip install -e ".[plot]"); TensorBoard shows the same
curves live.
"""

import json
import sys
from pathlib import Path

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.files import open_regular, parse_json, shown

MAX_LINE_BYTES = 2**20  # one logged step is a few hundred bytes; a longer line is not one of ours
MAX_LINE_DEPTH = 4  # {"step": ..., "eval": {"task": {...}}}


def read_metrics(run_dir):
    """{field: (steps, values)} from <run_dir>/metrics.jsonl. A resumed run may log a step again;
    the last value wins, as it belongs to the checkpoint that training went on from. Read as every
    file of ours is (files.py): a regular file, line by line, each line at most MAX_LINE_BYTES of
    UTF-8 JSON, an object with a whole-number step; a field that is not a number is not plotted. A
    last line cut short (a run killed while writing it) is skipped with a warning; any other bad
    line is one error line naming the file, the line and the field."""
    path = Path(run_dir) / "metrics.jsonl"
    where = shown(path, 1000)
    try:
        f = open_regular(path, follow_links=True)
    except FileNotFoundError:
        raise ConfigError(
            f"{where} does not exist: pass a run's log directory, <log_dir>/<run_name>"
        ) from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    by_field = {}
    with f:
        number = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise ConfigError(f"{where}: line {number} is over {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                row = parse_json(line, MAX_LINE_DEPTH)
            except ValueError as e:
                if not line.endswith(b"\n") and not f.read(1):
                    print(
                        f"warning: {where}: its last line is cut short ({e}): skipped",
                        file=sys.stderr,
                        flush=True,
                    )
                    break
                raise ConfigError(f"{where}: line {number} {e}") from None
            step = row.get("step")
            if type(step) is not int or step < 0:
                raise ConfigError(
                    f"{where}: line {number}: step is {shown(json.dumps(step), 40)}, not a whole "
                    "number >= 0"
                )
            for name, value in row.items():
                if name != "step" and type(value) in (int, float):
                    by_field.setdefault(name, {})[step] = value
    return {
        name: (sorted(values), [values[s] for s in sorted(values)])
        for name, values in by_field.items()
    }


def plot(run_dirs, out=None):
    """Train and val loss against the step of one run directory or of several (labelled by their
    names, one colour each); returns the PNG's path: `out`, else loss.png in the run directory
    (several: in the first one's parent, the log directory)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
        ) from None
    run_dirs = [Path(d) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    runs = {d: read_metrics(d) for d in run_dirs}
    for d, series in runs.items():
        if "loss" not in series:
            raise ConfigError(f"{d / 'metrics.jsonl'} has no loss values yet")
    one = len(run_dirs) == 1
    out = Path(out) if out else run_dirs[0] / "loss.png" if one else run_dirs[0].parent / "loss.png"
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (d, series) in enumerate(runs.items()):
        name, color = ("" if one else f"{d.name}: "), f"C{i}"
        ax.plot(
            *series["loss"],
            "." if len(series["loss"][0]) < 2 else "-",
            color=color,
            label=name + "train loss",
        )
        if "val_loss" in series:
            ax.plot(*series["val_loss"], "o--", color=color, label=name + "val loss")
    ax.set(xlabel="step", ylabel="cross-entropy loss", title=run_dirs[0].name if one else "")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out

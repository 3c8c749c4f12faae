"""A run's loss curves as a PNG, from its metrics.jsonl; several runs on one plot to compare them:

    minimal-fsdp plot logs/shakespeare              # writes logs/shakespeare/loss.png
    minimal-fsdp plot logs/shakespeare --out a.png
    minimal-fsdp plot logs/bf16 logs/fp8 --out bf16_vs_fp8.png   # default: logs/loss.png

Needs matplotlib (pip install matplotlib, or pip install -e ".[plot]"); TensorBoard shows the same
curves live.
"""

import json
from pathlib import Path

from minimal_fsdp.config.commands import PlotFlags
from minimal_fsdp.config.flags import ConfigError, one_line_errors
from minimal_fsdp.config.parser import parse


def read_metrics(run_dir):
    """{field: (steps, values)} from <run_dir>/metrics.jsonl. A resumed run may log a step again;
    the last value wins, as it belongs to the checkpoint that training went on from."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: pass a run's log directory, <log_dir>/<run_name>"
        )
    by_field = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for name, value in row.items():
            if name != "step":
                by_field.setdefault(name, {})[row["step"]] = value
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


@one_line_errors
def main(argv=None, cfg=None):
    """`minimal-fsdp plot`: the flags (or PlotFlags parsed already) -> the PNG's path on stdout."""
    args = cfg or parse(PlotFlags, argv)
    print(plot(args.run_dir, args.out))

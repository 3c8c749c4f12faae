"""A run's loss curves as a PNG, from its metrics.jsonl:

    python -m minimal_fsdp.plot logs/shakespeare              # writes logs/shakespeare/loss.png
    python -m minimal_fsdp.plot logs/shakespeare --out a.png

Needs matplotlib (pip install matplotlib, or pip install -e ".[plot]"); TensorBoard shows the same curves live.
"""
import argparse
import json
from pathlib import Path

from .config import ConfigError, one_line_errors


def read_metrics(run_dir):
    """{field: (steps, values)} from <run_dir>/metrics.jsonl. A resumed run may log a step again; the last
    value wins, as it belongs to the checkpoint that training went on from."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: pass a run's log directory, <log_dir>/<run_name>")
    by_field = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for name, value in row.items():
            if name != "step":
                by_field.setdefault(name, {})[row["step"]] = value
    return {name: (sorted(values), [values[s] for s in sorted(values)]) for name, values in by_field.items()}


def plot(run_dir, out=None):
    """Train and val loss against the step; returns the PNG's path."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from None
    series = read_metrics(run_dir)
    if "loss" not in series:
        raise ConfigError(f"{Path(run_dir) / 'metrics.jsonl'} has no loss values yet")
    out = Path(out) if out else Path(run_dir) / "loss.png"
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(*series["loss"], "." if len(series["loss"][0]) < 2 else "-", label="train loss")
    if "val_loss" in series:
        ax.plot(*series["val_loss"], "o-", label="val loss")
    ax.set(xlabel="step", ylabel="cross-entropy loss", title=Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


@one_line_errors
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minimal_fsdp.plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run's log directory, <log_dir>/<run_name>")
    parser.add_argument("--out", help="PNG to write (default: <run_dir>/loss.png)")
    args = parser.parse_args(argv)
    print(plot(args.run_dir, args.out))


if __name__ == "__main__":
    main()

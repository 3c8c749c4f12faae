"""`minimal-fsdp plot RUN_DIR ...`: a run's loss curves as a PNG (tools/plot.py)."""

from minimal_fsdp.tools.plot import plot


def main(flags):
    """PlotFlags -> the PNG's path on stdout."""
    print(plot(flags.run_dir, flags.out))

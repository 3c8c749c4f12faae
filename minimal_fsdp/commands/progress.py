"""`minimal-fsdp progress [the run's training flags]`: "STEP LAST_STEP" of the run's newest complete
checkpoint, "0 none" without one (tools/progress.py), without importing torch."""

from pathlib import Path

from minimal_fsdp.tools.progress import newest


def main(cfg):
    """The run's training Config -> "STEP LAST_STEP"."""
    meta = newest(Path(cfg.checkpoint_dir) / cfg.run_name)
    if meta is None:
        print("0 none")
    else:
        print(meta["step"], meta["state"]["schedule"].get("last_step") or "none")

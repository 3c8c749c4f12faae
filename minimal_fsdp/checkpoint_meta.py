"""A checkpoint's meta.json: its versioned layout, read and checked before anything uses it.

meta.json, format 2 (read_meta turns a format-1 file, from before "format" existed, into this layout):
  format      2
  step        optimizer steps done; world_size: ranks that saved it; val_loss: at this step, or null
  model_type  "gpt" or "llama"; model: the model config's fields; config: every resolved flag
  state       the JSON state of the run's other parts, each written by its own state_dict(): "schedule"
              (train.Schedule: lr_decay_steps, last_step) and "data" (data.TokenData / streaming.StreamingData:
              the position of the train stream)
  replicas    decentralized runs: replicas saved one per rank (0: the average only)
  files       {file name: [size, CRC-32]} of every other file of the checkpoint
"""
import json
from pathlib import Path

FORMAT = 2


def read_meta(path):
    """A checkpoint's meta.json in the current format's layout (see the top of this file)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if not isinstance(meta, dict) or meta.get("format", 1) == FORMAT:
        return meta
    # Format 1 kept the parts' state at the top level and often no model_type (it was always GPT then).
    config = meta.get("config") or {}
    blocks_per_micro_step = meta.get("world_size", 1) * config.get("batch_size", 1)
    data = meta.get("data_position") or {"train_blocks_seen": blocks_per_micro_step * meta.get(
        "train_batches", meta.get("step", 0) * config.get("grad_accum_steps", 1))}
    schedule = {"lr_decay_steps": meta.get("lr_decay_steps"), "last_step": meta.get("last_step")}
    return dict(meta, format=FORMAT, model_type=meta.get("model_type", "gpt"),
                state={"schedule": schedule, "data": data})

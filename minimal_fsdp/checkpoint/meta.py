"""A checkpoint's meta.json: its versioned layout, read and checked before anything uses it.

meta.json, format 2 (read_meta turns a format-1 file, from before "format" existed, into this
layout):
  format      2
  step        optimizer steps done; world_size: ranks that saved it; val_loss: at this step, or null
  model_type  the family (models/families); model: the model config's fields; config: every
              resolved flag
  state       the JSON state of the run's other parts, each written by its own state_dict():
              "schedule" (train.Schedule: lr_decay_steps, last_step) and "data" (tokens.TokenData /
              streaming.StreamingData: the position of the train stream); with --eval_tasks
              "eval_tasks" (harness.TrainingTasks: the --best_metric choice and the step's scores,
              checkpoint/best.py)
  replicas    decentralized runs: replicas saved one per rank (0: the average only)
  files       {file name: [size, CRC-32]} of every other file of the checkpoint

meta.json is read before its own checksums can protect anything, so read_meta trusts nothing in it:
the file must be a regular file of at most MAX_BYTES, nested at most MAX_DEPTH deep, and every field
present must have its type and range (SCHEMA, model_problem); a file it names must be a plain name
inside the checkpoint. Any failure is a MetaError, one line naming the field. check_run_keys adds
the keys a training run needs.
"""

import dataclasses
import json
import math
import re
from pathlib import Path

from minimal_fsdp.checkpoint.dirs import STEP_NAME
from minimal_fsdp.config.checks import MAX_WHOLE, WHOLE_RANGES
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.files import read_json, shown
from minimal_fsdp.models.families import FAMILIES, check_shape

FORMAT = 2
MAX_BYTES = 64 * 2**20  # a few KB, plus two numbers per file: room for a run of a million ranks
MAX_DEPTH = 32  # the deepest meta.json we write nests 4 levels (state.data.stream[rank][i])
# steps, positions, sizes: far beyond any run, far below where arithmetic on them overflows
MAX_INT = MAX_WHOLE
# Model sizes: each well above the largest model anyone trains, so that nothing built from them is
# absurd; the shards then bound them exactly (checkpoint_find compares every shape with DCP's
# .metadata). The flags' own table (config/checks.py), so a model the flags accept is one whose
# checkpoint is accepted.
MODEL_BOUNDS = {
    name: WHOLE_RANGES[name][1]
    for name in (
        "vocab_size",
        "seq_length",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "embed_size",
        "intermediate_size",
    )
}
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}")


class MetaError(ConfigError):
    """meta.json is unusable; the text is one line naming the field. A checkpoint with one is
    damaged."""

    def __init__(self, text):
        # a key or value of a hostile meta.json may hold control characters: never echoed raw
        super().__init__(shown(text))


def read_meta(path):
    """A checkpoint's meta.json in the current format's layout, every field present checked (the top
    of this file); raises MetaError (or OSError when the file is missing or unreadable)."""
    path = Path(path)
    numbered = STEP_NAME.fullmatch(path.name)
    if numbered and path.is_symlink():
        raise MetaError(f"{path.name} is a symbolic link, not a checkpoint directory of this run")
    try:
        meta = read_json(path / "meta.json", MAX_BYTES, MAX_DEPTH)
    except ValueError as e:
        raise MetaError(f"meta.json {e}") from None
    version = meta.get("format", 1)
    if version not in (1, FORMAT) or isinstance(version, bool):
        raise MetaError(
            f"meta.json: format {_show(version)} is not one this version reads (1 or {FORMAT})"
        )
    if version == 1:
        meta = _from_format_1(meta)
    check(meta)
    # a copy or rename of another step's checkpoint
    if numbered and meta["step"] != int(numbered.group(1)):
        raise MetaError(f"meta.json says step {meta['step']}, but its directory is {path.name}")
    return meta


def _from_format_1(meta):
    """Format 1 kept the parts' state at the top level and often no model_type (it was always GPT
    then)."""
    for field in ("step", "world_size", "train_batches"):
        _whole(meta, field, optional=True)
    config = meta.get("config")
    if config is None:
        meta, config = {k: v for k, v in meta.items() if k != "config"}, {}
    if not isinstance(config, dict):
        raise MetaError(f"meta.json: config is {_show(config)}, not an object")
    for field in ("batch_size", "grad_accum_steps"):
        _whole(config, field, optional=True, where="config.")
    blocks_per_micro_step = (meta.get("world_size") or 1) * (config.get("batch_size") or 1)
    train_batches = meta.get("train_batches")
    if train_batches is None:
        train_batches = (meta.get("step") or 0) * (config.get("grad_accum_steps") or 1)
    data = meta.get("data_position") or {"train_blocks_seen": blocks_per_micro_step * train_batches}
    schedule = {"lr_decay_steps": meta.get("lr_decay_steps"), "last_step": meta.get("last_step")}
    return dict(
        meta,
        format=FORMAT,
        model_type=meta.get("model_type", "gpt"),
        state={"schedule": schedule, "data": data},
    )


def check(meta):
    """Every field of a (format-2) meta.json that is present has its type and range: MetaError
    otherwise."""
    _whole(meta, "step")
    _whole(meta, "world_size", low=1, high=2**24, optional=True)
    _whole(meta, "replicas", high=2**24, optional=True)
    if meta.get("val_loss") is not None and not _number(meta["val_loss"]):
        raise MetaError(f"meta.json: val_loss is {_show(meta['val_loss'])}, not a number or null")
    for field in ("config", "state", "model", "files"):
        if field in meta and not isinstance(meta[field], dict):
            raise MetaError(f"meta.json: {field} is {_show(meta[field])}, not an object")
    if "model_type" in meta and not (
        isinstance(meta["model_type"], str) and meta["model_type"] in FAMILIES
    ):
        raise MetaError(
            f"meta.json: model_type is {_show(meta['model_type'])}, not one of "
            f"{', '.join(FAMILIES)}"
        )
    state = meta.get("state", {})
    for part in ("schedule", "data"):
        if part in state and not isinstance(state[part], dict):
            raise MetaError(f"meta.json: state.{part} is {_show(state[part])}, not an object")
    # the flags a run saved: what a launch would accept
    for name, (low, high) in WHOLE_RANGES.items():
        _whole(meta.get("config", {}), name, low, high, optional=True, where="config.")
    schedule, data = state.get("schedule", {}), state.get("data", {})
    _whole(schedule, "lr_decay_steps", optional=True, where="state.schedule.")
    _whole(schedule, "last_step", optional=True, where="state.schedule.")
    _whole(data, "train_blocks_seen", optional=True, where="state.data.")
    if "stream" in data and not (
        isinstance(data["stream"], list)
        and all(
            isinstance(p, list)
            and len(p) == 3
            and all(type(i) is int and 0 <= i <= MAX_INT for i in p)
            for p in data["stream"]
        )
    ):
        raise MetaError(
            "meta.json: state.data.stream is not a list of [file, document, token] positions"
        )
    for name, entry in meta.get("files", {}).items():
        if not PLAIN_NAME.fullmatch(name) or name in (".", ".."):
            raise MetaError(
                f"meta.json: files names {_show(name)}, not a plain file name inside the checkpoint"
            )
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and all(type(v) is int for v in entry)
            and 0 <= entry[0] <= MAX_INT
            and 0 <= entry[1] < 2**32
        ):
            raise MetaError(f"meta.json: files.{name} is {_show(entry)}, not [size, CRC-32]")
    if "model" in meta:
        problem = model_problem(meta.get("model_type", "gpt"), meta["model"])
        if problem:
            raise MetaError(f"meta.json: {problem}")


def check_run_keys(meta):
    """The keys a training run, sampling and export read: MetaError naming the first one missing."""
    state = meta.get("state", {})
    for present, name in [
        ("model_type" in meta, "model_type"),
        ("model" in meta, "model"),
        ("config" in meta, "config"),
        ("schedule" in state, "state.schedule"),
        ("data" in state, "state.data"),
    ]:
        if not present:
            raise MetaError(f"meta.json has no {name}")


def model_problem(model_type, fields):
    """Why `fields` (meta.json's "model", or a model config read elsewhere) is not a config of our
    `model_type` that can be built, or None: known keys only, each of its type, sizes within
    MODEL_BOUNDS, shapes that fit."""
    config_class = FAMILIES[model_type].Config
    types = {f.name: f.type for f in dataclasses.fields(config_class)}
    for name, value in fields.items():
        kind = types.get(name)
        if kind is None:
            return f"model.{shown(name, 40)} is not a field of a {model_type} model"
        if name in MODEL_BOUNDS and not (type(value) is int and 1 <= value <= MODEL_BOUNDS[name]):
            return (
                f"model.{name} is {_show(value)}, not a whole number in [1, {MODEL_BOUNDS[name]}]"
            )
        if (
            name == "document_eot_id"
            and value is not None
            and not (type(value) is int and value >= 0)
        ):
            return f"model.{name} is {_show(value)}, not a token id"
        if kind in (float, "float") and not (
            _number(value) and math.isfinite(value) and value >= 0
        ):
            return f"model.{name} is {_show(value)}, not a finite number >= 0"
        if kind in (bool, "bool") and type(value) is not bool:
            return f"model.{name} is {_show(value)}, not true or false"
        if (
            kind in (dict, "dict")
            and value is not None
            and not (
                isinstance(value, dict)
                and all(_number(v) or isinstance(v, str) for v in value.values())
            )
        ):
            return f"model.{name} is {_show(value)}, not an object of numbers"
    if fields.get("dropout", 0) >= 1:
        return f"model.dropout is {_show(fields['dropout'])}, not below 1"
    for name in ("vocab_size", "seq_length", "num_layers", "num_heads", "embed_size"):
        if name not in fields:
            return f"model has no {name}"
    try:
        check_shape(config_class(**fields))
    except ConfigError as e:
        return f"model: {e}"
    return None


def _whole(mapping, field, low=0, high=MAX_INT, optional=False, where=""):
    """mapping[field] is a whole number in [low, high] (or, if optional, absent or null): MetaError
    otherwise."""
    value = mapping.get(field)
    if value is None and optional:
        return
    if value is None:
        raise MetaError(f"meta.json has no {where}{field}")
    if type(value) is not int or not low <= value <= high:
        bounds = f">= {low}" if high == MAX_INT else f"in [{low}, {high}]"
        raise MetaError(f"meta.json: {where}{field} is {_show(value)}, not a whole number {bounds}")


def _number(value):
    return type(value) in (int, float)


def _show(value):
    """A value as one short line (its JSON, cut)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""Finding a checkpoint to load: the checks that a checkpoint is complete and undamaged (verify),
the run's newest complete one, the one a run starts from (find), and the one a command names
(checkpoint_path, source_fallback: sample, evaluate, export). The directories, markers and
the order to try them in are checkpoint/dirs.py's. The job chains' question (how far a run is) is
`minimal-fsdp progress` (tools/progress.py), answered without torch by fewer checks than
verify's."""

import dataclasses
import errno
import io
import math
import re
import stat
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from minimal_fsdp.checkpoint.dirs import candidates, files_problem, marker, skipping, step_dirs
from minimal_fsdp.checkpoint.meta import PLAIN_NAME, MetaError, check_run_keys, read_meta
from minimal_fsdp.checkpoint.rng import read_rng, rng_file, rng_problem
from minimal_fsdp.checkpoint.safe_load import load_quietly, read_dcp_metadata
from minimal_fsdp.config.choices import DEVICES_PER_RANK, ConfigError
from minimal_fsdp.files import open_regular, read_json, shown
from minimal_fsdp.launch import failures
from minimal_fsdp.launch.failures import run_on_main
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import config_from_dict

BLOCK = re.compile(r"blocks\.(\d+)\.")
MAX_JSON_BYTES = 2**30  # a tokenizer.json: 9 MB for Llama 3's 128K tokens
# one optimizer setting saved as an object (a param group's parameter names: ~2 KB)
MAX_OBJECT_BYTES = 2**20


def verify(path, checksums=True, share=(0, 1)):
    """Why `path` is not a complete checkpoint, or None if it is: meta.json passes its schema with
    the keys a run reads (checkpoint_meta), DCP's .metadata loads (without running code), every byte
    range it lists lies inside a regular shard file of this directory, the shards hold the model
    meta.json describes, every rank's RNG file loads, and, with checksums, every file has the size
    and CRC-32 recorded at save (this caller's `share` of them, (index, count), when several
    processes split the reading). Checkpoints from before checksums skip that."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        meta = read_meta(path)
        check_run_keys(meta)
    except MetaError as e:
        return str(e)
    except OSError as e:
        return "meta.json is missing or unreadable" + (
            "" if e.errno == errno.ENOENT else f" ({e.strerror})"
        )
    try:
        cap = metadata_cap(meta)
        size = (path / ".metadata").lstat().st_size
    except OSError:
        return ".metadata is missing"
    if size > cap:
        return (
            f".metadata is {size} bytes, more than the {cap} that the model meta.json describes "
            "needs"
        )
    try:
        metadata = read_dcp_metadata(path / ".metadata", cap)
        needed = {}
        for info in metadata.storage_data.values():
            name = info.relative_path
            if not (isinstance(name, str) and PLAIN_NAME.fullmatch(name)):
                return (
                    f".metadata names a shard {name!r} that is not a plain file name inside "
                    f"the checkpoint"
                )
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
        problem = _storage_problem(metadata) or _model_problem(meta, metadata)
    except Exception as e:  # noqa: BLE001 - a truncated or hostile pickle fails in many ways; all mean "unusable"
        return (
            f".metadata is missing or unreadable ({type(e).__name__}: "
            f"{shown(' '.join(str(e).split())[:120])})"
        )
    for name, size in sorted(needed.items()):
        try:
            info = (path / name).lstat()
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size < size:
            return f"{name} is truncated ({info.st_size} of {size} bytes)"
    # the checksums before the entries verify unpickles itself: damaged bytes are named as such
    if not problem and checksums:
        problem = files_problem(path, meta.get("files") or {}, share)
    problem = problem or _objects_problem(path, metadata, meta)
    if problem:
        return shown(problem)  # the names in it are the file's: never a control character raw
    # the tokenizer's: json.loads recurses once per level of nesting
    for name in sorted(meta.get("files") or {}):
        if name.endswith(".json"):
            try:
                read_json(path / name, MAX_JSON_BYTES)
            except FileNotFoundError:
                continue  # the checksums' check reports it
            except OSError as e:
                return f"{name}: {e.strerror or e}"
            except ValueError as e:
                return f"{name} {e}"
    for rank in range(meta.get("world_size") or 0):
        try:
            state = read_rng(path, rank)
        except Exception as e:  # noqa: BLE001 - missing, truncated: a few KB each, so read them all
            why = (
                e.strerror
                if isinstance(e, OSError) and e.errno != errno.ENOENT
                else type(e).__name__
            )
            return f"{rng_file(rank)} is missing or unreadable ({why})"
        problem = rng_problem(state)
        if problem:
            return f"{rng_file(rank)} {problem}"
    return None


def _storage_problem(metadata):
    """Why DCP's .metadata does not describe loadable storage, or None: every tensor chunk and
    object it describes has a byte range, each range is at least its chunk's bytes long, and no two
    ranges in a file overlap (a range pointing into another tensor would load that one's bytes, or
    fail deep inside DCP)."""
    stored, spans = {}, {}
    for index, info in metadata.storage_data.items():
        offset, length = int(info.offset), int(info.length)
        if offset < 0 or length < 0:
            return f".metadata gives {index.fqn} the byte range [{offset}, {offset + length})"
        stored[(index.fqn, None if index.offset is None else tuple(index.offset))] = length
        spans.setdefault(info.relative_path, []).append((offset, length, index.fqn))
    for key, md in metadata.state_dict_metadata.items():
        chunks = (
            [(tuple(c.offsets), c.sizes) for c in md.chunks]
            if hasattr(md, "chunks")
            else [(None, None)]
        )
        for offset, sizes in chunks:
            length = stored.get((key, offset))
            if length is None:
                return f".metadata describes {key} but gives no byte range for it"
            if sizes is not None and length < math.prod(sizes) * md.properties.dtype.itemsize:
                return (
                    f".metadata gives {key} {length} bytes, fewer than its {list(sizes)} "
                    f"values take"
                )
    for name, ranges in spans.items():
        ranges.sort()
        for (start, length, first), (next_start, _, second) in zip(ranges, ranges[1:]):
            if next_start < start + length:
                return f".metadata places {first} and {second} in overlapping bytes of {name}"
    return None


# an optimizer entry restored as saved: a parameter's step count, and a param group's settings
STEP_KEY = re.compile(r"(?:replicas\.\d+\.)?optim\.state\..+\.step")
SETTING_KEY = re.compile(r"((?:replicas\.\d+\.)?optim\.param_groups\.\d+)\.(\w+)")
# .metadata's bytes per chunk it describes (its key, index, byte range and shape: about 270 with
# a tiny model's names), with room for long names, and for the rest (the param groups, the header)
METADATA_BYTES_PER_CHUNK = 1024
METADATA_SLACK = 2**20


def _implied_params(meta):
    """{name: shape} of every parameter of the model meta.json describes (one block built on the
    meta device, so no config allocates anything), and the config."""
    config = config_from_dict(meta["model_type"], meta["model"])
    with torch.device("meta"):
        one_block = MODELS[meta["model_type"]](dataclasses.replace(config, num_layers=1))
    return {name: tuple(p.shape) for name, p in one_block.named_parameters()}, config


def metadata_cap(meta):
    """The most bytes DCP's .metadata of the checkpoint meta.json describes can need: a chunk per
    device of each tensor (and never more chunks than values), for the model, both AdamW
    moments (and a decentralized run's accumulated gradient), each parameter's step, and each
    replica's copy of all that. A larger file is refused by its size before a byte is unpickled:
    the pure-Python unpickler reads about 1.4 MB/s, so a forged one of 383 MB took minutes."""
    params, config = _implied_params(meta)
    device = (meta.get("config") or {}).get("device")
    devices = (meta.get("world_size") or 1) * DEVICES_PER_RANK.get(device, 1)
    chunks = 0
    for name, shape in params.items():
        count = config.num_layers if name.startswith("blocks.0.") else 1
        chunks += count * (4 * min(devices, math.prod(shape)) + 1)
    chunks *= 1 + (meta.get("replicas") or 0)
    return METADATA_SLACK + METADATA_BYTES_PER_CHUNK * chunks


def _objects_problem(path, metadata, meta):
    """Why the entries of the shards the optimizer restores as saved (its param_groups' settings,
    loaded with torch.load(weights_only=True) as restoring loads them, and each parameter's step)
    do not load or do not fit meta.json, or None. They are a few KB in all."""
    opened, values = {}, {}
    try:
        for index, info in sorted(metadata.storage_data.items(), key=lambda item: item[0].fqn):
            md = metadata.state_dict_metadata.get(index.fqn)
            if md is None or hasattr(md, "size") and not STEP_KEY.fullmatch(index.fqn):
                continue  # a tensor read in bulk, or bytes nothing loads
            if info.length > MAX_OBJECT_BYTES:
                return (
                    f"{index.fqn} is {info.length} bytes, over {MAX_OBJECT_BYTES}: not an "
                    f"optimizer setting"
                )
            if info.relative_path not in opened:
                opened[info.relative_path] = open_regular(path / info.relative_path)
            f = opened[info.relative_path]
            f.seek(info.offset)
            try:
                values[index.fqn] = load_quietly(io.BytesIO(f.read(info.length)))
            except Exception as e:  # noqa: BLE001 - a refused pickle or damaged bytes: either way it cannot load
                return (
                    f"{index.fqn} does not load ({type(e).__name__}: "
                    f"{shown(' '.join(str(e).split())[:100])})"
                )
    except OSError as e:
        return f"{info.relative_path}: {e.strerror or e}"
    finally:
        for f in opened.values():
            f.close()
    for key, value in values.items():
        problem = (
            _step_problem(value, meta["step"])
            if STEP_KEY.fullmatch(key)
            else _setting_problem(key, value, meta.get("config") or {})
        )
        if problem:
            return f"{key} is {problem}"
    return None


def _step_problem(value, step):
    """Why a parameter's saved AdamW step is not a whole number of steps in [0, meta.json's step],
    or None. (An update skipped on a non-finite gradient leaves it below; nothing takes it above.)
    AdamW divides by 1 - beta^step: a negative step ends the run later blaming --lr, a huge one
    changes every update silently."""
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()):
        return "not one number"
    number = value.double().item()
    if not (math.isfinite(number) and number == int(number) and 0 <= number <= step):
        return f"{number:g}, not a whole number of steps in [0, {step}] (meta.json's step)"
    return None


def _number(value):
    # an int is finite however large (math.isfinite would convert it to a float, and overflow)
    return type(value) is int or type(value) is float and math.isfinite(value)


def _setting_problem(key, value, config):
    """Why a param group's saved setting is not one build_optimizer makes for the run meta.json's
    config describes, or None. Restoring takes these over the flags; lr alone is set again each
    step."""
    field = SETTING_KEY.fullmatch(key).group(2) if SETTING_KEY.fullmatch(key) else None
    decentralized = config.get("data_parallel") == "decentralized"
    if field == "lr" and not (_number(value) and value >= 0):
        return f"{_show(value)}, not a learning rate"
    if field == "betas":
        beta2 = config.get("beta2")
        wanted = [
            config.get("beta1"),
            beta2 if beta2 is not None else 0.98 if decentralized else 0.95,
        ]
        if not (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(_number(b) and 0 <= b < 1 for b in value)
            and ("beta1" not in config or list(value) == wanted)
        ):
            return f"{_show(value)}, not meta.json's --beta1, --beta2 ({wanted[0]}, {wanted[1]})"
    if field == "eps" and value != 1e-8:  # AdamW's default, which build_optimizer keeps
        return f"{_show(value)}, not 1e-08"
    if field == "weight_decay" and not (
        _number(value)
        and value >= 0
        and ("weight_decay" not in config or value in (config["weight_decay"], 0.0))
    ):
        return f"{_show(value)}, not meta.json's --weight_decay ({config.get('weight_decay')}) or 0"
    if field in ("amsgrad", "maximize", "differentiable") and value is not False:
        return f"{_show(value)}, not false"
    if field in ("capturable", "decoupled_weight_decay") and type(value) is not bool:
        return f"{_show(value)}, not true or false"
    if field in ("foreach", "fused") and value is not None and type(value) is not bool:
        return f"{_show(value)}, not true, false or null"
    if field == "accum_steps" and not (
        type(value) is int
        and value >= 1
        and (not decentralized or value == config.get("accum_steps", value))
    ):
        return f"{_show(value)}, not meta.json's --accum_steps ({config.get('accum_steps')})"
    return None


def _show(value):
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _optimizer_problem(metadata, params):
    """Why the optimizer state saved beside the model (each of "optim.", and a decentralized run's
    "replicas.<rank>.optim.") is not one for these parameters ({name: shape}), or None: each
    parameter has its step and both AdamW moments of its shape. A checkpoint without optimizer state
    is left to the load."""
    sizes = {
        key: tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if hasattr(md, "size")
    }
    prefixes = {key[: key.index("optim.state.")] for key in sizes if "optim.state." in key}
    for prefix in sorted(prefixes):
        for name, shape in params.items():
            for entry, wanted in (("step", None), ("exp_avg", shape), ("exp_avg_sq", shape)):
                key = f"{prefix}optim.state.{name}.{entry}"
                if key not in sizes:
                    return f"the shards hold no {key} for the model's {name}"
                if wanted is not None and sizes[key] != wanted:
                    return (
                        f"the shards hold {key} of shape {list(sizes[key])}, the parameter's "
                        f"is {list(wanted)}"
                    )
    return None


def _model_problem(meta, metadata):
    """Why the shards do not hold the model meta.json describes, or None: the same blocks, and every
    parameter the config implies with its shape. One block is built, on the meta device, so no
    config, however absurd, allocates anything, and the sizes of what is built later are bounded by
    what the shards hold."""
    held = {
        key[len("model.") :]: tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(md, "size")
    }
    wanted, config = _implied_params(meta)
    blocks = {int(m.group(1)) for m in map(BLOCK.match, held) if m}
    if blocks != set(range(config.num_layers)):
        return f"meta.json describes {config.num_layers} layers, the shards hold {len(blocks)}"
    params = {}
    for name, shape in held.items():
        implied = wanted.get(BLOCK.sub("blocks.0.", name, count=1))
        if implied is not None and implied != shape:
            return (
                f"meta.json's model gives {name} the shape {list(implied)}, the shards hold "
                f"{list(shape)}"
            )
        if implied is not None:
            params[name] = shape
    per_block = sum(name.startswith("blocks.0.") for name in wanted)
    if len(params) != len(wanted) + (config.num_layers - 1) * per_block:
        return (
            f"the shards hold {len(params)} of the "
            f"{len(wanted) + (config.num_layers - 1) * per_block} "
            "tensors of the model meta.json describes"
        )
    return _optimizer_problem(metadata, params)


def newest_complete(run_dir, checksums=True, refused=()):
    """The first complete checkpoint among candidates(run_dir), less those `refused` (they failed
    to load: first_loading), or None. Each one skipped is reported in one line on stderr."""
    for path in candidates(run_dir):
        if str(path) in refused:
            continue
        problem = verify(path, checksums)
        if problem is None:
            return path
        skipping(path, problem)
    return None


def latest(run_dir):
    """The newest complete checkpoint of a run, or None (one process; training uses find)."""
    return newest_complete(run_dir)


def resolve(path):
    """A checkpoint directory from what a user may pass: the directory itself, a `latest`/`best`
    marker, or a run directory (its newest complete checkpoint, by the cheap checks; verify() the
    result)."""
    path = Path(path)
    if path.is_file():
        target = marker(path.parent, path.name, warn=False)
        if target is None:
            raise ConfigError(
                f"{path} is a file but not a checkpoint marker (one line naming a step_<N> "
                "directory beside it): pass a step_<N> directory, a run directory or its "
                "latest/best marker"
            )
        return target
    if (
        path.is_dir()
        and not (path / "meta.json").exists()
        and ((path / "latest").exists() or step_dirs(path))
    ):
        return newest_complete(path, checksums=False) or path
    return path


def find(checkpoint, refused=()):
    """Collective. The checkpoint a run starts from (`checkpoint`: config.sections.Checkpoint):
    --restart_checkpoint_file, else (--resume auto) the run's newest complete one, else None. Rank 0
    looks at the files and passes its candidates to all (so every rank loads the same checkpoint
    even if files change meanwhile); the ranks then share the checksum reading. `refused`:
    checkpoints that failed to load (load_first). A run directory that holds checkpoints, every one
    of them refused, is an error: starting fresh would save over them."""
    together = dist.is_initialized()  # else one process (a tool, a test) does it all
    rank, world = (dist.get_rank(), dist.get_world_size()) if together else (0, 1)
    tried = (
        failures.run_on_main(_cheaply_complete, checkpoint, refused)
        if together
        else _cheaply_complete(checkpoint, refused)
    )
    for path in tried:
        problems = [verify(path, share=(rank, world))]
        if together:
            problems *= world
            dist.all_gather_object(problems, problems[rank])
        problem = next((p for p in problems if p), None)
        if problem is None:
            return Path(path)
        if checkpoint.restart_checkpoint_file:
            raise ConfigError(
                f"--restart_checkpoint_file {checkpoint.restart_checkpoint_file} is damaged: "
                f"{path}: {problem}"
            )
        if rank == 0:
            skipping(path, problem)
    if tried:
        raise ConfigError(_every_one_refused(checkpoint))
    return None


def _every_one_refused(checkpoint):
    run_dir = Path(checkpoint.checkpoint_dir) / checkpoint.run_name
    return (
        f"every checkpoint of {run_dir} is refused (the lines above say why), and a fresh start "
        "would save over them: nothing was changed there; repair or move them away, pick one with "
        "--restart_checkpoint_file, or train under another --run_name"
    )


def load_first(checkpoint, path, load):
    """Collective: load(path) and return path; if loading fails (shards forged to pass every check,
    say: DCP raises alike on every rank), one line, then (--resume auto) the next complete
    checkpoint, as find gives it. A checkpoint named by --restart_checkpoint_file, or none left, is
    an error in one line."""
    named, next_one = run_fallback(checkpoint)
    return first_loading(path, load, next_one, named)[0]


def run_fallback(checkpoint):
    """(named, next_one) for first_loading: how a run (training, or --max_epochs -1) replaces a
    checkpoint find gave it that fails to load: the next one find gives (collective), or, for
    --restart_checkpoint_file's, none."""

    def next_one(refused):
        found = find(checkpoint, refused)
        if found is None:
            raise ConfigError(_every_one_refused(checkpoint))
        return found

    named = checkpoint.restart_checkpoint_file and (
        f"--restart_checkpoint_file {checkpoint.restart_checkpoint_file}"
    )
    return named, next_one


def first_loading(path, load, next_one, named=None, failures=(Exception, CheckpointException)):
    """Collective where load is: (path, load(path)) for the first checkpoint that loads, starting at
    `path`. One that fails (with one of `failures`: damaged shard bytes under recomputed checksums
    pass every check and fail only here) is reported in one line, as find skips one, and
    next_one(the paths refused so far) gives the next (it raises when none is left). `named`: how
    the user named `path` (a flag, a command's argument); then no other checkpoint is taken for it,
    and its failure is an error in one line. Resume (load_first), sample, export and generation
    only all fall back through here."""
    refused = []
    while True:
        try:
            return Path(path), load(path)
        except failures as e:
            cause = _cause(e)
            problem = (
                f"loading it failed ({type(cause).__name__}: "
                f"{shown(' '.join(str(cause).split())[:160])})"
            )
        if named:
            raise ConfigError(f"{named}: {path}: {problem}")
        if not dist.is_initialized() or dist.get_rank() == 0:
            skipping(path, problem)
        refused.append(str(path))
        path = next_one(refused)


def _cause(error):
    """The exception behind a failed load: DCP's CheckpointException holds each rank's (one rank's
    is named), LoadFailed its __cause__."""
    per_rank = getattr(error, "failures", None)
    if isinstance(per_rank, dict) and per_rank:
        error = next(iter(per_rank.values()))
        error = error[0] if isinstance(error, tuple) else error
    if isinstance(error, LoadFailed) and error.__cause__ is not None:
        return _cause(error.__cause__)
    return error


class LoadFailed(Exception):
    """Reading a checkpoint's tensors failed (its __cause__ says how), where a caller must tell that
    from its own failures (export's writing)."""


def _cheaply_complete(checkpoint, refused=()):
    """Rank 0: the checkpoints to try, in order, that pass verify's cheap checks (no checksums yet),
    less those `refused`. None, where the run directory holds checkpoints: an error (find)."""
    if checkpoint.restart_checkpoint_file:
        path = resolve(checkpoint.restart_checkpoint_file)
        problem = verify(path, checksums=False)
        if problem:
            raise ConfigError(
                f"--restart_checkpoint_file {checkpoint.restart_checkpoint_file} is not a complete "
                f"checkpoint: {path}: {problem}"
            )
        return [str(path)]
    run_dir = Path(checkpoint.checkpoint_dir) / checkpoint.run_name
    if checkpoint.resume == "never" and not checkpoint.generate_only:
        if step_dirs(run_dir):
            raise ConfigError(
                f"--resume never, but {run_dir} already holds checkpoints: pick another "
                "--run_name, move that directory away, or resume from it with --resume auto"
            )
        return []
    found = []
    for path in candidates(run_dir):
        if str(path) in refused:
            continue
        problem = verify(path, checksums=False)
        if problem is None:
            found.append(str(path))
        else:
            skipping(path, problem)
    if not found and step_dirs(run_dir):
        raise ConfigError(_every_one_refused(checkpoint))
    return found


# ---- a checkpoint named on the command line (sample, evaluate, export) ----


def is_run_dir(path):
    """A run's checkpoint directory (checkpoints/<run>), not one checkpoint in it."""
    return (
        path.is_dir()
        and not (path / "meta.json").exists()
        and ((path / "latest").exists() or bool(step_dirs(path)))
    )


def source_fallback(source, together):
    """How a checkpoint SOURCE whose shards fail to load is replaced, as a resumed run replaces one:
    (named, next_one) for first_loading. A run directory gives its next complete checkpoint, one
    line naming each one passed over (rank 0 looks when `together`: collective); a checkpoint named
    itself (a step_<N> directory, a marker) none: its failure is an error."""
    path = Path(source)
    if not is_run_dir(path):
        return str(source), None

    def next_one(refused):
        look = newest_complete
        found = run_on_main(look, path, True, refused) if together else look(path, True, refused)
        if found is None:
            raise ConfigError(
                f"{source} holds no complete checkpoint that loads (each one's problem is named "
                "above)"
            )
        return found

    return None, next_one


def checkpoint_path(source):
    """The complete checkpoint SOURCE names. A run directory gives its newest complete one: a
    checkpoint that fails only its checksums is skipped, with one line, for an older good one, as a
    resumed run does."""
    path = Path(source)
    if is_run_dir(path):
        found = newest_complete(path)
        if found is None:
            raise ConfigError(
                f"{source} holds no complete checkpoint (each one's problem is named above)"
            )
        return found
    resolved = resolve(path)
    problem = verify(resolved)
    if problem:
        raise ConfigError(f"{source} is not a complete checkpoint: {resolved}: {problem}")
    return resolved

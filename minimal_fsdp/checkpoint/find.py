"""Finding a checkpoint to load: the checks that a checkpoint is complete and undamaged (verify), the run's
newest complete one, and the one a run starts from (find). The directories, markers and the order to try them
in are checkpoint_dirs.py's. The job chains' question (how far a run is) is `minimal-fsdp progress`
(tools/progress.py), answered without torch by fewer checks than verify's."""
import dataclasses
import errno
import re
import stat
from pathlib import Path

import torch
import torch.distributed as dist

from minimal_fsdp.launch import environment
from minimal_fsdp.checkpoint.dirs import candidates, files_problem, marker, skipping, step_dirs
from minimal_fsdp.checkpoint.dirs import crc32, step_of  # noqa: F401 (re-exported: checkpoint.py and tests use them here)
from minimal_fsdp.checkpoint.meta import PLAIN_NAME, MetaError, check_run_keys, read_meta
from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.files import open_regular, read_json
from minimal_fsdp.models.families import MODELS, config_from_dict
from minimal_fsdp.checkpoint.safe_load import read_dcp_metadata

BLOCK = re.compile(r"blocks\.(\d+)\.")
MAX_RNG_BYTES = 2**20  # torch, CUDA, numpy and python states: about 17 KB
MAX_JSON_BYTES = 2**30  # a tokenizer.json: 9 MB for Llama 3's 128K tokens


def rng_file(rank):
    return f"rng_{rank}.pt"


def verify(path, checksums=True, share=(0, 1)):
    """Why `path` is not a complete checkpoint, or None if it is: meta.json passes its schema with the keys a run
    reads (checkpoint_meta), DCP's .metadata loads (without running code), every byte range it lists lies inside
    a regular shard file of this directory, the shards hold the model meta.json describes, every rank's RNG file
    loads, and, with checksums, every file has the size and CRC-32 recorded at save (this caller's `share` of
    them, (index, count), when several processes split the reading). Checkpoints from before checksums skip that."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        meta = read_meta(path)
        check_run_keys(meta)
    except MetaError as e:
        return str(e)
    except OSError as e:
        return "meta.json is missing or unreadable" + ("" if e.errno == errno.ENOENT else f" ({e.strerror})")
    try:
        metadata = read_dcp_metadata(path / ".metadata")
        needed = {}
        for info in metadata.storage_data.values():
            name = info.relative_path
            if not (isinstance(name, str) and PLAIN_NAME.fullmatch(name)):
                return f".metadata names a shard {name!r} that is not a plain file name inside the checkpoint"
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
        problem = _model_problem(meta, metadata)
    except Exception as e:  # noqa: BLE001 - a truncated or hostile pickle fails in many ways; all mean "unusable"
        return f".metadata is missing or unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    for name, size in sorted(needed.items()):
        try:
            info = (path / name).lstat()
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size < size:
            return f"{name} is truncated ({info.st_size} of {size} bytes)"
    if problem:
        return problem
    for name in sorted(meta.get("files") or {}):  # the tokenizer's: json.loads recurses once per level of nesting
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
            with open_regular(path / rng_file(rank), MAX_RNG_BYTES) as f:
                torch.load(f, weights_only=True)
        except Exception as e:  # noqa: BLE001 - missing, truncated: a few KB each, so read them all
            why = e.strerror if isinstance(e, OSError) and e.errno != errno.ENOENT else type(e).__name__
            return f"{rng_file(rank)} is missing or unreadable ({why})"
    return files_problem(path, meta.get("files") or {}, share) if checksums else None


def _model_problem(meta, metadata):
    """Why the shards do not hold the model meta.json describes, or None: the same blocks, and every parameter
    the config implies with its shape. One block is built, on the meta device, so no config, however absurd,
    allocates anything, and the sizes of what is built later are bounded by what the shards hold."""
    held = {key[len("model."):]: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(md, "size")}
    config = config_from_dict(meta["model_type"], meta["model"])
    blocks = {int(m.group(1)) for m in map(BLOCK.match, held) if m}
    if blocks != set(range(config.num_layers)):
        return f"meta.json describes {config.num_layers} layers, the shards hold {len(blocks)}"
    with torch.device("meta"):
        one_block = MODELS[meta["model_type"]](dataclasses.replace(config, num_layers=1))
    wanted = {name: tuple(p.shape) for name, p in one_block.named_parameters()}
    found = 0
    for name, shape in held.items():
        implied = wanted.get(BLOCK.sub("blocks.0.", name, count=1))
        if implied is not None and implied != shape:
            return f"meta.json's model gives {name} the shape {list(implied)}, the shards hold {list(shape)}"
        found += implied is not None
    per_block = sum(name.startswith("blocks.0.") for name in wanted)
    if found != len(wanted) + (config.num_layers - 1) * per_block:
        return f"the shards hold {found} of the {len(wanted) + (config.num_layers - 1) * per_block} tensors " \
               "of the model meta.json describes"
    return None


def newest_complete(run_dir, checksums=True):
    """The first complete checkpoint among candidates(run_dir), or None. Each one skipped is reported in one
    line on stderr."""
    for path in candidates(run_dir):
        problem = verify(path, checksums)
        if problem is None:
            return path
        skipping(path, problem)
    return None


def latest(run_dir):
    """The newest complete checkpoint of a run, or None (one process; training uses find)."""
    return newest_complete(run_dir)


def resolve(path):
    """A checkpoint directory from what a user may pass: the directory itself, a `latest`/`best` marker, or a
    run directory (its newest complete checkpoint, by the cheap checks; verify() the result)."""
    path = Path(path)
    if path.is_file():
        target = marker(path.parent, path.name, warn=False)
        if target is None:
            raise ConfigError(f"{path} is a file but not a checkpoint marker (one line naming a step_<N> directory "
                              "beside it): pass a step_<N> directory, a run directory or its latest/best marker")
        return target
    if path.is_dir() and not (path / "meta.json").exists() and ((path / "latest").exists() or step_dirs(path)):
        return newest_complete(path, checksums=False) or path
    return path


def find(cfg):
    """Collective. The checkpoint a run starts from: --restart_checkpoint_file, else (--resume auto) the run's
    newest complete one, else None. Rank 0 looks at the files and passes its candidates to all (so every rank
    loads the same checkpoint even if files change meanwhile); the ranks then share the checksum reading."""
    together = dist.is_initialized()  # else one process (a tool, a test) does it all
    rank, world = (dist.get_rank(), dist.get_world_size()) if together else (0, 1)
    for path in environment.run_on_main(_cheaply_complete, cfg) if together else _cheaply_complete(cfg):
        problems = [verify(path, share=(rank, world))]
        if together:
            problems *= world
            dist.all_gather_object(problems, problems[rank])
        problem = next((p for p in problems if p), None)
        if problem is None:
            return Path(path)
        if cfg.restart_checkpoint_file:
            raise ConfigError(f"--restart_checkpoint_file {cfg.restart_checkpoint_file} is damaged: {path}: {problem}")
        if rank == 0:
            skipping(path, problem)
    return None


def _cheaply_complete(cfg):
    """Rank 0: the checkpoints to try, in order, that pass verify's cheap checks (no checksums yet)."""
    if cfg.restart_checkpoint_file:
        path = resolve(cfg.restart_checkpoint_file)
        problem = verify(path, checksums=False)
        if problem:
            raise ConfigError(f"--restart_checkpoint_file {cfg.restart_checkpoint_file} is not a complete "
                              f"checkpoint: {path}: {problem}")
        return [str(path)]
    run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
    if cfg.resume == "never" and not cfg.generate_only:
        if step_dirs(run_dir):
            raise ConfigError(f"--resume never, but {run_dir} already holds checkpoints: pick another --run_name, "
                              "move that directory away, or resume from it with --resume auto")
        return []
    found = []
    for path in candidates(run_dir):
        problem = verify(path, checksums=False)
        if problem is None:
            found.append(str(path))
        else:
            skipping(path, problem)
    return found


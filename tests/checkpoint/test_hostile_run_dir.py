"""Everything a run reads from its run directory treated as hostile: checkpoints forged so that
their checksums pass (optimizer state, byte ranges, shard bytes, pickles), step directories that are
links or renamed copies, lock files that are not lock files, leftovers of killed writers, a run
directory whose every checkpoint is refused, numbers that cannot round-trip through meta.json, and a
full disk named as one. Each refusal is one line; nothing hangs."""

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from minimal_fsdp import files
from minimal_fsdp.checkpoint import checkpointer, find, safe_load
from minimal_fsdp.checkpoint.meta import MetaError, read_meta
from minimal_fsdp.config.checks import WHOLE_RANGES
from minimal_fsdp.config.flags import Config, ConfigError, parse_args
from minimal_fsdp.config.sections import Checkpoint
from minimal_fsdp.inference import load
from minimal_fsdp.launch import run_lock
from minimal_fsdp.tools import progress

from conftest import ROOT
from support import (  # noqa: F401 (fixtures)
    TINY,
    MakeDirectory,
    console,
    meta_of,
    recompute_checksums,
    run,
    saved,
    scramble_a_tensor,
    tiny,
)

pytestmark = pytest.mark.usefixtures("one_rank_group")


def args_for(run, *extra):
    """The checkpoint flags (find.find's) of a run in `run`."""
    return Checkpoint.of(flags_for(run, *extra))


def flags_for(run, *extra):
    return parse_args(["--checkpoint_dir", str(run.parent), "--run_name", run.name, *extra])


def forge_state(step, edit):
    """Save step's checkpoint again from a state that edit(state) changed, checksums recomputed."""
    model, optimizer = tiny()
    state = checkpointer._state(model, optimizer)
    edit(state)
    for name in (".metadata", "__0_0.distcp"):
        (step / name).unlink()
    dcp.save(state, checkpoint_id=str(step))
    recompute_checksums(step)


def forge_metadata(step, edit):
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    edit(metadata)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    recompute_checksums(step)


def storage(metadata, fqn):
    return next(index for index in metadata.storage_data if index.fqn == fqn)


def overlap(metadata):
    moved, into = storage(metadata, "model.wpe.weight"), storage(metadata, "model.wte.weight")
    metadata.storage_data[moved] = dataclasses.replace(
        metadata.storage_data[moved], offset=metadata.storage_data[into].offset
    )


FORGED = {
    "moment of another shape": (
        lambda step: forge_state(
            step, lambda s: s["optim"]["state"]["wte.weight"].update(exp_avg=torch.zeros(3, 3))
        ),
        "the shards hold optim.state.wte.weight.exp_avg of shape [3, 3], the parameter's is [8, 4]",
    ),
    "moment missing": (
        lambda step: forge_state(
            step, lambda s: s["optim"]["state"]["ln_f.bias"].pop("exp_avg_sq")
        ),
        "the shards hold no optim.state.ln_f.bias.exp_avg_sq for the model's ln_f.bias",
    ),
    "byte range inside another tensor": (
        lambda step: forge_metadata(step, overlap),
        ".metadata places model.wpe.weight and model.wte.weight in overlapping bytes of "
        "__0_0.distcp",
    ),
    "byte range too short": (
        lambda step: forge_metadata(
            step,
            lambda m: m.storage_data.update(
                {
                    storage(m, "model.wte.weight"): (
                        dataclasses.replace(
                            m.storage_data[storage(m, "model.wte.weight")], length=16
                        )
                    )
                }
            ),
        ),
        ".metadata gives model.wte.weight 16 bytes, fewer than its [8, 4] values take",
    ),
    "tensor without bytes": (
        lambda step: forge_metadata(
            step, lambda m: m.storage_data.pop(storage(m, "model.ln_f.weight"))
        ),
        ".metadata describes model.ln_f.weight but gives no byte range for it",
    ),
}


@pytest.mark.parametrize("case", FORGED)
def test_forged_checkpoints_that_pass_their_checksums_are_refused_before_loading(
    run, console, case
):
    forge, problem = FORGED[case]
    forge(run / "step_3")
    assert find.verify(run / "step_3") == problem
    out, err = console()
    assert find.find(args_for(run)) == run / "step_2"
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"


def with_length(metadata, fqn, length):
    index = storage(metadata, fqn)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], length=length)
    return metadata


def test_a_byte_range_one_value_short_is_refused_and_one_exactly_long_enough_is_not(saved):
    """The byte-range check at its boundary: wte's [8, 4] float32 values take 128 bytes. A range of
    124 (one value short) is refused; a check that forgot the dtype's size (32) would pass it."""
    step = saved[0] / "step_3"
    fqn = "model.wte.weight"
    short = with_length(safe_load.read_dcp_metadata(step / ".metadata"), fqn, 8 * 4 * 4 - 4)
    assert find._storage_problem(short) == (
        f".metadata gives {fqn} 124 bytes, fewer than its [8, 4] values take"
    )
    exact = with_length(safe_load.read_dcp_metadata(step / ".metadata"), fqn, 8 * 4 * 4)
    assert find._storage_problem(exact) is None


def test_a_refused_pickle_in_param_groups_is_refused_before_loading_and_runs_nothing(run, tmp_path):
    marker = tmp_path / "code-ran"
    forge_state(
        run / "step_3", lambda s: s["optim"]["param_groups"][0].update(lr=MakeDirectory(marker))
    )
    problem = find.verify(run / "step_3")
    assert (
        problem.startswith("optim.param_groups.0.lr does not load (UnpicklingError: ")
        and "\n" not in problem
    )
    assert not marker.exists()


def set_step(value):
    return lambda s: s["optim"]["state"]["wpe.weight"].update(step=torch.tensor(value))


# Entries the optimizer restores as saved, forged with their checksums recomputed: each made the
# run fail later blaming the user's flags, or train differently without a word.
FORGED_OPTIMIZER = {
    "step negative": (
        set_step(-5.0),
        "optim.state.wpe.weight.step is -5, not a whole number of steps in [0, 3] (meta.json's "
        "step)",
    ),
    "step huge": (
        set_step(1e30),
        "optim.state.wpe.weight.step is 1e+30, not a whole number of steps in [0, 3] (meta.json's "
        "step)",
    ),
    "step past meta.json's": (
        set_step(4.0),
        "optim.state.wpe.weight.step is 4, not a whole number of steps in [0, 3] (meta.json's "
        "step)",
    ),
    "step not whole": (
        set_step(1.5),
        "optim.state.wpe.weight.step is 1.5, not a whole number of steps in [0, 3] (meta.json's "
        "step)",
    ),
    "maximize": (
        lambda s: s["optim"]["param_groups"][0].update(maximize=True),
        "optim.param_groups.0.maximize is True, not false",
    ),
    "eps": (
        lambda s: s["optim"]["param_groups"][0].update(eps=1e30),
        "optim.param_groups.0.eps is 1e+30, not 1e-08",
    ),
    "betas not meta.json's": (
        lambda s: s["optim"]["param_groups"][0].update(betas=(0.9, 0.95)),
        "optim.param_groups.0.betas is (0.9, 0.95), not meta.json's --beta1, --beta2 (0.9, 0.999)",
    ),
    "weight decay not meta.json's": (
        lambda s: s["optim"]["param_groups"][0].update(weight_decay=3.0),
        "optim.param_groups.0.weight_decay is 3.0, not meta.json's --weight_decay (0.01) or 0",
    ),
}


@pytest.mark.parametrize("case", FORGED_OPTIMIZER)
def test_optimizer_state_that_disagrees_with_meta_json_is_skipped_for_the_previous_checkpoint(
    run, console, case
):
    """The optimizer's step and settings, restored as saved, checked against meta.json: a forged one
    is skipped in one line and the run resumes from the previous good checkpoint."""
    for step in (2, 3):  # the flags tiny()'s AdamW was made with, as a run's meta.json holds them
        meta = meta_of(run / f"step_{step}")
        meta["config"].update(beta1=0.9, beta2=0.999, weight_decay=0.01)
        (run / f"step_{step}" / "meta.json").write_text(json.dumps(meta))
        recompute_checksums(run / f"step_{step}")
    assert find.verify(run / "step_3") is None  # the honest one passes
    edit, problem = FORGED_OPTIMIZER[case]
    forge_state(run / "step_3", edit)
    assert find.verify(run / "step_3") == problem
    out, err = console()
    saver, meta = restore(run)
    assert saver.restored_from == run / "step_2" and meta["step"] == 2
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"


def test_a_metadata_file_larger_than_its_model_needs_is_refused_by_its_size(run, console):
    """DCP's .metadata had no cap: 383 MB unpickled at ~1.4 MB/s. Its cap comes from the model
    meta.json describes, and the file is refused by its size before a byte is unpickled."""
    meta = meta_of(run / "step_3")
    cap = find.metadata_cap(meta)
    honest = (run / "step_3" / ".metadata").stat().st_size
    assert honest < cap < 4 * 2**20  # a tiny model's: 33 KB, room for the rest
    with open(run / "step_3" / ".metadata", "ab") as f:  # a valid pickle, then padding
        f.truncate(cap + 1)
    recompute_checksums(run / "step_3")

    def unpickled(*_):
        raise AssertionError("the oversized .metadata was unpickled")

    original = safe_load._MetadataUnpickler.load
    safe_load._MetadataUnpickler.load = unpickled
    try:
        problem = find.verify(run / "step_3")
    finally:
        safe_load._MetadataUnpickler.load = original
    assert problem == (
        f".metadata is {cap + 1} bytes, more than the {cap} that the model meta.json describes "
        "needs"
    )
    out, err = console()
    assert find.find(args_for(run)) == run / "step_2"
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"


def test_a_raw_pickle_in_the_optimizer_entries_is_skipped_without_torchs_warnings(run, console):
    """A param group's entry that is a raw pickle (not torch.save's archive): torch's weights-only
    load warned twice about its protocol beside the one-line skip."""
    step = run / "step_3"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    index = storage(metadata, "optim.param_groups.0.lr")
    shard = step / metadata.storage_data[index].relative_path
    raw = pickle.dumps(0.1, protocol=4)
    end = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(raw)
    metadata.storage_data[index] = dataclasses.replace(
        metadata.storage_data[index], offset=end, length=len(raw)
    )
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    recompute_checksums(step)
    out, err = console()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert find.find(args_for(run)) == run / "step_2"
    assert [str(w.message) for w in warned] == []
    said = err.getvalue()
    assert (
        said.startswith(
            f"warning: skipping checkpoint {step}: optim.param_groups.0.lr does not load "
            "(UnpicklingError: "
        )
        and said.count("\n") == 1
    )


def forge_rng(step, edit):
    state = torch.load(step / "rng_0.pt", weights_only=True)
    state = edit(state) or state
    torch.save(state, step / "rng_0.pt")
    recompute_checksums(step)


FORGED_RNG = {
    "a missing key": (lambda s: s.__delitem__("python"), "rng_0.pt has no python.version"),
    "a missing inner key": (lambda s: s["numpy"].__delitem__("pos"), "rng_0.pt has no numpy.pos"),
    "a list": (lambda s: [s["torch"]], "rng_0.pt holds list, not the generators' states"),
    "torch state of floats": (
        lambda s: s.update(torch=s["torch"].float()),
        "rng_0.pt torch is not the CPU generator's bytes",
    ),
    "torch state short": (
        lambda s: s.update(torch=s["torch"][:100]),
        "rng_0.pt torch is not the CPU generator's bytes",
    ),
    "numpy keys of another length": (
        lambda s: s["numpy"].update(keys=s["numpy"]["keys"][:5]),
        "rng_0.pt numpy.keys is not 624 words of 32 bits",
    ),
    "numpy position a string": (
        lambda s: s["numpy"].update(pos="3"),
        "rng_0.pt numpy.pos is not a whole number in [0, 624]",
    ),
    "numpy gaussian a tensor": (
        lambda s: s["numpy"].update(cached_gaussian=torch.ones(2)),
        "rng_0.pt numpy.cached_gaussian is not a finite number",
    ),
    "python words out of range": (
        lambda s: s["python"].update(state=s["python"]["state"] - 2**40),
        "rng_0.pt python.state is not 624 words of 32 bits and a position",
    ),
    "python version": (
        lambda s: s["python"].update(version=2),
        "rng_0.pt python.version is not 3",
    ),
}


@pytest.mark.parametrize("case", FORGED_RNG)
def test_rng_states_that_cannot_be_restored_are_skipped_for_the_previous_checkpoint(
    run, console, case
):
    """A wrong type or a missing key in an RNG file traced back on every rank at restore, with no
    fallback: now the checkpoint is skipped in one line and the previous one restored."""
    edit, problem = FORGED_RNG[case]
    forge_rng(run / "step_3", edit)
    assert find.verify(run / "step_3") == problem
    out, err = console()
    saver, meta = restore(run)
    assert saver.restored_from == run / "step_2" and meta["step"] == 2
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"


def restore(run, *extra):
    model, optimizer = tiny(seed=1)
    cfg = flags_for(run, *extra)
    section = Checkpoint.of(cfg)
    saver = checkpointer.Checkpointer(
        section, dataclasses.asdict(cfg), TINY, None, decentralized=False
    )
    return saver, saver.restore(find.find(section), model, optimizer, cfg.seed)


def test_shards_that_fail_to_load_are_one_line_and_resume_takes_the_next_checkpoint(run, console):
    scramble_a_tensor(run / "step_3")
    assert find.verify(run / "step_3") is None  # it passes every check
    out, err = console()
    saver, meta = restore(run)
    assert saver.restored_from == run / "step_2" and meta["step"] == 2
    said = err.getvalue()
    assert (
        said.startswith(f"warning: skipping checkpoint {run / 'step_3'}: loading it failed (")
        and said.count("\n") == 1
    )
    # a checkpoint the user named: no other is taken for it
    with pytest.raises(ConfigError) as raised:
        restore(run, "--restart_checkpoint_file", str(run / "step_3"))
    assert str(raised.value).startswith(
        f"--restart_checkpoint_file {run / 'step_3'}: {run / 'step_3'}: loading it failed ("
    ) and "\n" not in str(raised.value)


def listing(directory):
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_mtime_ns, p.stat().st_size)
        for p in Path(directory).rglob("*")
    )


def test_a_run_whose_every_checkpoint_is_refused_never_starts_fresh_over_them(run, console):
    for step in (1, 2, 3):
        meta = meta_of(run / f"step_{step}")
        meta["state"]["schedule"]["last_step"] = 2**63  # not a whole number the schema accepts
        (run / f"step_{step}" / "meta.json").write_text(json.dumps(meta))
    before = listing(run)
    out, err = console()
    with pytest.raises(ConfigError) as raised:
        find.find(args_for(run))
    assert str(raised.value) == (
        f"every checkpoint of {run} is refused (the lines above say why), and a fresh start would "
        "save over them: nothing was changed there; repair or move them away, pick one with "
        "--restart_checkpoint_file, or train under another --run_name"
    )
    assert err.getvalue().count("warning: skipping checkpoint") == 3 and listing(run) == before
    scramble_a_tensor(run / "step_1")  # and when the last one left fails to load
    for step in (1, 2, 3):
        meta = meta_of(run / f"step_{step}")
        meta["state"]["schedule"]["last_step"] = 9
        (run / f"step_{step}" / "meta.json").write_text(json.dumps(meta))
        recompute_checksums(run / f"step_{step}")
    for step in (2, 3):
        scramble_a_tensor(run / f"step_{step}")
    with pytest.raises(ConfigError) as raised:
        restore(run)
    assert str(raised.value).startswith(f"every checkpoint of {run} is refused")


# ---- numbers that cannot round-trip ----


def test_every_whole_number_flag_has_the_range_its_checkpoint_accepts():
    whole = {f.name for f in dataclasses.fields(Config) if f.type in (int, "int")}
    assert whole <= set(WHOLE_RANGES)  # a new flag gets its range, or this fails
    for flag in (
        "max_steps",
        "lr_decay_steps",
        "max_epochs",
        "warmup_steps",
        "checkpoint_interval",
    ):
        high = WHOLE_RANGES[flag][1]
        parse_args([f"--{flag}", str(high)])  # the highest accepted value ...
        with pytest.raises(ConfigError) as raised:
            parse_args([f"--{flag}", str(high + 1)])  # ... and one more, refused at startup
        assert str(raised.value).startswith(f"--{flag} must be a whole number in [")


def test_the_largest_values_a_run_accepts_are_read_back_from_its_checkpoint(run):
    meta = meta_of(run / "step_3")
    highest = {name: high for name, (_, high) in WHOLE_RANGES.items()}
    meta["config"].update(highest)
    meta["state"]["schedule"] = {
        "lr_decay_steps": highest["lr_decay_steps"],
        "last_step": highest["max_steps"],
    }
    (run / "step_3" / "meta.json").write_text(json.dumps(meta))
    assert read_meta(run / "step_3")["config"]["max_steps"] == highest["max_steps"]
    meta["config"]["max_steps"] += 1
    (run / "step_3" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(MetaError):
        read_meta(run / "step_3")


# ---- step directories are real directories of the run, named by their step ----


def test_a_step_directory_that_is_a_link_or_a_renamed_copy_is_never_used(run, tmp_path, console):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    (run / "step_30").symlink_to(other / "step_2")  # another run's model
    (run / "step_20").symlink_to(run / "step_2")  # this run's older checkpoint: a silent roll-back
    (run / "latest").write_text("step_30\n")
    out, err = console()
    assert (
        find.verify(run / "step_30") == "step_30 is a symbolic link, not a checkpoint directory of "
        "this run"
    )
    assert find.find(args_for(run)) == run / "step_3"
    assert progress.newest(run)["step"] == 3
    with pytest.raises(ConfigError) as raised:
        load.open_source(str(run / "step_30"))
    assert "step_30 is a symbolic link" in str(raised.value)
    (run / "step_30").unlink()
    shutil.copytree(run / "step_2", run / "step_30")  # a copy under another step's name
    assert find.verify(run / "step_30") == "meta.json says step 2, but its directory is step_30"
    assert find.find(args_for(run)) == run / "step_3"


def test_pruning_leaves_a_linked_step_directory_and_what_it_points_to(run, tmp_path):
    shutil.copytree(run / "step_1", tmp_path / "elsewhere")
    (run / "step_0").symlink_to(tmp_path / "elsewhere")
    model, optimizer = tiny()
    meta = {
        k: v for k, v in meta_of(run / "step_3").items() if k not in ("step", "world_size", "files")
    }
    # commits, prunes, reports no failure
    checkpointer.save(run, 4, model, optimizer, meta, keep_last=1)
    assert (run / "step_0").is_symlink() and (tmp_path / "elsewhere" / "meta.json").exists()
    assert find.marker(run, "latest") == run / "step_4"


# ---- the run lock: never read, followed or waited on when it is not a lock file ----


def bounded(function, seconds=60):
    outcome = []

    def call():
        try:
            outcome.append(function())
        except Exception as e:  # noqa: BLE001 - the test looks at it
            outcome.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("kind", ["a FIFO", "a symbolic link", "a directory"])
def test_a_lock_file_that_is_not_one_is_refused_in_one_line_without_blocking(tmp_path, kind):
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    {
        "a FIFO": lambda: os.mkfifo(lock),
        "a symbolic link": lambda: lock.symlink_to("/dev/zero"),
        "a directory": lock.mkdir,
    }[kind]()
    error = bounded(lambda: run_lock.RunLock({"--checkpoint_dir": lock.parent}).acquire(wait=0))
    assert isinstance(error, run_lock.LockError) and str(error) == (
        f"--checkpoint_dir: the run lock {lock} is {kind}, not a lock file this program wrote: "
        "remove it if no training run uses this directory"
    )


def test_a_stale_lock_that_cannot_be_taken_over_is_one_line(tmp_path, monkeypatch):
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    os.utime(lock, (1, 1))  # silent for decades

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(files.os, "replace", refuse)  # an immutable run directory (chattr +i)
    with pytest.raises(run_lock.LockError) as raised:
        run_lock.RunLock({"--checkpoint_dir": lock.parent}).acquire(wait=0)
    assert str(raised.value) == (
        f"--checkpoint_dir: cannot take over the stale lock {lock} of a run that ended "
        "(host elsewhere, pid 1, started None): Operation not permitted"
    )


def test_leftovers_of_killed_writers_are_removed_once_the_lock_is_held(run):
    (run / ".latest.tmp4242").write_text("step_3\n")
    (run / ".lock.stale-0123abcd").write_text("{}")
    (run / ".tmp-step_7").mkdir()
    # a prune that died after its rename...
    shutil.copytree(run / "step_2", run / ".tmp-old-step_2")
    # ... or a save that died between its two renames
    shutil.move(run / "step_1", run / ".tmp-old-step_1")
    keep = run / "notes.tmp"
    keep.write_text("not ours")
    lock = run_lock.RunLock({"--checkpoint_dir": run})
    lock.acquire(wait=0)
    try:
        names = sorted(p.name for p in run.iterdir())
        assert names == [".lock", "best", "latest", "notes.tmp", "step_1", "step_2", "step_3"]
        assert find.verify(run / "step_1") is None  # put back whole
    finally:
        lock.release()


# ---- a full disk, or a file size limit, named as such ----

FILE_SIZE_LIMIT = """
import resource, signal
from pathlib import Path
import torch
import torch.distributed as dist
from minimal_fsdp.checkpoint import checkpointer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
# A tensor larger than the limit: torch.save writes it straight into the file, and its zip writer \
reports the
# failed write as "[enforce fail at inline_container.cc:672] . unexpected pos ...", the OS's \
reason lost.
resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    checkpointer.save(Path({run!r}), 1, None, None, {{"format": 2}}, state={{"model": {{"w": \
torch.zeros(2**20)}}}})
except checkpointer.SaveError as e:
    print(e)
"""


@pytest.mark.slow  # a second Python that saves under a file size limit
def test_a_write_past_the_file_size_limit_is_named_not_torchs_zip_error(tmp_path):
    script = FILE_SIZE_LIMIT.format(run=str(tmp_path / "run"))
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.stdout == (
        f"writing checkpoint {tmp_path / 'run' / 'step_1'} failed (rank 0: File too large (over "
        "this process's file size limit, ulimit -f): "
        f"{tmp_path / 'run' / '.tmp-step_1'}); the previous checkpoint is untouched\n"
    ), result.stdout + result.stderr

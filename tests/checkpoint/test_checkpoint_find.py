"""checkpoint/find.py and checkpoint/meta.py: what verify() finds wrong with a damaged or crafted
checkpoint (each hostile field of meta.json, files that are not regular or lie outside the
checkpoint, a model the shards do not hold, sizes and checksums), the markers and the order
checkpoints are tried in, resolve(), find() as one rank of two, the format-1 meta.json, and the
`progress` command line of the job chains."""

import dataclasses
import json
import os
import pickle
import shutil
import sys
import threading

import pytest
import torch.distributed as dist

from minimal_fsdp.__main__ import main as cli
from minimal_fsdp.checkpoint import find, safe_load
from minimal_fsdp.checkpoint.meta import MAX_BYTES, MetaError, read_meta
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.config.sections import Checkpoint
from minimal_fsdp.launch import failures

from support import (  # noqa: F401 (fixtures)
    HOSTILE_META,
    MakeDirectory,
    command,
    console,
    edited,
    flip_a_byte,
    meta_of,
    run,
    saved,
)

pytestmark = pytest.mark.usefixtures("one_rank_group")


# ---- verify: one line on what is wrong ----


def test_verify_names_what_is_wrong_with_meta_json(run):
    assert find.verify(run / "step_9") == "no such directory"
    meta = run / "step_3" / "meta.json"
    for text, problem in [
        ("[1, 2]", "meta.json holds a JSON list, not an object"),
        ("{}", "meta.json has no step"),
        ('{"step": "3"}', 'meta.json: step is "3", not a whole number >= 0'),
        ('{"step": 3, "wor', "meta.json is not JSON (JSONDecodeError: Unterminated string"),
    ]:
        meta.write_text(text)
        assert find.verify(run / "step_3").startswith(problem)
    meta.unlink()
    assert find.verify(run / "step_3") == "meta.json is missing or unreadable"


@pytest.mark.parametrize("case", HOSTILE_META)
def test_a_hostile_meta_json_makes_its_checkpoint_damaged_in_one_line(run, console, case):
    edit, problem = HOSTILE_META[case]
    edited(run / "step_3", edit)
    assert find.verify(run / "step_3") == problem
    out, err = console()
    # the newest good one instead, with one line
    assert find.latest(run) == run / "step_2"
    assert err.getvalue() == f"warning: skipping checkpoint {run / 'step_3'}: {problem}\n"
    # what progress would count
    assert find.newest_complete(run, checksums=False) == run / "step_2"


def test_a_deeply_nested_or_oversized_meta_json_is_refused_unread(run):
    meta = run / "step_3" / "meta.json"
    meta.write_text('{"step": 3, "model": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert find.verify(run / "step_3") == "meta.json nests deeper than 32 levels"
    meta.write_text('{"step": 3, "x": "' + "[" * 200_000 + '"}')  # brackets in a string do not nest
    assert find.verify(run / "step_3") == "meta.json has no model"
    with open(meta, "r+b") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: no disk used
    assert find.verify(run / "step_3") == (
        f"meta.json is missing or unreadable ({MAX_BYTES + 1} bytes, over {MAX_BYTES})"
    )


def test_a_deeply_nested_tokenizer_json_makes_its_checkpoint_damaged(run):
    (run / "step_3" / "tokenizer.json").write_text(
        '{"vocab": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    assert (
        find.verify(run / "step_3", checksums=False) == "tokenizer.json nests deeper than 32 levels"
    )


def bounded(function, seconds=60):
    """function() in a thread: its result, or a failure if it is still running after `seconds` (a
    hang)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    return result[0]


@pytest.mark.parametrize(
    "name", ["meta.json", ".metadata", "__0_0.distcp", "rng_0.pt", "tokenizer.json"]
)
@pytest.mark.parametrize("kind", ["fifo", "link to a device", "link inside"])
def test_files_that_are_not_regular_are_never_read(run, name, kind):
    step = run / "step_3"
    file = step / name
    file.rename(step / "moved")
    if kind == "fifo":
        os.mkfifo(file)  # opening it for reading would wait for a writer forever
    else:
        file.symlink_to("/dev/zero" if kind == "link to a device" else step / "moved")
    problem = bounded(lambda: find.verify(step))
    assert problem is not None and "regular file" in problem, problem
    assert bounded(lambda: find.latest(run)) == run / "step_2"


def test_metadata_naming_a_shard_outside_the_checkpoint_is_refused(run):
    step = run / "step_3"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path="../step_2/__0_0.distcp")
    }
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    assert find.verify(step, checksums=False) == (
        ".metadata names a shard '../step_2/__0_0.distcp' that is "
        "not a plain file name inside the checkpoint"
    )


def test_verify_reports_crafted_metadata_in_one_bounded_line(run):
    step = run / "step_3"
    (step / ".metadata").write_bytes(pickle.dumps(MakeDirectory(run / "code-ran")))
    assert find.verify(step) == (
        ".metadata is missing or unreadable (UnpicklingError: checkpoint metadata "
        "refers to posix.mkdir, which is not allowed)"
    )
    (step / ".metadata").write_bytes(b"c" + b"m" * 200 + b"\nx\n.")
    problem = find.verify(step)
    assert (
        problem
        == ".metadata is missing or unreadable (UnpicklingError: "
        + ("checkpoint metadata refers to " + "m" * 200)[:120]
        + ")"
    )
    assert not (run / "code-ran").exists()


def test_verify_finds_a_truncated_shard_whatever_order_the_metadata_lists_it_in(run):
    step = run / "step_3"
    shard = step / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-1])
    assert find.verify(step) == f"__0_0.distcp is truncated ({size - 1} of {size} bytes)"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    metadata.storage_data = dict(reversed(list(metadata.storage_data.items())))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    assert (
        find.verify(step, checksums=False)
        == f"__0_0.distcp is truncated ({size - 1} of {size} bytes)"
    )
    shard.unlink()
    assert find.verify(step) == "__0_0.distcp is missing"


def test_verify_needs_no_bytes_for_an_empty_byte_range(run):
    step = run / "step_3"
    metadata = safe_load.read_dcp_metadata(step / ".metadata")
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[dataclasses.replace(index, fqn="unused")] = dataclasses.replace(
        info, relative_path="__9_0.distcp", offset=0, length=0
    )
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    (step / "__9_0.distcp").write_bytes(b"")
    assert find.verify(step, checksums=False) is None


def test_verify_checks_every_ranks_rng_file(run):
    (run / "step_3" / "rng_0.pt").unlink()
    assert find.verify(run / "step_3") == "rng_0.pt: No such file or directory"
    assert (
        find.verify(run / "step_3", checksums=False)
        == "rng_0.pt is missing or unreadable (FileNotFoundError)"
    )


def test_verify_checks_sizes_and_checksums_unless_told_not_to(run):
    step = run / "step_3"
    flip_a_byte(step / "__0_0.distcp")
    problem = "__0_0.distcp does not match its checksum: the file was damaged after it was saved"
    assert find.verify(step) == problem
    assert find.verify(step, checksums=False) is None
    # The reading shared by two processes: sorted names .metadata, __0_0.distcp,
    # rng_0.pt, tokenizer.json.
    assert find.verify(step, share=(0, 2)) is None and find.verify(step, share=(1, 2)) == problem
    step = run / "step_2"
    size = (step / "tokenizer.json").stat().st_size
    with open(step / "tokenizer.json", "a") as f:
        f.write(" ")
    assert find.verify(step) == f"tokenizer.json has {size + 1} bytes, {size} when saved"
    (step / "tokenizer.json").unlink()
    assert find.verify(step) == "tokenizer.json: No such file or directory"
    assert find.verify(step, checksums=False) is None


def test_verify_accepts_a_checkpoint_from_before_checksums_and_world_size(run):
    step = run / "step_3"
    meta = meta_of(step)
    (step / "meta.json").write_text(
        json.dumps(
            {
                "step": 3,
                "val_loss": meta["val_loss"],
                "model": meta["model"],
                "config": meta["config"],
            }
        )
    )  # format 1
    (step / "rng_0.pt").unlink()
    flip_a_byte(step / "__0_0.distcp")
    assert find.verify(step) is None


# ---- markers, the order checkpoints are tried in ----


def test_step_dirs_are_numbered_directories_newest_first(tmp_path):
    for name in ["step_9", "step_10", "step_2", "step_x", "step_3.old"]:
        (tmp_path / name).mkdir()
    (tmp_path / "step_11").write_text("a file")
    assert find.step_dirs(tmp_path) == [
        tmp_path / "step_10",
        tmp_path / "step_9",
        tmp_path / "step_2",
    ]


def test_candidates_start_at_latest_then_older_then_newer(tmp_path):
    for step in range(1, 5):
        (tmp_path / f"step_{step}").mkdir()
    assert find.candidates(tmp_path) == [tmp_path / f"step_{s}" for s in (4, 3, 2, 1)]
    (tmp_path / "latest").write_text("step_2\n")
    assert find.candidates(tmp_path) == [tmp_path / f"step_{s}" for s in (2, 1, 4, 3)]


def test_a_bad_marker_is_ignored_with_one_flushed_warning(tmp_path, console):
    out, err = console()
    marker = tmp_path / "latest"
    for data in [b"\xff\xfe\n", b"../other_run/step_3\n", b"step_3 and more"]:
        marker.write_bytes(data)
        assert find.marker(tmp_path, "latest") is None
        assert (
            err.flushed
            == f"warning: ignoring {marker}: it does not name a step_<N> checkpoint of this run\n"
        )
        assert out.getvalue() == ""
        err.seek(0), err.truncate(), err.flush()
    marker.write_text("  step_3\n")
    assert find.marker(tmp_path, "latest") == tmp_path / "step_3"
    assert find.marker(tmp_path, "best") is None
    assert err.getvalue() == ""


def test_latest_skips_damaged_checkpoints_with_a_line_each(run, console):
    out, err = console()
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    assert find.latest(run) == run / "step_2"
    assert err.flushed == (
        f"warning: skipping checkpoint {run / 'step_3'}: __0_0.distcp does not match its "
        "checksum: the file was damaged after it was saved\n"
    )
    assert find.newest_complete(run, checksums=False) == run / "step_3"
    for step in (1, 2):
        (run / f"step_{step}" / "rng_0.pt").unlink()
    assert find.latest(run) is None
    assert find.latest(run.parent / "no_such_run") is None


def test_resolve_accepts_a_checkpoint_a_marker_or_a_run(run, console):
    out, err = console()
    assert find.resolve(run / "step_2") == run / "step_2"
    assert find.resolve(run / "best") == run / "step_2"
    assert find.resolve(run) == run / "step_3"
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    # the cheap checks: the caller verifies the checksums
    assert find.resolve(run) == run / "step_3"
    (run / "step_3" / "rng_0.pt").unlink()
    assert find.resolve(run) == run / "step_2"
    (run / "latest").unlink()
    assert find.resolve(run) == run / "step_2"
    assert find.resolve(run.parent / "nothing") == run.parent / "nothing"
    (run.parent / "empty").mkdir()
    assert find.resolve(run.parent / "empty") == run.parent / "empty"
    # meta.json makes a checkpoint, whatever else is there
    shutil.copytree(run / "step_1", run / "step_2" / "step_1")
    (run / "step_2" / "latest").write_text("step_1\n")
    assert find.resolve(run / "step_2") == run / "step_2"


def test_resolve_refuses_a_file_that_is_not_a_marker_in_one_line(run, console):
    out, err = console()
    (run / "notes.txt").write_text("step 3 was good")
    with pytest.raises(ConfigError) as raised:
        find.resolve(run / "notes.txt")
    assert str(raised.value) == (
        f"{run / 'notes.txt'} is a file but not a checkpoint marker (one line naming a "
        "step_<N> directory beside it): pass a step_<N> directory, a run directory or its "
        "latest/best marker"
    )
    assert err.getvalue() == ""


def test_resolve_of_a_run_with_nothing_complete_says_why_and_returns_the_run(tmp_path, console):
    out, err = console()
    (tmp_path / "latest").write_text("step_4\n")
    assert find.resolve(tmp_path) == tmp_path
    assert (
        err.getvalue() == f"warning: skipping checkpoint {tmp_path / 'step_4'}: no such directory\n"
    )


# ---- find: the checkpoint a run starts from ----


def args_for(run, *extra):
    """The checkpoint flags (find.find's) of a run in `run`."""
    flags = parse_args(["--checkpoint_dir", str(run.parent), "--run_name", run.name, *extra])
    return Checkpoint.of(flags)


def test_find_skips_a_checkpoint_whose_checksums_fail(run, console):
    out, err = console()
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    assert find.find(args_for(run)) == run / "step_2"
    assert err.getvalue() == (
        f"warning: skipping checkpoint {run / 'step_3'}: __0_0.distcp does not match "
        "its checksum: the file was damaged after it was saved\n"
    )


def test_find_refuses_a_damaged_restart_checkpoint_in_one_line(run):
    flip_a_byte(run / "step_3" / "__0_0.distcp")
    with pytest.raises(ConfigError) as raised:
        find.find(args_for(run, "--restart_checkpoint_file", str(run / "latest")))
    assert str(raised.value) == (
        f"--restart_checkpoint_file {run / 'latest'} is damaged: {run / 'step_3'}: "
        "__0_0.distcp does not match its checksum: the file was damaged after it was saved"
    )
    (run / "step_2" / "rng_0.pt").unlink()
    with pytest.raises(ConfigError) as raised:
        find.find(args_for(run, "--restart_checkpoint_file", str(run / "step_2")))
    assert str(raised.value) == (
        f"--restart_checkpoint_file {run / 'step_2'} is not a complete checkpoint: "
        f"{run / 'step_2'}: rng_0.pt is missing or unreadable (FileNotFoundError)"
    )


def test_resume_never_refuses_a_run_with_checkpoints_in_one_line(run):
    with pytest.raises(ConfigError) as raised:
        find.find(args_for(run, "--resume", "never"))
    assert str(raised.value) == (
        f"--resume never, but {run} already holds checkpoints: pick another --run_name, "
        "move that directory away, or resume from it with --resume auto"
    )


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
def test_find_in_one_process_reads_every_checksum(run, monkeypatch, damaged):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    step = run / "step_3"
    if damaged == ".metadata":  # still readable, but not the bytes that were saved
        (step / ".metadata").write_bytes(
            pickle.dumps(safe_load.read_dcp_metadata(step / ".metadata"), protocol=2)
        )
    else:
        flip_a_byte(step / damaged)
    assert find.find(args_for(run)) == run / "step_2"


@pytest.mark.parametrize("damaged,rank_0_reads_it", [("__0_0.distcp", False), ("rng_0.pt", True)])
def test_find_as_rank_1_of_2_reads_its_share_and_takes_rank_0s_list(
    run, monkeypatch, console, damaged, rank_0_reads_it
):
    """Rank 0 lists the candidates and passes them on (run_on_main); each rank reads every other
    file's checksum (rank 1: the 2nd and 4th of .metadata, __0_0.distcp, rng_0.pt, tokenizer.json);
    the verdicts are gathered."""
    out, err = console()
    flip_a_byte(run / "step_3" / damaged)
    listed, sent = [], []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def run_on_main(fn, *args):
        listed.append(fn(*args))
        return listed[-1]

    checked, verify = [], find.verify

    def verify_noting(path, *args, **kwargs):
        checked.append(path)
        return verify(path, *args, **kwargs)

    # rank 0's verdict on its share of the checkpoint being checked, then ours
    def all_gather_object(out, mine):
        sent.append(mine)
        out[:] = [verify(checked[-1], share=(0, 2)), mine]

    monkeypatch.setattr(find, "verify", verify_noting)
    monkeypatch.setattr(failures, "run_on_main", run_on_main)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert find.find(args_for(run)) == run / "step_2"
    assert listed == [[str(run / f"step_{s}") for s in (3, 2, 1)]]
    problem = f"{damaged} does not match its checksum: the file was damaged after it was saved"
    assert sent == ([None, None] if rank_0_reads_it else [problem, None])
    assert err.getvalue() == ""  # rank 0 reports it


# ---- format-1 meta.json (before "format" existed) ----


def written_and_read(tmp_path, meta):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return read_meta(tmp_path)


def test_read_meta_keeps_the_current_format_as_it_is(tmp_path):
    meta = {"format": 2, "step": 3, "lr_decay_steps": 5, "state": {"x": 1}}
    assert written_and_read(tmp_path, meta) == meta
    with pytest.raises(MetaError, match="^meta.json holds a JSON list, not an object$"):
        written_and_read(tmp_path, [1, 2])


def test_read_meta_moves_format_1s_state_into_place(tmp_path):
    meta = {
        "step": 7,
        "world_size": 2,
        "config": {"batch_size": 3, "grad_accum_steps": 5},
        "lr_decay_steps": 90,
        "last_step": 100,
        "val_loss": 1.5,
        "data_position": {"train_blocks_seen": 11},
    }
    assert written_and_read(tmp_path, meta) == dict(
        meta,
        format=2,
        model_type="gpt",
        state={
            "schedule": {"lr_decay_steps": 90, "last_step": 100},
            "data": {"train_blocks_seen": 11},
        },
    )
    assert written_and_read(tmp_path, dict(meta, model_type="llama"))["model_type"] == "llama"


def test_read_meta_counts_format_1s_train_position_from_what_it_kept(tmp_path):
    def seen(**meta):
        return written_and_read(tmp_path, meta)["state"]["data"]

    config = {"batch_size": 3, "grad_accum_steps": 5}
    assert seen(step=7, world_size=2, train_batches=11, config=config) == {
        "train_blocks_seen": 2 * 3 * 11
    }
    assert seen(step=7, world_size=2, config=config) == {"train_blocks_seen": 2 * 3 * 7 * 5}
    assert seen(step=7, config=None) == {"train_blocks_seen": 7}
    assert seen(step=7) == {"train_blocks_seen": 7}
    with pytest.raises(MetaError, match="^meta.json has no step$"):
        seen()
    with pytest.raises(MetaError, match='^meta.json: config.batch_size is "3", not a whole number'):
        seen(step=7, world_size=2, config={"batch_size": "3"})
    assert written_and_read(tmp_path, {"step": 7})["state"]["schedule"] == {
        "lr_decay_steps": None,
        "last_step": None,
    }


# ---- `minimal-fsdp progress` (the job chains; tools/progress.py) ----


def test_progress_prints_step_and_last_step_of_the_newest_complete_checkpoint(
    run, console, monkeypatch
):
    out, err = console()
    flags = ["--checkpoint_dir", str(run.parent), "--run_name", run.name]
    flip_a_byte(run / "step_3" / "__0_0.distcp")  # only the cheap checks: the chains ask often
    command("progress", *flags)
    (run / "step_3" / "rng_0.pt").unlink()
    monkeypatch.setattr(sys, "argv", ["minimal-fsdp", "progress", *flags])
    cli()  # the console script: the flags from sys.argv
    command("progress", *["--checkpoint_dir", str(run.parent), "--run_name", "other"])
    meta = meta_of(run / "step_2")
    del meta["format"], meta["state"]
    (run / "step_2" / "meta.json").write_text(json.dumps(dict(meta, last_step=50)))  # format 1
    command("progress", *flags)
    assert out.getvalue() == "3 100\n2 none\n0 none\n2 50\n"

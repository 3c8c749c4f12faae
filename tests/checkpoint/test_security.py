"""What a hostile or damaged file, a second run, or a careless value can do: no code runs from a
checkpoint, one run per run directory, damage is found before loading, every save failure and bad
value is one line."""

import copyreg
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from minimal_fsdp.checkpoint import find, safe_load
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.hf import hub
from minimal_fsdp.launch import run_lock

from conftest import ROOT, TINY_MODEL, launch, launch_runs, make_text
from faults import launch_with_faults
from support import command

# ---- a corpus of hostile pickles: none may run, every one is refused ----


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory):
    """A genuine DCP checkpoint (tensors and a non-tensor entry), saved in this process."""
    path = tmp_path_factory.mktemp("dcp")
    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "optim": {"lr": 0.1},
    }
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, safe_load.read_dcp_metadata(path / ".metadata")


class Reduce:
    """Pickles as a call of `function(*args)`, whatever pickle protocol."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def hostile(marker):
    """(label, bytes) of pickles that try to run `touch marker`, each a different way in."""
    cmd = f"touch {marker}"
    text = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()  # noqa: E731 - SHORT_BINUNICODE
    payloads = []
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        for function, args in (
            (os.system, (cmd,)),
            (eval, (f"__import__('os').system({cmd!r})",)),
            (exec, (f"import os; os.system({cmd!r})",)),
            (subprocess.call, (cmd.split(),)),
        ):
            payloads.append(
                (
                    f"REDUCE {function.__name__} p{protocol}",
                    pickle.dumps(Reduce(function, *args), protocol=protocol),
                )
            )
    payloads += [
        # The payload: protocol 4 resolves a dotted name attribute by attribute.
        (
            "STACK_GLOBAL dotted",
            b"\x80\x04"
            + text("torch.distributed.checkpoint.filesystem")
            + text("os.system")
            + b"\x93"
            + text(cmd)
            + b"\x85R.",
        ),
        (
            "STACK_GLOBAL dotted from an allowed class",
            b"\x80\x04"
            + text("torch.distributed.checkpoint.metadata")
            + text("Metadata.__init__.__globals__")
            + b"\x93.",
        ),
        (
            "GLOBAL dotted",
            f"ctorch.distributed.checkpoint.filesystem\nos.system\n(V{cmd}\ntR.".encode(),
        ),
        (
            "GLOBAL getattr + __import__",
            f"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V{cmd}\ntR.".encode(),
        ),
        ("INST", f"(V{cmd}\nios\nsystem\n.".encode()),
        ("OBJ", f"(cos\nsystem\nV{cmd}\no.".encode()),
        ("NEWOBJ", b"\x80\x02cposix\nsystem\n)\x81."),
        ("NEWOBJ_EX", b"\x80\x04" + text("subprocess") + text("Popen") + b"\x93)}\x92."),
        (
            "BUILD on an allowed class",
            b"\x80\x04"
            + text("torch.distributed.checkpoint.metadata")
            + text("Metadata")
            + b"\x93N}"
            + text("__eq__")
            + text("x")
            + b"s\x86b.",
        ),
        (
            "REDUCE on an allowed class with junk",
            b"\x80\x04" + text("torch") + text("Size") + b"\x93" + text(cmd) + b"\x85R.",
        ),
        ("persistent id", b"Pos.system\n."),
        (
            "getattr of an allowed class",
            b"\x80\x04"
            + text("builtins")
            + text("getattr")
            + b"\x93"
            + text("torch.distributed.checkpoint.metadata")
            + text("Metadata")
            + b"\x93"
            + text("__init__")
            + b"\x86R.",
        ),
    ]
    return payloads


def test_hostile_pickles_never_run(tmp_path):
    marker = tmp_path / "pwned"
    # EXT opcodes reach find_class through the extension registry
    copyreg.add_extension("os", "system", 0xF0)
    try:
        corpus = hostile(marker) + [("EXT1", b"\x80\x02\x82\xf0.")]
        for label, payload in corpus:
            path = tmp_path / "metadata"
            path.write_bytes(payload)
            with pytest.raises(Exception):  # noqa: B017 - refused in any way at all, never run
                safe_load.read_dcp_metadata(path)
            assert not marker.exists(), label
    finally:
        copyreg.remove_extension("os", "system", 0xF0)
    # BUILD could not set attributes on an allowed class
    assert callable(dcp_metadata.Metadata.__eq__)


def test_hostile_payload_nested_in_valid_metadata_is_refused(tmp_path, real_metadata):
    """A real Metadata with a payload hidden inside it, pickled with every protocol."""
    _, metadata = real_metadata
    marker = tmp_path / "pwned"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        tampered = pickle.loads(pickle.dumps(metadata))
        tampered.planner_data = {"model.w": Reduce(os.system, f"touch {marker}")}
        path = tmp_path / f"metadata{protocol}"
        path.write_bytes(pickle.dumps(tampered, protocol=protocol))
        with pytest.raises(pickle.UnpicklingError, match="not allowed"):
            safe_load.read_dcp_metadata(path)
        assert not marker.exists()


def test_an_enum_member_pickled_as_getattr_loads(tmp_path):
    """Python 3.11.2 pickles an Enum member as builtins.getattr(cls, name): that one getattr is
    allowed."""
    text = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()  # noqa: E731
    path = tmp_path / "metadata"
    path.write_bytes(
        b"\x80\x04"
        + text("builtins")
        + text("getattr")
        + b"\x93"
        + text(dcp_metadata.__name__)
        + text("_MEM_FORMAT_ENCODING")
        + b"\x93"
        + text("TORCH_CONTIGUOUS_FORMAT")
        + b"\x86R."
    )
    assert (
        safe_load.read_dcp_metadata(path)
        is dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    )


def test_genuine_metadata_loads_in_every_protocol_from_2(tmp_path, real_metadata):
    """DCP writes protocol 4 or 5 (pickle's default). Protocols 0 and 1 rebuild objects through
    copyreg._reconstructor, which stays off the list."""
    directory, metadata = real_metadata
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"metadata{protocol}"
        path.write_bytes(pickle.dumps(metadata, protocol=protocol))
        assert safe_load.read_dcp_metadata(path) == metadata
    assert {"model.w", "model.b", "optim.lr"} <= set(metadata.state_dict_metadata)


# ---- runs through the entry point ----


def train_args(run_name="run", steps=4, extra=(), corpus="corpus.txt"):
    """A tiny run's flags, with checkpoints every 2 steps."""
    return [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--max_steps",
        steps,
        "--eval_interval",
        0,
        "--log_interval",
        1,
        "--checkpoint_interval",
        2,
        "--run_name",
        run_name,
        *extra,
    ]


def train(work, run_name="run", steps=4, ranks=2, extra=(), check=True, faults=None):
    """A tiny run in `work` with checkpoints every 2 steps."""
    args = train_args(run_name, steps, extra)
    if faults:
        return launch_with_faults(
            args, faults=faults, ranks=ranks, cwd=work, check=check, timeout=180
        )
    return launch(args, ranks=ranks, cwd=work, check=check, timeout=180)


def one_error(result, code=2):
    assert result.returncode == code, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def plant_payload(step_dir, marker):
    """The issue's attack: a dotted-name global prepended to a real .metadata."""
    path = step_dir / ".metadata"
    original = path.read_bytes()
    text = lambda s: b"\x8c" + bytes([len(s)]) + s.encode()  # noqa: E731
    path.write_bytes(
        b"\x80\x04"
        + text("torch.distributed.checkpoint.filesystem")
        + text("os.system")
        + b"\x93"
        + text(f"touch {marker}")
        + b"\x85R0"
        + original[2:]
    )


def losses(work, run_name):
    rows = (work / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows) if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A 2-rank run of 6 steps with checkpoints at steps 2, 4 and 6, its prepared data and its
    logs."""
    work = tmp_path_factory.mktemp("straight")
    (work / "corpus.txt").write_text(make_text())
    train(work, run_name="straight", steps=6)
    return work


@pytest.fixture
def trained(tmp_path, straight):
    """A copy of the straight run's first 4 steps as run "run" in tmp_path (`latest` names
    step_4)."""
    for name in ("corpus.txt", "data"):
        (shutil.copytree if (straight / name).is_dir() else shutil.copy)(
            straight / name, tmp_path / name
        )
    run = tmp_path / "checkpoints" / "run"
    run.mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(
            straight / "checkpoints" / "straight" / f"step_{step}", run / f"step_{step}"
        )
    (run / "latest").write_text("step_4\n")
    return run


@pytest.mark.slow
def test_crafted_checkpoint_runs_nothing_anywhere(tmp_path, trained):
    marker = tmp_path / "pwned"
    plant_payload(trained / "step_4", marker)
    export = subprocess.run(
        [
            sys.executable,
            "-m",
            "minimal_fsdp",
            "export",
            str(trained / "step_4"),
            str(tmp_path / "o"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert "not allowed" in one_error(export)
    restart = launch(
        ["--restart_checkpoint_file", trained / "step_4", "--max_steps", 6, "--run_name", "other"],
        cwd=tmp_path,
        check=False,
    )
    assert "not a complete checkpoint" in one_error(restart)
    # A generation, then the resumed run, one after the other in one launch. The resumed run names
    # its checkpoint directory by its absolute path, so that what it prints is told apart from what
    # the generation prints.
    sample_then_resumed = launch_runs(
        [
            ["--max_epochs", "-1", "--num_tokens", "5", "--run_name", "run"],
            train_args(steps=6, extra=["--checkpoint_dir", tmp_path / "checkpoints"]),
        ],
        cwd=tmp_path,
        timeout=180,
    )
    assert "generating from checkpoints/run/step_2" in sample_then_resumed.stdout
    assert f"resuming from {trained}/step_2" in sample_then_resumed.stdout
    assert f"skipping checkpoint {trained}/step_4" in sample_then_resumed.stderr
    assert not marker.exists()


def module(*args, cwd):
    """`python -m <args>` in cwd; the timeout only guards against a hang."""
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
    )


@pytest.mark.slow
def test_a_hostile_meta_json_is_skipped_in_one_line_by_resume_sample_export_and_progress(
    tmp_path, trained, single_process, capfd
):
    """The issue's two hangs: sample built a model of a million layers; a `files` entry naming a
    device outside the checkpoint was read forever. Now the newest good checkpoint is used, with one
    line naming the bad one."""
    meta = json.loads((trained / "step_4" / "meta.json").read_text())
    meta["model"]["num_layers"] = 10**6
    meta["files"]["/dev/zero"] = [1, 0]
    (trained / "step_4" / "meta.json").write_text(json.dumps(meta))
    skipped = (
        'warning: skipping checkpoint checkpoints/run/step_4: meta.json: files names "/dev/zero", '
        'not a plain file name inside the checkpoint'
    )
    # The sample command's main in this process (single_process: a world of one in tmp_path); it
    # returns (exit 0).
    capfd.readouterr()
    command("sample", *["checkpoints/run", "--num_tokens", "5"])
    sample = SimpleNamespace(stderr=capfd.readouterr().err)
    assert "generating from checkpoints/run/step_2" in sample.stderr, sample.stderr
    assert [line for line in sample.stderr.splitlines() if "step_4" in line] == [skipped]
    export = module(
        "minimal_fsdp", "export", "checkpoints/run/step_4", tmp_path / "out", cwd=tmp_path
    )
    assert one_error(export) == (
        "error: checkpoints/run/step_4 is not a complete checkpoint: checkpoints/run/step_4: "
        + skipped.split(": ", 2)[2]
    )
    progress = module("minimal_fsdp", "progress", "--run_name", "run", cwd=tmp_path)  # job chains'
    assert (progress.returncode, progress.stdout, progress.stderr) == (0, "2 6\n", skipped + "\n")
    resumed = train(tmp_path, steps=6)
    assert "resuming from checkpoints/run/step_2" in resumed.stdout
    assert [line for line in resumed.stderr.splitlines() if "step_4" in line] == [skipped]
    assert "Traceback" not in sample.stderr + resumed.stderr


@pytest.mark.slow
def test_damaged_shard_is_found_before_loading(tmp_path, trained):
    shard = trained / "step_4" / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # 64 KiB overwritten in place: the size stays, the bytes do not
        f.seek(size // 3)
        f.write(b"\0" * min(65536, size // 3))
    # without checksums the damage passes unseen, or is seen only where it hits an entry that verify
    # reads itself (the optimizer's step counts)
    found = find.verify(trained / "step_4", checksums=False)
    assert shard.stat().st_size == size and (found is None or "does not load" in found)
    restart = launch(
        ["--restart_checkpoint_file", trained / "step_4", "--run_name", "other"],
        cwd=tmp_path,
        check=False,
    )
    # refused before loading: by the file's checksum, or by the entry verify reads from that file
    # (which rank reads which file decides which is said first)
    seen = ("__1_0.distcp does not match its checksum", "does not load (UnpicklingError")
    assert any(text in one_error(restart) for text in seen)
    resumed = train(tmp_path, steps=6)
    assert "resuming from checkpoints/run/step_2" in resumed.stdout
    assert any(text in resumed.stderr for text in seen)


@pytest.mark.slow
def test_markers_that_name_no_checkpoint_of_this_run_are_ignored(tmp_path, trained):
    (trained / "latest").write_bytes(b"\xff\xfe\x00step_4")
    result = train(tmp_path, steps=6)
    assert "ignoring checkpoints/run/latest" in result.stderr
    assert "resuming from checkpoints/run/step_4" in result.stdout
    # an absolute path: not a name beside it
    (trained / "latest").write_text(str(trained / "step_2") + "\n")
    assert find.candidates(trained)[0] == trained / "step_6"
    (trained / "latest").write_text("../other/step_6\n")
    assert find.candidates(trained)[0] == trained / "step_6"
    binary = tmp_path / "binary"
    binary.write_bytes(b"\x00\xff" * 100)
    result = launch(
        ["--restart_checkpoint_file", binary, "--run_name", "other"], cwd=tmp_path, check=False
    )
    assert "is a file but not a checkpoint marker" in one_error(result)


@pytest.mark.slow
def test_a_second_run_on_the_same_directory_refuses(tmp_path, corpus):
    """The first run pauses at step 5 (tests/faults.py) until the second one has been refused, then
    finishes."""
    args = [
        sys.executable,
        str(ROOT / "tests" / "faults.py"),
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--eval_interval",
        0,
        "--log_interval",
        1,
        "--run_name",
        "shared",
        "--max_steps",
        10,
    ]
    release = tmp_path / "release"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        MINIMAL_FSDP_FAULTS="pause@5",
        MINIMAL_FSDP_RELEASE=str(release),
    )
    lock = tmp_path / "checkpoints" / "shared" / run_lock.LOCK_NAME
    first = subprocess.Popen(
        [*map(str, args), "--checkpoint_interval", "3"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "checkpoints" / "shared" / "step_3").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        second = subprocess.run(
            [*map(str, args), "--seed", "7"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env, MINIMAL_FSDP_FAULTS=""),
        )
        assert "is in use by another training run" in one_error(second)
        release.touch()
        out, err = first.communicate(timeout=240)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    rows = [
        json.loads(line)
        for line in (tmp_path / "logs" / "shared" / "metrics.jsonl").read_text().splitlines()
    ]
    # the first run's alone, in order
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 11))
    assert (tmp_path / "checkpoints" / "shared" / "latest").read_text().strip() == "step_10"
    assert not lock.exists() and not (tmp_path / "logs" / "shared" / run_lock.LOCK_NAME).exists()


def test_a_dead_runs_lock_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / run_lock.LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": dead.pid})
    )
    lock = run_lock.RunLock({"--checkpoint_dir": run_dir})
    lock.acquire()
    assert json.loads((run_dir / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    run_lock.check_lock(run_dir)  # still ours
    lock.release()
    assert not (run_dir / run_lock.LOCK_NAME).exists()


def test_a_live_lock_of_the_same_job_is_refused(tmp_path, monkeypatch):
    """A second step of one SLURM job (or a requeued job whose first attempt lives): the job id is
    no proof that the holder ended, its live pid on this host is (test_launch_errors.py launches it
    in the full tier)."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / run_lock.LOCK_NAME).write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid, "job": "4242"})
        )
        with pytest.raises(run_lock.LockError, match="in use by another training run"):
            run_lock.RunLock({"--checkpoint_dir": run_dir}).acquire(wait=0.5)
    finally:
        holder.kill()
        holder.wait()


def test_a_live_lock_from_another_host_is_waited_for_then_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "STALE_AFTER", 2.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / run_lock.LOCK_NAME
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "99"}))
    with pytest.raises(run_lock.LockError, match="in use by another training run"):
        run_lock.RunLock({"--checkpoint_dir": run_dir}).acquire(wait=0.5)  # its heartbeat is fresh
    old = time.time() - 10
    os.utime(path, (old, old))  # silent for longer than STALE_AFTER: its run died
    lock = run_lock.RunLock({"--checkpoint_dir": run_dir})
    lock.acquire(wait=0.5)
    # someone took it over from us
    path.write_text(json.dumps({"host": "elsewhere", "token": "theirs"}))
    with pytest.raises(run_lock.LockError, match="another run took over"):
        run_lock.check_lock(run_dir)
    lock.release()
    assert path.exists()  # not ours any more: left alone


@pytest.mark.slow  # one launch each
@pytest.mark.parametrize("flag", ["--checkpoint_dir", "--log_dir"])
def test_unwritable_directories_are_found_at_startup(tmp_path, corpus, flag):
    (tmp_path / "a_file").write_text("")
    # Below a file: the flag's own path is no file (config_checks refuses that at once), yet nothing
    # can be made there.
    result = launch(
        [
            "--dataset",
            "text",
            "--input_file",
            corpus,
            *TINY_MODEL,
            flag,
            tmp_path / "a_file" / "runs",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert f"{flag}: cannot create the run directory" in one_error(result)
    assert not (tmp_path / "checkpoints").exists() or flag == "--log_dir"


@pytest.mark.slow
def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path, trained):
    result = train(tmp_path, steps=8, faults="enospc_in_save@6:1", check=False)
    line = one_error(result, code=1)
    assert "checkpoint checkpoints/run/step_6" in line and "No space left on device" in line, line
    assert "rank 1" in line and "the previous checkpoint is untouched" in line
    assert (trained / "latest").read_text().strip() == "step_4" and find.verify(
        trained / "step_4"
    ) is None
    assert not (trained / "step_6").exists() and not list(trained.glob(".tmp-*"))
    assert "resuming from checkpoints/run/step_4" in train(tmp_path, steps=8).stdout


WINDOWS = {
    "kill_after_shards": 2,
    "kill_after_meta": 2,
    "kill_after_rename": 2,
    "kill_after_latest": 4,
}


@pytest.fixture(scope="module")
def crashed_then_resumed(request, straight, tmp_path_factory):
    """For each selected window, a run in a directory of its own killed inside step 4's save (a
    launch each: a kill ends its launch), and what it left (`latest`, and what verify says of the
    checkpoint `latest` names); then every one of them resumed to step 6, one after the other in one
    launch (conftest.launch_runs)."""
    selected = {
        item.callspec.params["window"]
        for item in request.session.items
        if item.originalname == "test_a_crash_anywhere_in_a_save_resumes_from_the_last_commit"
    }
    work = tmp_path_factory.mktemp("crashes")
    left, resumes = {}, []
    for window in WINDOWS:
        if window not in selected:
            continue
        crash = work / window
        crash.mkdir()
        shutil.copy(straight / "corpus.txt", crash / "corpus.txt")
        crashed = train(crash, steps=6, faults=f"{window}@4", check=False)
        marker = crash / "checkpoints" / "run" / "latest"
        latest = marker.read_text().strip() if marker.exists() else None
        left[window] = (
            crash,
            crashed.returncode,
            latest,
            latest and find.verify(marker.parent / latest),
        )
        resumes.append(
            train_args(
                steps=6,
                corpus=crash / "corpus.txt",
                extra=[
                    "--checkpoint_dir",
                    crash / "checkpoints",
                    "--log_dir",
                    crash / "logs",
                    "--data_dir",
                    crash / "data",
                ],
            )
        )
    return left, launch_runs(resumes, ranks=2, cwd=work, timeout=180).stdout


@pytest.mark.parametrize("window,resumed", WINDOWS.items())
@pytest.mark.slow
def test_a_crash_anywhere_in_a_save_resumes_from_the_last_commit(
    crashed_then_resumed, straight, window, resumed
):
    """Killed inside step 4's save: `latest` always names a complete checkpoint, the run resumes
    from it, and finishes with the same losses as a run that never crashed."""
    left, resumes = crashed_then_resumed
    crash, returncode, latest, problem = left[window]
    assert returncode != 0
    assert latest == f"step_{resumed}"
    assert problem is None  # find.verify of that checkpoint, before the resume
    assert f"resuming from {crash / 'checkpoints' / 'run' / f'step_{resumed}'}" in resumes
    assert losses(crash, "run") == losses(straight, "straight")


def test_a_hugging_face_directory_without_weights_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="has a config.json but no weights"):
        hub.resolve(str(tmp_path))


# ---- values ----


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--min_lr", "-0.003"], "--min_lr must be a finite number >= 0"),
        (["--lr", "1e-3", "--min_lr", "2e-3"], "--min_lr 0.002 is above --lr 0.001"),
        (["--grad_clip", "-1"], "--grad_clip must be a finite number >= 0"),
        (["--beta1", "2"], "--beta1 must be a finite number in [0, 1)"),
        (["--beta2", "1"], "--beta2 must be a finite number in [0, 1)"),
        (["--weight_decay", "-0.1"], "--weight_decay must be a finite number >= 0"),
        (["--dropout", "1.5"], "--dropout must be a finite number in [0, 1)"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top_k", "-3"], "--top_k must be a finite number >= 0"),
        (["--collective_timeout", "0"], "--collective_timeout must be a finite number in (0, "),
        (["--collective_timeout", "-5"], "--collective_timeout must be a finite number in (0, "),
        (["--max_epochs", "0"], "--max_epochs must be positive, or -1"),
        (["--max_epochs", "-2"], "--max_epochs must be positive, or -1"),
        (["--run_name", "../x"], "--run_name must be one plain directory name"),
        (["--run_name", ""], "--run_name must be one plain directory name"),
        (["--run_name", "a/b"], "--run_name must be one plain directory name"),
    ],
)
def test_values_that_would_corrupt_training_are_refused(flags, message):
    with pytest.raises(ConfigError, match=None) as raised:
        parse_args(flags)
    assert message in str(raised.value)


def test_a_binary_config_file_is_one_line(tmp_path):
    (tmp_path / "bad.toml").write_bytes(b"\x00\xff\xfe\x80 binary")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_args(["--config", tmp_path / "bad.toml"])


def test_refused_values_end_every_rank_with_one_line(tmp_path):
    result = launch(["--grad_clip", "-1", "--run_name", "../escape"], cwd=tmp_path, check=False)
    assert "--grad_clip must be a finite number >= 0" in one_error(result)
    assert not any(tmp_path.parent.glob("escape"))

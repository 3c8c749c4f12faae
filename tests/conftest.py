"""Shared test helpers: a tiny corpus, and launching the real entry point under mpiexec."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "basic_training.py"
# Small enough to train in seconds on one core, big enough to exercise sharding (uneven
# shards included).
TINY_MODEL = [
    "--num_layers",
    "2",
    "--num_heads",
    "2",
    "--embed_size",
    "32",
    "--seq_length",
    "32",
    "--batch_size",
    "4",
    "--eval_batches",
    "2",
    "--num_tokens",
    "0",
]


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-full",
        action="store_true",
        default=False,
        help="the fuzzer's full profile: over 10,000 examples (tests/fuzz/README.md)",
    )
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="the full tier: also the tests marked slow (CI runs this; tests/README.md)",
    )


def pytest_configure(config):
    """The fuzzer's Hypothesis profiles (tests/fuzz/, tests/README.md): quick, derandomized and
    without a database in the quick tier; with --full (CI), five times the examples, random; with
    --fuzz-full the full profile, over 10,000 examples across the readers (about 25 minutes on two
    cores). Both keep the failing ones in .hypothesis/ (ignored by git) to try first next time."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    common = dict(
        deadline=None,  # a hang is the fuzzer's alarm's to catch: no verdict depends on the load
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        # no "explain" phase: its line tracing slows a reader tenfold, past the fuzzer's alarm
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )
    settings.register_profile(
        "fuzz-quick", max_examples=20, derandomize=True, database=None, **common
    )
    database = DirectoryBasedExampleDatabase(str(ROOT / ".hypothesis" / "examples"))
    settings.register_profile("fuzz-ci", max_examples=100, database=database, **common)
    settings.register_profile("fuzz-full", max_examples=800, database=database, **common)
    # MINIMAL_FSDP_FUZZ_HUNT=1 with --full: the full profile's examples without shrinking, to see
    # quickly which readers fail (tests/README.md: measuring the fuzzer on old code)
    hunt = dict(common, phases=[Phase.explicit, Phase.generate])
    settings.register_profile("fuzz-hunt", max_examples=800, database=None, **hunt)
    fuzz_full = config.getoption("--fuzz-full")
    hunting = fuzz_full and os.environ.get("MINIMAL_FSDP_FUZZ_HUNT") == "1"
    ci = config.getoption("--full")
    profile = "fuzz-hunt" if hunting else "fuzz-full" if fuzz_full else "fuzz-ci" if ci else None
    settings.load_profile(profile or "fuzz-quick")


def pytest_collection_modifyitems(config, items):
    """Plain `pytest` is the quick tier: it leaves out the tests marked slow (most launches of
    several ranks, each covered in kind by a quick one). `--full`, a named file or test, -k or -m
    select as pytest does."""
    named = config.option.file_or_dir or config.option.keyword or config.option.markexpr
    if config.getoption("--full") or named:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True, scope="session")
def no_processes_under_mutmut():
    """Under mutmut a mutant's covering tests run once per mutant: a test that starts a process
    (mpiexec, a second Python) takes seconds to minutes, so there it is skipped where it starts one.
    Elsewhere: nothing. Session-scoped, so that it is in place before any module's fixtures launch
    runs."""
    # set by mutmut (tests/mutation.py) where it runs tests
    if "MUTANT_UNDER_TEST" not in os.environ:
        yield
        return

    def skip(*args, **kwargs):
        pytest.skip("starts a process: skipped under mutation testing")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", skip)
        yield


@pytest.fixture(autouse=True)
def one_thread():
    """Every test computes with one thread, as every launched rank does (OMP_NUM_THREADS=1): the
    cores are shared with the ranks it launches (and, on a busy machine, with more), and a second
    thread that waits for a busy core makes a tiny model's step many times slower (the
    single-process reference: 7 s instead of 0.4). Set before each test, since a run inside this
    process sets its own share (environment.cpu_threads)."""
    torch.set_num_threads(1)


def mpiexec():
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if not found:
        pytest.skip("no mpiexec (pip install -e '.[dev]' installs the mpich wheel)")
    return found


def launch(args, ranks=2, cwd=None, timeout=300, env=None, check=True, entry=ENTRY):
    """Run basic_training.py (or `entry`, a script that wraps it) on `ranks` MPI ranks; returns the
    CompletedProcess. The timeout only guards against a hang; no test asserts on time."""
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(entry), *map(str, args)]
    # Not single_process's MASTER_PORT: a port picked free earlier can be anyone's by now (an
    # ephemeral port of a connection), and the job would stop on "already in use". Unset, rank 0
    # binds a free one itself; a test that means a port passes it in env.
    inherited = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    environment = dict(inherited, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    result = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environment
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited "
            f"{result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def launch_runs(
    flag_lists, ranks=2, cwd=None, timeout=300, entry=ROOT / "tests" / "several_runs.py"
):
    """Several runs of the real entry point, one after the other on the same `ranks` ranks of one
    launch (tests/several_runs.py, or `entry`, a script that wraps it): Python and torch start once,
    not once per run. Each run's flags say where its output goes; a run that fails ends the launch
    (AssertionError with its output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as listed:
        json.dump([list(map(str, flags)) for flags in flag_lists], listed)
        listed.flush()
        return launch(
            [listed.name], ranks=ranks, cwd=cwd, timeout=timeout * len(flag_lists), entry=entry
        )


def printed_by_run(stdout):
    """A launch_runs launch's stdout cut into what each training run printed, in order: each part
    starts at its banner's first line ("launch: ...", rank 0's) and runs to the next banner. Returns
    [(run name, text)]."""
    parts = re.split(r"^(?=launch: )", stdout, flags=re.MULTILINE)[1:]
    return [(re.search(r'\brun_name = "([^"]*)"', part).group(1), part) for part in parts]


def make_text(n_chars=60_000, seed=0):
    """Pseudo-English from a fixed word list: learnable structure, no dependency on real data."""
    rng = random.Random(seed)
    words = (
        "the king queen lord lady good night sweet love death fair heart come go speak hear thou "
        "thee my our your sword crown night day blood tears"
    ).split()
    lines = []
    while sum(map(len, lines)) < n_chars:
        speaker = rng.choice(["ROMEO", "JULIET", "KING", "NURSE"])
        lines.append(
            f"{speaker}:\n"
            + " ".join(rng.choice(words) for _ in range(rng.randint(5, 15)))
            + ".\n\n"
        )
    return "".join(lines)[:n_chars]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(make_text())
    return path


@pytest.fixture
def single_process(monkeypatch, tmp_path):
    """A plain `python basic_training.py` run inside this process: a world of one, in tmp_path, with
    the rendezvous kept out of os.environ."""
    from minimal_fsdp.launch import discovery, environment, rendezvous

    for name in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", *discovery.MPI_RANK_VARIABLES]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(rendezvous._free_port()))
    monkeypatch.chdir(tmp_path)
    yield
    environment.teardown()


@pytest.fixture(scope="module")
def one_rank_group():
    """A world of one rank in this process, so FSDP2 runs exactly as in training."""
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cores are shared with other tests: oversubscribing them is slow
    yield
    torch.set_num_threads(threads)
    dist.destroy_process_group()


def global_batch(data, step, world, batch_size, seq_length, seed):
    """Every rank's first micro-batch of optimizer step `step` of a tokens.TokenData, concatenated
    (rank 0 first)."""
    parts = []
    for rank in range(world):
        data.bind(seq_length, batch_size, 1, rank, world, seed)
        parts.append(data.train_batches(step)[0])
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

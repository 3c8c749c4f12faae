"""--profile START:END and --memory_snapshot (profiling.py): a trace per rank of exactly the range,
the CPU's one warning for the CUDA-only snapshot, nothing made or written when off, a bad range one
error line."""

import json
from pathlib import Path

import pytest

from minimal_fsdp import profiling

from conftest import TINY_MODEL, launch, make_text
from support import command, refused, train_args


@pytest.fixture
def single(single_process, tmp_path):
    (tmp_path / "small.txt").write_text(make_text(12_000))


def train(*flags):
    command(
        "train",
        *[
            "--dataset",
            "text",
            "--input_file",
            "small.txt",
            *TINY_MODEL,
            "--seq_length",
            "128",
            "--batch_size",
            "16",
            "--eval_interval",
            "0",
            "--max_steps",
            "4",
            *map(str, flags),
        ],
    )


def traced_steps(path):
    """The ProfilerStep#N ranges of a Chrome trace, by N."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return sorted(
        {
            int(e["name"].split("#")[1])
            for e in events
            if e.get("name", "").startswith("ProfilerStep#")
        }
    )


def test_profile_writes_a_trace_of_exactly_the_range(single, capsys):
    train("--run_name", "p", "--profile", "1:3", "--memory_snapshot")
    files = list(Path("logs/p").rglob("*trace.json"))
    assert [f.name for f in files] == ["rank0.steps1-3.pt.trace.json"]
    assert files[0].parent == Path("logs/p/profile")
    assert traced_steps(files[0]) == [1, 2]
    # the traced steps ran the model: its operators are in the trace
    assert "aten::mm" in files[0].read_text()
    # CPU: the snapshot is CUDA-only, said in one warning line, and nothing is written
    warnings = [line for line in capsys.readouterr().err.splitlines() if "memory_snapshot" in line]
    assert len(warnings) == 1 and "CUDA-only" in warnings[0]
    assert not list(Path("logs/p").rglob("*.pickle"))


@pytest.mark.slow  # a profiled training run in this process: seconds
def test_a_range_past_the_runs_end_is_written_at_the_end(single):
    train("--run_name", "late", "--profile", "2:10")
    assert traced_steps("logs/late/profile/rank0.steps2-10.pt.trace.json") == [2, 3]


@pytest.mark.slow  # a profiled training run in this process: seconds
def test_off_nothing_is_made_or_written(single, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was made with --profile and --memory_snapshot off")

    monkeypatch.setattr(profiling, "StepProfiler", refuse)
    monkeypatch.setattr("torch.profiler.profile", refuse)
    train("--run_name", "off")
    written = {p.name for p in Path("logs/off").rglob("*")}
    assert "profile" not in written and not [n for n in written if "trace" in n or "pickle" in n]


@pytest.mark.parametrize("bad", ["10:5", "a:b", "-1:3", "4", "3:3", ":2"])
def test_a_bad_range_is_one_error_line(capsys, bad):
    refused(capsys, ["--profile", bad], "--profile")


@pytest.mark.slow
def test_two_ranks_write_a_trace_each(tmp_path, corpus):
    launch(train_args(corpus, "two", ["--profile", "2:4"]), ranks=2, cwd=tmp_path)
    for rank in (0, 1):
        path = tmp_path / "logs" / "two" / "profile" / f"rank{rank}.steps2-4.pt.trace.json"
        assert traced_steps(path) == [2, 3]

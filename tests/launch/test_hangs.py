"""launch/hangs.py: the line a collective timeout ends a run with names the collective, the ranks
waiting in it, the ranks that never joined, and the step. In this process (the flight recorder's
entry, the line built from the ranks' reports) and through a 2-rank gloo launch with a rank hung."""

import os

import pytest
import torch
import torch.distributed as dist

from minimal_fsdp.launch import hangs

from conftest import TINY_MODEL, make_text
from faults import launch_with_faults


def test_ranks_are_written_as_spans():
    assert hangs.ranks_text([3]) == "rank 3"
    assert hangs.ranks_text([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_the_line_names_the_collective_the_step_the_waiting_and_the_silent_ranks():
    reports = [
        {"rank": 0, "step": 3, "collective": "gloo:all_reduce", "seq": 41, "group": "default_pg"},
        {"rank": 2, "step": 3, "collective": "gloo:all_reduce", "seq": 41, "group": "default_pg"},
        {"rank": 3, "step": 3, "collective": "gloo:broadcast", "seq": 40, "group": "default_pg"},
    ]
    assert hangs.describe(reports, 5) == (
        "ranks 0, 2 waited in gloo:all_reduce (collective #41 of process group default_pg) at "
        "step 3; rank 3 waited in gloo:broadcast (collective #40 of process group default_pg) at "
        "step 3; ranks 1, 4 never joined it (stopped, hung, or cut off from the others)"
    )
    assert hangs.describe([{"rank": 0, "step": None}], 1) == (
        "rank 0 waited in a collective (no flight recorder: set TORCH_FR_BUFFER_SIZE) outside the "
        "training steps"
    )


@pytest.fixture
def recorded_group(monkeypatch):
    """A one-rank gloo group made with the flight recorder on, as environment.setup makes one."""
    for name in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    hangs.record()
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ  # torch warns on every rank if set
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    yield group
    dist.destroy_process_group(group)
    if made:
        dist.destroy_process_group()


def test_a_rank_reports_its_last_collective_from_the_flight_recorder(recorded_group):
    dist.all_reduce(torch.ones(2), group=recorded_group)
    dist.broadcast(torch.ones(2), 0, group=recorded_group)
    seen = hangs.waiting_in()
    assert seen["collective"] == "gloo:broadcast" and seen["seq"] == 2, seen
    hangs.at_step(7)
    try:
        line = hangs.timeout_line("Timed out waiting 5000ms")
    finally:
        hangs.at_step(None)
    assert line.startswith(
        "a collective waited longer than --collective_timeout: rank 0 waited in gloo:broadcast "
        "(collective #2 of process group "
    ) and line.endswith(") at step 7 (Timed out waiting 5000ms)"), line


@pytest.mark.slow
def test_a_hung_rank_in_a_two_rank_gloo_run_is_named_in_one_line(tmp_path):
    """Rank 1 stops answering in step 3 (tests/faults.py); rank 0's collective times out after 5 s.
    The launch's timeout only guards against a hang."""
    (tmp_path / "corpus.txt").write_text(make_text())
    result = launch_with_faults(
        [
            "--dataset",
            "text",
            "--input_file",
            "corpus.txt",
            *TINY_MODEL,
            "--max_steps",
            6,
            "--eval_interval",
            0,
            "--collective_timeout",
            5,
        ],
        faults="hang@3:1",
        cwd=tmp_path,
        check=False,
        timeout=240,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(
        "error: rank 0: a collective waited longer than --collective_timeout: rank 0 waited in "
        "gloo:"
    ), errors
    assert (
        " at step 3; rank 1 never joined it (stopped, hung, or cut off from the others)"
        in errors[0]
    ), errors
    assert "Traceback" not in result.stderr and "deprecated" not in result.stderr


def test_without_a_process_group_the_line_says_what_it_knows():
    if dist.is_initialized():
        pytest.skip("a process group of this session exists")
    assert hangs.timeout_line("Timed out") == (
        "a collective waited longer than --collective_timeout: another rank or its host has died, "
        "hangs or cannot be reached (Timed out)"
    )


def test_a_store_that_cannot_be_reached_leaves_this_ranks_report_alone(recorded_group, monkeypatch):
    def gone(*args):
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(hangs, "_exchange", gone)
    hangs.at_step(2)
    try:
        (report,) = hangs.gathered(wait=0.1)
    finally:
        hangs.at_step(None)
    assert report["rank"] == 0 and report["step"] == 2

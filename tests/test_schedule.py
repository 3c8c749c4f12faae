"""The learning-rate schedule as the real entry point logs it (metrics.jsonl, one row per step),
against the warmup + cosine formula written in reference.py: warmup end, peak, cosine midpoint, the
final value past the horizon, --min_lr's default of --lr / 10, and the horizon kept across a stop
and resume."""

import json

import pytest

from conftest import TINY_MODEL
from faults import launch_with_faults
from reference import lr_at

LR, WARMUP, HORIZON = 1e-3, 4, 12  # --min_lr left out: lr / 10


def logged_lr(work, run_name):
    rows = [
        json.loads(line)
        for line in (work / "logs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


@pytest.mark.slow
def test_logged_lr_follows_the_schedule_and_keeps_its_horizon_across_a_resume(tmp_path, corpus):
    """The first launch's horizon is 12 steps (--max_steps); SIGTERM stops it at step 7. Resumed
    with --max_steps 16, the run keeps the 12-step schedule: the cosine ends at step 12 and steps
    13-16 stay at min_lr."""
    args = [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--lr",
        LR,
        "--warmup_steps",
        WARMUP,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--run_name",
        "lr",
    ]
    first = launch_with_faults(
        [*args, "--max_steps", HORIZON], faults="sigterm@7", ranks=1, cwd=tmp_path
    )
    assert "step 7: SIGTERM received" in first.stdout
    resumed = launch_with_faults([*args, "--max_steps", 16], ranks=1, cwd=tmp_path)
    assert f"the LR schedule spans {HORIZON} steps, as when the run began" in resumed.stdout

    # row `step` s logs the rate of the s-th step (lr_at's step s - 1)
    lr = logged_lr(tmp_path, "lr")
    assert sorted(lr) == list(range(1, 17))
    for step, value in lr.items():
        assert value == pytest.approx(
            lr_at(step - 1, LR, LR / 10, WARMUP, HORIZON), rel=1e-12, abs=0
        ), step
    assert lr[1] == pytest.approx(LR / WARMUP)  # the first warmup step
    assert lr[WARMUP] == pytest.approx(LR) == max(lr.values())  # warmup ends at the peak
    assert lr[WARMUP + 1] == pytest.approx(LR)  # the cosine starts there
    midpoint = WARMUP + (HORIZON - WARMUP) // 2 + 1  # progress 1/2
    assert lr[midpoint] == pytest.approx((LR + LR / 10) / 2)
    # flat past the horizon
    assert [lr[s] for s in range(HORIZON + 1, 17)] == pytest.approx([LR / 10] * 4)
    # A schedule re-planned for 16 steps at the resume would differ from step 8 on.
    assert lr[8] != pytest.approx(lr_at(7, LR, LR / 10, WARMUP, 16))

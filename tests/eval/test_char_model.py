"""The quick start's kind of model, a character-level GPT trained on Shakespeare, evaluated with the
shipped tasks (configs/eval: multiple choice, whole-text perplexity, generation) as docs/evaluate.md
shows it: before, it ended in `error: the model's char tokenizer has no end-of-text or begin-of-text
token`. On 1 and on 2 ranks the numbers are the same; whole-text scoring says which prefix it used
(the newline)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_MODEL, launch, mpiexec
from support import command

lm_eval = pytest.importorskip("lm_eval")

TASKS = "tiny_mc,tiny_ppl,tiny_gen"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A tiny char GPT on the first 100,000 characters of the quick start's text (every character
    the shipped tasks use is among them)."""
    work = tmp_path_factory.mktemp("char")
    (work / "input.txt").write_text(
        (ROOT / "data" / "shakespeare" / "input.txt").read_text()[:100_000]
    )
    launch(
        [
            "--dataset",
            "text",
            "--input_file",
            "input.txt",
            *TINY_MODEL,
            "--seq_length",
            64,
            "--max_steps",
            30,
            "--eval_interval",
            0,
        ],
        ranks=1,
        cwd=work,
    )
    return work / "checkpoints" / "input"


def results(folder):
    (model,) = folder.iterdir()
    (found,) = model.glob("results_*.json")
    return json.loads(found.read_text())["results"]


@pytest.mark.slow
def test_the_char_model_is_evaluated_alike_on_one_and_two_ranks(
    char_run, tmp_path, single_process, monkeypatch, capfd
):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    flags = [str(char_run), "--tasks", TASKS, "--include_path", "configs/eval"]
    command("evaluate", *[*flags, "--output_path", str(tmp_path / "one")])
    err = capfd.readouterr().err
    assert (
        "prefix token" in err and "'\\n'" in err and "the newline that separates documents" in err
    )
    cmd = [
        mpiexec(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "minimal_fsdp",
        "evaluate",
        *flags,
        "--output_path",
        str(tmp_path / "two"),
    ]
    two = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **OFFLINE),
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one, two = results(tmp_path / "one"), results(tmp_path / "two")
    assert set(one) == set(two) == {"tiny_mc", "tiny_ppl", "tiny_gen"}
    for task, metrics in one.items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and "stderr" not in key:
                assert two[task][key] == pytest.approx(value, rel=1e-5), (task, key)
    assert one["tiny_ppl"]["bits_per_byte,none"] > 0 and "acc,none" in one["tiny_mc"]

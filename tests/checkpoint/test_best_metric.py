"""checkpoint/best.py: which checkpoint the `best` marker names, by val loss or by an --eval_tasks
score (--best_metric <task>/<metric>). The decision on meta.json records, the flag's checks against
the harness's loaded tasks (higher or lower is better as each task declares), and a training run
whose val loss and task score disagree on the best step: `best` names the step with the best logged
score, and a resumed run keeps the choice."""

import json
import random

import pytest

from minimal_fsdp.checkpoint import best, find
from minimal_fsdp.config.flags import Config, ConfigError
from minimal_fsdp.config.sections import Evaluation

from conftest import ROOT, TINY_MODEL, launch, make_text

DATA = ROOT / "configs" / "eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def meta(val_loss=None, name=None, higher=None, **scores):
    """A checkpoint's meta.json as far as best_metric reads it."""
    record = {} if name is None else {"eval_tasks": best.record(name, higher, scores)}
    return {"val_loss": val_loss, "state": dict(record, schedule={})}


def test_val_loss_chooses_the_lowest_as_before():
    assert best.better(meta(2.0), None)
    assert best.better(meta(2.0), meta(3.0)) and not best.better(meta(3.0), meta(2.0))
    assert not best.better(meta(2.0), meta(2.0))  # a tie keeps the earlier one
    # a save at a stop request has no val loss: never best
    assert not best.better(meta(None), None)
    assert not best.better(meta(float("nan")), meta(3.0))
    assert best.better(meta(2.0), meta(None))  # the old best had none (a damaged record)
    # with --eval_tasks but --best_metric val_loss, the scores are recorded and ignored
    assert best.better(
        meta(2.0, "val_loss", False, **{"t/acc": 0.1}),
        meta(3.0, "val_loss", False, **{"t/acc": 0.9}),
    )


def test_a_task_score_chooses_by_its_direction():
    acc = lambda value, loss=1.0: meta(loss, "t/acc", True, **{"t/acc": value})  # noqa: E731
    # val loss disagrees: the score wins
    assert best.better(acc(0.6, loss=9.0), acc(0.5, loss=1.0))
    assert not best.better(acc(0.4), acc(0.5)) and not best.better(acc(0.5), acc(0.5))
    ppl = lambda value: meta(1.0, "t/word_perplexity", False, **{"t/word_perplexity": value})  # noqa: E731
    assert best.better(ppl(10.0), ppl(12.0)) and not best.better(ppl(12.0), ppl(10.0))
    unscored = meta(1.0, "t/acc", True)  # the tasks did not run at this step (a stop request)
    assert not best.better(unscored, None) and best.better(acc(0.1), unscored)
    # a best chosen by val loss before --best_metric changed: one without the score gives way, one
    # with it competes
    assert best.better(acc(0.1), meta(0.5))
    assert not best.better(acc(0.1), meta(0.5, "val_loss", False, **{"t/acc": 0.2}))


def test_a_damaged_record_counts_as_none():
    damaged = [
        {"state": {"eval_tasks": {"best_metric": 3, "higher_is_better": True, "scores": {}}}},
        {
            "state": {
                "eval_tasks": {"best_metric": "t/acc", "higher_is_better": "yes", "scores": {}}
            }
        },
        {
            "state": {
                "eval_tasks": {"best_metric": "t/acc", "higher_is_better": True, "scores": [0.5]}
            }
        },
        {"state": {"eval_tasks": [1]}},
        {"state": [1]},
        [1],
        None,
    ]
    for bad in damaged:
        assert best.read_record(bad) == {}
    assert best.read_record(meta(1.0, "t/acc", True, **{"t/acc": "high", "t/f1": 0.5})) == {
        "best_metric": "t/acc",
        "higher_is_better": True,
        "scores": {"t/f1": 0.5},
    }


def test_the_flag_is_checked_before_anything_is_loaded():
    assert best.chosen(Evaluation.of(Config())) == "val_loss"
    # as metrics.jsonl
    assert best.chosen(Evaluation.of(Config(eval_tasks="t", best_metric="eval/t/acc"))) == "t/acc"
    with pytest.raises(
        ConfigError, match=r"^--best_metric acc: expected val_loss or <task>/<metric>"
    ):
        best.chosen(Evaluation.of(Config(eval_tasks="t", best_metric="acc")))
    with pytest.raises(
        ConfigError,
        match=r"^--best_metric t/acc is a score of --eval_tasks: pass --eval_tasks "
        r"with task t \(or --best_metric val_loss\)$",
    ):
        best.chosen(Evaluation.of(Config(best_metric="t/acc")))
    resumed = meta(1.0, "t/acc", True)
    # a resumed run keeps its choice
    assert best.chosen(Evaluation.of(Config(eval_tasks="t")), resumed) == "t/acc"
    # unless told otherwise
    assert best.chosen(Evaluation.of(Config(best_metric="val_loss")), resumed) == "val_loss"
    with pytest.raises(
        ConfigError,
        match="^the resumed checkpoint's --best_metric t/acc is a score of --eval_tasks",
    ):
        best.chosen(Evaluation.of(Config()), resumed)


def test_the_direction_is_the_harness_own(monkeypatch):
    pytest.importorskip("lm_eval")
    from minimal_fsdp.eval.harness import load_tasks

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    _, tasks = load_tasks(["tiny_mc", "tiny_ppl"], str(DATA))
    assert best.direction("tiny_mc/acc_norm", tasks) is True
    assert best.direction("tiny_ppl/word_perplexity", tasks) is False
    assert best.direction("val_loss", tasks) is False
    with pytest.raises(
        ConfigError,
        match=r"^--best_metric tiny_mc/f1: --eval_tasks computes no such score; it "
        r"computes tiny_mc/acc, tiny_mc/acc_norm, tiny_ppl/bits_per_byte, ",
    ):
        best.direction("tiny_mc/f1", tasks)
    with pytest.raises(ConfigError, match="no such score"):
        # a shipped task this run does not evaluate
        best.direction("tiny_gen/exact_match", tasks)


def anti_task(folder):
    """A multiple-choice task whose right answer is the nonsense choice: the more the model learns
    the training text, the lower its accuracy, while its val loss falls. So val loss and this score
    pick different steps."""
    rng = random.Random(1)
    words = "the king queen lord lady good night sweet love death fair heart".split()
    with open(folder / "anti.jsonl", "w") as f:
        for _ in range(16):
            question = (
                rng.choice(["ROMEO", "JULIET", "KING", "NURSE"])
                + ":\n"
                + " ".join(rng.choices(words, k=4))
            )
            real = " " + " ".join(rng.choices(words, k=3))
            nonsense = " " + " ".join("".join(rng.choices("zqxvjk", k=3)) for _ in range(2))
            f.write(
                json.dumps({"question": question, "choices": [real, nonsense], "answer": 1}) + "\n"
            )
    text = (DATA / "tiny_mc.yaml").read_text().replace("task: tiny_mc", "task: anti")
    (folder / "anti.yaml").write_text(
        text.replace("configs/eval/tiny_mc.jsonl", str(folder / "anti.jsonl"))
    )


def scores_by_step(logs, key):
    return {
        row["step"]: row[key]
        for row in map(json.loads, (logs / "metrics.jsonl").open())
        if key in row
    }


@pytest.mark.slow
def test_best_is_the_checkpoint_the_task_score_prefers(tmp_path):
    pytest.importorskip("lm_eval")
    anti_task(tmp_path)
    (tmp_path / "corpus.txt").write_text(make_text())
    flags = [
        "--dataset",
        "text",
        "--input_file",
        tmp_path / "corpus.txt",
        *TINY_MODEL,
        "--tokenizer",
        "sentencepiece",
        "--vocab_size",
        300,
        "--warmup_steps",
        5,
        "--eval_interval",
        0,
        "--checkpoint_interval",
        10,
        "--keep_last",
        1,
        "--checkpoint_dir",
        tmp_path / "checkpoints",
        "--log_dir",
        tmp_path / "logs",
        "--data_dir",
        tmp_path / "data",
        "--run_name",
        "anti",
        "--num_tokens",
        0,
    ]
    tasks = ["--eval_tasks", "anti", "--eval_tasks_include_path", tmp_path]
    launch([*flags, *tasks, "--best_metric", "anti/acc", "--max_steps", 30], ranks=2, env=OFFLINE)
    run = tmp_path / "checkpoints" / "anti"
    acc, val_loss = (
        scores_by_step(tmp_path / "logs" / "anti", "eval/anti/acc"),
        scores_by_step(tmp_path / "logs" / "anti", "val_loss"),
    )
    # the tasks ran at every save (no --eval_tasks_interval)
    assert sorted(acc) == sorted(val_loss) == [10, 20, 30]
    # the first step with the highest accuracy
    by_score = max(acc, key=lambda step: (acc[step], -step))
    by_loss = min(val_loss, key=val_loss.get)
    assert by_score != by_loss, (acc, val_loss)  # the run is one where the two disagree
    assert find.marker(run, "best").name == f"step_{by_score}"
    assert find.marker(run, "best").is_dir()  # --keep_last 1 spared it
    acc_norm = scores_by_step(tmp_path / "logs" / "anti", "eval/anti/acc_norm")
    assert json.loads((run / "step_30" / "meta.json").read_text())["state"]["eval_tasks"] == {
        "best_metric": "anti/acc",
        "higher_is_better": True,
        "scores": {"anti/acc": acc[30], "anti/acc_norm": acc_norm[30]},
    }
    # resumed without --best_metric: the checkpoint's choice is kept, and without --eval_tasks it
    # cannot be
    launch([*flags, *tasks, "--max_steps", 40], ranks=2, env=OFFLINE)
    acc = scores_by_step(tmp_path / "logs" / "anti", "eval/anti/acc")
    assert (
        json.loads((run / "step_40" / "meta.json").read_text())["state"]["eval_tasks"][
            "best_metric"
        ]
        == "anti/acc"
    )
    assert find.marker(run, "best").name == f"step_{max(acc, key=lambda step: (acc[step], -step))}"
    out = launch([*flags, "--max_steps", 50], ranks=2, env=OFFLINE, check=False)
    assert out.returncode == 2
    assert [line for line in out.stderr.splitlines() if line.startswith("error")] == [
        "error: the resumed checkpoint's --best_metric anti/acc is a score of --eval_tasks: pass "
        "--eval_tasks with task anti (or --best_metric val_loss)"
    ]
    assert "step 41" not in out.stdout and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_score_the_tasks_do_not_compute_stops_every_rank_before_training(tmp_path):
    pytest.importorskip("lm_eval")
    (tmp_path / "corpus.txt").write_text(make_text())
    out = launch(
        [
            "--dataset",
            "text",
            "--input_file",
            tmp_path / "corpus.txt",
            *TINY_MODEL,
            "--tokenizer",
            "sentencepiece",
            "--vocab_size",
            300,
            "--max_steps",
            5,
            "--checkpoint_dir",
            tmp_path / "ck",
            "--data_dir",
            tmp_path / "data",
            "--log_dir",
            tmp_path / "logs",
            "--eval_tasks",
            "tiny_mc",
            "--eval_tasks_include_path",
            DATA,
            "--best_metric",
            "tiny_mc/perplexity",
        ],
        ranks=2,
        env=OFFLINE,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("error")] == [
        "error: --best_metric tiny_mc/perplexity: --eval_tasks computes no such score; it computes "
        "tiny_mc/acc, tiny_mc/acc_norm (or pass --best_metric val_loss)"
    ]
    assert "step 1/" not in out.stdout and "Traceback" not in out.stderr
    assert not list((tmp_path / "ck").rglob("step_*"))

"""Which checkpoint is a run's `best`: the one with the lowest val loss, or, with --best_metric
<task>/<metric>, the one with the best score of that --eval_tasks metric (higher or lower is better
as the harness's task declares for that metric: accuracy up, perplexity down).

Each checkpoint records the choice and the scores of its step in meta.json (state.eval_tasks,
written by harness.TrainingTasks.state_dict): a resumed run keeps choosing by the metric it began
with, and checkpoint/checkpointer.py asks better() whether a new checkpoint beats the one `best`
names, by the new one's record.
"""

import math

from minimal_fsdp.config.choices import ConfigError

VAL_LOSS = "val_loss"
NAME_FORM = (
    "val_loss or <task>/<metric>, as the log and metrics.jsonl name --eval_tasks' scores "
    "(eval/<task>/<metric>), e.g. hellaswag/acc_norm"
)


def read_record(meta):
    """A checkpoint's state.eval_tasks record ({} if it has none). meta.json is read before anything
    can vouch for it (checkpoint/meta.py), so every field is checked here before use."""
    state = meta.get("state") if isinstance(meta, dict) else None
    record = state.get("eval_tasks") if isinstance(state, dict) else None
    if not isinstance(record, dict):
        return {}
    name, higher, scores = (
        record.get("best_metric"),
        record.get("higher_is_better"),
        record.get("scores"),
    )
    if not isinstance(name, str) or not isinstance(higher, bool) or not isinstance(scores, dict):
        return {}
    return {
        "best_metric": name,
        "higher_is_better": higher,
        "scores": {k: v for k, v in scores.items() if isinstance(k, str) and _finite(v)},
    }


def chosen(evaluation, saved=None):
    """--best_metric (of `evaluation`, config.sections.Evaluation), else the metric the resumed
    checkpoint (saved: its meta.json) was chosen by, else val_loss. Checked for its form and against
    --eval_tasks, alike on every rank; whether the tasks compute it is direction()'s check, once
    they are loaded."""
    name = evaluation.best_metric or read_record(saved).get("best_metric") or VAL_LOSS
    name = name.removeprefix("eval/")
    origin = "--best_metric" if evaluation.best_metric else "the resumed checkpoint's --best_metric"
    if name == VAL_LOSS:
        return name
    task, _, metric = name.rpartition("/")
    if not task or not metric:
        raise ConfigError(f"{origin} {name}: expected {NAME_FORM}")
    if not evaluation.eval_tasks:
        raise ConfigError(
            f"{origin} {name} is a score of --eval_tasks: pass --eval_tasks with task {task} "
            "(or --best_metric val_loss)"
        )
    return name


def computed(tasks):
    """{<task>/<metric>: whether higher is better} for every score the harness will report for these
    loaded Task and Group objects (evaluate.load_tasks): each task's metrics, and a group's
    aggregated ones."""
    found = {}
    for item in tasks:
        leaves = item.get_all_tasks() if hasattr(item, "get_all_tasks") else [item]
        for task in leaves:
            for metric, higher in task.higher_is_better().items():
                found[f"{task.task_name}/{metric}"] = bool(higher)
        for aggregate in getattr(item, "aggregate_metric_list", None) or []:
            directions = [
                found[key]
                for key in (f"{t.task_name}/{aggregate.metric}" for t in leaves)
                if key in found
            ]
            if directions:
                found[f"{item.name}/{aggregate.metric}"] = directions[0]
    return found


def direction(name, tasks):
    """Rank 0, with --eval_tasks loaded: whether a higher `name` is better (val_loss: lower). A
    score the tasks do not compute is one line naming those they do."""
    if name == VAL_LOSS:
        return False
    scores = computed(tasks)
    if name not in scores:
        raise ConfigError(
            f"--best_metric {name}: --eval_tasks computes no such score; it computes "
            f"{', '.join(sorted(scores)) or 'none'} (or pass --best_metric val_loss)"
        )
    return scores[name]


def record(name, higher_is_better, scores):
    """The state.eval_tasks part of a checkpoint's meta.json: the choice, and the scores of its step
    ({} if the tasks did not run at that step; such a checkpoint cannot become best by a task
    score)."""
    return {"best_metric": name, "higher_is_better": higher_is_better, "scores": dict(scores)}


def better(candidate, best):
    """Whether the checkpoint with meta.json `candidate` becomes `best`, replacing the one with
    meta.json `best` (None: there is none, or it is damaged). Compared by the candidate's metric; a
    best without a value of that metric (chosen by another metric, its step not scored) gives way to
    one with a value."""
    mine = read_record(candidate)
    name, higher = mine.get("best_metric", VAL_LOSS), mine.get("higher_is_better", False)
    value, old = _value(candidate, name), _value(best, name)
    if value is None:
        return False
    return old is None or (value > old if higher else value < old)


def _value(meta, name):
    if not isinstance(meta, dict):
        return None
    value = (
        meta.get("val_loss") if name == VAL_LOSS else read_record(meta).get("scores", {}).get(name)
    )
    return value if _finite(value) else None


def _finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

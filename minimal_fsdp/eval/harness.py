"""The harness's side of evaluation, for the evaluate command and for training alike (train.py
imports this, no command module): lm_eval imported with one line when it is missing, the tasks
loaded and checked before the model, the harness run on rank 0 while the other ranks serve it, its
tables and results file, and --eval_tasks (TrainingTasks) on the live model during training.
Imports config, launch and checkpoint.best; eval.lm (which imports lm_eval at its top) only where
the harness is known to be there.
"""

import functools
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from minimal_fsdp.checkpoint.best import VAL_LOSS, chosen, direction, record
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.launch import failures
from minimal_fsdp.launch.failures import MainRankFailed


def go_offline():
    """The harness and Hugging Face datasets read only local files and caches, unless the user set
    these. They are read when `datasets` is imported, so this runs first."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def harness():
    """lm_eval, or one line saying how to install it (checked on every rank alike, before any
    collective)."""
    try:
        import lm_eval
        import lm_eval.tasks  # noqa: F401
        import lm_eval.utils
    except ImportError as e:
        raise ConfigError(
            f"evaluation needs EleutherAI's lm-evaluation-harness ({e}): pip install "
            "'minimal_fsdp[eval]' (or pip install lm-eval)"
        ) from e
    compile_templates_once(lm_eval.utils)
    quiet_bars()
    return lm_eval


def quiet_bars(modules=("lm_eval.api.task", "lm_eval.api.model")):
    """The harness's own progress bars (building each task's requests) redraw one line with
    carriage returns: written into a redirected log they run together into one long line, so where
    stderr is not a terminal they are left out (our backend's progress is then plain lines,
    eval.lm.PlainProgress)."""
    if sys.stderr.isatty():
        return
    import importlib

    for name in modules:
        module = importlib.import_module(name)
        bar = getattr(module, "tqdm", None)
        if bar is not None and not getattr(bar, "quiet", False):
            module.tqdm = functools.partial(_no_bar, bar)
            module.tqdm.quiet = True


def _no_bar(bar, *args, **kwargs):
    return bar(*args, **dict(kwargs, disable=True))


def compile_templates_once(utils):
    """The harness renders a task's Jinja templates (doc_to_text, doc_to_choice, ...) through
    utils.apply_template, which compiles the template anew for every document, three times an item
    for multiple choice: jinja2's Environment.from_string caches nothing, and lm_eval 0.4 has no
    option to keep a compiled template. Here each distinct template is compiled once, by the
    harness's own environment, and rendered as it renders it: the same text, most of the harness's
    own time per item gone."""
    if getattr(utils.apply_template, "compiles_once", False):
        return
    compiled = functools.lru_cache(maxsize=1024)(utils.env.from_string)

    def apply_template(template, doc):
        return compiled(template).render(**doc)

    apply_template.compiles_once, apply_template.__wrapped__ = True, utils.apply_template
    utils.apply_template = apply_template


def task_names(tasks):
    """--tasks as lm_eval takes them: names (or YAML files) separated by commas and/or spaces."""
    return [name for item in tasks for name in item.split(",") if name]


def load_tasks(names, include_path=None):
    """Rank 0: (the harness's TaskManager, the Task and Group objects named), their data loaded, so
    a missing task or data file stops the run here, with one line, before the model is loaded."""
    from lm_eval.tasks import TaskManager

    # Indexing the harness's own hundreds of task folders takes a minute on a busy machine: skipped
    # when every name is in --include_path.
    manager = (
        TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    )
    if manager is None or not all(n in manager.all_tasks or Path(n).is_file() for n in names):
        manager = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in manager.all_tasks and not Path(n).is_file()]
    if unknown:
        where = (
            f" nor in --include_path {include_path}"
            if include_path
            else " (local YAML tasks: --include_path)"
        )
        raise ConfigError(
            f"--tasks: {', '.join(unknown)} is not one of lm_eval's tasks{where}; "
            "lm_eval ls tasks lists them"
        )
    objects = []
    for name in names:
        try:
            loaded = manager.load([name])
        except FileNotFoundError as e:  # a data file: datasets says "Unable to find '<path>'"
            raise ConfigError(
                f"task {name}: its data is not here: {e} (relative data_files are read from the "
                f"working directory, {os.getcwd()})"
            ) from e
        # the dataset is neither local nor in the cache, and we are offline
        except ConnectionError as e:
            raise ConfigError(
                f"task {name}: its dataset is not in the Hugging Face datasets cache ({e}): "
                "download it where there is network and copy the cache here (docs/evaluate.md), or "
                "set HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 to download it"
            ) from e
        groups = loaded.get("groups") or {}
        objects += (
            [groups[name]]
            if name in groups
            else [loaded["tasks"][name]]
            if name in loaded["tasks"]
            else list(loaded["tasks"].values())
        )  # a tag, or a YAML file
    return manager, objects


def evaluate(
    lm, manager, tasks, model_name, num_fewshot=None, limit=None, log_samples=False, tracker=None
):
    """Collective: rank 0 runs the harness on `lm` (lm.ShardedLM) while the other ranks
    serve it. Returns the harness's results on rank 0, None elsewhere. A failure on rank 0 stops
    every rank alike."""
    if lm.me != 0:
        lm.serve()
        return None
    import lm_eval

    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args=f"pretrained={model_name}",
            tasks=tasks,
            task_manager=manager,
            num_fewshot=num_fewshot,
            limit=limit,
            batch_size=lm.batch_size,
            log_samples=log_samples,
            evaluation_tracker=tracker,
        )
    except ConfigError as e:
        lm.finish(str(e), bad_input=True)
        raise
    except Exception as e:
        traceback.print_exc()
        lm.finish(f"{type(e).__name__}: {e}", bad_input=False)
        raise MainRankFailed(f"{type(e).__name__}: {e}") from e
    lm.finish()
    return results


def report(results, tracker=None, log_samples=False):
    """Rank 0: the harness's tables on stdout; its results (and samples) files where --output_path
    says."""
    from lm_eval.utils import make_table

    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
        for task in results["configs"] if log_samples else []:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    print(make_table(results), flush=True)
    if "groups" in results:
        print(make_table(results, "groups"), flush=True)


class TrainingTasks:
    """--eval_tasks: the harness's tasks on the live model during training (train.train calls
    it)."""

    def __init__(self, lm, manager, tasks, evaluation, best=(VAL_LOSS, False)):
        """evaluation: config.sections.Evaluation."""
        self.lm, self.manager, self.tasks = lm, manager, tasks
        self.interval = evaluation.eval_tasks_interval
        self.limit = _limit(evaluation.eval_tasks_limit)
        self.best = best  # (--best_metric, whether higher is better)
        self.scored = (None, {})  # (step, {<task>/<metric>: score}) of the last evaluation

    @classmethod
    def for_run(cls, evaluation, env, tokenizer, model, saved=None):
        """None without --eval_tasks (of `evaluation`, config.sections.Evaluation). Collective:
        loads the tasks on rank 0 now, so that a missing task or data file, or a --best_metric they
        do not compute, stops the run before its first step, alike on every rank. saved: the
        resumed checkpoint's meta.json, whose --best_metric the run keeps unless given anew."""
        best = chosen(evaluation, saved)
        if not evaluation.eval_tasks:
            return None
        # The flags' own checks (interval, limit, not decentralized)
        # are checks.check_train's.
        if tokenizer is None:
            raise ConfigError(
                "--eval_tasks needs the data's tokenizer, which this device's data does not hold"
            )
        go_offline()
        harness()
        from minimal_fsdp.eval.lm import ShardedLM

        loaded = {}

        # rank 0's Task objects stay on rank 0; the direction of --best_metric goes to every rank
        def load():
            loaded["tasks"] = load_tasks(
                task_names([evaluation.eval_tasks]), evaluation.eval_tasks_include_path
            )
            return direction(best, loaded["tasks"][1])

        higher = failures.run_on_main(load)
        dtype = torch.bfloat16 if evaluation.precision in ("bf16", "fp8") else torch.float32
        lm = ShardedLM(model, tokenizer, env.device, dtype, evaluation.batch_size, progress=False)
        return cls(lm, *loaded.get("tasks", (None, None)), evaluation, (best, higher))

    def due(self, step, final, saves=False):
        """At the end, every --eval_tasks_interval steps, and at every save when a task score
        chooses `best`."""
        return (
            final
            or bool(self.interval)
            and step % self.interval == 0
            or saves
            and self.best[0] != VAL_LOSS
        )

    def state_dict(self, step):
        """For the checkpoint of `step` (meta.json's state.eval_tasks): --best_metric and the scores
        of that step, by which checkpoint/checkpointer.py decides whether it becomes `best`
        (best.better)."""
        step_scored, scores = self.scored
        return record(*self.best, scores if step_scored == step else {})

    def run(self, step, log):
        """Collective: every score to metrics.jsonl (and TensorBoard, wandb) as
        eval/<task>/<metric>, one line to the log, and the harness's results file to <log
        dir>/eval_tasks/step_<N>_<date>.json."""
        tracker = None
        if self.lm.me == 0:
            from lm_eval.loggers import EvaluationTracker

            tracker = EvaluationTracker(
                output_path=str(log.metrics.dir / "eval_tasks" / f"step_{step}.json")
            )
        with generators_kept(self.lm.me == 0):
            results = evaluate(
                self.lm, self.manager, self.tasks, f"step_{step}", limit=self.limit, tracker=tracker
            )
        if results is None:
            return
        tracker.save_results_aggregated(results=results, samples=None)
        scores = {
            f"eval/{task}/{key.split(',')[0]}": value
            for task, metrics in results["results"].items()
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and "_stderr" not in key and key != "sample_len"
        }
        log.metrics.log(step, **scores)
        self.scored = (step, {name[5:]: value for name, value in scores.items()})
        log.print(
            f"step {step}: "
            + ", ".join(f"{name[5:]} {value:.4g}" for name, value in scores.items())
        )


@contextmanager
def generators_kept(seeded):
    """The harness seeds Python's, NumPy's and torch's global generators (seeded: on this rank);
    training's states are put back afterwards, so a run with --eval_tasks draws what it would draw
    without them."""
    if not seeded:
        yield
        return
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(
        devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []
    ):
        yield
    random.setstate(states[0])
    np.random.set_state(states[1])


def _limit(limit):
    """--limit as the harness takes it: a count (1 and up) or a fraction (below 1)."""
    return int(limit) if limit is not None and limit >= 1 else limit

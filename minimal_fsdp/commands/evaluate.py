"""`minimal-fsdp evaluate SOURCE --tasks ...`: benchmarks on a trained model, EleutherAI's
lm-evaluation-harness with our model as its backend (eval/), straight from a checkpoint sharded
over the ranks (no export, no rank ever holds the whole model). pip install 'minimal_fsdp[eval]'.

    minimal-fsdp evaluate checkpoints/shakespeare --tasks tiny_mc,tiny_ppl \\
        --include_path configs/eval
    mpiexec -n 4 minimal-fsdp evaluate checkpoints/run/best --tasks hellaswag arc_easy \\
        --batch_size 16 --precision bf16 --output_path results/
    minimal-fsdp evaluate ~/models/Llama-3.2-1B --tasks lambada_openai --limit 200

The source is anything `minimal-fsdp sample` reads (a checkpoint, a run directory, an export, a
Hugging Face model directory), laid out over the ranks as sample lays it out (--sharding). The
flags named as lm_eval's own mean what they mean there. Offline unless HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE say otherwise: tasks read local data files or the Hugging Face datasets cache
(docs/evaluate.md). Prints the harness's results table; --output_path writes its JSON results file
(and --log_samples each task's samples), which its tools read. During training, --eval_tasks runs
the same evaluation on the live model every --eval_tasks_interval steps.
"""

import sys

import torch

from minimal_fsdp.config.checks import check_parallel, validate_world
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.config.sections import Launch, Parallel
from minimal_fsdp.eval.harness import (
    _limit,
    evaluate,
    go_offline,
    harness,
    load_tasks,
    report,
    task_names,
)
from minimal_fsdp.inference import load
from minimal_fsdp.launch import environment, failures


def main(args):
    """EvaluateFlags -> the results table."""
    go_offline()
    load.command(lambda: _evaluate(args, Parallel.of(args, generate_only=True)))


def _evaluate(args, parallel):
    """The tasks loaded on rank 0, then the source over the ranks (inference.load), then the
    harness."""
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1 (got {args.batch_size})")
    if args.log_samples and not args.output_path:
        raise ConfigError("--log_samples writes files: give --output_path too")
    check_parallel(parallel)
    harness()
    from minimal_fsdp.eval.lm import ShardedLM

    env = environment.setup(Launch.of(args))
    # --shard_group_size
    validate_world(parallel, env.world_size, env.local_world_size, env.local_world_sizes)
    # rank 0's Task objects stay on rank 0 (run_on_main would send a result to every rank)
    loaded = {}
    failures.run_on_main(
        lambda: loaded.update(tasks=load_tasks(task_names(args.tasks), args.include_path))
    )
    model = load.load(args.source, parallel, env)
    lm = ShardedLM(
        model.model,
        model.tokenizer,
        env.device,
        torch.bfloat16 if args.precision == "bf16" else torch.float32,
        args.batch_size,
    )
    tracker = None
    if env.is_main:
        print(
            load.describe(model.source, model.model, model.tokenizer, env, "evaluating")
            + f"\nlayout: {model.plan.describe()}",
            file=sys.stderr,
            flush=True,
        )
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    manager, tasks = loaded.get("tasks", (None, None))
    results = evaluate(
        lm,
        manager,
        tasks,
        model.source.path,
        args.num_fewshot,
        _limit(args.limit),
        args.log_samples,
        tracker,
    )
    if env.is_main:
        report(results, tracker, args.log_samples)

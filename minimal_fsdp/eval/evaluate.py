"""Benchmarks on a trained model: EleutherAI's lm-evaluation-harness with our model as its backend, straight from a
checkpoint sharded over the ranks (no export, no rank ever holds the whole model). pip install 'minimal_fsdp[eval]'.

    python -m minimal_fsdp.eval.evaluate checkpoints/shakespeare --tasks tiny_mc,tiny_ppl --include_path configs/eval
    mpiexec -n 4 python -m minimal_fsdp.eval.evaluate checkpoints/run/best --tasks hellaswag arc_easy --batch_size 16 \\
        --precision bf16 --output_path results/
    python -m minimal_fsdp.eval.evaluate ~/models/Llama-3.2-1B --tasks lambada_openai --limit 200

The source is anything python -m minimal_fsdp.inference.sample reads (a checkpoint, a run directory, an export, a Hugging
Face model directory), laid out over the ranks as sample.py lays it out (--sharding). The flags named as lm_eval's
own mean what they mean there. Offline unless HF_DATASETS_OFFLINE / HF_HUB_OFFLINE say otherwise: tasks read
local data files or the Hugging Face datasets cache (docs/evaluate.md). Prints the harness's results table;
--output_path writes its JSON results file (and --log_samples each task's samples), which its tools read.
During training, --eval_tasks runs the same evaluation on the live model every --eval_tasks_interval steps.
"""
import argparse
import sys

import torch

from minimal_fsdp.launch import environment
from minimal_fsdp.config.choices import SHARDING
from minimal_fsdp.config.flags import Config, ConfigError, validate, validate_world
from minimal_fsdp.launch.failures import MainRankFailed
from minimal_fsdp.parallel.plan import make_plan
from minimal_fsdp.inference.sample import describe, load_model, open_source, source_tokenizer
from minimal_fsdp.eval.harness import (TrainingTasks, _limit, compile_templates_once,  # noqa: F401
                                      evaluate, go_offline, harness, load_tasks, report, task_names)


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m minimal_fsdp.eval.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a checkpoint (step_<N>, a run directory, its latest/best marker), an "
                                       "export (python -m minimal_fsdp.hf.export), or a Hugging Face model directory")
    parser.add_argument("--tasks", nargs="+", required=True,
                        help="lm_eval task, group or tag names (or YAML files), separated by commas or spaces")
    parser.add_argument("--include_path", help="a folder of your own YAML tasks (lm_eval's format)")
    parser.add_argument("--num_fewshot", type=int, help="examples in each prompt (default: each task's own)")
    parser.add_argument("--limit", type=float,
                        help="at most this many examples per task (below 1: this fraction); for quick checks")
    parser.add_argument("--batch_size", type=int, default=1,
                        help="sequences per rank in one forward call (generation: one per rank)")
    parser.add_argument("--output_path", help="where the harness writes its results JSON: a folder (results go "
                                              "to <folder>/<model>/results_<date>.json) or a .json path")
    parser.add_argument("--log_samples", action="store_true",
                        help="also write every example's prompt and scores (needs --output_path)")
    parser.add_argument("--sharding", choices=SHARDING, default="full-shard",
                        help="how the model is laid out over the ranks (as training's --sharding)")
    parser.add_argument("--shard_group_size", type=int,
                        help="hybrid sharding: ranks per shard group (default: ranks per node), as training's")
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                        help="bf16: matmuls in bf16 (fast on GPUs); the weights stay float32, sharded")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    go_offline()
    cfg = Config(sharding=args.sharding, shard_group_size=args.shard_group_size, precision=args.precision,
                 max_epochs=-1, tensorboard=False)
    try:
        if args.batch_size < 1:
            raise ConfigError(f"--batch_size must be at least 1 (got {args.batch_size})")
        if args.log_samples and not args.output_path:
            raise ConfigError("--log_samples writes files: give --output_path too")
        validate(cfg)
        harness()
        from minimal_fsdp.eval.lm import ShardedLM
        env = environment.setup(cfg)
        validate_world(cfg, env.world_size, env.local_world_size, env.local_world_sizes)  # --shard_group_size
        loaded = {}  # rank 0's Task objects stay on rank 0 (run_on_main would send a result to every rank)
        environment.run_on_main(lambda: loaded.update(tasks=load_tasks(task_names(args.tasks), args.include_path)))
        source = environment.run_on_main(open_source, args.source)
        plan = make_plan(cfg, env, source.config, loads_weights=True)
        tokenizer = source_tokenizer(source)  # the same files on every rank: the same verdict everywhere
        lm = ShardedLM(load_model(source, plan, env), tokenizer, env.device,
                       torch.bfloat16 if cfg.precision == "bf16" else torch.float32, args.batch_size)
        tracker = None
        if env.is_main:
            print(describe(source, lm.model, tokenizer, env).replace("generating from", "evaluating") +
                  f"\nlayout: {plan.describe()}", file=sys.stderr, flush=True)
            from lm_eval.loggers import EvaluationTracker
            tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
        manager, tasks = loaded.get("tasks", (None, None))
        results = evaluate(lm, manager, tasks, source.path, args.num_fewshot, _limit(args.limit), args.log_samples,
                           tracker)
        if env.is_main:
            report(results, tracker, args.log_samples)
        del lm, plan
    except ConfigError as e:  # raised alike on every rank: one line, clean exit
        environment.exit_on_error(e, 2)
    except MainRankFailed as e:  # a bug on rank 0, which printed its traceback
        environment.exit_on_error(e, 1)
    environment.teardown()


if __name__ == "__main__":
    main()

"""Training throughput on synthetic tokens, through the same build_model/train_step as real
training.

    mpiexec -n 1 python benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 \
        --batch_size 16 --precision bf16 --compile

Prints one markdown row: model, world, sharding, precision, batch, seq, tokens/s (total and per
GPU), MFU, median step time, peak memory. MFU = (6N + attention) FLOPs per token x tokens/s / (peak
x GPUs), with the dense bf16 peak of the card (989 TFLOP/s for H100 SXM), also for --precision fp8
(whose row reads fp8-<recipe>), so fp8 and bf16 MFU compare. --out FILE appends the row as JSON too.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimal_fsdp import profiling  # noqa: E402
from minimal_fsdp.config.checks import (
    profile_range,  # noqa: E402
    validate,
    validate_world,
)
from minimal_fsdp.config.flags import Config, build_parser
from minimal_fsdp.config.sections import Optimizer  # noqa: E402
from minimal_fsdp.launch import environment  # noqa: E402
from minimal_fsdp.models.classes import MODELS  # noqa: E402
from minimal_fsdp.models.families import config_from_flags  # noqa: E402
from minimal_fsdp.parallel.choose import reduce_precision
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync  # noqa: E402
from minimal_fsdp.parallel.plan import apply_process_settings, make_plan
from minimal_fsdp.profiling import allocator_retries, peak_flops, peak_memory_gb
from minimal_fsdp.train import build_optimizer, collections_in_step, train_step  # noqa: E402

HEADER = (
    "| model | GPUs | sharding | precision | options | batch/GPU | seq | tok/s | tok/s/GPU | MFU | "
    "step ms | peak GB |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


BENCH_OPTIONS = {
    "warmup": (int, 5, "untimed steps (compilation, allocator warm-up)"),
    "steps": (int, 20, "timed steps; the median is reported"),
    "out": (str, None, "append the result as a JSON line to this file"),
    "label": (str, "", "free text for the options column"),
    "fsdp_on_one_rank": (int, 0, "1: FSDP even on one rank (training uses a plain module there)"),
}


def parse(options):
    """The training flags as a validated Config, plus a benchmark's own options {name: (type,
    default, help)}."""
    parser = build_parser()
    for name, (kind, default, help) in options.items():
        parser.add_argument(f"--{name}", type=kind, default=default, help=help)
    args = vars(parser.parse_args())
    bench = {name: args.pop(name) for name in options}
    cfg = Config(**args)
    validate(cfg)
    return cfg, bench


def build(cfg, fsdp_on_one_rank=False):
    """Ranks, plan, model, optimizer and gradient sync, built as training builds them."""
    env = environment.setup(cfg)
    validate_world(cfg, env.world_size, env.local_world_size)
    model_config = config_from_flags(cfg)
    plan = make_plan(cfg, env, model_config, fsdp_on_one_rank=fsdp_on_one_rank)
    apply_process_settings(plan)  # as run.parallel_plan does
    model = build_model(MODELS[model_config.model_type], model_config, plan, env, cfg.seed)
    return (
        env,
        model_config,
        model,
        build_optimizer(model, Optimizer.of(cfg), plan),
        gradient_sync(model, plan),
    )


def step_times(
    model, optimizer, sync, cfg, env, seq, vocab, n, first_step=0, losses=None, profiler=None
):
    """Run n steps (numbered from first_step: gossip topologies change with the step); return each
    one's time in seconds (device events on CUDA). losses: a list that gets each step's loss (a
    device tensor). profiler: profiling.StepProfiler, told of each step."""
    generator = torch.Generator(device=env.device).manual_seed(cfg.seed + env.rank)
    times = []
    for step in range(first_step, first_step + n):
        if profiler:
            profiler.at(step)
        batches = []
        for _ in range(cfg.grad_accum_steps):
            tokens = torch.randint(
                vocab, (cfg.batch_size, seq + 1), device=env.device, generator=generator
            )
            batches.append((tokens[:, :-1], tokens[:, 1:]))
        if env.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss, _ = train_step(model, optimizer, batches, sync, cfg.grad_clip, env.device, step)
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            loss, _ = train_step(model, optimizer, batches, sync, cfg.grad_clip, env.device, step)
            times.append(time.perf_counter() - t0)
        if losses is not None:
            losses.append(loss)
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1000 for s, e in times]
    return times


def main():
    cfg, bench = parse(BENCH_OPTIONS)
    env, model_config, model, optimizer, sync = build(cfg, bench["fsdp_on_one_rank"])
    seq, vocab = model_config.seq_length, model_config.vocab_size
    step_times(model, optimizer, sync, cfg, env, seq, vocab, bench["warmup"])
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    retries = allocator_retries(env.device)
    losses = []  # same seed, same synthetic batches: a variant that trains differently shows here
    # as in training: no rank pauses alone for a full garbage collection
    with collections_in_step():
        times = step_times(
            model, optimizer, sync, cfg, env, seq, vocab, bench["steps"], losses=losses
        )
    if cfg.profile or cfg.memory_snapshot:
        # after the timed steps, which it would slow: --profile's range counts these steps from 0
        run_dir = Path(cfg.log_dir) / cfg.run_name
        warn = print if env.is_main else None
        with profiling.around_steps(cfg, env, run_dir, warn) as profiler:
            n = profile_range(cfg.profile)[1] if cfg.profile else profiling.SNAPSHOT_STEPS
            step_times(model, optimizer, sync, cfg, env, seq, vocab, n, profiler=profiler)
        if env.is_main:
            print(f"profile: written under {run_dir}", flush=True)
    last_loss = float(losses[-1])
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.grad_accum_steps * seq * env.world_size
    tok_s = tokens / median
    peak = peak_flops(env.device)
    mfu = model.flops_per_token() * tok_s / (peak * env.world_size) if peak else float("nan")
    memory = max(environment_all_ranks(peak_memory_gb(env.device), env))
    host = max(environment_all_ranks(peak_memory_gb(torch.device("cpu")), env))
    # the timed steps'
    retries = sum(environment_all_ranks(allocator_retries(env.device) - retries, env))
    named = [
        o
        for o in ("compile", "activation_checkpoints", "cpu_offload", "meta_init")
        if getattr(cfg, o)
    ]
    named = [f"ckpt:{cfg.recompute}" if o == "activation_checkpoints" else o for o in named]
    summed = reduce_precision(
        cfg.reduce_precision, env.num_nodes, cfg.precision
    )  # as the plan has it
    named += [f"reduce:{summed}"] if summed != "float32" else []
    options = bench["label"] or " ".join(named) or "-"
    n = model.num_params(non_embedding=False)
    layers = f"·{cfg.num_layers}L" if cfg.num_layers else ""  # a preset cut to fewer or more blocks
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    row = dict(
        model=f"{cfg.model_preset}{layers if n >= 1e9 else ''}({size})",
        gpus=env.world_size,
        sharding="replica" if cfg.data_parallel == "decentralized" else cfg.sharding,
        precision=cfg.precision + (f"-{cfg.fp8_recipe}" if cfg.precision == "fp8" else ""),
        options=options,
        batch=cfg.batch_size * cfg.grad_accum_steps,
        seq=seq,
        tok_s=tok_s,
        tok_s_gpu=tok_s / env.world_size,
        mfu=mfu,
        step_ms=median * 1000,
        peak_gb=memory,
        host_rss_gb=host,
        last_loss=last_loss,
        alloc_retries=retries,
        device=torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        torch=torch.__version__,
    )
    if env.is_main:
        print(
            f"host memory: peak RSS {host:.1f} GB on the largest rank; rank 0's loss at the last "
            f"step {last_loss:.5f}",
            flush=True,
        )
        if retries:
            print(
                f"memory: the CUDA allocator freed its cache and retried {retries} time(s) over "
                "the ranks in the timed steps: the GPU is at its memory's limit, and the row is "
                "slower for it",
                flush=True,
            )
        print(HEADER)
        print(
            f"| {row['model']} | {row['gpus']} | {row['sharding']} | {row['precision']} | "
            f"{options} | {row['batch']} | {seq} | {tok_s:,.0f} | {row['tok_s_gpu']:,.0f} | "
            f"{'-' if mfu != mfu else f'{mfu:.1%}'} | {row['step_ms']:.1f} | {memory:.1f} |",
            flush=True,
        )
        if bench["out"]:
            with open(bench["out"], "a") as f:
                f.write(json.dumps(row) + "\n")
    # release the sharded state before its process groups (see environment.teardown)
    del model, optimizer
    environment.teardown()


def environment_all_ranks(value, env):
    """Every rank's value (e.g. peak memory), gathered to all."""
    out = [None] * env.world_size
    torch.distributed.all_gather_object(out, value)
    return out


if __name__ == "__main__":
    main()

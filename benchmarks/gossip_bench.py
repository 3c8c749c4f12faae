"""Decentralized (gossip) against all-reduce training: step time and bytes each GPU sends per step,
through the same build_model/build_optimizer/train_step as real training, on synthetic tokens.

    mpiexec -n 4 python benchmarks/gossip_bench.py --model_preset gpt2 --vocab_size 50304 \
        --batch_size 16 --precision bf16 --out gossip.jsonl

Runs, in one launch: all-reduce (FSDP --sharding no-shard, i.e. DDP: gradients all-reduced in fp32),
then --data_parallel decentralized with each topology (its wire: --gossip_dtype, bf16 unless told).
Prints one markdown row per mode. Bytes: for gossip, the
payload the Gossip object posted (counted); for all-reduce, a ring all-reduce's 2(n-1)/n x gradient
bytes (computed: NCCL does not report what it sends). Step time: median of --steps steps (CUDA
events).
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import BENCH_OPTIONS, parse, step_times  # noqa: E402  (the same timed loop, in this folder)

from minimal_fsdp.config.sections import Optimizer  # noqa: E402
from minimal_fsdp.launch import environment  # noqa: E402
from minimal_fsdp.models.classes import MODELS  # noqa: E402
from minimal_fsdp.models.families import config_from_flags  # noqa: E402
from minimal_fsdp.parallel.gossip import TOPOLOGIES  # noqa: E402
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync  # noqa: E402
from minimal_fsdp.parallel.plan import make_plan  # noqa: E402
from minimal_fsdp.train import build_optimizer  # noqa: E402

HEADER = (
    "| mode | topology | GPUs | model | precision | batch/GPU | step ms | MB sent/step/GPU | bytes "
    "are |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def measure(cfg, env, bench, model_config):
    plan = make_plan(cfg, env, model_config)
    model = build_model(MODELS[model_config.model_type], model_config, plan, env, cfg.seed)
    optimizer = build_optimizer(model, Optimizer.of(cfg), plan)
    sync = gradient_sync(model, plan)
    gossip = sync if plan.decentralized else None
    seq, vocab = model_config.seq_length, model_config.vocab_size
    step_times(model, optimizer, sync, cfg, env, seq, vocab, bench["warmup"])
    sent_before = gossip.bytes_sent if gossip else 0
    times = step_times(
        model, optimizer, sync, cfg, env, seq, vocab, bench["steps"], bench["warmup"]
    )
    # FSDP: this rank's shard; no-shard: all of them
    params = sum(p.numel() for p in model.parameters())
    if gossip is not None:
        sent, counted = (gossip.bytes_sent - sent_before) / bench["steps"], "counted"
    else:
        sent, counted = 2 * (env.world_size - 1) / env.world_size * params * 4, "ring formula"
    del model, optimizer, gossip, sync, plan
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    decentralized = cfg.data_parallel == "decentralized"
    return dict(
        mode=cfg.data_parallel,
        topology=cfg.topology if decentralized else "-",
        gpus=env.world_size,
        params=params,
        precision=cfg.precision,
        # complete sums in fp32 whatever --gossip_dtype (gossip.py)
        wire=cfg.gossip_dtype if decentralized and cfg.topology != "complete" else "float32",
        batch=cfg.batch_size,
        step_ms=statistics.median(times) * 1000,
        bytes_per_step=sent,
        bytes_are=counted,
        device=torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        torch=torch.__version__,
    )


def main():
    cfg, bench = parse({k: v for k, v in BENCH_OPTIONS.items() if k != "label"})
    env = environment.setup(cfg)
    model_config = config_from_flags(cfg)
    modes = [
        dataclasses.replace(cfg, data_parallel="allreduce", sharding="no-shard", accum_steps=1)
    ]
    modes += [
        dataclasses.replace(cfg, data_parallel="decentralized", sharding="no-shard", topology=t)
        for t in TOPOLOGIES
    ]
    if env.is_main:
        print(HEADER, flush=True)
    for mode in modes:
        row = measure(mode, env, bench, model_config)
        if env.is_main:
            print(
                f"| {row['mode']} | {row['topology']} | {row['gpus']} | "
                f"{cfg.model_preset}({row['params'] / 1e6:.0f}M) | {row['precision']} | "
                f"{row['batch']} | {row['step_ms']:.1f} | {row['bytes_per_step'] / 1e6:.1f} | "
                f"{row['bytes_are']} |",
                flush=True,
            )
            if bench["out"]:
                with open(bench["out"], "a") as f:
                    f.write(json.dumps(row) + "\n")
    environment.teardown()


if __name__ == "__main__":
    main()

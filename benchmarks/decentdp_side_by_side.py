"""Our decentralized training beside Decent-DP's (ICLR 2025) and plain PyTorch DDP, and our
all-reduce strategies (--allreduce), in one launch: the same GPT, synthetic tokens, batch, topology
and ranks (or virtual hosts), timed alike; one markdown row each.

    mpiexec -n 4 python benchmarks/decentdp_side_by_side.py --model_preset tiny --topology exp
    minimal-fsdp cluster --hosts 8 --rate 100mbit -- mpiexec -n 8 -ppn 1 \\
        -hosts node0,node1,node2,node3,node4,node5,node6,node7 python
            benchmarks/decentdp_side_by_side.py \\
        --num_layers 6 --embed_size 384 --num_heads 6 --seq_length 128 --batch_size 2
            --vocab_size 65

Ours: build_model + Gossip (--gossip_dtype, host-aware) + AccumAdamW through train_step, as training
runs. torch DDP: torch.nn.parallel.DistributedDataParallel (fp32 gradients in 25 MB buckets,
all-reduced during the backward) around the same model under bf16 autocast, with fused AdamW:
nanoGPT's train.py setup. Ours, all-reduce (--allreduce full-shard,no-shard): the plan make_plan
picks for each --sharding, as training does. Decent-DP: its DecentralizedDataParallel around the
same model with its per-bucket AdamW (optim_fn_adamw, the same lr, betas and weight decay); every
bucket's update and next all-reduce on its edge's group start in the bucket's gradient hook. A
benchmark-only dependency (`pip install .wheels/decent_dp-0.2.3-py3-none-any.whl --no-deps`); its
loguru logging is replaced by a no-op when loguru is absent. Step time: the median over --steps
steps after --warmup (host clock; each step ends with the loss on the host).
"""

import dataclasses
import functools
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimal_fsdp.launch import environment  # noqa: E402
from minimal_fsdp.models.classes import MODELS  # noqa: E402
from minimal_fsdp.models.families import config_from_flags  # noqa: E402
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync  # noqa: E402
from minimal_fsdp.parallel.plan import make_plan  # noqa: E402
from minimal_fsdp.train import build_optimizer, train_step  # noqa: E402
from throughput import BENCH_OPTIONS, parse  # noqa: E402  (the flags and bench options, in this folder)

TOPOLOGY_NAMES = {
    "complete": "complete",
    "ring": "ring",
    "exp": "one-peer-exp",
    "alternating-exp-ring": "alternating-exp-ring",
}  # ours -> Decent-DP's
HEADER = (
    "| implementation | topology | ranks | params | batch/rank | wire | step ms | tokens/s |\n"
    "|---|---|---|---|---|---|---|---|"
)


def decent_dp():
    """Decent-DP's modules, or None; a no-op loguru where it is not installed (it only logs with
    it)."""
    try:
        import loguru  # noqa: F401
    except ImportError:
        quiet = types.SimpleNamespace(
            debug=lambda *a, **k: None,
            info=lambda *a, **k: None,
            warning=lambda *a, **k: None,
            error=lambda *a, **k: None,
        )
        sys.modules["loguru"] = types.SimpleNamespace(logger=quiet)
    try:
        from decent_dp import ddp, optim
    except ImportError:
        return None
    return ddp, optim


def batches(cfg, model_config, env, count):
    generator = torch.Generator().manual_seed(cfg.seed + env.rank)
    shape = (cfg.batch_size, model_config.seq_length + 1)
    for _ in range(count):
        tokens = torch.randint(model_config.vocab_size, shape, generator=generator).to(env.device)
        yield tokens[:, :-1], tokens[:, 1:]


def timed(step, steps, warmup):
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(cfg, env, model_config, bench):
    plan = make_plan(cfg, env, model_config)
    model = build_model(MODELS[model_config.model_type], model_config, plan, env, cfg.seed)
    optimizer, sync = build_optimizer(model, cfg, plan), gradient_sync(model, plan)
    data = batches(cfg, model_config, env, bench["warmup"] + bench["steps"])
    return timed(
        lambda i: train_step(model, optimizer, [next(data)], sync, cfg.grad_clip, env.device, i)[
            0
        ].item(),
        bench["steps"],
        bench["warmup"],
    )


def torch_ddp(cfg, env, model_config, bench):
    torch.manual_seed(cfg.seed)
    model = MODELS[model_config.model_type](model_config).to(env.device)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2 or 0.95),
        fused=True,
    )
    data = batches(cfg, model_config, env, bench["warmup"] + bench["steps"])

    def step(i):
        x, y = next(data)
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            loss = wrapped(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return timed(step, bench["steps"], bench["warmup"])


def theirs(cfg, env, model_config, bench, modules):
    ddp, optim = modules
    plan = make_plan(cfg, env, model_config)
    model = build_model(MODELS[model_config.model_type], model_config, plan, env, cfg.seed)
    # Decent-DP builds its own buckets over the parameters: plain tensors
    for p in model.parameters():
        p.data = p.data.clone()
    optim_fn = functools.partial(
        optim.optim_fn_adamw,
        lr=cfg.lr,
        beta1=cfg.beta1,
        beta2=cfg.beta2 or 0.98,
        weight_decay=cfg.weight_decay,
    )
    wrapped = ddp.DecentralizedDataParallel(
        model,
        optim_fn,
        topology=TOPOLOGY_NAMES[cfg.topology],
        grad_clip_norm=cfg.grad_clip,
        _local_world_size=env.local_world_size,
    )
    warmup = max(2, bench["warmup"])  # its first two steps trace and initialize
    data = batches(cfg, model_config, env, warmup + bench["steps"])

    def step(i):
        x, y = next(data)
        loss = wrapped(x, y)
        loss.backward()  # the hooks step each bucket and post its next exchange
        loss.item()

    return timed(step, bench["steps"], warmup)


def main():
    options = {k: v for k, v in BENCH_OPTIONS.items() if k != "label"}
    options["allreduce"] = (
        str,
        "",
        "also our all-reduce strategies, e.g. full-shard,no-shard (--sharding's)",
    )
    options["torch_ddp"] = (int, 1, "1: a torch DistributedDataParallel row")
    cfg, bench = parse(options)
    env = environment.setup(cfg)
    model_config = config_from_flags(cfg)
    allreduce = [dataclasses.replace(cfg, sharding=s) for s in bench["allreduce"].split(",") if s]
    cfg = dataclasses.replace(cfg, data_parallel="decentralized", sharding="no-shard")
    tokens = env.world_size * cfg.batch_size * model_config.seq_length
    params = make_plan(cfg, env, model_config).num_params
    modules = decent_dp()
    runs = (
        [("torch DDP", "float32", lambda: torch_ddp(cfg, env, model_config, bench))]
        if bench["torch_ddp"]
        else []
    )
    runs += [
        (
            f"ours, {c.sharding} ({make_plan(c, env, model_config).strategy})",
            c.reduce_precision,
            functools.partial(ours, c, env, model_config, bench),
        )
        for c in allreduce
    ]
    runs.append(
        ("ours, decentralized", cfg.gossip_dtype, lambda: ours(cfg, env, model_config, bench))
    )
    runs.append(
        ("Decent-DP 0.2.3", "float32", lambda: theirs(cfg, env, model_config, bench, modules))
        if modules
        else ("Decent-DP (not installed)", "-", None)
    )
    if env.is_main:
        print(HEADER, flush=True)
    for name, wire, run in runs:
        step = run() if run else None
        if env.is_main:
            row = dict(
                implementation=name,
                topology=cfg.topology,
                ranks=env.world_size,
                params=params,
                batch=cfg.batch_size,
                wire=wire,
                step_ms=step and 1000 * step,
                tokens_per_s=step and tokens / step,
                torch=torch.__version__,
            )
            print(
                f"| {name} | {cfg.topology} | {env.world_size} | {params / 1e6:.2f}M | "
                f"{cfg.batch_size} | {wire} | {f'{1000 * step:.1f}' if step else '-'} | "
                f"{f'{tokens / step:,.0f}' if step else '-'} |",
                flush=True,
            )
            if bench["out"]:
                with open(bench["out"], "a") as f:
                    f.write(json.dumps(row) + "\n")
    environment.teardown()


if __name__ == "__main__":
    main()

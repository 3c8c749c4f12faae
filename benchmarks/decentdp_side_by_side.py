"""Ours beside the strongest plain-PyTorch references and Decent-DP (ICLR 2025), in one launch: the
same GPT, tokens, batch, topology and ranks (or virtual hosts), timed alike; one markdown row each,
and with --loss_out each one's loss at every step and its val loss.

    mpiexec -n 4 python benchmarks/decentdp_side_by_side.py --model_preset tiny --topology exp
    # 8 virtual hosts at 100 Mbit/s (benchmarks/multihost.py --side_by_side does this per rate)
    minimal-fsdp cluster --hosts 8 --rate 100mbit -- mpiexec -n 8 -ppn 1 \\
        -hosts node0,node1,node2,node3,node4,node5,node6,node7 python \\
            benchmarks/decentdp_side_by_side.py \\
        --num_layers 6 --embed_size 384 --num_heads 6 --seq_length 128 --batch_size 2 \\
            --vocab_size 65
    # the loss at equal steps on real tokens: Shakespeare characters, ids in a 50304 vocabulary
    mpiexec -n 8 python benchmarks/decentdp_side_by_side.py --text data/shakespeare/input.txt \\
        --vocab_size 50304 ... --warmup 0 --steps 300 --loss_out loss.jsonl

Rows (--references picks the PyTorch ones; --reference_model runs them on our GPT, nanoGPT's
model.py from --nanogpt, or both):
- torch DDP, fp32: DistributedDataParallel (25 MB buckets all-reduced in fp32 during backward) with
  fused AdamW under autocast: nanoGPT's train.py setup.
- torch DDP, bf16_compress_hook: the same with `register_comm_hook(None, bf16_compress_hook)`, as
  torch's DDP communication hooks page shows (each bucket cast to bf16, all-reduced, cast back).
- torch DDP, PowerSGD: `PowerSGDState(process_group=None, matrix_approximation_rank=4,
  start_powerSGD_iter=S)` and `powerSGD_hook`, error feedback and warm start on (its defaults, which
  its docs recommend). S: 10% of the run's steps, at least 2, as its docstring suggests starting
  ("start with 10% of total training steps"); the timed steps start after S, so its row times the
  compressed steps.
- torch FSDP2, bf16 sums: `fully_shard` on each block, then the root, with
  `MixedPrecisionPolicy(param_dtype=bf16 under --precision bf16, reduce_dtype=bfloat16)`, as
  torchtitan applies it.
- Decent-DP 0.2.3: its DecentralizedDataParallel around the model with its per-bucket AdamW
  (optim_fn_adamw, the same lr, betas, weight decay), as its quick start shows; every bucket's
  update and next exchange start in the bucket's gradient hook. A benchmark-only dependency (`pip
  install decent-dp==0.2.3 loguru`); a no-op loguru stands in where loguru is absent. Its
  alternating-exp-ring is a two-level graph of its own that needs 2^k nodes of 2+ ranks: with one
  rank a host (or every rank on one host) use --topology exp or ring; a layout that cannot be built
  is a row that says so.
- Ours: build_model + the plan training makes (--allreduce SHARDING[:REDUCE_PRECISION],...) and
  decentralized (Gossip, --gossip_dtype, host-aware) through train.train_step, as training runs.
- compute alone (--compute_row 1): our model, each rank stepping alone (no collective at all):
  the compute part of every step above under the same load, for the planner's estimate.
Every row: constant lr, the same optimizer settings, the same batches (each rank its own); PowerSGD
and Decent-DP run their untimed first steps on top of --warmup + --steps (longer loss rows).
Step time: the median over --steps after --warmup (host clock; each step ends with the loss on the
host). --text: character tokens of the file, the last 10% held out; the val loss is the mean over
ranks of each rank's model on --val_batches held-out batches (a decentralized rank: its own
replica).
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import BENCH_OPTIONS, parse  # noqa: E402  (the flags and bench options, in this folder)

from minimal_fsdp.config.sections import Optimizer  # noqa: E402
from minimal_fsdp.launch import environment  # noqa: E402
from minimal_fsdp.models.classes import MODELS  # noqa: E402
from minimal_fsdp.models.families import config_from_flags  # noqa: E402
from minimal_fsdp.parallel.parallelize import (  # noqa: E402
    build_model,
    gradient_sync,
    init_weights,
)
from minimal_fsdp.parallel.plan import make_plan  # noqa: E402
from minimal_fsdp.train import build_optimizer, train_step  # noqa: E402

TOPOLOGY_NAMES = {
    "complete": "complete",
    "ring": "ring",
    "exp": "one-peer-exp",
    "alternating-exp-ring": "alternating-exp-ring",
}  # ours -> Decent-DP's
REFERENCES = ("ddp", "ddp-bf16", "ddp-powersgd", "fsdp2-bf16", "decent-dp")
POWERSGD_RANK = 4
HEADER = (
    "| implementation | model | topology | ranks | params | batch/rank | wire | step ms | tokens/s "
    "| val loss |\n|---|---|---|---|---|---|---|---|---|---|"
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


class Tokens:
    """Each rank's training batches (synthetic, or windows of --text's characters) and its held-out
    ones; every implementation gets the same sequence."""

    def __init__(self, cfg, model_config, env, text):
        self.cfg, self.env, self.seq = cfg, env, model_config.seq_length
        self.vocab = model_config.vocab_size
        self.train = self.val = None
        if text:
            chars = Path(text).read_text()
            index = {c: i for i, c in enumerate(sorted(set(chars)))}
            if len(index) > self.vocab:
                sys.exit(f"error: --text has {len(index)} characters; raise --vocab_size")
            ids = torch.tensor([index[c] for c in chars], dtype=torch.long)
            cut = int(0.9 * len(ids))
            self.train, self.val = ids[:cut], ids[cut:]

    def _batches(self, ids, seed, count):
        generator = torch.Generator().manual_seed(seed)
        shape = (self.cfg.batch_size, self.seq + 1)
        for _ in range(count):
            if ids is None:
                tokens = torch.randint(self.vocab, shape, generator=generator)
            else:
                starts = torch.randint(len(ids) - self.seq - 1, (shape[0],), generator=generator)
                tokens = torch.stack([ids[s : s + self.seq + 1] for s in starts.tolist()])
            tokens = tokens.to(self.env.device)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def training(self, count):
        return self._batches(self.train, self.cfg.seed + self.env.rank, count)

    def held_out(self, count):
        return list(self._batches(self.val, 10_000 + self.env.rank, count))


class NanoGPTLoss(torch.nn.Module):
    """nanoGPT's GPT, called as ours is: forward(x, y) -> loss."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        return self.gpt(x, y)[1]


def reference_model(cfg, model_config, env, which, nanogpt):
    """A fresh model for a PyTorch reference, on the device, seeded alike: ours (the class training
    builds, unwrapped) or nanoGPT's."""
    torch.manual_seed(cfg.seed)
    if which == "nanogpt":
        sys.path.insert(0, str(Path(nanogpt).resolve()))
        from model import GPT, GPTConfig  # nanoGPT's model.py

        config = GPTConfig(
            block_size=model_config.seq_length,
            vocab_size=model_config.vocab_size,
            n_layer=model_config.num_layers,
            n_head=model_config.num_heads,
            n_embd=model_config.embed_size,
            dropout=0.0,
            bias=model_config.bias,
        )
        return NanoGPTLoss(GPT(config)).to(env.device)  # initialized as nanoGPT does
    model = MODELS[model_config.model_type](model_config).to(env.device)
    with torch.no_grad():  # the initial values training gives ours (torch's defaults differ)
        init_weights(model, cfg.seed, env.device)
    return model


def adamw(cfg, model, **options):
    """nanoGPT's configure_optimizers: weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2 or 0.95),
        **options,
    )


def plain_step(cfg, env, loss_of, params, optimizer):
    """One step as nanoGPT's train.py takes it: autocast forward, backward, clip, AdamW."""

    def step(i, x, y):
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def torch_ddp(cfg, env, model_config, which, nanogpt, hook, total_steps):
    """torch DDP (fp32, bf16_compress_hook or PowerSGD): (step, model to evaluate, skip) where skip
    is the steps before the hook compresses."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = reference_model(cfg, model_config, env, which, nanogpt)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    skip = 0
    if hook == "bf16":
        hook_fn = default_hooks.bf16_compress_hook
        if env.device.type != "cuda":
            # DDP refuses the hook by its name without CUDA and NCCL (a check, not a limit: gloo
            # all-reduces bf16); the same function under another name runs on CPU ranks
            def bf16_hook_on_gloo(state, bucket):
                return default_hooks.bf16_compress_hook(state, bucket)

            hook_fn = bf16_hook_on_gloo
        wrapped.register_comm_hook(None, hook_fn)
    elif hook == "powersgd":
        skip = max(2, round(0.1 * total_steps))
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=skip,
        )
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    fused = {"fused": True} if env.device.type in ("cuda", "cpu") else {}
    optimizer = adamw(cfg, model, **fused)
    return plain_step(cfg, env, wrapped, list(model.parameters()), optimizer), model, skip


def torch_fsdp2(cfg, env, model_config, which, nanogpt):
    """FSDP2 per block, then the root, with bf16 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = reference_model(cfg, model_config, env, which, nanogpt)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
        reduce_dtype=torch.bfloat16,
    )
    blocks = model.gpt.transformer.h if which == "nanogpt" else model.blocks
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = adamw(cfg, model)
    params = list(model.parameters())

    def step(i, x, y):
        loss = model(x, y)  # the policy casts; no autocast (torchtitan's way)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model, 0


def theirs(cfg, env, model_config, which, nanogpt, modules):
    ddp, optim = modules
    model = reference_model(cfg, model_config, env, which, nanogpt)
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

    def step(i, x, y):
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            loss = wrapped(x, y)
        loss.backward()  # the hooks step each bucket and post its next exchange
        return loss.detach()

    return step, model, 2  # its first two steps trace and initialize


def ours(cfg, env, model_config):
    plan = make_plan(cfg, env, model_config)
    model = build_model(MODELS[model_config.model_type], model_config, plan, env, cfg.seed)
    optimizer, sync = build_optimizer(model, Optimizer.of(cfg), plan), gradient_sync(model, plan)

    def step(i, x, y):
        return train_step(model, optimizer, [(x, y)], sync, cfg.grad_clip, env.device, i)[0]

    return step, model, 0


def compute_alone(cfg, env, model_config):
    """Our model and AdamW with no collective: what every row's step computes."""
    model = reference_model(cfg, model_config, env, "ours", None)
    params = list(model.parameters())
    return plain_step(cfg, env, model, params, adamw(cfg, model)), model, 0


@torch.no_grad()
def val_loss(model, batches):
    """The mean over ranks of this rank's model's loss on its held-out batches (collective)."""
    model.eval()
    total = torch.stack([model(x, y).float() for x, y in batches]).mean()
    model.train()
    total = total.detach().reshape(1).cpu().double()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def drive(build, tokens, bench):
    """Build one implementation, run it; (median step s, per-step losses averaged over ranks,
    per-step seconds on rank 0, val loss)."""
    try:
        step, model, skip = build()
    except (ValueError, ZeroDivisionError) as e:
        # the same on every rank, before any step (Decent-DP's alternating-exp-ring needs 2^k
        # nodes of 2+ ranks): a row that says so, and the launch goes on
        return None, None, None, f"{type(e).__name__}: {e}"[:60]
    warmup = max(skip, bench["warmup"])
    times, losses = [], []
    dist.barrier()
    for i, (x, y) in enumerate(tokens.training(warmup + bench["steps"])):
        start = time.perf_counter()
        losses.append(step(i, x, y).float().item())
        times.append(time.perf_counter() - start)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    val = val_loss(model, tokens.held_out(bench["val_batches"])) if bench["val_batches"] else None
    del model, step
    return statistics.median(times[warmup:]), (mean / dist.get_world_size()).tolist(), times, val


def main():
    options = {k: v for k, v in BENCH_OPTIONS.items() if k != "label"}
    options.update(
        allreduce=(
            str,
            "",
            "also our all-reduce strategies, SHARDING[:REDUCE_PRECISION],... e.g. "
            "full-shard,no-shard:float32",
        ),
        references=(str, ",".join(REFERENCES), f"PyTorch rows, of {', '.join(REFERENCES)}"),
        reference_model=(str, "ours", "the references' model: ours, nanogpt, or ours,nanogpt"),
        nanogpt=(str, ".ref/nanogpt", "a copy of nanoGPT's repository (its model.py)"),
        decentralized=(int, 1, "1: our decentralized row"),
        ours_global_average_every=(int, 0, "our decentralized row's --global_average_every"),
        ours_accum_steps=(int, 1, "our decentralized row's --accum_steps (AccumAdamW)"),
        compute_row=(int, 0, "1: a row of our model stepping alone on every rank"),
        text=(str, "", "train on this file's characters (default: synthetic tokens)"),
        val_batches=(int, 0, "held-out batches a rank for each row's val loss"),
        loss_out=(str, "", "append each row with its loss at every step here (JSON lines)"),
    )
    cfg, bench = parse(options)
    env = environment.setup(cfg)
    model_config = config_from_flags(cfg)
    unknown = set(filter(None, bench["references"].split(","))) - set(REFERENCES)
    if unknown:
        sys.exit(f"error: --references {','.join(sorted(unknown))}: choose from {REFERENCES}")
    tokens = Tokens(cfg, model_config, env, bench["text"])
    allreduce = []
    for item in filter(None, bench["allreduce"].split(",")):
        sharding, _, precision = item.partition(":")
        allreduce.append(
            dataclasses.replace(
                cfg, sharding=sharding, reduce_precision=precision or cfg.reduce_precision
            )
        )
    cfg = dataclasses.replace(
        cfg,
        data_parallel="decentralized",
        sharding="no-shard",
        global_average_every=bench["ours_global_average_every"],
        accum_steps=bench["ours_accum_steps"],
    )
    per_step = env.world_size * cfg.batch_size * model_config.seq_length
    params = make_plan(cfg, env, model_config).num_params
    total = bench["warmup"] + bench["steps"]
    refs = [r for r in REFERENCES if r in bench["references"].split(",")]
    modules = decent_dp() if "decent-dp" in refs else None
    runs = []  # (implementation, model, wire, build)
    for which in filter(None, bench["reference_model"].split(",")):
        nano = bench["nanogpt"]
        for ref in refs:
            if ref == "ddp":
                runs.append(
                    ("torch DDP", which, "float32", functools.partial(
                        torch_ddp, cfg, env, model_config, which, nano, None, total))
                )  # fmt: skip
            elif ref == "ddp-bf16":
                runs.append(
                    ("torch DDP, bf16_compress_hook", which, "bf16", functools.partial(
                        torch_ddp, cfg, env, model_config, which, nano, "bf16", total))
                )  # fmt: skip
            elif ref == "ddp-powersgd":
                runs.append(
                    (f"torch DDP, PowerSGD rank {POWERSGD_RANK}", which, "float32 (low rank)",
                     functools.partial(
                        torch_ddp, cfg, env, model_config, which, nano, "powersgd", total))
                )  # fmt: skip
            elif ref == "fsdp2-bf16":
                runs.append(
                    ("torch FSDP2, reduce bf16", which, "bf16",
                     functools.partial(torch_fsdp2, cfg, env, model_config, which, nano))
                )  # fmt: skip
            elif modules:
                runs.append(
                    ("Decent-DP 0.2.3", which, "float32",
                     functools.partial(theirs, cfg, env, model_config, which, nano, modules))
                )  # fmt: skip
            else:
                runs.append(("Decent-DP (not installed)", which, "-", None))
    for c in allreduce:
        plan = make_plan(c, env, model_config)
        runs.append(
            (f"ours, {c.sharding} ({plan.strategy})", "ours", plan.reduce_precision,
             functools.partial(ours, c, env, model_config))
        )  # fmt: skip
    if bench["decentralized"]:
        runs.append(
            ("ours, decentralized"
             + (f", global average every {cfg.global_average_every}"
                if cfg.global_average_every else "")
             + (f", accum_steps {cfg.accum_steps}" if cfg.accum_steps > 1 else ""),
             "ours", cfg.gossip_dtype,
             functools.partial(ours, cfg, env, model_config))
        )  # fmt: skip
    if bench["compute_row"]:
        runs.append(
            ("compute alone", "ours", "-", functools.partial(compute_alone, cfg, env, model_config))
        )
    # ours first: a launch that meets its time limit has the rows it was run for (the references'
    # own rows are on record already)
    runs.sort(key=lambda run: not run[0].startswith("ours"))
    if env.is_main:
        print(HEADER, flush=True)
    for name, which, wire, build in runs:
        step, losses, times, val = drive(build, tokens, bench) if build else (None,) * 4
        failed = val if isinstance(val, str) else None
        val = None if failed else val
        if not env.is_main:
            continue
        row = dict(
            implementation=name,
            model=which,
            topology=cfg.topology,
            ranks=env.world_size,
            params=params,
            batch=cfg.batch_size,
            seq=model_config.seq_length,
            layers=model_config.num_layers,
            heads=model_config.num_heads,
            embed=model_config.embed_size,
            vocab=model_config.vocab_size,
            precision=cfg.precision,
            steps=bench["steps"],
            wire=wire,
            step_ms=step and 1000 * step,
            tokens_per_s=step and per_step / step,
            val_loss=val,
            **({"failed": failed} if failed else {}),
            data=bench["text"] or "synthetic",
            torch=torch.__version__,
        )
        cells = (
            name,
            which,
            cfg.topology,
            env.world_size,
            f"{params / 1e6:.2f}M",
            cfg.batch_size,
            wire,
            f"{1000 * step:.1f}" if step else failed or "-",
            f"{per_step / step:,.0f}" if step else "-",
            f"{val:.4f}" if val else "-",
        )
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        if bench["out"]:
            with open(bench["out"], "a") as f:
                f.write(json.dumps(row) + "\n")
        if bench["loss_out"] and losses:
            with open(bench["loss_out"], "a") as f:
                f.write(json.dumps(dict(row, losses=losses, step_s=times)) + "\n")
    environment.teardown()


if __name__ == "__main__":
    main()

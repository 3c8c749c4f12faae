"""The single-process reference that multi-rank runs are compared against, written from the
documented behaviour with plain PyTorch and NumPy: the warmup + cosine formula, torch.optim.AdamW
with its parameter groups, F.cross_entropy, batches sliced from the prepared train.bin by index
arithmetic, and initial weights re-derived from their rule. Only the models (GPT, Llama: their
presets and forward) and the flag parser come from the package, so a bug in the package's schedule,
optimizer groups, initialization or batch sampler shows up as a mismatch.
"""

import functools
import json
import math
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.models.gpt import GPT
from minimal_fsdp.models.llama import Llama

# Projections that write into the residual stream: GPT-2 scales their init by 1/sqrt(2 * layers).
RESIDUAL = ("attn.proj.weight", "mlp.proj.weight", "o_proj.weight", "down_proj.weight")


def lr_at(step, lr, min_lr, warmup, horizon):
    """Learning rate of optimizer step `step` (counted from 0): linear warmup reaching `lr` at the
    last warmup step, then a cosine from `lr` down to `min_lr` at step `horizon`, flat after it."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def schedule(cfg, horizon):
    """lr_at with a run's flags: --min_lr defaults to --lr / 10."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    return functools.partial(
        lr_at, lr=cfg.lr, min_lr=min_lr, warmup=cfg.warmup_steps, horizon=horizon
    )


def run_length(cfg, world, train_tokens):
    """Optimizer steps of a run: --max_steps, or --max_epochs passes over the train blocks,
    whichever ends first when both are given (--max_steps 0: no cap). An epoch is as many whole
    steps of world x batch x accumulation blocks as the (train_tokens - 1) // seq_length blocks fill
    (at least 1)."""
    per_epoch = max(
        1, (train_tokens - 1) // cfg.seq_length // (world * cfg.batch_size * cfg.grad_accum_steps)
    )
    if cfg.max_epochs is None:
        return cfg.max_steps
    steps = cfg.max_epochs * per_epoch
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


class PreparedTokens:
    """train.bin and val.bin of the one dataset prepared under --data_dir, read with NumPy."""

    def __init__(self, data_dir):
        (directory,) = {path.parent for path in Path(data_dir).rglob("train.bin")}
        meta = json.loads((directory / "meta.json").read_text())
        self.vocab_size = meta["vocab_size"]
        self.tokens = {
            split: np.fromfile(directory / f"{split}.bin", dtype=meta["dtype"])
            for split in ("train", "val")
        }
        self.orders = {}  # (seed, split, blocks, epoch) -> that epoch's permutation of the blocks

    def order(self, seed, split, blocks, epoch):
        key = (seed, split, blocks, epoch)
        if key not in self.orders:
            self.orders[key] = np.random.default_rng(
                [seed, int(split == "train"), epoch]
            ).permutation(blocks)
        return self.orders[key]

    def batch(self, split, index, rank, world, batch_size, seq, seed):
        """Micro-batch `index` of `rank`. A split of N tokens has N - 1 targets; epoch e cuts it
        into (N - 1) // seq blocks of seq + 1 tokens starting every seq tokens from an offset: for
        train, drawn from numpy's default_rng([seed, 2, e]).integers(seq), for val 0. A block that
        runs past the last token goes on at token 1. Each epoch visits its blocks in a permutation
        seeded by (seed, split is train, epoch); that stream of blocks is dealt out batch_size at a
        time, rank 0 first, then rank 1, ..."""
        tokens = self.tokens[split]
        targets = len(tokens) - 1
        blocks = targets // seq
        rows = []
        for j in range(batch_size):
            epoch, k = divmod((index * world + rank) * batch_size + j, blocks)
            offset = (
                int(np.random.default_rng([seed, 2, epoch]).integers(seq))
                if split == "train"
                else 0
            )
            start = (offset + int(self.order(seed, split, blocks, epoch)[k]) * seq) % targets
            positions = [
                start + i if start + i <= targets else start + i - targets for i in range(seq + 1)
            ]
            rows.append(tokens[positions].astype(np.int64))
        rows = torch.from_numpy(np.stack(rows))
        return rows[:, :-1], rows[:, 1:]

    def global_batch(self, split, index, world, batch_size, seq, seed):
        """Every rank's micro-batch `index`, concatenated (rank 0's rows first)."""
        parts = [
            self.batch(split, index, rank, world, batch_size, seq, seed) for rank in range(world)
        ]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


@torch.no_grad()
def initialize(model, seed, device):
    """Every parameter drawn from its own generator seeded by seed * 1_000_003 + crc32(its name):
    N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * layers)); norm weights 1, biases 0."""
    layers = model.config.num_layers
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        if name.endswith("bias"):
            param.zero_()
        elif "Norm" in type(module).__name__:
            param.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(RESIDUAL) else 0.02
            generator = torch.Generator(device=device).manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode())
            )
            param.copy_(
                torch.empty(param.shape, device=device).normal_(0.0, std, generator=generator)
            )


def param_groups(model, weight_decay):
    """Weight decay on matrices and embeddings (>= 2-D) only, not on biases and norm weights."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(model, cfg):
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, 0.95 if cfg.beta2 is None else cfg.beta2),
    )


def plain_loss(x, weight, targets):
    """Mean next-token cross-entropy of the (tied) output projection's logits."""
    logits = F.linear(x, weight)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def drop_none(fields):
    return {k: v for k, v in fields.items() if v is not None}


def build(cfg, vocab_size, device):
    """The flags' model (--model_preset's shape with the explicit shape flags applied), initialized
    as above, with the plain loss."""
    shape = dict(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        embed_size=cfg.embed_size,
        seq_length=cfg.seq_length,
        dropout=cfg.dropout,
        vocab_size=cfg.vocab_size or vocab_size,
    )
    if cfg.model == "llama":
        shape.update(num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size)
        model = Llama(Llama.config_class(**{**Llama.presets[cfg.model_preset], **drop_none(shape)}))
    else:
        model = GPT(
            GPT.config_class(
                **{**GPT.presets[cfg.model_preset], **drop_none(dict(shape, bias=cfg.bias))}
            )
        )
    model.to(device)
    initialize(model, cfg.seed, device)
    model.loss = plain_loss
    return model


def train(args, world, device="cpu", steps=None):
    """The run of basic_training.py `args` on `world` ranks, done in one process: whole model, every
    rank's batch of each micro-step concatenated. Returns (the cfg, the data, the model, each step's
    mean loss)."""
    cfg = parse_args([str(a) for a in args])
    data = PreparedTokens(cfg.data_dir)
    device = torch.device(device)
    model = build(cfg, data.vocab_size, device)
    optimizer = adamw(model, cfg)
    seq, accum = cfg.seq_length, cfg.grad_accum_steps
    horizon = run_length(cfg, world, len(data.tokens["train"]))
    lr = schedule(cfg, horizon)
    losses = []
    for step in range(horizon if steps is None else steps):
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        total = 0.0
        for micro in range(accum):  # the micro-batches of one step, each over every rank's rows
            x, y = data.global_batch(
                "train", step * accum + micro, world, cfg.batch_size, seq, cfg.seed
            )
            loss = model(x.to(device), y.to(device)) / accum
            loss.backward()
            total += loss.item()
        apply_gradients(model, optimizer, cfg)
        losses.append(total)
    return cfg, data, model, losses


def apply_gradients(model, optimizer, cfg):
    """The end of a reference step: clip the global gradient norm to --grad_clip (0: none), step,
    clear."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad()


@torch.no_grad()
def val_loss(model, data, cfg, world):
    """The evaluation's val loss: mean over every rank's first --eval_batches val micro-batches."""
    model.eval()
    losses = [
        model(*data.batch("val", i, rank, world, cfg.batch_size, cfg.seq_length, cfg.seed)).item()
        for rank in range(world)
        for i in range(cfg.eval_batches)
    ]
    model.train()
    return sum(losses) / len(losses)

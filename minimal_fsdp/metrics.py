"""What a run tells you: the startup banner, and the metrics rank 0 writes while training.

<log_dir>/<run_name>/ holds metrics.jsonl (always: one JSON object per logged step), TensorBoard event files
(unless --no-tensorboard), and config.toml (the resolved flags, loadable with --config). With --wandb the
same scalars go to Weights & Biases (WANDB_MODE=offline writes them locally for a later `wandb sync`).
"""
import dataclasses
import json
from pathlib import Path

from . import environment
from .config import to_toml

# JSONL field -> TensorBoard / wandb tag; grouped so the dashboards put loss, speed and memory apart.
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s", "step_time": "perf/step_time_s", "mfu": "perf/mfu",
        "peak_mem_gb": "perf/peak_mem_gb"}


class Metrics:
    """Rank 0 logs; the other ranks hold an inert object. Opening is collective (every rank calls it), so a
    failure on rank 0, e.g. wandb refusing to start, stops every rank with the same error."""

    def __init__(self, cfg):
        self.file = self.tensorboard = self.wandb = None
        self.dir = Path(cfg.log_dir) / cfg.run_name
        environment.run_on_main(self._open, cfg)

    def _open(self, cfg):
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.toml").write_text(to_toml(cfg))
        self.file = open(self.dir / "metrics.jsonl", "a")  # a resumed run appends
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(str(self.dir), flush_secs=30)
        if cfg.wandb:
            import wandb  # validate() checked it is installed
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name, dir=str(self.dir),
                                    config=dataclasses.asdict(cfg))

    def log(self, step, **scalars):
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, **scalars}) + "\n")
        self.file.flush()
        tagged = {TAGS.get(name, name): value for name, value in scalars.items()}
        if self.tensorboard:
            for tag, value in tagged.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log(tagged, step=step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.file = self.tensorboard = self.wandb = None


def state_bytes_per_rank(num_params, shard_size, training=True):
    """Parameters, gradients and AdamW moments, all fp32 (bf16 keeps fp32 master weights too), divided over
    the ranks a parameter is sharded across. Activations, the gathered block being computed, and allocator
    slack come on top."""
    bytes_per_param = 4 + 4 + 8 if training else 4
    return num_params * bytes_per_param / shard_size


def _readable(num_bytes):
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.3g} TB"


def banner(cfg, env, mesh, model, resume_from=None, training=True):
    """Rank 0's startup summary: layout, model size, a memory estimate, and every resolved flag."""
    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full size
    shard_size = mesh.shape[-1] if mesh is not None else 1  # no mesh: decentralized, a whole replica per rank
    state = _readable(state_bytes_per_rank(num_params, shard_size, training))
    where = "CPU memory (--cpu_offload)" if cfg.cpu_offload else f"{env.device.type} memory"
    mesh_text = (" x ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
                 if mesh is not None else f"none (decentralized, {cfg.topology} topology)")
    lines = [
        f"launch: {env.world_size} rank(s) = {env.num_nodes} node(s) x {env.local_world_size} rank(s)/node, "
        f"started by {env.launcher}, {env.backend} on {env.device.type}; mesh {mesh_text} ({cfg.sharding})",
        f"model: {num_params / 1e6:.2f}M parameters; params{' + grads + AdamW' if training else ''} take "
        f"~{state} of {where} per rank (sharded over {shard_size}; activations not included)",
        f"{'resuming' if training else 'generating'} from {resume_from}" if resume_from else "starting fresh",
        "config" + (f" ({cfg.config} + command line)" if cfg.config else "") + ":",
    ]
    for section in to_toml(cfg).strip().split("\n\n"):
        header, *entries = section.splitlines()
        lines.append(f"  {header} " + ", ".join(entries))
    return "\n".join(lines)

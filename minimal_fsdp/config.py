"""One config object for a run: built from command-line flags, validated once, passed down explicitly.

Every flag is a field of `Config`; its help text lives beside it, so `basic_training.py --help`
and this file never disagree.
"""
import argparse
import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """Bad user input. Raised identically on every rank before any collective, printed as one line."""


def flag(default, help, choices=None, section="train"):
    return field(default=default, metadata={"help": help, "choices": choices, "section": section})


SHARDING = ("full-shard", "grad-shard", "no-shard", "hybrid-full-shard", "hybrid-grad-shard")
PRECISION = ("float32", "bf16")


@dataclass
class Config:
    # launch
    environment: str = flag("auto", "how ranks are discovered: auto detects MPI/torchrun/SLURM/PBS",
                            ("auto", "local", "pbs"), "launch")
    run_name: str = flag("shakespeare", "labels checkpoints and logs", section="launch")
    seed: int = flag(1337, "seeds init, data order, dropout and sampling", section="launch")
    collective_timeout: float = flag(300.0, "seconds a collective may wait before the run fails",
                                     section="launch")

    # model
    model_preset: str = flag("tiny", "model shape; explicit model flags override it",
                             ("tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"), "model")
    num_layers: int = flag(None, "transformer blocks", section="model")
    num_heads: int = flag(None, "attention heads", section="model")
    embed_size: int = flag(None, "model width", section="model")
    seq_length: int = flag(None, "tokens per training sequence (and the model's context)", section="model")
    vocab_size: int = flag(None, "embedding rows; default: the tokenizer's vocabulary", section="model")
    dropout: float = flag(None, "dropout probability", section="model")

    # parallelism
    sharding: str = flag("full-shard", "FSDP sharding strategy", SHARDING, "parallel")
    shard_group_size: int = flag(None, "ranks per shard group for hybrid sharding (default: ranks per node)",
                                 section="parallel")
    precision: str = flag("float32", "float32, or bf16 params/compute with fp32 reduction and master weights",
                          PRECISION, "parallel")
    cpu_offload: bool = flag(False, "keep sharded params, grads and optimizer state in CPU memory",
                             section="parallel")
    activation_checkpoints: bool = flag(False, "recompute each block's activations in backward",
                                        section="parallel")
    meta_init: bool = flag(False, "build on the meta device, shard, then initialize only the local shard",
                           section="parallel")
    compile: bool = flag(False, "torch.compile each transformer block", section="parallel")

    # data
    dataset: str = flag("shakespeare", "shakespeare (fetched on first run) or text (--input_file)",
                        ("shakespeare", "text"), "data")
    input_file: str = flag(None, "for --dataset text: a UTF-8 text file, a .jsonl file of {\"text\": ...} lines, "
                                 "or a directory of .txt/.jsonl files", section="data")
    dataset_path: str = flag(None, "instead of --dataset: a directory written by `python -m minimal_fsdp.data "
                                   "prepare`; with --streaming, a .jsonl/.txt file or directory, a Hugging Face "
                                   "dataset saved with save_to_disk, or a hub dataset (NAME or NAME:CONFIG)",
                             section="data")
    streaming: bool = flag(False, "tokenize --dataset_path on the fly instead of preparing it; rank r reads every "
                                  "world-size-th document; needs --max_steps", section="data")
    tokenizer_dir: str = flag(None, "with --streaming: use the tokenizer saved in this directory (a prepared "
                                    "dataset or a checkpoint) instead of --tokenizer", section="data")
    data_dir: str = flag("data", "where prepared datasets live", section="data")
    tokenizer: str = flag("char", "char works offline; gpt2 needs tiktoken's encoding file",
                          ("char", "gpt2", "sentencepiece"), "data")
    val_fraction: float = flag(0.1, "share held out for validation: documents picked by --seed, or the tail of a "
                                    "single text", section="data")

    # training
    max_epochs: int = flag(1, "passes over the training tokens; -1 skips training and only generates")
    max_steps: int = flag(600, "stop after this many optimizer steps if that comes before --max_epochs "
                               "(the default keeps the first run to minutes on a laptop; 0: no cap)")
    batch_size: int = flag(16, "sequences per rank per micro-step")
    grad_accum_steps: int = flag(1, "micro-steps per optimizer step")
    lr: float = flag(3e-3, "peak learning rate (the default suits the tiny preset; GPT-2 sizes want ~6e-4)")
    min_lr: float = flag(None, "final learning rate of the cosine decay (default lr/10)")
    warmup_steps: int = flag(50, "linear warmup steps")
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices")
    beta1: float = flag(0.9, "AdamW beta1")
    beta2: float = flag(0.95, "AdamW beta2")
    grad_clip: float = flag(1.0, "clip the global grad norm to this (0 disables)")
    eval_interval: int = flag(200, "evaluate on the val split every N steps (0: only at the end)")
    eval_batches: int = flag(10, "batches per rank in each evaluation")
    log_interval: int = flag(10, "average and log the loss every N steps")

    # checkpoints and logs
    checkpoint_dir: str = flag("checkpoints", "checkpoints go to <checkpoint_dir>/<run_name>/step_<N>",
                               section="checkpoint")
    restart_checkpoint_file: str = flag(None, "a checkpoint directory to start from (default: the run's latest)",
                                        section="checkpoint")
    checkpoint_interval: int = flag(0, "also save every N steps (0: only at epoch ends)", section="checkpoint")
    log_dir: str = flag("logs", "metrics go to <log_dir>/<run_name>/metrics.jsonl", section="checkpoint")

    # generation
    prompt: str = flag("ROMEO:", "text to continue after training or with --max_epochs -1", section="generate")
    num_tokens: int = flag(200, "tokens to generate (0: no sample)", section="generate")
    temperature: float = flag(0.8, "sampling temperature (0: greedy)", section="generate")
    top_k: int = flag(50, "sample from the k most likely tokens (0: all)", section="generate")

    @property
    def generate_only(self):
        return self.max_epochs < 0


class _Parser(argparse.ArgumentParser):
    """argparse exits with a usage dump on a bad flag; we want one line and the same exit path as other errors."""

    def error(self, message):
        raise ConfigError(message)


def build_parser():
    parser = _Parser(
        description="Pre-train a GPT with FSDP2; launch with `mpiexec -n GPUS python basic_training.py`.")
    for f in dataclasses.fields(Config):
        meta, name = f.metadata, "--" + f.name
        if f.type is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        else:
            parser.add_argument(name, type=f.type, default=f.default, choices=meta["choices"], help=meta["help"])
    return parser


def parse_args(argv=None):
    cfg = Config(**vars(build_parser().parse_args(argv)))
    validate(cfg)
    return cfg


def validate(cfg):
    """Checks that need only the flags. Checks that need the world size, data or checkpoints live where
    those are known, and run before the first collective that could hang."""
    positive = ["batch_size", "grad_accum_steps", "num_layers", "num_heads", "embed_size", "seq_length",
                "vocab_size", "shard_group_size", "log_interval", "eval_batches"]
    for name in positive:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name} must be positive (got {value})")
    for name in ("max_steps", "num_tokens", "checkpoint_interval", "eval_interval", "warmup_steps"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be 0 or positive (got {getattr(cfg, name)})")
    if cfg.lr <= 0:
        raise ConfigError(f"--lr must be positive (got {cfg.lr})")
    if cfg.dropout is not None and not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout must be in [0, 1) (got {cfg.dropout})")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"--val_fraction must be in (0, 1) (got {cfg.val_fraction})")
    if cfg.dataset == "text" and not cfg.input_file:
        raise ConfigError("--dataset text needs --input_file PATH")
    if cfg.streaming and not cfg.dataset_path:
        raise ConfigError("--streaming needs --dataset_path (the documents to stream)")
    if cfg.streaming and not cfg.max_steps:
        raise ConfigError("--streaming needs --max_steps: a stream's length is unknown, so epochs cannot end the run")
    if cfg.tokenizer_dir and not cfg.streaming:
        raise ConfigError("--tokenizer_dir is for --streaming (a prepared --dataset_path carries its tokenizer)")
    if cfg.tokenizer == "sentencepiece" and cfg.vocab_size is None and not cfg.dataset_path:
        raise ConfigError("--tokenizer sentencepiece needs --vocab_size (the BPE vocabulary to train)")
    if cfg.embed_size and cfg.num_heads and cfg.embed_size % cfg.num_heads:
        raise ConfigError(f"--embed_size must be divisible by --num_heads (got {cfg.embed_size} and {cfg.num_heads})")


def validate_world(cfg, world_size, local_world_size):
    """Checks that need the launch layout; same inputs on every rank, so the same verdict everywhere."""
    if cfg.sharding.startswith("hybrid"):
        group = cfg.shard_group_size or local_world_size
        if world_size % group:
            raise ConfigError(f"--sharding {cfg.sharding} needs world size divisible by --shard_group_size "
                              f"(got {world_size} and {group})")

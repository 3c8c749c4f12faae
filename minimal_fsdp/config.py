"""One config object for a run: built from command-line flags (and an optional TOML file), validated once,
passed down explicitly.

Every flag is a field of `Config`; its help text lives beside it, so `basic_training.py --help`
and this file never disagree. A `--config run.toml` file sets the same names, grouped by each field's
section; flags given on the command line override it.
"""
import argparse
import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field

from .fp8 import RECIPES as FP8_RECIPES
from .gossip import TOPOLOGIES
from .llama import PRESETS as LLAMA_PRESETS
from .model import PRESETS as GPT_PRESETS
from .parallelize import DATA_PARALLEL, FSDP_UNITS, GRAPHS_MODEL, PRECISION, SHARDING, SMALL_MODEL


class ConfigError(ValueError):
    """Bad user input. Raised identically on every rank before any collective, printed as one line."""


def one_line_errors(main):
    """A command-line entry point whose bad input (ConfigError) ends it with one `error:` line and exit code 2."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
    return run


def flag(default, help, choices=None, section="train"):
    return field(default=default, metadata={"help": help, "choices": choices, "section": section})


# Preset names of each --model; "tiny" exists in both. The choices below live in the modules that act on them.
MODEL_PRESETS = {"gpt": tuple(GPT_PRESETS), "llama": tuple(LLAMA_PRESETS)}
SHAPE_FLAGS = ("num_layers", "num_heads", "embed_size", "vocab_size", "num_kv_heads", "intermediate_size", "bias")
DEVICE = ("auto", "xla")


@dataclass
class Config:
    # launch
    config: str = flag(None, "TOML file of flag values, in sections as configs/*.toml; command-line flags "
                             "override it", section="launch")
    environment: str = flag("auto", "how ranks are discovered: auto detects torchrun, MPI (mpiexec) and srun; "
                            "pbs also counts nodes from PBS_NODEFILE", ("auto", "local", "pbs"), "launch")
    run_name: str = flag("shakespeare", "labels checkpoints and logs", section="launch")
    seed: int = flag(1337, "seeds init, data order, dropout and sampling", section="launch")
    collective_timeout: float = flag(300.0, "seconds a collective may wait before the run fails, so a dead or "
                                            "hung rank ends the job instead of idling until walltime",
                                     section="launch")
    time_limit: str = flag(None, "HH:MM:SS after the start at which every rank saves a checkpoint at the next step "
                                 "and exits 0; set it below the job's walltime by one save's duration",
                           section="launch")

    # model
    model: str = flag(None, "architecture: gpt (GPT-2) or llama; default: the family of --model_preset "
                            "(tiny: gpt)", ("gpt", "llama"), "model")
    model_preset: str = flag("tiny", "model shape; explicit model flags override it",
                             tuple(dict.fromkeys(n for names in MODEL_PRESETS.values() for n in names)), "model")
    hf_model: str = flag(None, "start from a Hugging Face GPT-2 or Llama checkpoint: a local directory "
                               "(config.json + safetensors or .bin) or a hub name (fetched if the hub is "
                               "reachable); its shape and tokenizer replace --model_preset and --tokenizer",
                         section="model")
    num_layers: int = flag(None, "transformer blocks", section="model")
    num_heads: int = flag(None, "attention heads", section="model")
    embed_size: int = flag(None, "model width", section="model")
    seq_length: int = flag(None, "tokens per training sequence (and the model's context)", section="model")
    vocab_size: int = flag(None, "embedding rows; default: the tokenizer's vocabulary", section="model")
    dropout: float = flag(None, "dropout probability", section="model")
    num_kv_heads: int = flag(None, "llama: heads with their own keys and values (grouped-query attention)",
                             section="model")
    intermediate_size: int = flag(None, "llama: hidden width of the SwiGLU MLP", section="model")
    bias: bool = flag(None, "gpt: biases in the linear layers and LayerNorms (GPT-2 has them; --no-bias is "
                            "nanoGPT's benchmark setting and a little faster)", section="model")

    # parallelism
    device: str = flag("auto", "auto: CUDA GPUs if present, else CPU; xla: PyTorch/XLA (TPU, or XLA:CPU with "
                       "PJRT_DEVICE=CPU), one process per host, parameters sharded over all devices with SPMD "
                       "(docs/xla.md)", DEVICE, "parallel")
    sharding: str = flag("full-shard", "FSDP sharding strategy", SHARDING, "parallel")
    shard_group_size: int = flag(None, "ranks per shard group for hybrid sharding (default: ranks per node)",
                                 section="parallel")
    precision: str = flag("float32", "float32; bf16 params/compute with fp32 reduction and master weights; or fp8: "
                                     "bf16 plus float8 matmuls in the blocks' large linear layers (torchao; GPUs of "
                                     "compute capability 8.9+: H100, H200, L40S; see docs/fp8.md)", PRECISION,
                          "parallel")
    fp8_recipe: str = flag("tensorwise", "--precision fp8's scaling: tensorwise (one scale per tensor; FSDP "
                                         "all-gathers the weights in float8) or rowwise (a scale per row: more "
                                         "accurate, slower)", FP8_RECIPES, "parallel")
    fsdp_unit: str = flag("auto", "what is gathered and freed at once: block (one transformer block at a time by "
                          "FSDP2, communication overlapped with compute: large models) or model (the whole model "
                          "kept gathered, one all-gather and one reduce-scatter a step and one compiled graph, "
                          "replayable as CUDA graphs: small models, whose step is bound by per-block host work); "
                          f"auto: model up to {SMALL_MODEL // 10**6}M parameters", FSDP_UNITS, "parallel")
    cpu_offload: bool = flag(False, "keep sharded params, grads and optimizer state in CPU memory",
                             section="parallel")
    activation_checkpoints: bool = flag(False, "recompute each block's activations in backward",
                                        section="parallel")
    recompute: str = flag("full", "what --activation_checkpoints recomputes: full (the whole block from its "
                          "input: least memory) or selective (norms and activations only: matmul and attention "
                          "outputs are kept)", ("full", "selective"), "parallel")
    meta_init: bool = flag(False, "build on the meta device, shard, then initialize only the local shard",
                           section="parallel")
    compile: bool = flag(False, "torch.compile each transformer block (FSDP units per block), or the whole model "
                                "(one rank, no-shard, or the whole model as one unit: --fsdp_unit)",
                         section="parallel")
    cuda_graphs: bool = flag(None, "with --compile where the whole model is compiled (one rank, no-shard, or one "
                                   "unit without --cpu_offload): replay the compiled model "
                                   "as CUDA graphs (torch.compile's reduce-overhead mode), for small models whose "
                                   "step is bound by the host launching kernels; unset: on for models up to "
                                   f"{GRAPHS_MODEL // 10**6}M parameters (not with fp8 or decentralized)",
                             section="parallel")

    # decentralized data parallel (gossip.py, accum_adamw.py)
    data_parallel: str = flag("allreduce", "allreduce: one model, gradients averaged over all ranks (FSDP; for "
                              "no-shard, one all-reduce: DDP, or a small model's one unit); "
                              "decentralized: every rank trains its own whole replica and averages parameters "
                              "with its --topology neighbours each step (no sharding)", DATA_PARALLEL,
                              "decentralized")
    topology: str = flag("alternating-exp-ring", "decentralized: whom each rank averages with: complete (all), "
                         "ring (two neighbours), exp (one peer at distance 1, 2, 4, ... in turn), "
                         "alternating-exp-ring (exp and ring steps in turn)", TOPOLOGIES, "decentralized")
    accum_steps: int = flag(1, "decentralized (AccumAdamW): Adam's moments take the mean gradient of this many "
                            "steps, while parameters still move every step (unlike --grad_accum_steps)",
                            section="decentralized")

    # data
    dataset: str = flag("shakespeare", "shakespeare (tinyshakespeare, shipped in data/shakespeare/input.txt) or "
                                       "text (--input_file)",
                        ("shakespeare", "text"), "data")
    input_file: str = flag(None, "for --dataset text: a UTF-8 text file, a .jsonl file of {\"text\": ...} lines, "
                                 "or a directory of .txt/.jsonl files", section="data")
    dataset_path: str = flag(None, "instead of --dataset: a directory written by `python -m minimal_fsdp.data "
                                   "prepare`; with --streaming, a .jsonl/.txt file or directory, a Hugging Face "
                                   "dataset saved with save_to_disk, or a hub dataset (NAME or NAME:CONFIG)",
                             section="data")
    streaming: bool = flag(False, "tokenize --dataset_path on the fly instead of preparing it; rank r reads every "
                                  "world-size-th document; needs --max_steps", section="data")
    tokenizer_dir: str = flag(None, "use the tokenizer in this directory instead of --tokenizer: a Hugging Face "
                                    "model's (tokenizer.json, vocab.json + merges.txt, or tokenizer.model: GPT-2, "
                                    "Llama 2 and 3), a prepared dataset's, a checkpoint's or an export's",
                              section="data")
    data_dir: str = flag("data", "where prepared datasets live", section="data")
    tokenizer: str = flag("char", "char works offline; gpt2 needs tiktoken's encoding file; sentencepiece is "
                                  "trained on the data (--vocab_size); for a Hugging Face model's tokenizer "
                                  "(Llama 3's, say) pass --tokenizer_dir instead", ("char", "gpt2", "sentencepiece"),
                          "data")
    val_fraction: float = flag(0.1, "share held out for validation: documents picked by --seed, or the tail of a "
                                    "single text", section="data")

    # training
    max_epochs: int = flag(None, "passes over the training tokens; with --max_steps too, the run stops at whichever "
                                 "comes first; -1 skips training and only generates")
    max_steps: int = flag(600, "optimizer steps to train (the default keeps the first run to minutes on a laptop; "
                               "0: no cap, --max_epochs sets the length)")
    batch_size: int = flag(16, "sequences per rank per micro-step")
    grad_accum_steps: int = flag(1, "micro-steps per optimizer step")
    lr: float = flag(3e-3, "peak learning rate (the default suits the tiny preset; GPT-2 sizes want ~6e-4)")
    min_lr: float = flag(None, "final learning rate of the cosine decay (default lr/10)")
    warmup_steps: int = flag(50, "linear warmup steps")
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices")
    beta1: float = flag(0.9, "AdamW beta1")
    beta2: float = flag(None, "AdamW beta2 (default 0.95; 0.98 with --data_parallel decentralized)")
    lr_decay_steps: int = flag(None, "steps the warmup + cosine schedule spans (default: the first launch's "
                                     "--max_epochs/--max_steps length, kept on resume); set it to stop early with "
                                     "--max_steps and continue later on the same schedule")
    grad_clip: float = flag(1.0, "clip the global grad norm to this (0 disables)")
    skip_nonfinite: int = flag(0, "skip up to N optimizer steps whose grad norm is NaN/Inf before stopping "
                                  "(0: stop at the first)")
    eval_interval: int = flag(200, "evaluate on the val split every N steps (0: only at checkpoints and the end)")
    eval_batches: int = flag(10, "batches per rank in each evaluation")
    log_interval: int = flag(10, "average and log the loss every N steps")

    # checkpoints
    checkpoint_dir: str = flag("checkpoints", "checkpoints go to <checkpoint_dir>/<run_name>/step_<N>",
                               section="checkpoint")
    restart_checkpoint_file: str = flag(None, "a checkpoint directory (or a run's `latest`/`best` marker) to start "
                                              "from, overriding --resume", section="checkpoint")
    resume: str = flag("auto", "auto: continue from the run's newest complete checkpoint, if any; never: start "
                               "fresh, refusing a run directory that already holds checkpoints",
                       ("auto", "never"), "checkpoint")
    checkpoint_interval: int = flag(1000, "save every N steps, and at the end (0: only at the end)",
                                    section="checkpoint")
    keep_last: int = flag(3, "keep the newest K checkpoints of the run, plus the `best` one (0: keep all)",
                          section="checkpoint")

    save_average: bool = flag(False, "decentralized: checkpoints keep only the average of the replicas, "
                              "not each rank's own", section="checkpoint")

    # logs
    log_dir: str = flag("logs", "metrics.jsonl, TensorBoard events and config.toml go to <log_dir>/<run_name>/",
                        section="log")
    tensorboard: bool = flag(True, "write TensorBoard scalars (tensorboard --logdir <log_dir>)", section="log")
    wandb: bool = flag(False, "also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works "
                              "without network)", section="log")
    wandb_project: str = flag("minimal_fsdp", "wandb project for --wandb", section="log")

    # generation
    prompt: str = flag("ROMEO:", "text to continue after training or with --max_epochs -1", section="generate")
    num_tokens: int = flag(200, "tokens to generate (0: no sample)", section="generate")
    temperature: float = flag(0.8, "sampling temperature (0: greedy)", section="generate")
    top_k: int = flag(50, "sample from the k most likely tokens (0: all)", section="generate")

    @property
    def generate_only(self):
        return self.max_epochs is not None and self.max_epochs < 0

    @property
    def time_limit_seconds(self):
        return parse_duration(self.time_limit) if self.time_limit else None


def parse_duration(text):
    """'HH:MM:SS' (also 'MM:SS' or 'SS', as PBS and SLURM write walltimes) -> seconds."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts):
        raise ConfigError(f"--time_limit must look like HH:MM:SS (got {text!r})")
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + p
    return seconds


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
    """Defaults < --config file < command line. The command line is read twice: once for --config, then in
    full with the file's values as the defaults."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    config_file = parser.parse_known_args(argv)[0].config
    if config_file:
        parser.set_defaults(**load_config_file(config_file))
    cfg = Config(**vars(parser.parse_args(argv)))
    validate(cfg)
    return cfg


SECTIONS = tuple(dict.fromkeys(f.metadata["section"] for f in dataclasses.fields(Config)))
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _read_toml(path):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("--config needs tomli on Python < 3.11: pip install tomli") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not a UTF-8 text file (TOML)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: {e}") from None


def load_config_file(path):
    """{flag name: value} from a TOML file whose tables are Config's sections and whose keys are its flags.
    Unknown or misplaced keys and wrong types are one-line errors that name section.key."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = {}
    for section, table in _read_toml(path).items():
        if not isinstance(table, dict):
            home = fields[section].metadata["section"] if section in fields else None
            where = f"put it under [{home}]" if home else "sections are " + ", ".join(SECTIONS)
            raise ConfigError(f"--config {path}: '{section}' is outside any section; {where}")
        if section not in SECTIONS:
            raise ConfigError(f"--config {path}: unknown section [{section}]; sections are {', '.join(SECTIONS)}")
        for key, value in table.items():
            f = fields.get(key)
            if f is None or key == "config":
                close = difflib.get_close_matches(key, [n for n in fields if n != "config"], n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"--config {path}: unknown key {section}.{key}{hint}")
            if f.metadata["section"] != section:
                raise ConfigError(f"--config {path}: {section}.{key} belongs in [{f.metadata['section']}]")
            values[key] = _checked(f, value, f"--config {path}: {section}.{key}")
    return values


def _checked(f, value, where):
    ok = isinstance(value, f.type) and not (f.type is int and isinstance(value, bool))
    if f.type is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True  # TOML writes 1 for 1.0
    if not ok:
        raise ConfigError(f"{where} must be {_TYPE_NAMES[f.type]} (got {value!r})")
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)} (got {value!r})")
    return value


def to_toml(cfg):
    """The resolved config as a file --config accepts. Unset (None) values are left out: TOML has no null."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.metadata["section"] == section and f.name != "config" and value is not None:
                text = json.dumps(value, ensure_ascii=False) if isinstance(value, (str, bool)) else repr(value)
                lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)


def validate(cfg):
    """Checks that need only the flags. Checks that need the world size, data or checkpoints live where
    those are known, and run before the first collective that could hang."""
    positive = ["batch_size", "grad_accum_steps", "num_layers", "num_heads", "embed_size", "seq_length",
                "vocab_size", "shard_group_size", "log_interval", "eval_batches", "lr_decay_steps", "num_kv_heads",
                "intermediate_size", "accum_steps"]
    for name in positive:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name} must be positive (got {value})")
    for name in ("max_steps", "num_tokens", "checkpoint_interval", "eval_interval", "warmup_steps", "keep_last",
                 "skip_nonfinite"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be 0 or positive (got {getattr(cfg, name)})")
    if cfg.time_limit:
        parse_duration(cfg.time_limit)
    validate_values(cfg)
    if cfg.dataset == "text" and not cfg.input_file:
        raise ConfigError("--dataset text needs --input_file PATH")
    if cfg.streaming and not cfg.dataset_path:
        raise ConfigError("--streaming needs --dataset_path (the documents to stream)")
    if cfg.streaming and not cfg.max_steps:
        raise ConfigError("--streaming needs --max_steps: a stream's length is unknown, so epochs cannot end the run")
    if cfg.tokenizer_dir and cfg.dataset_path and not cfg.streaming:
        raise ConfigError("a prepared --dataset_path carries its own tokenizer: drop --tokenizer_dir")
    if cfg.tokenizer_dir and cfg.tokenizer != "char":  # char is the default: not asked for
        raise ConfigError(f"--tokenizer_dir replaces --tokenizer: drop --tokenizer {cfg.tokenizer}")
    if cfg.tokenizer == "sentencepiece" and cfg.vocab_size is None and not cfg.dataset_path:
        raise ConfigError("--tokenizer sentencepiece needs --vocab_size (the BPE vocabulary to train)")
    if cfg.cuda_graphs and not cfg.compile:
        raise ConfigError("--cuda_graphs replays the compiled model: add --compile")
    if cfg.fp8_recipe != "tensorwise" and cfg.precision != "fp8":
        raise ConfigError(f"--fp8_recipe {cfg.fp8_recipe} applies with --precision fp8: add it")
    if cfg.precision == "fp8" and not cfg.generate_only and importlib.util.find_spec("torchao") is None:
        raise ConfigError("--precision fp8 needs torchao: pip install -e \".[fp8]\" (offline: see docs/fp8.md)")
    if cfg.recompute != "full" and not cfg.activation_checkpoints:
        raise ConfigError(f"--recompute {cfg.recompute} applies with --activation_checkpoints: add it")
    if cfg.embed_size and cfg.num_heads and cfg.embed_size % cfg.num_heads:
        raise ConfigError(f"--embed_size must be divisible by --num_heads (got {cfg.embed_size} and {cfg.num_heads})")
    for name, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(cfg, name) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--{name} needs the {package} package: pip install {package}")
    if cfg.hf_model:
        given = [name for name in SHAPE_FLAGS if getattr(cfg, name) is not None]
        if given:
            raise ConfigError(f"--{given[0]} cannot change the shape of --hf_model {cfg.hf_model} "
                              "(only --seq_length, to shorten the context, and --dropout apply)")
        if cfg.generate_only and cfg.restart_checkpoint_file:
            raise ConfigError("--max_epochs -1 with --hf_model generates from the Hugging Face model: "
                              "drop --restart_checkpoint_file, or drop --hf_model to generate from the checkpoint")
    elif model_family(cfg) == "gpt":
        for name in ("num_kv_heads", "intermediate_size"):
            if getattr(cfg, name) is not None:
                raise ConfigError(f"--{name} is a llama flag: add --model llama, or drop it")
    elif cfg.bias is not None:
        raise ConfigError("--bias/--no-bias is a gpt flag (llama has no biases): drop it")
    validate_decentralized(cfg)
    validate_xla(cfg)


def _check_range(cfg, name, low, high=None, low_ok=True, note=""):
    """--name, if set, must be a finite number >= low (> low unless low_ok) and, given high, < high."""
    value = getattr(cfg, name)
    if value is None:
        return
    if not (math.isfinite(value) and (value >= low if low_ok else value > low) and (high is None or value < high)):
        opening = "[" if low_ok else "("
        bounds = f"in {opening}{low:g}, {high:g})" if high is not None else f"{'>=' if low_ok else '>'} {low:g}"
        raise ConfigError(f"--{name} must be a finite number {bounds} (got {value}){note}")


def validate_values(cfg):
    """Numbers that would silently corrupt training (a negative clip is gradient ascent, a negative min_lr a
    negative learning rate), or fail deep inside torch with a traceback, are refused here in one line."""
    _check_range(cfg, "lr", 0, low_ok=False)
    _check_range(cfg, "min_lr", 0)
    if cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min_lr {cfg.min_lr} is above --lr {cfg.lr}: the schedule decays from --lr to --min_lr")
    _check_range(cfg, "beta1", 0, 1)
    _check_range(cfg, "beta2", 0, 1)
    _check_range(cfg, "weight_decay", 0)
    _check_range(cfg, "grad_clip", 0, note=" (0 disables clipping)")
    _check_range(cfg, "dropout", 0, 1)
    _check_range(cfg, "val_fraction", 0, 1, low_ok=False)
    _check_range(cfg, "temperature", 0, note=" (0: greedy)")
    _check_range(cfg, "top_k", 0, note=" (0: all tokens)")
    _check_range(cfg, "collective_timeout", 0, low_ok=False, note=" (seconds)")
    if not -2**63 <= cfg.seed < 2**63:  # torch's seeds are 64-bit
        raise ConfigError(f"--seed must be an integer in [-2**63, 2**63) (got {cfg.seed})")
    if cfg.max_epochs is not None and (cfg.max_epochs == 0 or cfg.max_epochs < -1):
        raise ConfigError(f"--max_epochs must be positive, or -1 to only generate (got {cfg.max_epochs})")
    if cfg.max_epochs is None and not cfg.max_steps and not cfg.streaming:  # a stream says it below
        raise ConfigError("--max_steps 0 (no cap) needs --max_epochs to set the run's length")
    name = cfg.run_name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name != name.strip():
        raise ConfigError(f"--run_name must be one plain directory name, without '/' (got {name!r})")


def model_family(cfg):
    """--model, or else the family --model_preset belongs to ("tiny" is gpt's unless --model llama)."""
    if cfg.model is None:
        return next(family for family, presets in MODEL_PRESETS.items() if cfg.model_preset in presets)
    if cfg.model_preset not in MODEL_PRESETS[cfg.model]:
        raise ConfigError(f"--model_preset {cfg.model_preset} is not a {cfg.model} preset (those are "
                          f"{', '.join(MODEL_PRESETS[cfg.model])}): drop --model or pick one of them")
    return cfg.model


def validate_decentralized(cfg):
    if cfg.data_parallel != "decentralized":
        for name, unset in (("accum_steps", 1), ("save_average", False)):
            if getattr(cfg, name) != unset:
                raise ConfigError(f"--{name} applies to --data_parallel decentralized only")
        return
    if cfg.sharding not in ("full-shard", "no-shard"):  # full-shard: the default, i.e. not asked for
        raise ConfigError(f"--data_parallel decentralized keeps a whole replica on every rank: "
                          f"drop --sharding {cfg.sharding}")
    if cfg.cpu_offload:
        raise ConfigError("--cpu_offload offloads FSDP shards; --data_parallel decentralized has none: drop it")
    if cfg.fsdp_unit != "auto":
        raise ConfigError("--fsdp_unit says what FSDP gathers; --data_parallel decentralized has no FSDP: drop it")


def validate_xla(cfg):
    """--device xla trains one way (xla.py): every parameter sharded over every device, no CPU offload."""
    if cfg.device != "xla":
        return
    if importlib.util.find_spec("torch_xla") is None:
        raise ConfigError("--device xla needs torch_xla: pip install -e '.[xla]' (torch_xla 2.9 with torch 2.9)")
    unsupported = {"sharding": cfg.sharding != "full-shard", "shard_group_size": cfg.shard_group_size is not None,
                   "data_parallel": cfg.data_parallel != "allreduce", "cpu_offload": cfg.cpu_offload,
                   "meta_init": cfg.meta_init, "compile": cfg.compile, "recompute": cfg.recompute != "full",
                   "fsdp_unit": cfg.fsdp_unit != "auto"}
    for name, given in unsupported.items():
        if given:
            raise ConfigError(f"--{name} is not available with --device xla, which shards every parameter over "
                              "all devices with SPMD and compiles each step whole (docs/xla.md): drop it")


def validate_world(cfg, world_size, local_world_size, local_world_sizes=()):
    """Checks that need the launch layout; same inputs on every rank, so the same verdict everywhere.
    local_world_sizes: every rank's local world size, gathered (a rank's own can differ from the others')."""
    if cfg.device == "xla" and local_world_size > 1:
        raise ConfigError(f"--device xla runs one process per host, which drives all of the host's devices, but "
                          f"{local_world_size} ranks share this host: launch one rank per host (mpiexec -n HOSTS "
                          "-ppn 1, or plain python on one host)")
    if cfg.sharding.startswith("hybrid"):
        if not cfg.shard_group_size and len(set(local_world_sizes)) > 1:
            sizes = ", ".join(map(str, sorted(set(local_world_sizes))))
            raise ConfigError(f"--sharding {cfg.sharding} shards over the ranks of a node, but nodes run different "
                              f"numbers of ranks ({sizes}): start as many on every node, or set --shard_group_size")
        group = cfg.shard_group_size or local_world_size
        if world_size % group:
            raise ConfigError(f"--sharding {cfg.sharding} needs world size divisible by --shard_group_size "
                              f"(got {world_size} and {group})")

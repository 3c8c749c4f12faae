"""The flags' checks, made once before anything is built: one function per section of Config (the
groups of `--help`, the tables of a --config file), which checks.validate calls in order, each
refusing its own flags' bad values and then the flags they cannot go with; then validate_world (the
flags against the launch layout) and check_sizes (the batch and model against the memory here). The
same flags give the same verdict on every rank, so every rank stops alike before the first
collective.

The subsystems these flags drive (data, streaming, fp8, gossip, hf, evaluate, checkpoint) import
torch and torch.distributed, and most import config; their flag checks live here, by section, so a
bad flag and `--help` answer without importing torch, and no import cycle forms through
config/flags.py.
"""

import importlib.util
import math
import os

from minimal_fsdp.config.choices import MODEL_FLAGS, MODEL_PRESETS, ConfigError

GiB = 2**30
MAX_TIMEOUT = 10**6  # seconds (11.6 days): longer than any job's walltime
SHAPE_FLAGS = (
    "num_layers",
    "num_heads",
    "embed_size",
    "vocab_size",
    "num_kv_heads",
    "intermediate_size",
    "bias",
)
# steps and counts: beyond any run, below where arithmetic on them overflows 64 bits
MAX_WHOLE = 2**62
# Every whole-number flag's range: [lowest, highest]. A checkpoint's meta.json is read with this
# same table (checkpoint/meta.py: its config, its model's sizes, its steps), so every value a run
# accepts round-trips through its checkpoints: a value the next launch would refuse is refused at
# startup instead.
WHOLE_RANGES = {
    "seed": (-(2**63), 2**63 - 1),
    "num_layers": (1, 2**12),
    "num_heads": (1, 2**12),
    "num_kv_heads": (1, 2**12),
    "embed_size": (1, 2**18),
    "seq_length": (1, 2**24),
    "vocab_size": (1, 2**24),
    "intermediate_size": (1, 2**20),
    "shard_group_size": (1, 2**24),
    "accum_steps": (1, MAX_WHOLE),
    "global_average_every": (0, MAX_WHOLE),
    # the run's last step is max_epochs x steps per epoch: 2^20 epochs leaves 2^42 steps an epoch
    # below MAX_WHOLE
    "max_epochs": (-1, 2**20),
    "max_steps": (0, MAX_WHOLE),
    "batch_size": (1, 2**24),
    "grad_accum_steps": (1, MAX_WHOLE),
    "warmup_steps": (0, MAX_WHOLE),
    "lr_decay_steps": (1, MAX_WHOLE),
    "skip_nonfinite": (0, MAX_WHOLE),
    "eval_interval": (0, MAX_WHOLE),
    "eval_batches": (1, MAX_WHOLE),
    # read (and refused below 0) only with --eval_tasks
    "eval_tasks_interval": (-MAX_WHOLE, MAX_WHOLE),
    "log_interval": (1, MAX_WHOLE),
    "checkpoint_interval": (0, MAX_WHOLE),
    "keep_last": (0, MAX_WHOLE),
    "num_tokens": (0, MAX_WHOLE),
    "top_k": (0, MAX_WHOLE),
    # the other commands' (config/commands.py)
    "num_fewshot": (0, 2**20),
    "num_proc": (1, 2**12),
    "gpus": (1, 2**24),
    "gpus_per_node": (1, 2**12),
    # cluster: hosts get the addresses 10.77.0.1.. of one /24 (tools/virtual_cluster.py)
    "hosts": (1, 250),
    "slots": (1, 2**10),
}
# Every number flag's range, [lowest, highest]; each must be finite. The sections' checks below
# refine some (a positive --lr, the bounds they exclude); this table holds for every command, from
# the command line or a --config file, so no value past it reaches torch, the kernel or arithmetic.
NUMBER_RANGES = {
    "lr": (0, 1e6),
    "min_lr": (0, 1e6),
    "beta1": (0, 1),
    "beta2": (0, 1),
    "weight_decay": (0, 1e6),
    "grad_clip": (0, 1e12),
    "dropout": (0, 1),
    "val_fraction": (0, 1),
    "temperature": (0, 1e6),
    "collective_timeout": (0, MAX_TIMEOUT),
    "eval_tasks_limit": (0, MAX_WHOLE),
    "limit": (0, MAX_WHOLE),
    "mfu": (0, 1),
    "inter_node_gbps": (0, 1e9),
    "loss": (0, 100),  # cluster: percent of packets lost
}


def validate(cfg):
    """Checks that need only the flags, section by section; those that need the world size, data or
    checkpoints run where those are known, before the first collective that could hang. Training's
    come first, as the others read --max_epochs (generate_only) and trust it; logging's late, so a
    missing package is named after the flags' own mistakes; --device xla's (xla.py) last."""
    for check in (
        check_train,
        check_launch,
        check_model,
        check_parallel,
        check_decentralized,
        check_data,
        check_checkpoint,
        check_generate,
        check_log,
        validate_xla,
        check_whole_ranges,
    ):
        check(cfg)


def check_whole_ranges(cfg):
    """Every number flag of cfg within its range (check_numbers), after the sections' own checks,
    whose lines say more."""
    check_numbers(cfg)


def check_numbers(flags):
    """Every number field of a flags dataclass (any command's): a whole number within WHOLE_RANGES
    (64 bits where it has no entry), a float finite and within NUMBER_RANGES. ConfigError in one
    line otherwise."""
    import dataclasses

    for f in dataclasses.fields(flags):
        value = getattr(flags, f.name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int):
            low, high = WHOLE_RANGES.get(f.name, (-(2**63), 2**63 - 1))
            if not low <= value <= high:
                raise ConfigError(
                    f"--{f.name} must be a whole number in [{low}, {high}] (got {_number(value)}): "
                    "a checkpoint records it, and a larger value could not be read back"
                )
            continue
        low, high = NUMBER_RANGES.get(f.name, (-math.inf, math.inf))
        if not (math.isfinite(value) and low <= value <= high):
            raise ConfigError(
                f"--{f.name} must be a finite number in [{low:g}, {high:g}] (got {value})"
            )


def _number(value):
    """A whole number for a message: a huge one by its digit count (str() of one past 4300 digits
    raises)."""
    digits = len(format(abs(value), "x")) * 4 * 0.30103
    return str(value) if digits < 60 else f"a number of about {digits:.0f} digits"


def check_train(cfg):
    """The run's length, the optimizer and its schedule, and evaluation (--eval_tasks:
    eval/harness.py)."""
    _positive(
        cfg, "batch_size", "grad_accum_steps", "log_interval", "eval_batches", "lr_decay_steps"
    )
    _not_negative(cfg, "max_steps", "eval_interval", "warmup_steps", "skip_nonfinite")
    _check_range(cfg, "lr", 0, low_ok=False)
    _check_range(cfg, "min_lr", 0)
    if cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise ConfigError(
            f"--min_lr {cfg.min_lr} is above --lr {cfg.lr}: the schedule decays from --lr to "
            f"--min_lr"
        )
    _check_range(cfg, "beta1", 0, 1)
    _check_range(cfg, "beta2", 0, 1)
    _check_range(cfg, "weight_decay", 0)
    _check_range(cfg, "grad_clip", 0, note=" (0 disables clipping)")
    if cfg.max_epochs is not None and (cfg.max_epochs == 0 or cfg.max_epochs < -1):
        raise ConfigError(
            f"--max_epochs must be positive, or -1 to only generate (got {cfg.max_epochs})"
        )
    # check_data says it for a stream
    if cfg.max_epochs is None and not cfg.max_steps and not cfg.streaming:
        raise ConfigError("--max_steps 0 (no cap) needs --max_epochs to set the run's length")
    if cfg.eval_tasks:
        if (
            cfg.eval_tasks_interval < 0
            or cfg.eval_tasks_limit is not None
            and cfg.eval_tasks_limit <= 0
        ):
            raise ConfigError(
                "--eval_tasks_interval must be 0 or positive and --eval_tasks_limit positive (got "
                f"{cfg.eval_tasks_interval} and {cfg.eval_tasks_limit})"
            )
        if cfg.data_parallel == "decentralized":
            raise ConfigError(
                "--eval_tasks scores one model, and under --data_parallel decentralized every rank "
                "trains a replica of its own: evaluate a checkpoint with minimal-fsdp evaluate"
            )


def check_launch(cfg):
    if cfg.time_limit:
        parse_duration(cfg.time_limit)
    # Bounded: torch turns it into a timedelta and then milliseconds, which overflow far above any
    # walltime.
    _check_range(cfg, "collective_timeout", 0, MAX_TIMEOUT, low_ok=False, note=" (seconds)")
    if not -(2**63) <= cfg.seed < 2**63:  # torch's seeds are 64-bit
        raise ConfigError(f"--seed must be an integer in [-2**63, 2**63) (got {cfg.seed})")
    name = cfg.run_name
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or not name.isprintable()
        or name != name.strip()
    ):
        raise ConfigError(
            "--run_name must be one plain directory name on one line, without '/' or control "
            f"characters (got {name!r})"
        )


def check_model(cfg):
    """The model's shape flags, and with --hf_model (hf/read.py) that the model's own shape is not
    changed."""
    _positive(
        cfg,
        "num_layers",
        "num_heads",
        "embed_size",
        "seq_length",
        "vocab_size",
        "num_kv_heads",
        "intermediate_size",
    )
    _check_range(cfg, "dropout", 0, 1)
    if cfg.embed_size and cfg.num_heads and cfg.embed_size % cfg.num_heads:
        raise ConfigError(
            f"--embed_size must be divisible by --num_heads (got {cfg.embed_size} and "
            f"{cfg.num_heads})"
        )
    if cfg.hf_model:
        given = [name for name in SHAPE_FLAGS if getattr(cfg, name) is not None]
        if given:
            raise ConfigError(
                f"--{given[0]} cannot change the shape of --hf_model {cfg.hf_model} "
                "(only --seq_length, to shorten the context, and --dropout apply)"
            )
        if cfg.generate_only and cfg.restart_checkpoint_file:
            raise ConfigError(
                "--max_epochs -1 with --hf_model generates from the Hugging Face model: "
                "drop --restart_checkpoint_file, or drop --hf_model to generate from the checkpoint"
            )
    else:
        family = model_family(cfg)
        for name in dict.fromkeys(n for names in MODEL_FLAGS.values() for n in names):
            takers = [f for f, names in MODEL_FLAGS.items() if name in names]
            value = getattr(cfg, name)
            if value is not None and family not in takers:
                also = f" (also {', '.join(takers[1:])})" if takers[1:] else ""
                flag = f"--{name}/--no-{name}" if isinstance(value, bool) else f"--{name}"
                raise ConfigError(
                    f"{flag} is a {takers[0]} flag{also}, and {family} has no such setting: "
                    f"add --model {takers[0]}, or drop it"
                )


def check_parallel(cfg):
    """The flags plan.make_plan decides with, as far as the flags alone tell (the rest needs the
    launch and the model's size: make_plan refuses it there), and --precision fp8's torchao
    (fp8.py)."""
    _positive(cfg, "shard_group_size")
    if cfg.cuda_graphs and not cfg.compile:
        raise ConfigError("--cuda_graphs replays the compiled model: add --compile")
    if cfg.fp8_recipe != "tensorwise" and cfg.precision != "fp8":
        raise ConfigError(f"--fp8_recipe {cfg.fp8_recipe} applies with --precision fp8: add it")
    if cfg.fp8_layers != "auto" and cfg.precision != "fp8":
        raise ConfigError(f"--fp8_layers {cfg.fp8_layers} applies with --precision fp8: add it")
    if (
        cfg.precision == "fp8"
        and not cfg.generate_only
        and importlib.util.find_spec("torchao") is None
    ):
        raise ConfigError(
            "--precision fp8 needs torchao: pip install -e \".[fp8]\" (offline: see "
            "docs/performance.md)"
        )
    if cfg.recompute != "full" and not cfg.activation_checkpoints:
        raise ConfigError(
            f"--recompute {cfg.recompute} applies with --activation_checkpoints: add it"
        )


def check_decentralized(cfg):
    """--data_parallel decentralized (gossip.py, accum_adamw.py) and the flags that apply only to
    it, --save_average (a [checkpoint] flag) included."""
    _positive(cfg, "accum_steps")
    _not_negative(cfg, "global_average_every")
    if cfg.data_parallel != "decentralized":
        for name, unset in (
            ("accum_steps", 1),
            ("save_average", False),
            ("gossip_dtype", "bf16"),
            ("global_average_every", 0),
        ):
            if getattr(cfg, name) != unset:
                raise ConfigError(f"--{name} applies to --data_parallel decentralized only")
        return
    # full-shard: the default, i.e. not asked for
    if cfg.sharding not in ("full-shard", "no-shard"):
        raise ConfigError(
            f"--data_parallel decentralized keeps a whole replica on every rank: "
            f"drop --sharding {cfg.sharding}"
        )
    if cfg.cpu_offload:
        raise ConfigError(
            "--cpu_offload offloads FSDP shards; --data_parallel decentralized has none: drop it"
        )
    if cfg.fsdp_unit != "auto":
        raise ConfigError(
            "--fsdp_unit says what FSDP gathers; --data_parallel decentralized has no FSDP: drop it"
        )
    if cfg.reduce_precision not in ("auto", "float32"):
        raise ConfigError(
            "--reduce_precision is the dtype gradients are summed in; --data_parallel "
            "decentralized averages parameters, not gradients: drop it"
        )


def check_data(cfg):
    """Which data (data/tokens.py, prepare.py, streaming.py) and which tokenizer; whether the files
    are there is checked where they are opened."""
    _check_range(cfg, "val_fraction", 0, 1, low_ok=False)
    _directory(cfg, "data_dir")
    if cfg.dataset == "text" and not cfg.input_file:
        raise ConfigError("--dataset text needs --input_file PATH")
    # parse_args reads --input_file alone as --dataset text
    if cfg.input_file and cfg.dataset != "text":
        raise ConfigError(
            f"--input_file is the file of --dataset text: drop --dataset {cfg.dataset}"
        )
    if cfg.streaming and not cfg.dataset_path:
        raise ConfigError("--streaming needs --dataset_path (the documents to stream)")
    if cfg.streaming and not cfg.max_steps:
        raise ConfigError(
            "--streaming needs --max_steps: a stream's length is unknown, so epochs cannot end the "
            "run"
        )
    if cfg.tokenizer_dir and cfg.dataset_path and not cfg.streaming:
        raise ConfigError(
            "a prepared --dataset_path carries its own tokenizer: drop --tokenizer_dir"
        )
    if cfg.tokenizer_dir and cfg.tokenizer != "char":  # char is the default: not asked for
        raise ConfigError(f"--tokenizer_dir replaces --tokenizer: drop --tokenizer {cfg.tokenizer}")
    if cfg.tokenizer == "sentencepiece" and cfg.vocab_size is None and not cfg.dataset_path:
        raise ConfigError(
            "--tokenizer sentencepiece needs --vocab_size (the BPE vocabulary to train)"
        )


def check_checkpoint(cfg):
    """How often and where checkpoints are written; which one a run starts from is find.py's
    (it needs the files)."""
    _not_negative(cfg, "checkpoint_interval", "keep_last")
    _directory(cfg, "checkpoint_dir")


def check_generate(cfg):
    """The sample's flags; whether --prompt fits the tokenizer is checked once the tokenizer is
    known."""
    _not_negative(cfg, "num_tokens")
    _check_range(cfg, "temperature", 0, note=" (0: greedy)")
    _check_range(cfg, "top_k", 0, note=" (0: all tokens)")


def check_log(cfg):
    _directory(cfg, "log_dir")
    if cfg.profile is not None:
        profile_range(cfg.profile)
    for name, package in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(cfg, name) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--{name} needs the {package} package: pip install {package}")


def profile_range(text):
    """--profile's 'START:END' -> (start, end), whole numbers with 0 <= start < end (profiling.py
    traces steps START to END-1)."""
    start, sep, end = text.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise ConfigError(
            f"--profile takes START:END, two whole numbers 0 or more (got {text!r}); e.g. "
            "--profile 10:12 traces steps 10 and 11"
        )
    start, end = int(start), int(end)
    if end <= start:
        raise ConfigError(
            f"--profile {text}: END must be after START (steps START to END-1 are traced), "
            f"e.g. --profile {start}:{start + 2}"
        )
    return start, end


def _positive(cfg, *names):
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name} must be positive (got {value})")


def _not_negative(cfg, *names):
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name} must be 0 or positive (got {value})")


def _check_range(cfg, name, low, high=None, low_ok=True, note=""):
    """--name, if set, must be a finite number >= low (> low unless low_ok) and, given high, < high.
    A value out of range would silently corrupt training (a negative clip is gradient ascent) or
    fail deep inside torch."""
    value = getattr(cfg, name)
    if value is None:
        return
    if not (
        math.isfinite(value)
        and (value >= low if low_ok else value > low)
        and (high is None or value < high)
    ):
        opening = "[" if low_ok else "("
        bounds = (
            f"in {opening}{low:g}, {high:g})"
            if high is not None
            else f"{'>=' if low_ok else '>'} {low:g}"
        )
        raise ConfigError(f"--{name} must be a finite number {bounds} (got {value}){note}")


def _directory(cfg, name):
    path = getattr(cfg, name)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"--{name} {path} is a file, not a directory: name a directory (or a path that "
            "does not exist yet)"
        )


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


def model_family(cfg):
    """--model, or else the family --model_preset belongs to ("tiny" is gpt's unless --model
    llama)."""
    if cfg.model is None:
        return next(
            family for family, presets in MODEL_PRESETS.items() if cfg.model_preset in presets
        )
    if cfg.model_preset not in MODEL_PRESETS[cfg.model]:
        raise ConfigError(
            f"--model_preset {cfg.model_preset} is not a {cfg.model} preset (those are "
            f"{', '.join(MODEL_PRESETS[cfg.model])}): drop --model or pick one of them"
        )
    return cfg.model


def validate_xla(cfg):
    """--device xla trains one way (xla.py): every parameter sharded over every device, no CPU
    offload."""
    if cfg.device != "xla":
        return
    if importlib.util.find_spec("torch_xla") is None:
        raise ConfigError(
            "--device xla needs torch_xla: pip install -e '.[xla]' (torch_xla 2.9 with torch 2.9)"
        )
    unsupported = {
        "sharding": cfg.sharding != "full-shard",
        "shard_group_size": cfg.shard_group_size is not None,
        "data_parallel": cfg.data_parallel != "allreduce",
        "cpu_offload": cfg.cpu_offload,
        "meta_init": cfg.meta_init,
        "compile": cfg.compile,
        "recompute": cfg.recompute != "full",
        "fsdp_unit": cfg.fsdp_unit != "auto",
        "reduce_precision": cfg.reduce_precision not in ("auto", "float32"),
    }
    for name, given in unsupported.items():
        if given:
            raise ConfigError(
                f"--{name} is not available with --device xla, which shards every parameter over "
                "all devices with SPMD and compiles each step whole (docs/parallelism.md): drop it"
            )


def validate_world(cfg, world_size, local_world_size, local_world_sizes=()):
    """Checks that need the launch layout; same inputs on every rank, so the same verdict
    everywhere. local_world_sizes: every rank's local world size, gathered (a rank's own can differ
    from the others')."""
    if cfg.device == "xla" and local_world_size > 1:
        raise ConfigError(
            f"--device xla runs one process per host, which drives all of the host's devices, but "
            f"{local_world_size} ranks share this host: launch one rank per host (mpiexec -n HOSTS "
            "-ppn 1, or plain python on one host)"
        )
    if cfg.sharding.startswith("hybrid"):
        if not cfg.shard_group_size and len(set(local_world_sizes)) > 1:
            sizes = ", ".join(map(str, sorted(set(local_world_sizes))))
            raise ConfigError(
                f"--sharding {cfg.sharding} shards over the ranks of a node, but nodes run "
                f"different numbers of ranks ({sizes}): start as many on every node, or set "
                f"--shard_group_size"
            )
        group = cfg.shard_group_size or local_world_size
        if world_size % group:
            raise ConfigError(
                f"--sharding {cfg.sharding} needs world size divisible by --shard_group_size "
                f"(got {world_size} and {group})"
            )


def host_memory_available():
    """Bytes this host can still give to new allocations (Linux's MemAvailable); None where
    unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_sizes(
    cfg,
    seq_length,
    num_params,
    processes,
    device_free,
    device="cpu",
    ranks=1,
    at_least=False,
    vocab_size=None,
):
    """Refuse a batch or a model that surely cannot fit, before anything is allocated (which would
    end in a traceback, or the kernel's OOM killer). Counted low on purpose: only what certainly
    does not fit is refused.
      batch: its token ids on the host, three int64 copies (window index, gathered tokens, rows) in
             each of the host's `processes`;
      model: its fp32 weights where they are built (`device`, with `device_free` bytes free; a CPU's
             memory is shared by the host's processes): whole, or (--meta_init) a 1/`ranks` shard.
      logits: on a CPU (vocab_size given), a micro-batch's fp32 logits, their log-softmax and their
             gradient in each process (CUDA's fused loss never holds them whole).
    device_free None: unknown, not checked. at_least: num_params is a lower bound (counted without
    torch, before an absurd shape could overflow torch's size arithmetic)."""
    host_free = host_memory_available()
    batch = cfg.batch_size * (seq_length + 1) * 8 * 3 * processes
    if host_free is not None and batch > host_free:
        raise ConfigError(
            f"--batch_size {cfg.batch_size}: a batch of {cfg.batch_size} x {seq_length + 1} token "
            f"ids takes {batch / GiB:.3g} GiB of host memory over this host's {processes} "
            f"process(es), more than the {host_free / GiB:.3g} GiB free: lower --batch_size (raise "
            "--grad_accum_steps to keep the tokens per step)"
        )
    logits = 3 * cfg.batch_size * seq_length * (vocab_size or 0) * 4 * processes
    if device == "cpu" and device_free is not None and logits > device_free:
        raise ConfigError(
            f"--vocab_size {vocab_size:,} with --batch_size {cfg.batch_size}: a micro-batch's "
            f"logits ({cfg.batch_size} x {seq_length} x {vocab_size:,}, three fp32 copies) take "
            f"{logits / GiB:.3g} GiB over this host's {processes} process(es), more than the "
            f"{device_free / GiB:.3g} GiB "
            "free: lower --batch_size (raise --grad_accum_steps to keep the tokens per step)"
        )
    weights = (
        num_params * 4 * (processes if device == "cpu" else 1) // (ranks if cfg.meta_init else 1)
    )
    if device_free is not None and weights > device_free:
        raise ConfigError(
            f"the model ({'at least ' if at_least else ''}{num_params:,} parameters) takes "
            f"{weights / GiB:.3g} GiB in fp32 on this host's {device} ({processes} process(es)), "
            f"more than the {device_free / GiB:.3g} GiB "
            "free: lower --vocab_size, --embed_size or --num_layers, or add --meta_init with more "
            "ranks (minimal-fsdp plan estimates what fits)"
        )


def cpu_recipe_warning(cfg, device_type):
    """A line for a GPU recipe (--compile, --precision bf16/fp8) started on a CPU, where compiling
    takes minutes and bf16 matmuls crawl (a GPU recipe's first steps can take an hour there); None
    otherwise."""
    asked = [
        f
        for f, on in (
            ("--compile", cfg.compile),
            (f"--precision {cfg.precision}", cfg.precision != "float32"),
        )
        if on
    ]
    if device_type != "cpu" or not asked:
        return None
    return (
        f"warning: {' and '.join(asked)} on a CPU: compiling takes minutes there and bf16 matmuls "
        "are slow, so a GPU recipe may not reach its first step for a long time; "
        "configs/shakespeare_tiny.toml is the CPU recipe (or drop those flags)"
    )

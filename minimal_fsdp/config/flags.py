"""One config object for a run: built from command-line flags (and an optional TOML file), validated
once, passed down explicitly.

Every flag is a field of `Config`; its help text lives beside it, so `basic_training.py --help`
and this file never disagree. A `--config run.toml` file sets the same names, grouped by each
field's section; flags given on the command line override it.
"""

import dataclasses
import functools
import json
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

from minimal_fsdp.config import parser
from minimal_fsdp.config.checks import parse_duration, validate

# Nothing here imports torch: `basic_training.py --help` and a mistyped flag answer at once.
from minimal_fsdp.config.choices import (
    DATA_PARALLEL,
    DEVICE,
    FP8_LAYERS,
    FP8_RECIPES,
    FSDP_UNITS,
    GRAPHS_MODEL,
    MODEL_PRESETS,
    PRECISION,
    RANK_VARIABLES,
    REDUCE_PRECISION,
    SHARDING,
    SMALL_MODEL,
    TOKENIZER_KINDS,
    TOPOLOGIES,
    ConfigError,
)
from minimal_fsdp.config.parser import flag


def launcher_rank():
    """This process's rank as its launcher set it, 0 without one; torch.distributed is not started
    yet."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def one_line_errors(main):
    """A command-line entry point whose bad input (ConfigError) ends it with one `error:` line and
    exit code 2. Every rank of a launch parses the same flags, so rank 0 speaks for all."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as e:
            if launcher_rank() == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return run


# checked once (check), then never changed: every part of the run reads the same values
@dataclass(frozen=True)
class Config:
    PROG: ClassVar[str] = "minimal-fsdp train"
    USAGE: ClassVar[str] = (
        "[mpiexec -n N] minimal-fsdp train [--config FILE.toml] [--FLAG VALUE ...]  "
        "(python basic_training.py: the same)"
    )
    DESCRIPTION: ClassVar[str] = (
        "Pre-train a GPT with FSDP2; launch with `mpiexec -n GPUS minimal-fsdp train`. "
        "Each group below is a [section] of a --config TOML file; docs/flags.md has "
        "the same list."
    )

    # launch
    config: str = flag(
        None,
        "TOML file of flag values, in sections as configs/*.toml; command-line flags override it",
        section="launch",
    )
    environment: str = flag(
        "auto",
        "how ranks are discovered: auto detects torchrun, MPI (mpiexec) and srun; "
        "pbs also counts nodes from PBS_NODEFILE",
        ("auto", "local", "pbs"),
        "launch",
    )
    run_name: str = flag(
        "shakespeare",
        "labels checkpoints and logs; unset, it names what the run "
        "trains on: the --input_file's or --dataset_path's name, else the --dataset, "
        "with the --model_preset (or --hf_model) unless tiny, e.g. my-gpt2",
        section="launch",
    )
    seed: int = flag(1337, "seeds init, data order, dropout and sampling", section="launch")
    collective_timeout: float = flag(
        300.0,
        "seconds a collective may wait before the run fails, so a dead or "
        "hung rank ends the job instead of idling until walltime",
        section="launch",
    )
    time_limit: str = flag(
        None,
        "HH:MM:SS after the start at which every rank saves a checkpoint at the next step "
        "and exits 0; set it below the job's walltime by one save's duration",
        section="launch",
    )

    # model
    model: str = flag(
        None,
        "architecture (a family of models/families); default: the family of --model_preset "
        "(tiny: gpt)",
        tuple(MODEL_PRESETS),
        "model",
    )
    model_preset: str = flag(
        "tiny",
        "model shape; explicit model flags override it",
        tuple(dict.fromkeys(n for names in MODEL_PRESETS.values() for n in names)),
        "model",
    )
    hf_model: str = flag(
        None,
        "start from a Hugging Face checkpoint of one of --model's families: a local directory "
        "(config.json + safetensors or .bin) or a hub name (fetched if the hub is "
        "reachable); its shape and tokenizer replace --model_preset and --tokenizer",
        section="model",
    )
    num_layers: int = flag(None, "transformer blocks", section="model")
    num_heads: int = flag(None, "attention heads", section="model")
    embed_size: int = flag(None, "model width", section="model")
    seq_length: int = flag(
        None, "tokens per training sequence (and the model's context)", section="model"
    )
    vocab_size: int = flag(
        None, "embedding rows; default: the tokenizer's vocabulary", section="model"
    )
    dropout: float = flag(None, "dropout probability", section="model")
    num_kv_heads: int = flag(
        None,
        "heads with their own keys and values (grouped-query attention; not gpt)",
        section="model",
    )
    intermediate_size: int = flag(None, "hidden width of the SwiGLU MLP (not gpt)", section="model")
    bias: bool = flag(
        None,
        "gpt: biases in the linear layers and LayerNorms (GPT-2 has them; --no-bias is "
        "nanoGPT's benchmark setting and a little faster)",
        section="model",
    )
    document_mask: bool = flag(
        False,
        "block-causal attention: tokens attend only within their own document of a "
        "window packing several, documents ending at the tokenizer's end-of-text token "
        "(so not with --tokenizer char); positions are not restarted. FlexAttention on "
        "CUDA (docs/llama3.md)",
        section="model",
    )

    # parallelism
    device: str = flag(
        "auto",
        "auto: CUDA GPUs if present, else CPU; xla: PyTorch/XLA (TPU, or XLA:CPU with "
        "PJRT_DEVICE=CPU), one process per host, parameters sharded over all devices with SPMD "
        "(docs/parallelism.md)",
        DEVICE,
        "parallel",
    )
    sharding: str = flag("full-shard", "FSDP sharding strategy", SHARDING, "parallel")
    shard_group_size: int = flag(
        None,
        "ranks per shard group for hybrid sharding (default: ranks per node)",
        section="parallel",
    )
    precision: str = flag(
        "float32",
        "float32; bf16 params/compute with fp32 master weights (gradients summed as "
        "--reduce_precision says); or fp8: bf16 plus float8 matmuls in the blocks' large "
        "linear layers (torchao; GPUs of compute capability 8.9+: H100, H200, L40S; see "
        "docs/performance.md)",
        PRECISION,
        "parallel",
    )
    fp8_recipe: str = flag(
        "tensorwise",
        "--precision fp8's scaling: tensorwise (one scale per tensor; FSDP "
        "all-gathers the weights in float8) or rowwise (a scale per row: more "
        "accurate, slower)",
        FP8_RECIPES,
        "parallel",
    )
    fp8_layers: str = flag(
        "auto",
        "which layers --precision fp8 makes float8: the output head's matmuls always "
        "(tensorwise), and the blocks' linear layers with all, or with auto where the model is "
        "at least 4096 wide (narrower ones measured slower in float8 than in bf16 at the same "
        "batch: docs/performance.md); head: the head alone",
        FP8_LAYERS,
        "parallel",
    )
    reduce_precision: str = flag(
        "auto",
        "the dtype gradients are summed across ranks in (FSDP's reduce-scatter, "
        "DDP's all-reduce): bf16 sends half the bytes, for a slow network between hosts, "
        "at bf16's rounding of the sums (FSDP2 also adds --grad_accum_steps' micro-steps "
        "in it); the master weights and optimizer stay fp32. auto: bf16 where the ranks "
        "span hosts and the matmuls run in bf16 or fp8, else float32",
        REDUCE_PRECISION,
        "parallel",
    )
    fsdp_unit: str = flag(
        "auto",
        "what is gathered and freed at once: block (one transformer block at a time by "
        "FSDP2, communication overlapped with compute: large models) or model (the whole model "
        "kept gathered, one all-gather and one reduce-scatter a step and one compiled graph, "
        "replayable as CUDA graphs: small models, whose step is bound by per-block host work); "
        f"auto: model up to {SMALL_MODEL // 10**6}M parameters",
        FSDP_UNITS,
        "parallel",
    )
    cpu_offload: bool = flag(
        False, "keep sharded params, grads and optimizer state in CPU memory", section="parallel"
    )
    activation_checkpoints: bool = flag(
        False, "recompute each block's activations in backward", section="parallel"
    )
    recompute: str = flag(
        "full",
        "what --activation_checkpoints recomputes: full (the whole block from its "
        "input: least memory) or selective (norms and activations only: matmul and attention "
        "outputs are kept)",
        ("full", "selective"),
        "parallel",
    )
    meta_init: bool = flag(
        False,
        "build on the meta device, shard, then initialize only the local shard",
        section="parallel",
    )
    compile: bool = flag(
        False,
        "torch.compile each transformer block (FSDP units per block), or the whole model "
        "(one rank, no-shard, or the whole model as one unit: --fsdp_unit)",
        section="parallel",
    )
    cuda_graphs: bool = flag(
        None,
        "with --compile where the whole model is compiled (one rank, no-shard, or one "
        "unit without --cpu_offload): replay the compiled model "
        "as CUDA graphs (torch.compile's reduce-overhead mode), for small models whose "
        "step is bound by the host launching kernels; unset: on for models up to "
        f"{GRAPHS_MODEL // 10**6}M parameters (not with fp8 or decentralized)",
        section="parallel",
    )

    # decentralized data parallel (gossip.py, accum_adamw.py)
    data_parallel: str = flag(
        "allreduce",
        "allreduce: one model, gradients averaged over all ranks (FSDP; for "
        "no-shard, one all-reduce: DDP, or a small model's one unit); "
        "decentralized: every rank trains its own whole replica and averages parameters "
        "with its --topology neighbours each step (no sharding)",
        DATA_PARALLEL,
        "decentralized",
    )
    topology: str = flag(
        "alternating-exp-ring",
        "decentralized: whom each rank averages with: complete (all), "
        "ring (two neighbours), exp (one peer at distance 1, 2, 4, ... in turn), "
        "alternating-exp-ring (exp and ring steps in turn)",
        TOPOLOGIES,
        "decentralized",
    )
    accum_steps: int = flag(
        1,
        "decentralized (AccumAdamW): Adam's moments take the mean gradient of this many "
        "steps, while parameters still move every step (unlike --grad_accum_steps)",
        section="decentralized",
    )
    global_average_every: int = flag(
        0,
        "decentralized: every this many steps, one all-reduce averages all replicas in "
        "place of the --topology step, bounding how far they drift apart (0: never)",
        section="decentralized",
    )
    gossip_dtype: str = flag(
        "bf16",
        "decentralized: the dtype replicas travel in (mixed in fp32 on arrival); "
        "float32 doubles the bytes",
        REDUCE_PRECISION,
        "decentralized",
    )

    # data
    dataset: str = flag(
        "shakespeare",
        "shakespeare (tinyshakespeare, shipped in data/shakespeare/input.txt) or "
        "text (--input_file)",
        ("shakespeare", "text"),
        "data",
    )
    input_file: str = flag(
        None,
        "for --dataset text: a UTF-8 text file, a .jsonl file of {\"text\": ...} lines, "
        "or a directory of .txt/.jsonl files",
        section="data",
    )
    dataset_path: str = flag(
        None,
        "instead of --dataset: a directory written by `minimal-fsdp prepare`; "
        "with --streaming, a .jsonl/.txt file or directory, a Hugging Face "
        "dataset saved with save_to_disk, or a hub dataset (NAME or NAME:CONFIG)",
        section="data",
    )
    streaming: bool = flag(
        False,
        "tokenize --dataset_path on the fly instead of preparing it; rank r reads every "
        "world-size-th document; needs --max_steps",
        section="data",
    )
    tokenizer_dir: str = flag(
        None,
        "use the tokenizer in this directory instead of --tokenizer: a Hugging Face "
        "model's (tokenizer.json, vocab.json + merges.txt, or tokenizer.model: GPT-2, "
        "Llama 2 and 3), a prepared dataset's, a checkpoint's or an export's",
        section="data",
    )
    data_dir: str = flag("data", "where prepared datasets live", section="data")
    tokenizer: str = flag(
        "char",
        "char works offline; gpt2 needs tiktoken's encoding file; sentencepiece is "
        "trained on the data (--vocab_size); for a Hugging Face model's tokenizer "
        "(Llama 3's, say) pass --tokenizer_dir instead",
        TOKENIZER_KINDS,
        "data",
    )
    val_fraction: float = flag(
        0.1,
        "share held out for validation: documents picked by --seed, or the tail of a single text",
        section="data",
    )

    # training
    max_epochs: int = flag(
        None,
        "passes over the training tokens; with --max_steps too, the run stops at whichever "
        "comes first; -1 skips training and only generates",
    )
    max_steps: int = flag(
        600,
        "optimizer steps to train (the default keeps the first run to minutes on a laptop; "
        "0: no cap, --max_epochs sets the length)",
    )
    batch_size: int = flag(16, "sequences per rank per micro-step")
    grad_accum_steps: int = flag(1, "micro-steps per optimizer step")
    lr: float = flag(
        3e-3, "peak learning rate (the default suits the tiny preset; GPT-2 sizes want ~6e-4)"
    )
    min_lr: float = flag(None, "final learning rate of the cosine decay (default lr/10)")
    warmup_steps: int = flag(50, "linear warmup steps")
    weight_decay: float = flag(0.1, "AdamW weight decay on matrices")
    beta1: float = flag(0.9, "AdamW beta1")
    beta2: float = flag(None, "AdamW beta2 (default 0.95; 0.98 with --data_parallel decentralized)")
    lr_decay_steps: int = flag(
        None,
        "steps the warmup + cosine schedule spans (default: the first launch's "
        "--max_epochs/--max_steps length, kept on resume); set it to stop early with "
        "--max_steps and continue later on the same schedule",
    )
    grad_clip: float = flag(1.0, "clip the global grad norm to this (0 disables)")
    skip_nonfinite: int = flag(
        0,
        "skip up to N optimizer steps whose grad norm is NaN/Inf before stopping "
        "(0: stop at the first)",
    )
    eval_interval: int = flag(
        200, "evaluate on the val split every N steps (0: only at checkpoints and the end)"
    )
    eval_batches: int = flag(10, "batches per rank in each evaluation")
    eval_tasks: str = flag(
        None,
        "lm-evaluation-harness tasks (comma-separated, as minimal-fsdp evaluate "
        "--tasks) run on the live model every --eval_tasks_interval steps and at the end; "
        "scores go to the log, metrics.jsonl and TensorBoard (docs/evaluate.md)",
    )
    eval_tasks_interval: int = flag(
        0, "steps between --eval_tasks evaluations (0: only at the end)"
    )
    eval_tasks_include_path: str = flag(None, "a folder of your own YAML tasks for --eval_tasks")
    eval_tasks_limit: float = flag(
        None, "at most this many examples per --eval_tasks task (below 1: this fraction)"
    )
    best_metric: str = flag(
        None,
        "what chooses the `best` checkpoint: val_loss (the lowest), or an --eval_tasks "
        "score <task>/<metric> (e.g. hellaswag/acc_norm: the best as the task declares, "
        "higher or lower; the tasks then also run at every save); default: val_loss, or "
        "the resumed checkpoint's choice",
    )
    log_interval: int = flag(10, "average and log the loss every N steps")

    # checkpoints
    checkpoint_dir: str = flag(
        "checkpoints",
        "checkpoints go to <checkpoint_dir>/<run_name>/step_<N>",
        section="checkpoint",
    )
    restart_checkpoint_file: str = flag(
        None,
        "a checkpoint directory (or a run's `latest`/`best` marker) to start "
        "from, overriding --resume",
        section="checkpoint",
    )
    resume: str = flag(
        "auto",
        "auto: continue from the run's newest complete checkpoint, if any; never: start "
        "fresh, refusing a run directory that already holds checkpoints",
        ("auto", "never"),
        "checkpoint",
    )
    checkpoint_interval: int = flag(
        1000, "save every N steps, and at the end (0: only at the end)", section="checkpoint"
    )
    keep_last: int = flag(
        3,
        "keep the newest K checkpoints of the run, plus the `best` one (0: keep all)",
        section="checkpoint",
    )
    checkpoint_mode: str = flag(
        "auto",
        "async: training waits only while a save is copied to host memory, and the "
        "files are written beside training; sync: while they are written; auto: "
        "async on GPUs, sync on CPUs (docs/checkpoints.md)",
        ("auto", "sync", "async"),
        "checkpoint",
    )

    save_average: bool = flag(
        False,
        "decentralized: checkpoints keep only the average of the replicas, not each rank's own",
        section="checkpoint",
    )

    # logs
    log_dir: str = flag(
        "logs",
        "metrics.jsonl, TensorBoard events and config.toml go to <log_dir>/<run_name>/",
        section="log",
    )
    tensorboard: bool = flag(
        True, "write TensorBoard scalars (tensorboard --logdir <log_dir>)", section="log"
    )
    wandb: bool = flag(
        False,
        "also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works "
        "without network)",
        section="log",
    )
    wandb_project: str = flag("minimal_fsdp", "wandb project for --wandb", section="log")
    profile: str = flag(
        None,
        "START:END: a torch.profiler trace of steps START to END-1 per rank, in "
        "<log_dir>/<run_name>/profile/ (Perfetto, TensorBoard; docs/performance.md)",
        section="log",
    )
    memory_snapshot: bool = flag(
        False,
        "CUDA: write the allocator's snapshot for pytorch.org/memory_viz to "
        "<log_dir>/<run_name>/ after the --profile range (else the first 3 steps)",
        section="log",
    )

    # generation
    prompt: str = flag(
        "ROMEO:", "text to continue after training or with --max_epochs -1", section="generate"
    )
    num_tokens: int = flag(200, "tokens to generate (0: no sample)", section="generate")
    temperature: float = flag(0.8, "sampling temperature (0: greedy)", section="generate")
    top_k: int = flag(50, "sample from the k most likely tokens (0: all)", section="generate")

    @staticmethod
    def derived(values, given):
        """The values the flags imply, filled in before the Config is built (config.parser.parse):
        nothing is written into it afterwards. --input_file alone means the text dataset; a run not
        named is named after its data and model. `given`: the flags set by the file or the command
        line."""
        # --input_file says which data: the text dataset
        if values["input_file"] and values["dataset"] == "shakespeare":
            if "dataset" in given:
                raise ConfigError(
                    "--input_file is the file of --dataset text: drop --dataset shakespeare "
                    "(or drop --input_file to train on Shakespeare)"
                )
            values = dict(values, dataset="text")
        if "run_name" not in given:  # the other: new data never lands in an old run's directory
            values = dict(values, run_name=default_run_name(SimpleNamespace(**values)))
        return values

    def check(self, given):
        """After parsing (config.parser.parse): every section's checks (config.checks.validate)."""
        validate(self)

    @property
    def generate_only(self):
        return self.max_epochs is not None and self.max_epochs < 0

    @property
    def time_limit_seconds(self):
        return parse_duration(self.time_limit) if self.time_limit else None


def default_run_name(cfg):
    """What the run trains on: 'shakespeare' for the default data, 'my' for --input_file my.txt,
    'owt-gpt2' for --dataset_path .../owt with --model_preset gpt2."""
    source = cfg.input_file or cfg.dataset_path
    name = os.path.basename(os.path.normpath(source)) if source else cfg.dataset
    # a hub's NAME:CONFIG
    name = os.path.splitext(name)[0] if cfg.input_file else name.split(":")[0]
    model = os.path.basename(os.path.normpath(cfg.hf_model)) if cfg.hf_model else cfg.model_preset
    if model != "tiny":
        name += f"-{model}"
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name).lstrip(".") or "run"


def build_parser(prog=None, description=None):
    """The training flags' parser (config.parser's, built from `Config`)."""
    return parser.build_parser(Config, prog, description)


def parse_args(argv=None, prog=None, description=None):
    """Defaults < --config file < command line, validated (Config.check)."""
    return parser.parse(Config, argv, prog, description)


def load_config_file(path):
    """{flag name: value} from a training --config file (config.parser.load_config_file)."""
    return parser.load_config_file(path, Config)


SECTIONS = parser.sections(Config)


def to_toml(cfg):
    """The resolved config (a Config, or its flags as {name: value}) as a file --config accepts.
    Unset (None) values are left out: TOML has no null."""
    values = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for f in dataclasses.fields(Config):
            value = values[f.name]
            if f.metadata["section"] == section and f.name != "config" and value is not None:
                text = (
                    json.dumps(value, ensure_ascii=False)
                    if isinstance(value, (str, bool))
                    else repr(value)
                )
                lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)

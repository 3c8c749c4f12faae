"""The flags of every command beside training, one dataclass each (sample and evaluate share the
model source's): the fields are read by config.parser, as training's `Config` is. Names, sections
and defaults follow training's where a flag means the same thing, so a run's own config.toml is a
valid --config file here too (its other keys are ignored). Nothing here imports torch: `minimal-fsdp
COMMAND --help` answers at once.
"""

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar

from minimal_fsdp.config.choices import (
    FP8_RECIPES,
    FSDP_UNITS,
    MODEL_PRESETS,
    REDUCE_PRECISION,
    SHARDING,
    TOPOLOGIES,
)
from minimal_fsdp.config.flags import Config
from minimal_fsdp.config.parser import flag

# The values of choice flags whose owners import torch or numpy; tests/config/test_commands.py
# checks them.
GPU_TYPES = ("A100-40GB", "A100-80GB", "H100", "H200")  # tools/step_time.py's CARDS
TOKENIZER_KINDS = ("char", "gpt2", "sentencepiece")  # data/tokenizer.py's
EXPORT_DTYPES = ("float32", "bf16")  # hf/export.py's DTYPES
SOURCE = (
    "a checkpoint (step_<N>, a run directory, its latest/best marker), an export (minimal-fsdp "
    "export), or a Hugging Face model directory"
)


def trained(name):
    """Training's default for the flag `name`: a command that shares a flag shares its default."""
    return next(f.default for f in dataclasses.fields(Config) if f.name == name)


@dataclass(frozen=True)
class SourceFlags:
    """What sample and evaluate load, and in what precision."""

    FILE_ALSO: ClassVar[tuple] = (Config,)
    source: str = flag(None, SOURCE, section="source", positional=True, required=True)
    precision: str = flag(
        "float32",
        "bf16: matmuls in bf16 (fast on GPUs); the weights stay float32, sharded",
        ("float32", "bf16"),
        "parallel",
    )


@dataclass(frozen=True)
class SampleFlags(SourceFlags):
    PROG: ClassVar[str] = "minimal-fsdp sample"
    DESCRIPTION: ClassVar[str] = (
        "Text from a trained model, in one process or sharded over the ranks of "
        "mpiexec (torchrun, srun); the text goes to stdout."
    )
    prompt: str = flag("", "text to continue (empty: a fresh document)", section="generate")
    num_tokens: int = flag(trained("num_tokens"), "tokens to generate", section="generate")
    temperature: float = flag(
        trained("temperature"), "sampling temperature (0: greedy)", section="generate"
    )
    top_k: int = flag(
        trained("top_k"), "sample from the k most likely tokens (0: all)", section="generate"
    )
    seed: int = flag(trained("seed"), "the same seed gives the same text", section="launch")


@dataclass(frozen=True)
class EvaluateFlags(SourceFlags):
    PROG: ClassVar[str] = "minimal-fsdp evaluate"
    DESCRIPTION: ClassVar[str] = (
        "lm-evaluation-harness tasks on a trained model, sharded over the ranks "
        "(pip install 'minimal_fsdp[eval]'; docs/evaluate.md)."
    )
    tasks: list = flag(
        None,
        "lm_eval task, group or tag names (or YAML files), separated by commas or spaces",
        section="evaluate",
        required=True,
    )
    include_path: str = flag(
        None, "a folder of your own YAML tasks (lm_eval's format)", section="evaluate"
    )
    num_fewshot: int = flag(
        None, "examples in each prompt (default: each task's own)", section="evaluate"
    )
    limit: float = flag(
        None,
        "at most this many examples per task (below 1: this fraction); for quick checks",
        section="evaluate",
    )
    batch_size: int = flag(
        1, "sequences per rank in one forward call (generation: one per rank)", section="evaluate"
    )
    output_path: str = flag(
        None,
        "where the harness writes its results JSON: a folder (results go to "
        "<folder>/<model>/results_<date>.json) or a .json path",
        section="evaluate",
    )
    log_samples: bool = flag(
        False,
        "also write every example's prompt and scores (needs --output_path)",
        section="evaluate",
    )
    sharding: str = flag(
        trained("sharding"),
        "how the model is laid out over the ranks (as training's)",
        SHARDING,
        "parallel",
    )
    shard_group_size: int = flag(
        None, "hybrid sharding: ranks per shard group (default: ranks per node)", section="parallel"
    )


@dataclass(frozen=True)
class ExportFlags:
    PROG: ClassVar[str] = "minimal-fsdp export"
    DESCRIPTION: ClassVar[str] = (
        "A checkpoint -> one consolidated model.safetensors plus config.json and the "
        "tokenizer, in one CPU process."
    )
    checkpoint: str = flag(
        None,
        "a step_<N> directory, a run's `latest`/`best` marker, or a run directory",
        section="export",
        positional=True,
        required=True,
    )
    out: str = flag(
        None,
        "directory for model.safetensors, config.json and the tokenizer's files",
        section="export",
        positional=True,
        required=True,
    )
    dtype: str = flag(None, "cast the weights (default: as saved)", EXPORT_DTYPES, "export")
    format: str = flag(
        "safetensors",
        "safetensors: our names and config.json; hf: Hugging Face transformers "
        "layout (config.json, safetensors, tokenizer.json)",
        ("safetensors", "hf"),
        "export",
    )


@dataclass(frozen=True)
class PrepareFlags:
    PROG: ClassVar[str] = "minimal-fsdp prepare"
    DESCRIPTION: ClassVar[str] = (
        "Tokenize a dataset into train.bin, val.bin and meta.json, for training's --dataset_path."
    )
    FILE_ALSO: ClassVar[tuple] = (Config,)
    dataset: str = flag(
        None,
        "openwebtext: Skylion007/openwebtext from the hub (or --input_file, a local copy); "
        "shakespeare: the repository's data/shakespeare/input.txt; text: --input_file is a "
        "text/.jsonl file or a directory of .txt/.jsonl files; hf: --input_file is a hub "
        "dataset (NAME or NAME:CONFIG) or a save_to_disk directory",
        ("openwebtext", "shakespeare", "text", "hf"),
        "data",
        required=True,
    )
    input_file: str = flag(
        None, "the source for --dataset text and hf (see --dataset)", section="data"
    )
    tokenizer: str = flag(
        trained("tokenizer"),
        "char and sentencepiece are fit on the data; gpt2 (GPT-2's BPE, "
        "what openwebtext runs use) needs tiktoken's encoding file",
        TOKENIZER_KINDS,
        "data",
    )
    tokenizer_dir: str = flag(
        None,
        "use the tokenizer in this directory (replaces --tokenizer): a Hugging Face "
        "model's (Llama 3's, say), a prepared dataset's or a checkpoint's",
        section="data",
    )
    val_fraction: float = flag(
        None,
        "share of documents held out for validation (default 0.0005 for openwebtext, else 0.1)",
        section="data",
    )
    data_dir: str = flag(
        trained("data_dir"), "the output goes to <data_dir>/<name>/<tokenizer>", section="data"
    )
    vocab_size: int = flag(None, "BPE vocabulary for --tokenizer sentencepiece", section="model")
    seed: int = flag(trained("seed"), "picks which documents are held out", section="launch")
    output: str = flag(
        None, "write here instead of <data_dir>/<name>/<tokenizer>", section="prepare"
    )
    num_proc: int = flag(os.cpu_count() or 1, "tokenizing processes", section="prepare")


@dataclass(frozen=True)
class PlanFlags:
    PROG: ClassVar[str] = "minimal-fsdp plan"
    DESCRIPTION: ClassVar[str] = (
        "How big is a model, and will it train here? Parameters, checkpoint size, and "
        "the per-GPU and per-node memory of every sharding strategy; with "
        "--inter_node_gbps, each strategy's step time across hosts. A training "
        "--config file plans that run."
    )
    FILE_ALSO: ClassVar[tuple] = (Config,)
    model_preset: str = flag(
        trained("model_preset"),
        "model shape; explicit model flags override it",
        tuple(dict.fromkeys(n for names in MODEL_PRESETS.values() for n in names)),
        "model",
    )
    model: str = flag(
        None, "gpt or llama; default: the family of --model_preset", tuple(MODEL_PRESETS), "model"
    )
    hf_model: str = flag(
        None,
        "plan for a local Hugging Face GPT-2 or Llama directory (its config.json)",
        section="model",
    )
    vocab_size: int = flag(
        None, "default: the preset's (tiny: GPT 65, Llama 32000)", section="model"
    )
    seq_length: int = flag(
        None, "tokens per sequence (default: the preset's context)", section="model"
    )
    # the shape flags of a training --config (configs/shakespeare_char.toml sets them)
    num_layers: int = flag(None, "as in training: transformer blocks", section="model")
    num_heads: int = flag(None, "as in training: attention heads", section="model")
    embed_size: int = flag(None, "as in training: model width", section="model")
    num_kv_heads: int = flag(None, "as in training (llama)", section="model")
    intermediate_size: int = flag(None, "as in training (llama)", section="model")
    bias: bool = flag(None, "as in training (gpt)", section="model")
    batch_size: int = flag(1, "sequences per GPU per micro-step")
    grad_accum_steps: int = flag(1, "micro-steps per optimizer step")
    log_interval: int = flag(
        trained("log_interval"),
        "as in training: decentralized runs all-reduce the replica at each logging step",
    )
    precision: str = flag(
        "bf16",
        "as in training (whose own default is float32: plan a run that leaves it out with "
        "--precision float32); bf16 here, what a run on GPUs uses",
        ("float32", "bf16", "fp8"),
        "parallel",
    )
    fp8_recipe: str = flag(trained("fp8_recipe"), "as in training", FP8_RECIPES, "parallel")
    fsdp_unit: str = flag(trained("fsdp_unit"), "as in training", FSDP_UNITS, "parallel")
    reduce_precision: str = flag(
        trained("reduce_precision"),
        "as in training: the gradients' copies to reduce in, and their bytes over the link",
        REDUCE_PRECISION,
        "parallel",
    )
    shard_group_size: int = flag(
        None, "hybrid sharding's group (default: --gpus_per_node)", section="parallel"
    )
    compile: bool = flag(
        False, "as in training: the compiled MFU for the step time", section="parallel"
    )
    topology: str = flag(
        trained("topology"), "as in training (gossip)", TOPOLOGIES, "decentralized"
    )
    checkpoint_mode: str = flag(
        trained("checkpoint_mode"),
        "as in training: async (auto's choice on GPUs) keeps a host copy of the state to save from",
        ("auto", "sync", "async"),
        "checkpoint",
    )
    gpus: int = flag(1, "GPUs in the job", section="plan")
    gpus_per_node: int = flag(None, "default: min(--gpus, 8)", section="plan")
    gpu_memory: str = flag(
        None, "memory of one GPU, e.g. 40GB (default: --gpu_type's)", section="plan"
    )
    host_memory: str = flag(
        None, "memory of one node, e.g. 512GB (to check CPU offload fits)", section="plan"
    )
    inter_node_gbps: float = flag(
        None,
        "Gbit/s of each node's link to the others: also estimate each strategy's step time",
        section="plan",
    )
    gpu_type: str = flag(
        "H100",
        "the card: its memory (unless --gpu_memory), and its bf16 peak and measured MFU for the "
        "step time (Polaris: A100-40GB)",
        GPU_TYPES,
        "plan",
    )
    mfu: float = flag(
        None,
        "achieved fraction of the card's bf16 peak (default: measured on one GPU, GPT-2 "
        "124M at batch 32, compiled or eager as --compile says)",
        section="plan",
    )


@dataclass(frozen=True)
class ClusterFlags:
    PROG: ClassVar[str] = "minimal-fsdp cluster"
    USAGE: ClassVar[str] = "minimal-fsdp cluster [--hosts N] [--FLAG VALUE ...] -- COMMAND ..."
    DESCRIPTION: ClassVar[str] = (
        "Virtual hosts on one Linux machine (network namespaces; needs root and "
        "pyroute2): make them, run COMMAND on the first as a job script, tear down "
        "(docs/launch.md)."
    )
    hosts: int = flag(2, "hosts to make", section="cluster")
    slots: int = flag(1, "times each host is listed in PBS_NODEFILE", section="cluster")
    rate: str = flag(
        None, "each host's link rate, e.g. 10gbit (up to 34gbit; unshaped above)", section="cluster"
    )
    delay: str = flag(None, "each host's link latency, e.g. 1ms", section="cluster")
    loss: float = flag(None, "percent of packets lost on each link", section="cluster")
    node_local: str = flag(
        None,
        "a path that is a different directory on each host (a node-local disk)",
        section="cluster",
    )
    resolve: str = flag(
        "all",
        "which hostnames resolve in each host's /etc/hosts",
        ("all", "none", "loopback"),
        "cluster",
    )
    scheduler: str = flag(
        "none",
        "slurm: also run SLURM on the hosts (slurmctld, a slurmd each, munge; needs slurm-wlm), "
        "for sbatch and srun in COMMAND",
        ("none", "slurm"),
        "cluster",
    )
    command: list = flag(
        None,
        "what runs on the first host, after --",
        section="cluster",
        positional=True,
        required=True,
        nargs="...",
    )


@dataclass(frozen=True)
class PlotFlags:
    PROG: ClassVar[str] = "minimal-fsdp plot"
    DESCRIPTION: ClassVar[str] = (
        "A run's loss curves as a PNG, from its metrics.jsonl; several runs on one "
        "plot to compare them (needs matplotlib)."
    )
    run_dir: list = flag(
        None,
        "a run's log directory, <log_dir>/<run_name>; several to compare",
        section="plot",
        positional=True,
        required=True,
    )
    out: str = flag(
        None,
        "PNG to write (default: <run_dir>/loss.png; several runs: <log_dir>/loss.png)",
        section="plot",
    )

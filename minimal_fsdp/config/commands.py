"""The flags of every command beside training, one dataclass each (sample and evaluate share the
model source's): the fields are read by config.parser, as training's `Config` is. A flag that
training has too is training's own field: declared once, in config/flags.py, with training's
section, default and choices unless the command says why it differs, so a run's own config.toml is
a valid --config file here too (its other keys are ignored). A command takes a whole section of
training's flags with `@takes_sections(section)` (a flag added to that section in Config reaches
the command with no edit here), and a single flag with `name: T = shared("name")`.
Nothing here imports torch: `minimal-fsdp COMMAND --help` answers at once.
"""

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import ClassVar

from minimal_fsdp.config.flags import Config
from minimal_fsdp.config.parser import flag

# The values of choice flags whose owners import torch or numpy; tests/config/test_commands.py
# checks them.
GPU_TYPES = ("A100-40GB", "A100-80GB", "H100", "H200")  # tools/step_time.py's CARDS
EXPORT_DTYPES = ("float32", "bf16")  # hf/export.py's DTYPES
SOURCE = (
    "a checkpoint (step_<N>, a run directory, its latest/best marker), an export (minimal-fsdp "
    "export), or a Hugging Face model directory"
)


def shared(name, help=None, **overrides):
    """Training's flag `name` for another command: a field built from `Config`'s own field of that
    name (config/flags.py, where every flag training knows is declared once), so its default,
    choices, section, positional/required/nargs and help are training's unless named here. `help`
    words it for this command; an override of `default` or `choices` is for a command where the flag
    truly differs, with a comment saying why. The metadata's "shared" names the training flag and
    "overrides" what this command changes (tests/config/test_commands.py reads both)."""
    trained = next((f for f in dataclasses.fields(Config) if f.name == name), None)
    if trained is None:
        raise TypeError(f"shared({name!r}): no such field in training's Config (config/flags.py)")
    unknown = set(overrides) - {"default", *trained.metadata}
    if unknown:
        raise TypeError(f"shared({name!r}): {', '.join(sorted(unknown))} is not a flag's attribute")
    if help is not None:
        overrides["help"] = help
    metadata = dict(trained.metadata) | overrides | {"shared": name, "overrides": tuple(overrides)}
    default = metadata.pop("default", trained.default)
    return dataclasses.field(default=default, metadata=metadata)


def takes_sections(*names, but=(), **overrides):
    """A class decorator, under `@dataclass`: every flag of training's sections `names` (Config's
    fields whose section is one of them) as a field of the class, `shared(name, **overrides[name])`,
    but those in `but` and those the class or a base declares itself (its own declaration wins). A
    flag added to such a section in config/flags.py reaches the command with no edit here. The
    section's flags come first among the class's own, in Config's order (a flag the class declares
    itself keeps its place among them), then the class's other flags as it declares them."""
    trained = dataclasses.fields(Config)
    unknown = set(names) - {f.metadata["section"] for f in trained}
    if unknown:
        raise TypeError(f"takes_sections: no section {', '.join(sorted(unknown))} in Config")
    section = [f for f in trained if f.metadata["section"] in names]
    stray = (set(but) | set(overrides)) - {f.name for f in section}
    if stray:
        raise TypeError(
            f"takes_sections{names}: {', '.join(sorted(stray))} is not a flag of those sections"
        )

    def take(cls):
        own = inspect.get_annotations(cls)
        inherited = {
            f.name
            for base in cls.__mro__[1:]
            if dataclasses.is_dataclass(base)
            for f in dataclasses.fields(base)
        }
        clash = set(overrides) & (set(own) | inherited)
        if clash:
            raise TypeError(
                f"{cls.__name__} declares {', '.join(sorted(clash))} itself: override it there"
            )
        order = {}
        for f in section:
            if f.name in own:
                order[f.name] = own[f.name]
            elif f.name not in (*but, *inherited):
                setattr(cls, f.name, shared(f.name, **overrides.get(f.name, {})))
                order[f.name] = f.type
        # dataclass makes the fields in this order; argparse and the TOML reader read the fields
        cls.__annotations__ = order | {n: t for n, t in own.items() if n not in order}
        return cls

    return take


@dataclass(frozen=True)
class SourceFlags:
    """What sample and evaluate load, and in what precision."""

    FILE_ALSO: ClassVar[tuple] = (Config,)
    source: str = flag(None, SOURCE, section="source", positional=True, required=True)
    precision: str = shared(
        "precision",
        "bf16: matmuls in bf16 (fast on GPUs); the weights stay float32, sharded",
        # generation runs fp8 as bf16 (parallel/plan.py: float8 pays in training's large matmuls)
        choices=("float32", "bf16"),
    )


# training's [generate] flags, every one (a flag added there is sample's too)
@dataclass(frozen=True)
@takes_sections(
    "generate",
    # a model of any data: training's "ROMEO:" suits only its default Shakespeare
    prompt=dict(help="text to continue (empty: a fresh document)", default=""),
    num_tokens=dict(help="tokens to generate"),
)
class SampleFlags(SourceFlags):
    PROG: ClassVar[str] = "minimal-fsdp sample"
    DESCRIPTION: ClassVar[str] = (
        "Text from a trained model, in one process or sharded over the ranks of "
        "mpiexec (torchrun, srun); the text goes to stdout."
    )
    seed: int = shared("seed", "the same seed gives the same text")


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
    # lm_eval's default, in [evaluate] beside the harness's flags: a run's config.toml, read here
    # too, must not set it to the run's training batch
    batch_size: int = shared(
        "batch_size",
        "sequences per rank in one forward call (generation: one per rank)",
        default=1,
        section="evaluate",
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
    sharding: str = shared("sharding", "how the model is laid out over the ranks (as training's)")
    shard_group_size: int = shared("shard_group_size")


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
    # prepare reads more sources than training prepares itself (the hub's), and has no default one
    dataset: str = shared(
        "dataset",
        "openwebtext: Skylion007/openwebtext from the hub (or --input_file, a local copy); "
        "shakespeare: the repository's data/shakespeare/input.txt; text: --input_file is a "
        "text/.jsonl file or a directory of .txt/.jsonl files; hf: --input_file is a hub "
        "dataset (NAME or NAME:CONFIG) or a save_to_disk directory",
        default=None,
        choices=("openwebtext", "shakespeare", "text", "hf"),
        required=True,
    )
    input_file: str = shared("input_file", "the source for --dataset text and hf (see --dataset)")
    tokenizer: str = shared(
        "tokenizer",
        "char and sentencepiece are fit on the data; gpt2 (GPT-2's BPE, "
        "what openwebtext runs use) needs tiktoken's encoding file",
    )
    tokenizer_dir: str = shared("tokenizer_dir")
    # unset: the dataset's own share (openwebtext's millions of documents need only a sliver)
    val_fraction: float = shared(
        "val_fraction",
        "share of documents held out for validation (default 0.0005 for openwebtext, else 0.1)",
        default=None,
    )
    data_dir: str = shared("data_dir", "the output goes to <data_dir>/<name>/<tokenizer>")
    vocab_size: int = shared("vocab_size", "BPE vocabulary for --tokenizer sentencepiece")
    seed: int = shared("seed", "picks which documents are held out")
    output: str = flag(
        None, "write here instead of <data_dir>/<name>/<tokenizer>", section="prepare"
    )
    num_proc: int = flag(os.cpu_count() or 1, "tokenizing processes", section="prepare")


# the model's shape, as training takes it (configs/shakespeare_char.toml sets the shape flags), read
# through the model section (tools/model_size.model_config); dropout and the document mask change no
# size, memory or step time here
@dataclass(frozen=True)
@takes_sections(
    "model",
    but=("dropout", "document_mask"),
    hf_model=dict(help="plan for a local Hugging Face model directory (its config.json)"),
    vocab_size=dict(help="default: the preset's (tiny: GPT 65, Llama 32000)"),
    seq_length=dict(help="tokens per sequence (default: the preset's context)"),
)
class PlanFlags:
    PROG: ClassVar[str] = "minimal-fsdp plan"
    DESCRIPTION: ClassVar[str] = (
        "How big is a model, and will it train here? Parameters, checkpoint size, and "
        "the per-GPU and per-node memory of every sharding strategy; with "
        "--inter_node_gbps, each strategy's step time across hosts. A training "
        "--config file plans that run."
    )
    FILE_ALSO: ClassVar[tuple] = (Config,)
    # the smallest run: what fits at batch 1 is the question (training's 16 suits the tiny model)
    batch_size: int = shared("batch_size", default=1)
    grad_accum_steps: int = shared("grad_accum_steps")
    log_interval: int = shared(
        "log_interval",
        "as in training: decentralized runs all-reduce the replica at each logging step",
    )
    # what a run on GPUs uses; training's float32 default is for CPUs
    precision: str = shared(
        "precision",
        "as in training (whose own default is float32: plan a run that leaves it out with "
        "--precision float32); bf16 here, what a run on GPUs uses",
        default="bf16",
    )
    fp8_recipe: str = shared("fp8_recipe")
    fp8_layers: str = shared("fp8_layers")
    fsdp_unit: str = shared("fsdp_unit")
    reduce_precision: str = shared(
        "reduce_precision",
        "as in training: the gradients' copies to reduce in, and their bytes over the link",
    )
    shard_group_size: int = shared(
        "shard_group_size", "hybrid sharding's group (default: --gpus_per_node)"
    )
    compile: bool = shared("compile", "as in training: the compiled MFU for the step time")
    topology: str = shared("topology")
    checkpoint_mode: str = shared(
        "checkpoint_mode",
        "as in training: async (auto's choice on GPUs) keeps a host copy of the state to save from",
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

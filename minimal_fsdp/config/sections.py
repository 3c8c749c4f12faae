"""The sections of the flags that a library function takes instead of the whole training `Config`:
each names the flags one subsystem reads, so its signature says what it depends on (as torchtitan
hands `job_config.parallelism` to its parallelizer). A command builds the sections it needs from its
own parsed flags (`Section.of`): a flag it declares is taken from it, one it does not keeps
training's default, so no command builds a training Config to reach the library.
"""

import dataclasses
from dataclasses import dataclass

from minimal_fsdp.config.flags import Config


@dataclass(frozen=True)
class Section:
    @classmethod
    def of(cls, flags, **values):
        """This section of `flags` (training's Config, or another command's flags): each field from
        `values`, else from `flags` where it declares it, else training's default."""
        trained = {f.name: f.default for f in dataclasses.fields(Config)} | {"generate_only": False}
        return cls(
            **{
                f.name: values[f.name]
                if f.name in values
                else getattr(flags, f.name, trained[f.name])
                for f in dataclasses.fields(cls)
            }
        )


@dataclass(frozen=True)
class Launch(Section):
    """What launch.environment.setup and the rendezvous read."""

    environment: str
    collective_timeout: float
    checkpoint_dir: str  # rendezvous files under srun; checked to be shared across nodes


@dataclass(frozen=True)
class Parallel(Section):
    """What parallel.plan.make_plan decides the model's layout with (and config.checks's
    check_parallel and validate_world check)."""

    sharding: str
    shard_group_size: int
    fsdp_unit: str
    cpu_offload: bool
    data_parallel: str
    topology: str
    global_average_every: int
    gossip_dtype: str
    reduce_precision: str
    precision: str
    fp8_recipe: str
    fp8_layers: str
    device: str
    meta_init: bool
    activation_checkpoints: str
    recompute: str
    compile: bool
    cuda_graphs: bool
    generate_only: bool  # generation alone (--max_epochs -1, sample, evaluate): no float8, no XLA


@dataclass(frozen=True)
class Generation(Section):
    """What inference.load.stream_sample generates with."""

    prompt: str
    num_tokens: int
    temperature: float
    top_k: int
    seed: int


@dataclass(frozen=True)
class Model(Section):
    """What the model's shape is made from (models.families.config_from_flags, with_document_mask,
    hf.read.read_model_config)."""

    model: str
    model_preset: str
    hf_model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_size: int
    intermediate_size: int
    bias: bool
    seq_length: int
    vocab_size: int
    dropout: float
    document_mask: bool


@dataclass(frozen=True)
class Data(Section):
    """What training's data is prepared and read from (data.prepare.for_training,
    data.streaming.StreamingData.open)."""

    dataset: str
    dataset_path: str
    input_file: str
    data_dir: str
    tokenizer: str
    tokenizer_dir: str
    vocab_size: int
    val_fraction: float
    seed: int


# checkpoint, logging, evaluation, backends


@dataclass(frozen=True)
class Checkpoint(Section):
    """What checkpoint/ reads: find.find and run_fallback (what a run starts from),
    checkpointer.Checkpointer (where it saves, what it keeps), background.for_run (how)."""

    checkpoint_dir: str
    run_name: str
    resume: str
    restart_checkpoint_file: str
    keep_last: int
    save_average: bool
    checkpoint_mode: str
    collective_timeout: float  # a background save's wait for the other ranks
    generate_only: bool  # generation alone (--max_epochs -1) reads checkpoints under --resume never


@dataclass(frozen=True)
class Logging(Section):
    """What metrics.Metrics and TrainingLog write to, and where."""

    log_dir: str
    run_name: str
    tensorboard: bool
    wandb: bool
    wandb_project: str


@dataclass(frozen=True)
class Profiling(Section):
    """What profiling.around_steps records of the steps."""

    profile: str
    memory_snapshot: bool


@dataclass(frozen=True)
class Evaluation(Section):
    """What eval.harness.TrainingTasks runs during training, and what checkpoint.best.chosen
    chooses `best` by."""

    eval_tasks: str
    eval_tasks_include_path: str
    eval_tasks_interval: int
    eval_tasks_limit: float
    best_metric: str
    batch_size: int  # the scoring's batch and dtype are training's
    precision: str


@dataclass(frozen=True)
class Backend(Section):
    """What backends/ read: setup (the device), default.Torch and xla.XLA (the model's seed; under
    XLA also its precision, activation checkpoints and the hosts' collective timeout)."""

    device: str
    seed: int
    precision: str
    activation_checkpoints: bool
    collective_timeout: float


# the training loop


@dataclass(frozen=True)
class Optimizer(Section):
    """What train.build_optimizer builds AdamW (or, decentralized, AccumAdamW) with."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float  # None: 0.95, or 0.98 with --data_parallel decentralized
    data_parallel: str  # decentralized: AccumAdamW
    accum_steps: int  # AccumAdamW's: steps whose mean gradient Adam's moments take


@dataclass(frozen=True)
class LrSchedule(Section):
    """What train.Schedule.for_run and train.run_length decide the run's length and learning rate
    with."""

    lr: float
    min_lr: float
    warmup_steps: int
    lr_decay_steps: int
    max_steps: int
    max_epochs: int


@dataclass(frozen=True)
class Loop(Section):
    """What train.train's loop reads itself: the batch, the step's clipping and NaN/Inf guard, and
    when it logs, evaluates and saves (train.Due, train.evaluate_and_save)."""

    batch_size: int
    grad_accum_steps: int
    grad_clip: float
    skip_nonfinite: int
    log_interval: int
    eval_interval: int
    eval_batches: int
    checkpoint_interval: int


@dataclass(frozen=True)
class Sizes(Section):
    """What config.checks.check_sizes weighs against the memory here (run.check_fits)."""

    batch_size: int
    meta_init: bool


@dataclass(frozen=True)
class Resume(Section):
    """What run.check_resumable checks a checkpoint's flags against: the data-parallel mode (its
    optimizer state), --max_steps (whether anything is left to train), and the flags that change
    what a resumed run computes (run.TRAINING_FLAGS), named where they differ."""

    data_parallel: str
    max_steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    lr_decay_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    batch_size: int
    grad_accum_steps: int
    dropout: float
    precision: str
    fp8_recipe: str
    fp8_layers: str
    reduce_precision: str
    sharding: str
    seed: int

"""One run from start to end: the launch, the parallel plan, the run lock, what to start from, the
data, the model, then training (or only generation) and a sample. `minimal-fsdp train` and
basic_training.py (commands/train.py) hand it their Config.

    run(cfg):
      environment.setup        who and where every rank is; the process groups
      run_lock.RunLock         one training run per run directory
      find.find                what to resume from (--resume, --restart_checkpoint_file)
      train_model              data -> the model's shape -> plan.make_plan (the parallel plan,
                               parallel_plan) -> the plan's backend (backends.default.Torch, or
                               backends.xla.XLA) -> its model -> optimizer -> checkpoint or Hugging
                               Face weights -> train.train with the backend's parts
      or generation_model      a checkpoint or a Hugging Face model, as `sample` loads it
      generate                 the sample at the end
"""

import dataclasses
from pathlib import Path

import torch

from minimal_fsdp import backends
from minimal_fsdp.checkpoint import find, meta
from minimal_fsdp.config.checks import (
    check_sizes,
    cpu_recipe_warning,
    host_memory_available,
    validate_world,
)
from minimal_fsdp.config.flags import Config, ConfigError
from minimal_fsdp.config.sections import (
    Backend,
    Checkpoint,
    Data,
    Evaluation,
    Generation,
    Launch,
    Logging,
    Loop,
    LrSchedule,
    Model,
    Optimizer,
    Parallel,
    Profiling,
    Resume,
    Section,
    Sizes,
)
from minimal_fsdp.data import prepare
from minimal_fsdp.data.streaming import StreamingData
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.data.tokens import TokenData
from minimal_fsdp.hf import hub, read
from minimal_fsdp.inference import load
from minimal_fsdp.inference.generate import check_num_tokens
from minimal_fsdp.launch import environment, failures, run_lock
from minimal_fsdp.launch.resilience import StopRequests
from minimal_fsdp.models.families import config_from_flags, with_document_mask
from minimal_fsdp.models.size import count_parameters
from minimal_fsdp.parallel.plan import apply_process_settings, make_plan
from minimal_fsdp.train import RunParts, build_optimizer, train


@dataclasses.dataclass(frozen=True)
class RunSections:
    """The sections of training's Config that run's helpers read, built once by run(cfg); each
    helper takes the ones it reads (train_model and generation_model, which read most of them, take
    them all)."""

    model: Model
    data: Data
    parallel: Parallel
    generation: Generation
    optimizer: Optimizer
    schedule: LrSchedule
    loop: Loop
    sizes: Sizes
    resume: Resume
    backend: Backend
    checkpoint: Checkpoint
    evaluation: Evaluation
    logging: Logging
    profile: Profiling
    streaming: bool  # --streaming: the data is a stream, not a prepared dataset
    # --checkpoint_dir/--run_name: named when --max_epochs -1 finds nothing to generate from
    checkpoints: Path
    # every flag's value (dataclasses.asdict): the run's record, written whole into meta.json and
    # config.toml (and wandb's config); read by nothing else
    flags: dict

    @classmethod
    def of(cls, cfg):
        fields = dataclasses.fields(cls)
        sections = {f.name: f.type.of(cfg) for f in fields if issubclass(f.type, Section)}
        checkpoints = Path(cfg.checkpoint_dir) / cfg.run_name
        return cls(
            **sections,
            streaming=cfg.streaming,
            checkpoints=checkpoints,
            flags=dataclasses.asdict(cfg),
        )

    def for_loop(self):
        """train.train's sections, by its keyword names."""
        return dict(
            lr_schedule=self.schedule, loop=self.loop, evaluation=self.evaluation,
            logging=self.logging, profile=self.profile, flags=self.flags,
        )  # fmt: skip


def run(cfg):
    sections = RunSections.of(cfg)
    stop = StopRequests(cfg.time_limit_seconds)  # --time_limit counts from here
    env = backends.setup(Launch.of(cfg), sections.backend)
    validate_world(cfg, env.world_size, env.local_world_size, env.local_world_sizes)
    if env.is_main and cpu_recipe_warning(cfg, env.device.type):
        print(cpu_recipe_warning(cfg, env.device.type), flush=True)
    torch.manual_seed(cfg.seed + env.rank)  # dropout masks differ per rank, repeat per run
    # rank 0 downloads
    hf_dir = failures.run_on_main(hub.resolve, cfg.hf_model) if cfg.hf_model else None
    # One training run per run directory: rank 0 holds the lock until the end (generation
    # only reads).
    lock = run_lock.RunLock(
        {
            "--checkpoint_dir": Path(cfg.checkpoint_dir) / cfg.run_name,
            "--log_dir": Path(cfg.log_dir) / cfg.run_name,
        }
    )
    if not cfg.generate_only:
        failures.run_on_main(lock.acquire)
    try:
        # rank 0 picks it, all ranks check it: all load the same one
        start = find.find(sections.checkpoint)
        if cfg.generate_only:
            (model, tokenizer), samples = generation_model(sections, env, start, hf_dir), True
        else:
            model, tokenizer, samples = train_model(sections, env, start, hf_dir, stop)
    finally:
        lock.release()
    # Preempted: the checkpoint is saved; exit 0 without a sample, so a requeued job resumes
    # at once.
    if samples and cfg.num_tokens > 0 and not stop.reason:
        dtype = torch.float32 if cfg.precision == "float32" else torch.bfloat16
        if env.is_main:
            print("-" * 40, flush=True)
        # written as it is generated
        load.stream_sample(model, tokenizer, sections.generation, env, dtype)
        if env.is_main:
            print("\n" + "-" * 40, flush=True)
    # FSDP state and the device mesh refer to the process groups: let them go, so the groups (and
    # gloo's worker threads) end inside teardown, not during interpreter shutdown, where that can
    # abort the process.
    del model
    environment.teardown()


def given_tokenizer(tokenizer_dir, hf_dir=None):
    """--tokenizer_dir's tokenizer, else the --hf_model's own, else None (a --tokenizer is fit on
    the data)."""
    if tokenizer_dir:
        return load_tokenizer(tokenizer_dir)
    return read.load_tokenizer(hf_dir) if hf_dir else None


def open_data(data, streaming, env, hf_dir):
    """The training data (data: sections.Data): a stream, or a prepared dataset (prepared by rank 0
    on first use)."""
    if streaming:
        return StreamingData.open(data, env)
    return TokenData(
        failures.run_on_main(lambda: prepared(data, given_tokenizer(data.tokenizer_dir, hf_dir)))
    )


def prepared(data, tokenizer):
    """Rank 0's part of open_data: the dataset prepared (data.prepare's one front end), then
    checked, so that the token ids' maximum is cached for all ranks."""
    out = prepare.for_training(data, tokenizer)
    TokenData(out)
    return str(out)


def parallel_plan(parallel, env, model_config, loads_weights):
    """The run's parallel plan (plan.make_plan: every layout, sync, compile and precision decision,
    made once), and the process-wide torch settings it needs, applied here and nowhere else."""
    plan = make_plan(parallel, env, model_config, loads_weights=loads_weights)
    apply_process_settings(plan)
    return plan


def train_model(s, env, start, hf_dir, stop):
    """Open the data, build (or resume) the model and optimizer with the plan's backend, and train;
    returns the model to sample from (the trained one; under XLA, the host's copy of the checkpoint
    just saved) and the data's tokenizer. s: the run's sections (RunSections)."""
    if start is not None:
        # preparing the data can take minutes: refuse another run's model first
        check_before_data(s.model, s.data, start)
    data = open_data(s.data, s.streaming, env, hf_dir)
    samples = check_prompt(s.generation, data.tokenizer, env)
    model_config = (
        read.read_model_config(hf_dir, s.model)
        if hf_dir
        else config_from_flags(s.model, data.meta["vocab_size"])
    )
    model_config = with_document_mask(model_config, s.model, data.tokenizer)
    if samples:  # the sample's length, refused now rather than after hours of training
        check_num_tokens(s.generation.num_tokens, model_config)
    data.check(model_config.seq_length, model_config.vocab_size)
    check_fits(s.sizes, env, model_config)
    if start is not None:
        check_resumable(s.resume, start, model_config, env)
    plan = parallel_plan(s.parallel, env, model_config, loads_weights=hf_dir is not None)
    backend = backends.for_plan(s.backend, s.checkpoint, s.flags, env, plan)
    # Every data-parallel member (a rank; under XLA a device) reads --batch_size sequences: this
    # process, its own.
    data.bind(
        model_config.seq_length,
        s.loop.batch_size * backend.local_ranks,
        s.loop.grad_accum_steps,
        env.rank,
        env.world_size,
        s.data.seed,
    )
    model = backend.build_model(model_config, hf_dir if start is None else None)
    optimizer = build_optimizer(model, s.optimizer, plan)
    checkpointer = backend.checkpointer(model_config, data.directory, model)
    saved = None
    if start is not None:  # a resumed run continues from its own weights, RNG and data position
        saved = checkpointer.restore(start, model, optimizer, s.data.seed)
        start = checkpointer.restored_from  # an older one, where `start` failed to load
        data.load_state_dict(saved["state"]["data"], saved["step"])
    backend.seed(saved["step"] if saved else 0)
    if env.is_main:
        print(backend.banner(model, start, checkpointer) + "\n" + data.describe(), flush=True)
    parts = RunParts(
        model,
        optimizer,
        backend.batches(data),
        backend.gradient_sync(model),
        checkpointer,
        backend.ranks,
        backend.synchronize,
    )
    with stop.listening():
        _, log = train(parts, backend.env, plan, stop, saved, **s.for_loop())
    if env.is_main:
        print(log.summary(), flush=True)
    if not backend.samples_on_host:
        return model, data.tokenizer, samples
    # from the checkpoint just saved (or resumed), as --max_epochs -1
    if samples and not stop.reason:
        only = dataclasses.replace(
            s,
            parallel=dataclasses.replace(s.parallel, generate_only=True),
            checkpoint=dataclasses.replace(s.checkpoint, generate_only=True),
        )
        return *generation_model(only, env, log.checkpoint or start, None), True
    return None, data.tokenizer, False


def check_prompt(generation, tokenizer, env):
    """Encode --prompt (generation: sections.Generation) before training, not after it: a prompt the
    data's tokenizer cannot encode (a character vocabulary without capitals) is refused now; the
    default prompt only drops the sample, with one line. Returns whether the run ends with a
    sample."""
    prompt = generation.prompt
    if generation.num_tokens == 0:
        return False
    try:
        tokenizer.encode(prompt)
        return True
    except ConfigError as e:
        if prompt != Config.prompt:
            raise ConfigError(
                f"--prompt {prompt!r}: {e}; or pass --num_tokens 0 for no sample"
            ) from None
        if env.is_main:
            print(
                f"no sample at the end: the default --prompt {prompt!r} does not encode with "
                f"this data's tokenizer ({e}); pass --prompt with text from your data (or "
                f"--num_tokens 0 to say so)",
                flush=True,
            )
        return False


def check_fits(sizes, env, model_config):
    """Refuse a batch or model far beyond the memory here before allocating it
    (checks.check_sizes, of sections.Sizes)."""
    if env.device.type == "cuda":
        free = torch.cuda.mem_get_info(env.device)[0]
    else:
        free = host_memory_available() if env.device.type == "cpu" else None
    # first a lower bound in Python's integers: an absurd shape overflows torch's size arithmetic
    c = model_config
    lower = c.vocab_size * c.embed_size + c.num_layers * 2 * c.embed_size**2
    check_sizes(
        sizes,
        c.seq_length,
        lower,
        env.local_world_size,
        free,
        env.device.type,
        env.world_size,
        at_least=True,
    )
    num_params = count_parameters(c).total
    check_sizes(
        sizes,
        c.seq_length,
        num_params,
        env.local_world_size,
        free,
        env.device.type,
        env.world_size,
        vocab_size=c.vocab_size,
    )


# ---- resuming: whether a checkpoint is this run's to continue, checked twice (check_before_data
# before the data is prepared, check_resumable once the model's shape is known) ----


def refuse_another_model(start, saved, model_config):
    """The one refusal of a checkpoint (`saved`: its meta.json) whose model is not this one."""
    if saved["model_type"] != model_config.model_type or saved["model"] != model_config.to_dict():
        raise ConfigError(
            f"{start} holds a different model ({model_differences(saved, model_config)}): use "
            "another --run_name or --checkpoint_dir"
        )


def model_differences(saved, model_config):
    """What differs between a checkpoint's model and this one, e.g. 'vocab_size 65 there, 221
    here'."""
    if saved["model_type"] != model_config.model_type:
        return f"{saved['model_type']} there, {model_config.model_type} here"
    mine, theirs = model_config.to_dict(), saved["model"]
    return ", ".join(
        f"{name} {theirs.get(name)} there, {mine.get(name)} here"
        for name in dict.fromkeys([*theirs, *mine])
        if theirs.get(name) != mine.get(name)
    )


def data_source(flags):
    """(flag, value) of the data a run's flags (a dict) name: ('input_file', 'my.txt'), ('dataset',
    ...)."""
    for name in ("input_file", "dataset_path"):
        if flags.get(name):
            return name, flags[name]
    return "dataset", flags.get("dataset")


def other_file(mine, before):
    """Whether two --input_file/--dataset_path values surely name other data. A relative path was
    relative to its launch's directory, which the checkpoint does not keep: only a different name,
    or two absolute paths that differ, are sure (the vocabulary is checked later anyway)."""
    if Path(mine).name != Path(before).name:
        return True
    return Path(mine).is_absolute() and Path(before).is_absolute() and Path(mine) != Path(before)


def check_before_data(model, data, start):
    """Refuse a checkpoint whose model these flags (sections.Model and Data) cannot continue before
    the data is prepared, naming what differs: the data, where the vocabulary is built from it
    (--tokenizer char or sentencepiece), and the shape the model flags give (with the checkpoint's
    vocabulary, which only the data can tell)."""
    saved = meta.read_meta(start)
    theirs, vocab = saved["config"], saved["model"].get("vocab_size")
    if model.hf_model or theirs.get("hf_model"):
        return  # the shape comes from the Hugging Face model: checked once it is read
    (kind, mine), (their_kind, before) = data_source(dataclasses.asdict(data)), data_source(theirs)
    other_data = kind != their_kind or (
        mine != before and (kind == "dataset" or other_file(mine, before))
    )
    if (
        other_data
        and data.tokenizer in ("char", "sentencepiece")
        and not (data.tokenizer_dir or theirs.get("tokenizer_dir"))
    ):
        raise ConfigError(
            f"{start} holds a model trained on --{their_kind} {before} (--tokenizer "
            f"{theirs.get('tokenizer')}, vocabulary {vocab}); this run trains on --{kind} {mine}, "
            "whose vocabulary is built from its own text: use another --run_name (unset, it names "
            "the data) or --checkpoint_dir"
        )
    model_config = config_from_flags(model, vocab)
    # --document_mask's token comes from the tokenizer: as saved
    if "document_eot_id" in saved["model"]:
        model_config = dataclasses.replace(
            model_config, document_eot_id=saved["model"]["document_eot_id"]
        )
    refuse_another_model(start, saved, model_config)


# Flags that change what a resumed run computes (sections.Resume holds them); the startup lines name
# those that differ from the checkpoint's.
TRAINING_FLAGS = (
    "lr",
    "min_lr",
    "warmup_steps",
    "lr_decay_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "batch_size",
    "grad_accum_steps",
    "dropout",
    "precision",
    "fp8_recipe",
    "fp8_layers",
    "reduce_precision",
    "sharding",
    "seed",
)


def check_resumable(resume, start, model_config, env):
    """Refuse a checkpoint this run (resume: sections.Resume) cannot continue; say which training
    flags differ from it, and when it has trained to the end already. The same files and flags on
    every rank: the same verdict everywhere."""
    saved = meta.read_meta(start)
    refuse_another_model(start, saved, model_config)
    trained_with = saved["config"].get("data_parallel", "allreduce")
    if trained_with != resume.data_parallel:  # AdamW and AccumAdamW keep different optimizer state
        raise ConfigError(
            f"{start} was trained with --data_parallel {trained_with}: resume it the same way, "
            "or start another --run_name"
        )
    if not env.is_main:
        return
    now = dataclasses.asdict(resume)
    changed = [
        f"--{name} {saved['config'].get(name)} -> {now[name]}"
        for name in TRAINING_FLAGS
        if name in saved["config"] and saved["config"][name] != now[name]
    ]
    if changed:
        print(f"resuming {start} with changed flags: {', '.join(changed)}", flush=True)
    last = saved["state"]["schedule"].get("last_step")
    if last is not None and saved["step"] >= last and resume.max_steps <= saved["step"]:
        print(
            f"{start} finished its run at step {saved['step']}: nothing to train. Pass a larger "
            "--max_steps to train on, --max_epochs -1 to only sample from it, or another "
            "--run_name to start afresh",
            flush=True,
        )


def generation_model(s, env, start, hf_dir):
    """The model to sample from and its tokenizer: the --hf_model itself, or the checkpoint (whose
    meta.json gives the shape, so no model flags are repeated), loaded as the sample command loads
    it (inference.load). s: the run's sections (RunSections)."""
    if not hf_dir and start is None:
        raise ConfigError(
            f"--max_epochs -1 generates from a checkpoint, but {s.checkpoints} "
            "has none: train first or pass --restart_checkpoint_file"
        )
    # a checkpoint that fails to load: the next one find gives, as a resumed run takes it
    loaded = load.load(
        hf_dir or start,
        s.parallel,
        env,
        s.model.seq_length,
        given_tokenizer(s.data.tokenizer_dir),
        s.generation.num_tokens,
        None if hf_dir else find.run_fallback(s.checkpoint),
    )
    if env.is_main:
        print(load.describe(loaded.source, loaded.model, loaded.tokenizer, env), flush=True)
    return loaded.model, loaded.tokenizer

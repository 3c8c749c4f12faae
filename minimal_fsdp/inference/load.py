"""One way to load a trained model: a checkpoint (a step_<N> directory, a run directory, its
latest/best marker), our export (minimal-fsdp export) or a Hugging Face model directory -> the model
on N ranks, with its tokenizer, checked alike on every rank before anything is built. The sample and
evaluate commands, generation after training (run.generation_model) and export all load through
here, and end through command():

    load(source, parallel, env) -> Loaded(source, model, tokenizer, plan)  (collective)
    open_source(source)        what SOURCE holds, from small files (rank 0)
    command(body)              body() with one `error:` line for bad input (exit 2), the process
                               groups torn down afterwards

Every file is read as hostile: an export's files are confined to its directory (no link, FIFO or
device), its safetensors header bounded, and each tensor's shape compared with config.json before
anything is built; the tokenizer must fit the model's vocabulary."""

from dataclasses import dataclass
from pathlib import Path

from minimal_fsdp.checkpoint import checkpointer, find
from minimal_fsdp.checkpoint.dirs import step_dirs
from minimal_fsdp.checkpoint.meta import model_problem, read_meta
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.hf import hub, read
from minimal_fsdp.inference.generate import check_num_tokens, generate
from minimal_fsdp.launch import environment, failures
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import config_from_dict, guess_family
from minimal_fsdp.parallel.parallelize import build_model
from minimal_fsdp.parallel.plan import apply_process_settings, make_plan

# An export of ours is this one file, config.json and the tokenizer's files.
EXPORT_WEIGHTS = "model.safetensors"


@dataclass
class Source:
    kind: str  # "checkpoint", "export" (ours: --format safetensors) or "hf" (Hugging Face's)
    path: str
    model_type: str  # a family of models/families: "gpt", "llama", ...
    config: object  # that family's Config
    step: int = None  # a checkpoint's


@dataclass
class Loaded:
    source: Source
    model: object
    tokenizer: object
    plan: object


def command(body):
    """Run body() (a command's work, whose locals, the model among them, are gone when it returns),
    then tear the process groups down. Bad input, raised alike on every rank, ends each with one
    `error:` line (exit 2); a bug on rank 0, which printed its traceback, ends the others with one
    line (exit 1)."""
    try:
        body()
    except ConfigError as e:
        failures.exit_on_error(e, 2)
    except failures.MainRankFailed as e:
        failures.exit_on_error(e, 1)
    except KeyboardInterrupt:
        failures.exit_on_error("interrupted (Ctrl-C)", 130)
    environment.teardown()


def load(source, parallel, env, seq_length=None, tokenizer=None, num_tokens=0, fallback=None):
    """Collective: SOURCE's model built as make_plan(parallel, ...) lays it out over the ranks, its
    weights loaded, and its tokenizer (or `tokenizer`, e.g. --tokenizer_dir's), checked against the
    model's vocabulary; num_tokens, the tokens to generate, checked before anything is built
    (check_num_tokens). A checkpoint whose shards fail to load is replaced as `fallback`, (named,
    next_one) for find.first_loading, says: by default find.source_fallback's."""
    found = failures.run_on_main(open_source, str(source), seq_length)
    check_num_tokens(num_tokens, found.config)
    tokenizer = tokenizer or source_tokenizer(
        found
    )  # the same files on every rank: the same verdict everywhere
    check_vocabulary(tokenizer, found)
    plan = make_plan(parallel, env, found.config, loads_weights=True)
    apply_process_settings(plan)
    fallback = fallback or find.source_fallback(source, together=True)
    return Loaded(found, load_model(found, plan, env, fallback), tokenizer, plan)


def _is_checkpoint(path):
    return (
        path.is_file()
        or path.is_dir()
        and ((path / "meta.json").exists() or (path / "latest").exists() or bool(step_dirs(path)))
    )


def open_source(source, seq_length=None):
    """What SOURCE holds: its kind, model type and model config. Reads small files only (a hub name
    is downloaded): call it on rank 0 (failures.run_on_main). seq_length shortens a Hugging Face
    model's context; for a checkpoint or an export it may not exceed the saved context."""
    path = Path(source)
    if _is_checkpoint(path):
        resolved = find.checkpoint_path(path)
        meta = read_meta(resolved)
        found = Source(
            "checkpoint",
            str(resolved),
            meta["model_type"],
            config_from_dict(meta["model_type"], meta["model"]),
            meta["step"],
        )
    elif path.is_dir() and (path / "config.json").exists():
        config = read.config_json(path)
        if "model_type" in config:  # Hugging Face's config.json (ours has no such key)
            return _hf_source(path, seq_length)
        found = _export_source(path, config)
    elif not path.exists() and source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return _hf_source(
            hub.resolve(source), seq_length
        )  # a hub name: from the Hugging Face cache, or downloaded
    else:
        raise ConfigError(
            f"{source} is not a checkpoint (a step_<N> directory, a run directory or its "
            "latest/best marker), an export, or a Hugging Face model directory (config.json + "
            "weights)"
        )
    if seq_length and seq_length > found.config.seq_length:
        raise ConfigError(
            f"--seq_length {seq_length} is larger than the model's context of "
            f"{found.config.seq_length} tokens in {found.path}"
        )
    return found


def _hf_source(directory, seq_length):
    """A Hugging Face directory's config, checked against its weights' shapes before anything is
    built."""
    model_type, config = read.read_config(directory, seq_length)
    read.check_weights(directory, model_type, config)
    return Source("hf", str(directory), model_type, config)


def _export_source(path, config):
    """Our export: one model.safetensors beside config.json (our model config). Its header is read
    with the bounds of a Hugging Face directory's, and every tensor's shape is compared with
    config.json's model."""
    others = sorted(
        p.name
        for p in path.iterdir()
        if p.name.endswith(".safetensors") and p.name != EXPORT_WEIGHTS
    )
    if others:
        raise ConfigError(
            f"{path}: an export holds its weights in one {EXPORT_WEIGHTS}; {', '.join(others[:3])} "
            "would be read beside it: move it out"
        )
    if not (path / EXPORT_WEIGHTS).exists() and not (path / EXPORT_WEIGHTS).is_symlink():
        raise ConfigError(
            f"{path} has a config.json but no {EXPORT_WEIGHTS}: not an export of ours"
        )
    files = read.CheckpointFiles(path, where=str(path))
    recorded = files.metadata(path / EXPORT_WEIGHTS).get("model_type")
    model_type = recorded if recorded in MODELS else guess_family(config)
    problem = model_problem(model_type, config)
    if problem:
        raise ConfigError(f"{path}: config.json: {problem}")
    found = Source("export", str(path), model_type, config_from_dict(model_type, config))
    read.check_weights(path, model_type, found.config, names=export_names, where=str(path))
    return found


def export_names(model_type, config):
    """Our export keeps the model's own parameter names: {name: name}."""
    import torch

    with torch.device("meta"):
        return {name: name for name, _ in MODELS[model_type](config).named_parameters()}


def source_tokenizer(source):
    """The tokenizer that travels with the source."""
    return read.load_tokenizer(source.path) if source.kind == "hf" else load_tokenizer(source.path)


def check_vocabulary(tokenizer, source):
    """A tokenizer whose ids reach past the model's embedding would index out of it: refused, as
    training does."""
    if tokenizer.vocab_size > source.config.vocab_size:
        raise ConfigError(
            f"the {tokenizer.kind} tokenizer of {source.path} has {tokenizer.vocab_size} tokens, "
            f"but the model's vocabulary is {source.config.vocab_size}: token ids would be out of "
            "range"
        )


def load_model(source, plan, env, fallback=(None, None)):
    """Collective: build the source's model as the plan lays it out (built on the meta device: plan
    from make_plan(..., loads_weights=True)), and load its weights into it, each rank only its
    shard's rows. A checkpoint that fails to load is replaced as `fallback` says (load); `source`
    then names the one loaded."""
    model = build_model(MODELS[source.model_type], source.config, plan, env, seed=0)
    if source.kind == "checkpoint":
        named, next_one = fallback
        path, _ = find.first_loading(
            source.path, lambda p: checkpointer.load(p, model), next_one, named
        )
        if str(path) != source.path:
            source.path, source.step = str(path), read_meta(path)["step"]
    elif source.kind == "hf":
        read.load_weights(model, source.path, source.model_type)
    else:
        read.load_weights(
            model, source.path, source.model_type, names=export_names, where=source.path
        )
    return model


def describe(source, model, tokenizer, env, doing="generating from"):
    """What is loaded: the source, the model as loaded (not the command line's defaults), the
    tokenizer."""
    c = source.config
    heads = f"{c.num_heads} heads" + (
        f" ({c.num_kv_heads} kv)" if hasattr(c, "num_kv_heads") else ""
    )
    what = {
        "checkpoint": f"checkpoint, step {source.step}",
        "export": "export",
        "hf": "Hugging Face model",
    }[source.kind]
    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full size
    return "\n".join(
        [
            f"{doing} {source.path} ({what}) on {env.world_size} rank(s), {env.device.type}",
            f"model: {source.model_type}, {c.num_layers} layers, {heads}, width {c.embed_size}, "
            f"context {c.seq_length}, vocab {c.vocab_size}: {num_params / 1e6:.2f}M parameters",
            f"tokenizer: {tokenizer.kind}, {tokenizer.vocab_size} tokens",
        ]
    )


def printer():
    """write(text) that shows text on stdout at once (generation streams its text as it is
    produced)."""

    def write(text):
        print(text, end="", flush=True)

    return write


def stream_sample(model, tokenizer, generation, env, dtype):
    """--num_tokens after --prompt, sampled as --temperature, --top_k and --seed say (collective),
    the text written on rank 0 as it is produced: the sample command's and the one after
    training."""
    stream = printer() if env.is_main else None
    g = generation  # config.sections.Generation
    generate(model, tokenizer, g.prompt, g.num_tokens, g.temperature, g.top_k, g.seed,
             env.device, dtype, stream=stream)  # fmt: skip

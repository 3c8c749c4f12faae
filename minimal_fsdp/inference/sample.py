"""Text from a trained model: a checkpoint, an export, or a Hugging Face model directory.

    minimal-fsdp sample checkpoints/shakespeare --prompt "ROMEO:"        # the run's newest checkpoint
    minimal-fsdp sample checkpoints/shakespeare/best --temperature 0      # greedy, from the best one
    minimal-fsdp sample exported/ --prompt "Once upon a time" --top_k 20  # an export, either --format
    minimal-fsdp sample ~/models/Llama-3.2-1B --prompt "The capital of France is" --num_tokens 20
    mpiexec -n 4 minimal-fsdp sample ~/models/Llama-2-13b-hf --precision bf16   # sharded over 4 GPUs

One process on the CPU or one GPU; under mpiexec (or torchrun, srun) the model is sharded over the ranks with
FSDP2, as in training. The tokenizer is the one the source carries. The text goes to stdout, what was loaded
to stderr. basic_training.py --max_epochs -1 loads its model through here too.
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from minimal_fsdp.config.commands import SampleFlags
from minimal_fsdp.config.flags import one_line_errors
from minimal_fsdp.config.parser import parse
from minimal_fsdp.checkpoint import checkpointer as checkpoint
from minimal_fsdp.checkpoint import find as checkpoint_find
from minimal_fsdp.checkpoint import meta as checkpoint_meta
from minimal_fsdp.launch import environment
from minimal_fsdp.hf import read as hf
from minimal_fsdp.config.flags import Config, ConfigError, validate
from minimal_fsdp.inference.generate import generate
from minimal_fsdp.models.families import MODELS, config_from_dict
from minimal_fsdp.parallel.parallelize import build_model
from minimal_fsdp.parallel.plan import make_plan
from minimal_fsdp.data.tokenizer import load_tokenizer


@dataclass
class Source:
    kind: str  # "checkpoint", "export" (ours: --format safetensors) or "hf" (a Hugging Face directory)
    path: str
    model_type: str  # "gpt" or "llama"
    config: object  # GPTConfig or LlamaConfig
    step: int = None  # a checkpoint's


def _is_checkpoint(path):
    return path.is_file() or path.is_dir() and ((path / "meta.json").exists() or (path / "latest").exists()
                                                or bool(checkpoint_find.step_dirs(path)))


def open_source(source, seq_length=None):
    """What SOURCE holds: its kind, model type and model config. Reads small files only (a hub name is
    downloaded): call it on rank 0 (environment.run_on_main). seq_length shortens a Hugging Face model's
    context; for a checkpoint or an export it may not exceed the saved context."""
    path = Path(source)
    if _is_checkpoint(path):
        resolved = checkpoint_find.resolve(path)
        problem = checkpoint_find.verify(resolved)
        if problem:
            raise ConfigError(f"{source} is not a complete checkpoint: {resolved}: {problem}")
        meta = checkpoint_meta.read_meta(resolved)
        found = Source("checkpoint", str(resolved), meta["model_type"], config_from_dict(meta["model_type"],
                                                                                         meta["model"]), meta["step"])
    elif (path / "config.json").is_file():
        config = hf.config_json(path)
        if "model_type" in config:  # Hugging Face's config.json (ours has no such key)
            return _hf_source(path, seq_length)
        model_type = _export_model_type(path, config)
        problem = checkpoint_meta.model_problem(model_type, config)
        if problem:
            raise ConfigError(f"{path}: config.json: {problem}")
        found = Source("export", str(path), model_type, config_from_dict(model_type, config))
    elif not path.exists() and source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return _hf_source(hf.resolve(source), seq_length)  # a hub name: from the Hugging Face cache, or downloaded
    else:
        raise ConfigError(f"{source} is not a checkpoint (a step_<N> directory, a run directory or its latest/best "
                          "marker), an export, or a Hugging Face model directory (config.json + weights)")
    if seq_length and seq_length > found.config.seq_length:
        raise ConfigError(f"--seq_length {seq_length} is larger than the model's context of "
                          f"{found.config.seq_length} tokens in {found.path}")
    return found


def _hf_source(directory, seq_length):
    """A Hugging Face directory's config, checked against its weights' shapes before anything is built."""
    model_type, config = hf.read_config(directory, seq_length)
    hf.check_weights(directory, model_type, config)
    return Source("hf", str(directory), model_type, config)


def _export_model_type(path, config):
    """export.py records the model type in model.safetensors' metadata; a Llama's config has num_kv_heads."""
    from safetensors import safe_open
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{path} has a config.json but no model.safetensors: not an export of ours")
    try:
        with safe_open(str(weights), framework="pt") as f:
            recorded = (f.metadata() or {}).get("model_type")
    except Exception as e:  # noqa: BLE001 - random bytes or a hostile header fail in many ways
        raise ConfigError(f"{weights} cannot be read as safetensors ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:150]})") from None
    return recorded if recorded in MODELS else "llama" if "num_kv_heads" in config else "gpt"


def source_tokenizer(source):
    """The tokenizer that travels with the source."""
    return hf.load_tokenizer(source.path) if source.kind == "hf" else load_tokenizer(source.path)


def load_model(source, plan, env):
    """Collective: build the source's model as the plan lays it out (built on the meta device: plan from
    make_plan(..., loads_weights=True)), and load its weights into it."""
    model = build_model(MODELS[source.model_type], source.config, plan, env, seed=0)
    if source.kind == "checkpoint":
        checkpoint.load(source.path, model)
    elif source.kind == "hf":
        hf.load_weights(model, source.path, source.model_type)
    else:  # our export: the names are the state dict's, so DCP's Hugging Face reader loads each rank's shard
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        state = get_model_state_dict(model)
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(source.path))
        set_model_state_dict(model, state)
    return model


def describe(source, model, tokenizer, env):
    """What is generating: the source, the model as loaded (not the command line's defaults), the tokenizer."""
    c = source.config
    heads = f"{c.num_heads} heads" + (f" ({c.num_kv_heads} kv)" if source.model_type == "llama" else "")
    what = {"checkpoint": f"checkpoint, step {source.step}", "export": "export",
            "hf": "Hugging Face model"}[source.kind]
    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full size
    return "\n".join([
        f"generating from {source.path} ({what}) on {env.world_size} rank(s), {env.device.type}",
        f"model: {source.model_type}, {c.num_layers} layers, {heads}, width {c.embed_size}, context "
        f"{c.seq_length}, vocab {c.vocab_size}: {num_params / 1e6:.2f}M parameters",
        f"tokenizer: {tokenizer.kind}, {tokenizer.vocab_size} tokens"])


def main(argv=None, cfg=None):
    """`minimal-fsdp sample`: the flags (or SampleFlags parsed already) -> the text on stdout."""
    args = cfg or one_line_errors(parse)(SampleFlags, argv)
    cfg = Config(prompt=args.prompt, num_tokens=args.num_tokens, temperature=args.temperature, top_k=args.top_k,
                 seed=args.seed, precision=args.precision, max_epochs=-1, tensorboard=False)
    try:
        validate(cfg)
        env = environment.setup(cfg)
        source = environment.run_on_main(open_source, args.source)
        plan = make_plan(cfg, env, source.config, loads_weights=True)
        tokenizer = source_tokenizer(source)  # the same files on every rank: the same verdict everywhere
        model = load_model(source, plan, env)
        if env.is_main:
            print(describe(source, model, tokenizer, env), file=sys.stderr, flush=True)
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        text = generate(model, tokenizer, cfg.prompt, cfg.num_tokens, cfg.temperature, cfg.top_k, cfg.seed,
                        env.device, dtype)
        if env.is_main:
            print(text, flush=True)
        del model, plan
    except ConfigError as e:  # raised alike on every rank: one line, clean exit
        environment.exit_on_error(e, 2)
    except environment.MainRankFailed as e:  # a bug on rank 0, which printed its traceback
        environment.exit_on_error(e, 1)
    environment.teardown()

"""Train a GPT or Llama with FSDP2, then generate from a prompt.

    mpiexec -n 2 python basic_training.py                       # train on Shakespeare, print a sample
    mpiexec -n 2 python basic_training.py --max_epochs -1 --prompt "ROMEO:"   # generate from the last checkpoint
    mpiexec -n 2 python basic_training.py --hf_model DIR        # start from a Hugging Face GPT-2 or Llama

Flags -> Config -> the package's functions; nothing else happens here.
"""
import dataclasses
import sys
from pathlib import Path

import torch

from minimal_fsdp import checkpoint, environment, hf, resilience
from minimal_fsdp.config import ConfigError, model_family, parse_args, validate_world
from minimal_fsdp.data import TokenData, prepare
from minimal_fsdp.generate import generate
from minimal_fsdp.metrics import banner
from minimal_fsdp.llama import Llama, LlamaConfig, make_config as make_llama_config
from minimal_fsdp.model import GPT, GPTConfig, make_config as make_gpt_config
from minimal_fsdp.parallelize import build_mesh, build_model
from minimal_fsdp.streaming import StreamingData
from minimal_fsdp.tokenizer import load_tokenizer
from minimal_fsdp.train import build_optimizer, train

# model type (--model; "model_type" in a checkpoint's meta.json) -> (model class, its config class)
MODELS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}


def hf_model_config(cfg, hf_dir):
    """(model type, config) of the --hf_model checkpoint, with --seq_length and --dropout applied."""
    model_type, model_config = hf.read_config(hf_dir, cfg.seq_length, cfg.dropout)
    if cfg.model and cfg.model != model_type:
        raise ConfigError(f"--model {cfg.model}, but --hf_model {cfg.hf_model} is a {model_type} model: drop --model")
    return model_type, model_config


def preset_config(cfg, vocab_size=None):
    """--model_preset's shape with the explicit model flags applied (vocab: --vocab_size, else vocab_size,
    else the preset's)."""
    shape = dict(num_layers=cfg.num_layers, num_heads=cfg.num_heads, embed_size=cfg.embed_size,
                 seq_length=cfg.seq_length, dropout=cfg.dropout, vocab_size=cfg.vocab_size or vocab_size)
    if model_family(cfg) == "llama":
        return make_llama_config(cfg.model_preset, num_kv_heads=cfg.num_kv_heads,
                                 intermediate_size=cfg.intermediate_size, **shape)
    return make_gpt_config(cfg.model_preset, bias=cfg.bias, **shape)


def model_config_for(cfg, data, hf_dir=None):
    """The model's shape: a Hugging Face checkpoint's, or --model_preset's with the explicit flags applied."""
    model_config = hf_model_config(cfg, hf_dir)[1] if hf_dir else preset_config(cfg, data.meta["vocab_size"])
    c = model_config
    if c.embed_size % c.num_heads:
        raise ConfigError(f"embed size {c.embed_size} is not divisible by {c.num_heads} heads")
    if c.model_type == "llama" and (c.num_heads % c.num_kv_heads or c.embed_size // c.num_heads % 2):
        raise ConfigError(f"llama needs --num_heads divisible by --num_kv_heads and an even head size (got "
                          f"{c.num_heads} heads, {c.num_kv_heads} kv heads, head size {c.embed_size // c.num_heads})")
    data.check(c.seq_length, c.vocab_size)
    return model_config


def prepare_data(cfg, hf_dir=None):
    """Tokenize the dataset (once, on rank 0), with a Hugging Face model's own tokenizer if there is one."""
    return prepare(cfg, hf.load_tokenizer(hf_dir) if hf_dir else None)


def model_for_generation(cfg, env, mesh, start, hf_dir):
    """The model to sample from and its tokenizer: a Hugging Face model's, or the checkpoint's (whose
    meta.json gives the shape, so no model flags are repeated)."""
    if hf_dir:  # straight from the Hugging Face model, no checkpoint involved
        model_type, model_config = hf_model_config(cfg, hf_dir)
        model = build_model(MODELS[model_type][0], model_config, dataclasses.replace(cfg, meta_init=True), env, mesh)
        hf.load_weights(model, hf_dir, model_type)
        return model, hf.load_tokenizer(hf_dir)
    if start is None:
        raise ConfigError(f"--max_epochs -1 generates from a checkpoint, but {Path(cfg.checkpoint_dir) / cfg.run_name} "
                          "has none: train first or pass --restart_checkpoint_file")
    meta = checkpoint.read_meta(start)
    model_cls, config_cls = MODELS[meta.get("model_type", "gpt")]  # checkpoints from before Llama are GPTs
    model_config = config_cls(**meta["model"])
    if cfg.seq_length and cfg.seq_length > model_config.seq_length:
        raise ConfigError(f"--seq_length {cfg.seq_length} is larger than the model's context of "
                          f"{model_config.seq_length} tokens in {start}")
    model = build_model(model_cls, model_config, cfg, env, mesh)
    checkpoint.load(start, model)
    if env.is_main:
        print(banner(cfg, env, mesh, model, start, training=False), flush=True)
    return model, load_tokenizer(start)


def train_model(cfg, env, mesh, start, hf_dir, stop):
    """Prepare the data, build (or resume) the model and optimizer, and train; returns the model and the
    data's tokenizer."""
    if cfg.streaming:
        data = StreamingData.open(cfg, env)
    else:
        data = TokenData(environment.run_on_main(prepare_data, cfg, hf_dir))
    model_config = model_config_for(cfg, data, hf_dir)
    saved = None
    if start is not None:
        saved = checkpoint.read_meta(start)
        if saved.get("model_type", "gpt") != model_config.model_type or saved["model"] != model_config.to_dict():
            raise ConfigError(f"{start} holds a different model ({saved.get('model_type', 'gpt')} "
                              f"{saved['model']}): use another --run_name or --checkpoint_dir")
        trained_with = saved["config"].get("data_parallel", "allreduce")
        if trained_with != cfg.data_parallel:  # AdamW and AccumAdamW keep different optimizer state
            raise ConfigError(f"{start} was trained with --data_parallel {trained_with}: resume it the same way, "
                              "or start another --run_name")
        # Continue the data stream where the checkpoint left it (also on another world or batch size).
        data.restore(saved.get("data_position"), saved.get("train_batches", saved["step"] * cfg.grad_accum_steps))
    meta = {"model": model_config.to_dict(), "model_type": model_config.model_type, "config": dataclasses.asdict(cfg)}
    if cfg.device == "xla":  # its own sharding, optimizer, checkpoints and loop (minimal_fsdp/xla.py)
        from minimal_fsdp import xla
        saved_to = xla.train(MODELS[model_config.model_type][0], model_config, data, cfg, env, start, saved, hf_dir,
                             meta, stop)
        # The sample comes from the checkpoint just saved, generated on this host as --max_epochs -1 does.
        sample = cfg.num_tokens > 0 and not stop.reason
        return model_for_generation(cfg, env, mesh, saved_to, None) if sample else (None, data.tokenizer)
    # A model that gets Hugging Face weights is built on the meta device (as --meta_init), so no rank ever
    # holds more than its shard of it.
    build_cfg = dataclasses.replace(cfg, meta_init=True) if hf_dir else cfg
    model = build_model(MODELS[model_config.model_type][0], model_config, build_cfg, env, mesh)
    optimizer = build_optimizer(model, cfg)
    if start is not None:
        load = checkpoint.load_replicas if cfg.data_parallel == "decentralized" else checkpoint.load
        load(start, model, optimizer)  # a resumed run continues from its own weights
        checkpoint.restore_rng(start, env.rank, env.world_size, cfg.seed)
    elif hf_dir:
        hf.load_weights(model, hf_dir, model_config.model_type)
    if env.is_main:
        print(banner(cfg, env, mesh, model, start), flush=True)
    with stop.listening():
        train(model, optimizer, data, cfg, env, Path(cfg.checkpoint_dir) / cfg.run_name, meta, saved, stop)
    return model, data.tokenizer


def main(argv=None):
    cfg = parse_args(argv)
    stop = resilience.StopRequests(cfg.time_limit_seconds)  # --time_limit counts from here
    env = environment.setup(cfg)
    if cfg.device == "xla":  # SPMD over this host's devices; the hosts' process group (minimal_fsdp/xla.py)
        from minimal_fsdp import xla
        env = xla.setup(cfg, env)
    validate_world(cfg, env.world_size, env.local_world_size)
    torch.manual_seed(cfg.seed + env.rank)  # dropout masks differ per rank, repeat per run
    mesh = build_mesh(cfg, env)
    start = environment.run_on_main(checkpoint.find, cfg)  # rank 0 checks the files; all load the same one
    hf_dir = environment.run_on_main(hf.resolve, cfg.hf_model) if cfg.hf_model else None  # rank 0 downloads

    if cfg.generate_only:
        model, tokenizer = model_for_generation(cfg, env, mesh, start, hf_dir)
    else:
        model, tokenizer = train_model(cfg, env, mesh, start, hf_dir, stop)
    # Preempted: the checkpoint is saved; exit 0 without a sample, so a requeued job resumes at once.
    if cfg.num_tokens > 0 and not stop.reason:
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        text = generate(model, tokenizer, cfg.prompt, cfg.num_tokens, cfg.temperature, cfg.top_k,
                        cfg.seed, env.device, dtype)
        if env.is_main:
            print("-" * 40 + "\n" + text + "\n" + "-" * 40, flush=True)
    # FSDP state and the device mesh refer to the process groups: let them go, so the groups (and gloo's worker
    # threads) end inside teardown, not during interpreter shutdown, where that can abort the process.
    del model, mesh
    environment.teardown()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, resilience.Diverged) as e:  # raised alike on every rank: one line, clean exit
        if environment.rank_hint() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        environment.teardown()
        sys.exit(2 if isinstance(e, ConfigError) else 1)

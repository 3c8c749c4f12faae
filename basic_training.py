"""Train a GPT with FSDP2, then generate from a prompt.

    mpiexec -n 2 python basic_training.py                       # train on Shakespeare, print a sample
    mpiexec -n 2 python basic_training.py --max_epochs -1 --prompt "ROMEO:"   # generate from the last checkpoint

Flags -> Config -> the package's functions; nothing else happens here.
"""
import dataclasses
import sys
from pathlib import Path

import torch

from minimal_fsdp import checkpoint, environment
from minimal_fsdp.config import ConfigError, parse_args, validate_world
from minimal_fsdp.data import TokenData, prepare
from minimal_fsdp.generate import generate
from minimal_fsdp.model import GPT, GPTConfig, make_config
from minimal_fsdp.parallelize import build_mesh, build_model
from minimal_fsdp.streaming import StreamingData
from minimal_fsdp.tokenizer import load_tokenizer
from minimal_fsdp.train import build_optimizer, train


def model_config_for(cfg, data):
    model_config = make_config(cfg.model_preset, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                               embed_size=cfg.embed_size, seq_length=cfg.seq_length, dropout=cfg.dropout,
                               vocab_size=cfg.vocab_size or data.meta["vocab_size"])
    if model_config.embed_size % model_config.num_heads:
        raise ConfigError(f"embed size {model_config.embed_size} is not divisible by {model_config.num_heads} heads")
    data.check(model_config.seq_length, model_config.vocab_size)
    return model_config


def main(argv=None):
    cfg = parse_args(argv)
    env = environment.setup(cfg)
    validate_world(cfg, env.world_size, env.local_world_size)
    torch.manual_seed(cfg.seed + env.rank)  # dropout masks differ per rank, repeat per run
    run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
    mesh = build_mesh(cfg, env)
    start = checkpoint.find(cfg)

    if cfg.generate_only:
        if start is None:
            raise ConfigError(f"--max_epochs -1 generates from a checkpoint, but {run_dir} has none: "
                              "train first or pass --restart_checkpoint_file")
        model_config = GPTConfig(**checkpoint.read_meta(start)["model"])
        if cfg.seq_length and cfg.seq_length > model_config.seq_length:
            raise ConfigError(f"--seq_length {cfg.seq_length} is larger than the model's context of "
                              f"{model_config.seq_length} tokens in {start}")
        model = build_model(GPT, model_config, cfg, env, mesh)
        checkpoint.load(start, model)
        tokenizer = load_tokenizer(start)
    else:
        if cfg.streaming:
            data = StreamingData.open(cfg, env)
        else:
            data = TokenData(environment.run_on_main(prepare, cfg))
        model_config = model_config_for(cfg, data)
        start_step = 0
        if start is not None:
            saved = checkpoint.read_meta(start)
            if saved["model"] != model_config.to_dict():
                raise ConfigError(f"{start} holds a different model ({saved['model']}): "
                                  "use another --run_name or --checkpoint_dir")
            start_step = saved["step"]
            data.restore(saved.get("data_position"), start_step * cfg.grad_accum_steps)
        model = build_model(GPT, model_config, cfg, env, mesh)
        optimizer = build_optimizer(model, cfg)
        if start is not None:
            checkpoint.load(start, model, optimizer)
        if env.is_main:
            print(f"{env.world_size} rank(s) on {env.num_nodes} node(s), {env.backend}, mesh {tuple(mesh.shape)}; "
                  f"{model.num_params() / 1e6:.2f}M parameters; "
                  + (f"resuming from {start}" if start else "starting fresh"), flush=True)
        meta = {"model": model_config.to_dict(), "config": dataclasses.asdict(cfg)}
        train(model, optimizer, data, cfg, env, run_dir, meta, start_step)
        tokenizer = data.tokenizer

    if cfg.num_tokens > 0:
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        text = generate(model, tokenizer, cfg.prompt, cfg.num_tokens, cfg.temperature, cfg.top_k,
                        cfg.seed, env.device, dtype)
        if env.is_main:
            print("-" * 40 + "\n" + text + "\n" + "-" * 40, flush=True)
    environment.teardown()


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        if environment.rank_hint() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        environment.teardown()
        sys.exit(2)

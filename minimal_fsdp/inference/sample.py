"""Text from a trained model: a checkpoint, an export, or a Hugging Face model directory.

    minimal-fsdp sample checkpoints/shakespeare --prompt "ROMEO:"     # the run's newest checkpoint
    minimal-fsdp sample checkpoints/shakespeare/best --temperature 0    # greedy, from the best one
    minimal-fsdp sample exported/ --prompt "Once upon a time" --top_k 20  # an export, any --format
    minimal-fsdp sample ~/models/Llama-3.2-1B --prompt "The capital of France is" --num_tokens 20
    mpiexec -n 4 minimal-fsdp sample ~/models/Llama-2-13b-hf --precision bf16  # sharded over 4 GPUs

One process on the CPU or one GPU; under mpiexec (or torchrun, srun) the model is sharded over the
ranks with FSDP2, as in training. The tokenizer is the one the source carries. The text goes to
stdout, what was loaded to stderr; the text is written as it is generated. The model is loaded by
inference/load.py, as for evaluate, export and basic_training.py --max_epochs -1.
"""

import sys

import torch

from minimal_fsdp.config.commands import SampleFlags
from minimal_fsdp.config.flags import one_line_errors
from minimal_fsdp.config.parser import parse
from minimal_fsdp.config.flags import Config
from minimal_fsdp.config.checks import validate
from minimal_fsdp.inference import load
from minimal_fsdp.inference.load import (
    describe,
)
from minimal_fsdp.launch import environment


def main(argv=None, cfg=None):
    """`minimal-fsdp sample`: the flags (or SampleFlags parsed already) -> the text on stdout."""
    args = cfg or one_line_errors(parse)(SampleFlags, argv)
    cfg = Config(
        prompt=args.prompt,
        num_tokens=args.num_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        precision=args.precision,
        max_epochs=-1,
        tensorboard=False,
    )
    load.command(lambda: _sample(args.source, cfg))


def _sample(source, cfg):
    """Load SOURCE over the ranks (inference.load) and stream the text to stdout as it is
    generated."""
    validate(cfg)
    env = environment.setup(cfg)
    loaded = load.load(source, cfg, env, num_tokens=cfg.num_tokens)
    if env.is_main:
        print(
            describe(loaded.source, loaded.model, loaded.tokenizer, env),
            file=sys.stderr,
            flush=True,
        )
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    load.stream_sample(loaded.model, loaded.tokenizer, cfg, env, dtype)
    if env.is_main:
        print(flush=True)

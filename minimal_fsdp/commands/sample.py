"""`minimal-fsdp sample SOURCE`: text from a trained model: a checkpoint, an export, or a
Hugging Face model directory.

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

from minimal_fsdp.config.checks import check_generate, check_parallel
from minimal_fsdp.config.sections import Generation, Launch, Parallel
from minimal_fsdp.inference import load
from minimal_fsdp.launch import environment


def main(flags):
    """SampleFlags -> the text on stdout: the source loaded over the ranks (inference.load), the
    text streamed as it is generated."""
    load.command(lambda: _sample(flags))


def _sample(flags):
    parallel = Parallel.of(flags, generate_only=True)
    check_parallel(parallel)
    check_generate(flags)
    env = environment.setup(Launch.of(flags))
    loaded = load.load(flags.source, parallel, env, num_tokens=flags.num_tokens)
    if env.is_main:
        print(
            load.describe(loaded.source, loaded.model, loaded.tokenizer, env),
            file=sys.stderr,
            flush=True,
        )
    dtype = torch.bfloat16 if flags.precision == "bf16" else torch.float32
    load.stream_sample(loaded.model, loaded.tokenizer, Generation.of(flags), env, dtype)
    if env.is_main:
        print(flush=True)

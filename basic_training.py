"""Train a GPT or Llama with FSDP2, then generate from a prompt: `minimal-fsdp train`, as a script.

    # train on Shakespeare, print a sample; generate from the last checkpoint; start from a Hugging
    # Face GPT-2 or Llama
    mpiexec -n 2 python basic_training.py
    mpiexec -n 2 python basic_training.py --max_epochs -1 --prompt "ROMEO:"
    mpiexec -n 2 python basic_training.py --hf_model DIR

Flags -> Config (minimal_fsdp/config/flags.py, which imports no torch, so --help and a mistyped flag
answer at once) -> one run (minimal_fsdp/run.py), through the command table of
minimal_fsdp/__main__.py; nothing else happens here.
"""

import sys

from minimal_fsdp.__main__ import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])

"""Train a GPT or Llama with FSDP2, then generate from a prompt.

    mpiexec -n 2 python basic_training.py                       # train on Shakespeare, print a sample
    mpiexec -n 2 python basic_training.py --max_epochs -1 --prompt "ROMEO:"   # generate from the last checkpoint
    mpiexec -n 2 python basic_training.py --hf_model DIR        # start from a Hugging Face GPT-2 or Llama

Flags -> Config (minimal_fsdp/config/flags.py, which imports no torch, so --help and a mistyped flag answer at once)
-> one run (minimal_fsdp/run.py); nothing else happens here.
"""
from minimal_fsdp.config.flags import one_line_errors, parse_args

if __name__ == "__main__":
    cfg = one_line_errors(parse_args)()
    from minimal_fsdp.run import main  # torch and the rest come in here
    main(cfg=cfg)

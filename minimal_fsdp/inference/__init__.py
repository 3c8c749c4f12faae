"""A trained model from a checkpoint, an export or a Hugging Face directory, on N ranks (load.py:
the one way every command loads one), and text from a prompt (generate.py, streamed; the command is
commands/sample.py). Imports checkpoint, config, data, hf, launch, models and parallel.
"""

"""Hugging Face model directories: finding one (hub.py: local, or from the hub), reading each model
family's weights, and tokenizers (read.py, tokenizer.py), writing them (write.py), and exporting a
checkpoint (export.py).
Imports checkpoint, config, data, files and models.
"""

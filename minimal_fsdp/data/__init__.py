"""Text to tokens: tokenizers, preparation into token memmaps, documents and the validation split,
the batch sampler and streaming. Imports config, files and launch.
"""

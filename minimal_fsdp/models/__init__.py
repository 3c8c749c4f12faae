"""The models as math: GPT-2, Llama and Qwen2, their shared layers, attention, the fused loss; one
module per family in families/ (shape, presets, Hugging Face mapping, planner terms: no torch) and
the model classes by family (classes.py), never distributed code. Imports config.
"""

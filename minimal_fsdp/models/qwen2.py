"""Qwen2 / Qwen2.5: Llama's decoder (llama.py) with biases on q, k and v, and the output head tied
to the input embedding where the config says so (the small sizes). The family: families/qwen2.py."""

from minimal_fsdp.models.families.qwen2 import PRESETS, Qwen2Config
from minimal_fsdp.models.llama import Llama


class Qwen2(Llama):
    config_class, presets = Qwen2Config, PRESETS
    qkv_bias = True

"""The models as math: GPT-2 and Llama, their shared layers, attention, the fused loss, shapes as
plain data (configs.py) and the families' table (families.py). Never imports distributed code;
imports config only.
"""

"""How a model is spread over ranks: the plan decided once from the flags, FSDP2 per block or as one
unit, compile, float8 layers, and decentralized training (gossip, AccumAdamW).
Imports config and models.
"""

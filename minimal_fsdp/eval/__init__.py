"""Scoring a trained model with EleutherAI's lm-evaluation-harness on our sharded model.
Imports everything below it and inference.
"""

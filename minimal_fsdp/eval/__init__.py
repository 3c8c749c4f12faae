"""Scoring a trained model with EleutherAI's lm-evaluation-harness on our sharded model: lm.py (the
backend), harness.py (tasks, the run over the ranks, --eval_tasks: what training imports),
evaluate.py (the command). Imports everything below it and inference.
"""

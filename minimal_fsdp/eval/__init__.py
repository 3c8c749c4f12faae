"""Scoring a trained model with EleutherAI's lm-evaluation-harness on our sharded model: lm.py (the
backend), harness.py (tasks, the run over the ranks, --eval_tasks: what training imports); the
command is commands/evaluate.py. Imports checkpoint, config, inference and launch.
"""

"""Saving and loading a run: DCP checkpoints written atomically and checksummed (checkpointer.py,
background.py, writer.py), which one to load (find.py, dirs.py), meta.json (meta.py), reading files
without running code (safe_load.py), and the best checkpoint by a score (best.py).
Imports config, files, launch, models and parallel.
"""

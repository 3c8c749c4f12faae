"""Commands beside training: the memory and step-time planner, progress of a run for job chains, the
virtual cluster of network namespaces, loss plots and the flags' documentation (the commands that
run them are in commands/). Imports __main__ (its table, for the flags' document), checkpoint,
config, files, hf, models and parallel.
"""

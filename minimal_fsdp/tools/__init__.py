"""Commands beside training: the memory and step-time planner, progress of a run for job chains, the
virtual cluster of network namespaces, loss plots and the flags' documentation.
"""

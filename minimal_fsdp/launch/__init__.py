"""How a run's processes find each other: the launcher's variables (mpiexec, torchrun, srun, PBS),
the rendezvous, process groups and hosts, one error line per failure, and stop requests (signals,
time limit). Imports config and files.
"""

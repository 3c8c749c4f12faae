"""How a run's processes find each other: the launcher's variables (mpiexec, torchrun, srun, PBS),
the rendezvous, process groups and hosts, one error line per failure, stop requests (signals,
time limit), and the run lock (one training run per run directory). Imports config and files only.
"""

"""What differs by device, behind one seam: CUDA and CPU (default.py), torch_xla SPMD (xla.py),
and the startup banner each prints (banner.py). run.py asks only the two functions below; nothing
outside this folder tests for XLA (config/checks.py validates its flags). The top of the stack
below run.py.
Imports checkpoint, config, hf, launch, models and parallel.
"""


def setup(launch, backend):
    """The launch's environment (launch.environment.setup, given `launch`), as the device's backend
    computes on it (`backend`: config.sections.Backend): under --device xla one process per host
    drives all of the host's devices."""
    from minimal_fsdp.launch import environment

    env = environment.setup(launch)
    if backend.device == "xla":
        from minimal_fsdp.backends import xla  # needs torch_xla: imported only for --device xla

        env = xla.setup(backend, env)
    return env


def for_plan(backend, checkpoint, flags, env, plan):
    """The parts of the run that plan.backend computes: default.Torch (CUDA, CPU) or xla.XLA
    (--device xla). backend, checkpoint: config.sections' Backend and Checkpoint; flags: every
    resolved flag of the run, {name: value}, for meta.json and the banner."""
    if plan.backend == "xla":
        from minimal_fsdp.backends.xla import XLA

        return XLA(backend, checkpoint, flags, env, plan)
    from minimal_fsdp.backends.default import Torch

    return Torch(backend, checkpoint, flags, env, plan)

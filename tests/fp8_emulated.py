"""basic_training.py with --precision fp8 on the CPU, for tests/parallel/test_fp8.py: the device
check is lifted and torchao emulates the float8 matmuls (float8 casts and scales as on a GPU,
matmuls in higher precision), so conversion, sharding, the float8 all-gather, the scale precompute
and checkpoints run here as they do on an H100.

    mpiexec -n 2 python tests/fp8_emulated.py <basic_training flags>
    # several runs, as tests/several_runs.py (launch_runs)
    mpiexec -n 2 python tests/fp8_emulated.py runs.json
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minimal_fsdp.parallel import fp8  # noqa: E402

if __name__ == "__main__":
    fp8.check_device = lambda device: None
    # basic_training.py takes no such argument
    several = len(sys.argv) == 2 and sys.argv[1].endswith(".json")
    sys.argv[0] = str(ROOT / "tests" / "several_runs.py" if several else ROOT / "basic_training.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

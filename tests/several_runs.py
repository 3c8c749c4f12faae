"""Run under mpiexec by conftest.launch_runs (test_parallelize.py, test_hf_runs.py): several runs of
the entry point, one after the other, on the same ranks.

argv[1] is a JSON file holding a list of flag lists; each is one run of `minimal-fsdp train` (as
basic_training.py runs it: minimal_fsdp.__main__.main), with process groups of its own, set up and
torn down as in a launch of its own. One launch then pays for starting Python and importing torch
once, not once per run. Each run's output (logs, metrics.jsonl, checkpoints) lies where its flags
say, and what it prints goes to the launch's stdout and stderr, in the order of the runs; the tests
read and check each one.
"""

import json
import sys
from pathlib import Path

from minimal_fsdp.__main__ import main

if __name__ == "__main__":
    for flags in json.loads(Path(sys.argv[1]).read_text()):
        main(["train", *flags])

"""`minimal-fsdp train` (and basic_training.py): one run (run.run), whose bad input and failures end
every rank with one `error:` line."""

import torch
from torch.distributed.checkpoint import CheckpointException

from minimal_fsdp import run
from minimal_fsdp.checkpoint.checkpointer import SaveError
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.launch import failures, hangs
from minimal_fsdp.train import Diverged


def main(cfg):
    """The training Config -> one run."""
    try:
        run.run(cfg)
    except (ConfigError, Diverged, SaveError, failures.MainRankFailed) as e:
        failures.exit_on_error(e, 2 if isinstance(e, ConfigError) else 1)
    # a peer is gone: gloo raises a plain RuntimeError, torch's own a DistError, DCP (in a save) a
    # CheckpointException (a BaseException)
    except (RuntimeError, CheckpointException) as e:
        lost = failures.lost_peer(e)
        if lost is None:
            raise
        line = lost.line
        if lost.timed_out and torch.distributed.is_initialized():
            # which collective, on which ranks, at which step; the first failure's words after
            line = hangs.timeout_line(lost.detail)
        failures.exit_on_error(line, 1)
    # Ctrl-C outside training (inside it, resilience.StopRequests saves and stops)
    except KeyboardInterrupt:
        failures.exit_on_error("interrupted (Ctrl-C) before or after training: nothing saved", 130)

"""basic_training.py with faults injected at chosen steps, for the resilience tests.

    MINIMAL_FSDP_FAULTS="sigterm@10:1,nan@7" mpiexec -n 2 python tests/faults.py <training flags>

Each fault is KIND@STEP[:RANK] (every rank if RANK is left out); STEP is the optimizer step being
done, counted from 1 as in the logs. Kinds:
  sigterm, sigusr1  this rank receives that signal during the step
  clock             from this step on, this rank's clock says --time_limit has passed
  nan               this rank's loss is NaN
  kill              this rank is SIGKILLed during the step
  hang              this rank stops responding during the step
  pause             this rank waits during the step until the file $MINIMAL_FSDP_RELEASE exists
  kill_in_save      this rank is SIGKILLed while it writes its shard of this step's checkpoint
  stop_in_save      this rank is SIGSTOPped while it writes its shard of this step's checkpoint
                    (a host that stops answering mid-save)
  enospc_in_save    this rank's writes of this step's checkpoint fail with "No space left on
                    device"
  kill_after_shards, kill_after_meta, kill_after_rename, kill_after_latest
                    rank 0 is SIGKILLed inside this step's save: once every shard is written,
                    once meta.json is written, once the directory is renamed into place, once
                    `latest` names it
  kill_in_write, enospc_in_write, slow_write
                    this step's save's DCP writer on this rank (under --checkpoint_mode async, in
                    the background while training goes on): is SIGKILLed once its first bytes are
                    on disk (with a writer process: once it has written this rank's shard) / fails
                    with "No space left on device" / starts writing only after this process has
                    sent a sigterm or sigusr1 fault
MINIMAL_FSDP_CHECK_LOAD=report.json: right after a checkpoint is loaded, compare every model and
optimizer tensor of the live sharded model with the checkpoint's files (read in one process) and
write the verdict.
"""

import errno
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# As minimal_fsdp.__main__ sets it for every command, before torch loads (torch reads it then; the
# entry's own setting, after these imports, came too late): no c10d warning and C++ stack from a
# rank still asking the store of a rank 0 that has ended (test_slurm's node-lost test).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import state_dict as dcp_state_dict  # noqa: E402

from minimal_fsdp import train  # noqa: E402
from minimal_fsdp.checkpoint import checkpointer, safe_load
from minimal_fsdp.checkpoint.writer import ChecksummingWriter, _Checksummed
from minimal_fsdp.launch import resilience
from minimal_fsdp.models import gpt


def parse(spec):
    faults = []
    for item in filter(None, spec.split(",")):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        faults.append((kind, int(step), int(rank) if rank else None))
    return faults


FAULTS = parse(os.environ.get("MINIMAL_FSDP_FAULTS", ""))
now = {"step": 0}  # the optimizer step in progress, counted from 1


def due(kind, from_step_on=False):
    rank = dist.get_rank() if dist.is_initialized() else 0
    return any(
        k == kind and (now["step"] >= s if from_step_on else now["step"] == s) and r in (None, rank)
        for k, s, r in FAULTS
    )


def install_faults():
    lr_at, train_step, forward, save, monotonic = (
        train.Schedule.lr_at,
        train.train_step,
        gpt.GPT.forward,
        dcp.save,
        resilience.monotonic,
    )

    def tracking_lr_at(schedule, step):  # called once at the start of every step
        now["step"] = step + 1
        return lr_at(schedule, step)

    def faulty_train_step(*args, **kwargs):
        if due("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if due("hang"):
            time.sleep(3600)
        if due("pause"):
            deadline = time.monotonic() + 300
            while (
                not os.path.exists(os.environ["MINIMAL_FSDP_RELEASE"])
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
        for name in ("sigterm", "sigusr1"):
            if due(name):
                now["signalled"] = True
                os.kill(os.getpid(), getattr(signal, name.upper()))
        return train_step(*args, **kwargs)

    def faulty_forward(self, idx, targets=None, cache=None):
        out = forward(self, idx, targets, cache)
        return out * float("nan") if targets is not None and self.training and due("nan") else out

    def faulty_save(*args, **kwargs):
        if due("kill_in_save"):  # DCP fsyncs each shard file right after writing it
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        if due("stop_in_save"):
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGSTOP)
        if due("enospc_in_save"):

            def full(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.fsync = full
        try:
            result = save(*args, **kwargs)
        finally:
            os.fsync = fsync
        kill_if_due("kill_after_shards")
        return result

    def kill_if_due(kind):
        if due(kind) and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def after(function, kind, when=lambda *args: True):
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            if when(*args):
                kill_if_due(kind)
            return result

        return wrapped

    def faulty_writer_init(writer, *args, **kwargs):  # on the training thread, at the save's step
        writer_init(writer, *args, **kwargs)
        writer.faults = [
            kind for kind in ("kill_in_write", "enospc_in_write", "slow_write") if due(kind)
        ]

    def faulty_write_data(writer, plan, planner):  # in DCP's thread under --checkpoint_mode async
        if "slow_write" in writer.faults:
            deadline = time.monotonic() + 300
            while not now.get("signalled") and time.monotonic() < deadline:
                time.sleep(0.05)
        if "enospc_in_write" in writer.faults:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(writer.path))
        # a writer process writes the bytes
        if "kill_in_write" in writer.faults and writer.process is not None:
            written = write_data(writer, plan, planner)
            # the rank dies with its shard on disk, the save not committed
            os.kill(os.getpid(), signal.SIGKILL)
            return written
        if "kill_in_write" in writer.faults:

            def killing_write(stream, data):
                checksummed_write(stream, data)
                stream.flush()
                os.kill(os.getpid(), signal.SIGKILL)

            _Checksummed.write = killing_write
        return write_data(writer, plan, planner)

    writer = ChecksummingWriter
    writer_init, write_data, checksummed_write = (
        writer.__init__,
        writer.write_data,
        _Checksummed.write,
    )
    writer.__init__, writer.write_data = faulty_writer_init, faulty_write_data
    fsync = os.fsync
    train.Schedule.lr_at, train.train_step, gpt.GPT.forward, dcp.save = (
        tracking_lr_at,
        faulty_train_step,
        faulty_forward,
        faulty_save,
    )
    checkpointer._write_durably = after(
        checkpointer._write_durably, "kill_after_meta", lambda path, data: path.name == "meta.json"
    )
    checkpointer._publish = after(checkpointer._publish, "kill_after_rename")
    checkpointer._write_marker = after(
        checkpointer._write_marker,
        "kill_after_latest",
        lambda run_dir, name, target: name == "latest",
    )
    resilience.monotonic = lambda: monotonic() + (10**7 if due("clock", from_step_on=True) else 0)


def install_load_check(report):
    load = checkpointer.load

    def checked_load(path, model, optimizer=None):
        load(path, model, optimizer)
        # gathered on rank 0
        full = dcp_state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True)
        live = {
            "model." + k: v
            for k, v in dcp_state_dict.get_model_state_dict(model, options=full).items()
        }
        optim = dcp_state_dict.get_optimizer_state_dict(model, optimizer, options=full)
        live.update(
            {
                f"optim.state.{fqn}.{key}": v
                for fqn, state in optim.get("state", {}).items()
                for key, v in state.items()
            }
        )
        if dist.get_rank() == 0:
            saved = {"model." + k: v for k, v in safe_load.load_full_model_state(path).items()}
            names = [name for name, _, _ in safe_load.tensor_names(path, "optim.state.")]
            optim_saved = safe_load.read_tensors(path, names, "optim.state.")
            saved.update({"optim.state." + k: v for k, v in optim_saved.items()})
            Path(report).write_text(
                json.dumps(
                    {
                        "checked": len(saved),
                        "only_live": sorted(live.keys() - saved.keys()),
                        "only_saved": sorted(saved.keys() - live.keys()),
                        "different": sorted(
                            k for k in saved.keys() & live.keys() if not saved[k].equal(live[k])
                        ),
                    }
                )
            )

    checkpointer.load = checked_load


def launch_with_faults(
    args, faults="", ranks=2, cwd=None, timeout=300, env=None, check=True, check_load=None
):
    """Like conftest.launch, through this script."""
    from conftest import mpiexec

    cmd = [mpiexec(), "-n", str(ranks), sys.executable, __file__, *map(str, args)]
    extra = {
        "MINIMAL_FSDP_FAULTS": faults,
        **({"MINIMAL_FSDP_CHECK_LOAD": str(check_load)} if check_load else {}),
    }
    environment = dict(
        os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra, **(env or {})
    )
    result = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environment
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{faults} {' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-5000:]}"
        )
    return result


if __name__ == "__main__":
    install_faults()
    if os.environ.get("MINIMAL_FSDP_CHECK_LOAD"):
        install_load_check(os.environ["MINIMAL_FSDP_CHECK_LOAD"])
    sys.argv[0] = str(ROOT / "basic_training.py")
    runpy.run_path(sys.argv[0], run_name="__main__")

"""One training run at a time per run directory.

A run directory (<checkpoint_dir>/<run_name>, <log_dir>/<run_name>) holds one lock file, `.lock`,
while a training run uses it: who holds it (host, pid, scheduler job) and a heartbeat (its
modification time, touched every few seconds). A second run refuses to start, in one line. A lock is
taken over only when its holder is provably gone: at once when the holder ran on this host and its
process has ended; otherwise once its heartbeat has been silent for STALE_AFTER seconds. The same
scheduler job id is no proof: two job steps of one job (or a requeued job whose first attempt still
runs elsewhere) can hold and want the same directory at once. Only O_EXCL file creation, rename and
mtime are used, so it works on parallel file systems (Lustre, GPFS, NFSv4) where fcntl/flock locks
are often disabled or local to a node.
"""

import datetime
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.files import read_json, shown

LOCK_NAME = ".lock"
HEARTBEAT = 10.0  # seconds between touches of a held lock
STALE_AFTER = 60.0  # a lock untouched this long belongs to a run that died
# a lock holds one short JSON line (host, pid, job, command cut at 500 characters)
MAX_LOCK_BYTES = 2**16
_held = {}  # lock path -> token, for the locks this process holds
# Names only an interrupted writer leaves behind (clean_leftovers).
LEFTOVER = re.compile(r"\..+\.tmp\d+|\.lock\.stale-[0-9a-f]+|\.tmp-(old-)?step_\d+")


class LockError(ConfigError):
    """A run directory is in use, or cannot be written: one line for the user, as any bad input."""


def _job_id():
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")


def _read_holder(path):
    """The lock's JSON, or {} if it cannot be read (being written, or damaged: then only its age
    counts). Read through open_regular: a FIFO, device or link put there is never opened (it would
    block, or never end)."""
    try:
        holder = read_json(path, MAX_LOCK_BYTES, 4)
    except (OSError, ValueError):
        return {}
    # each field as this program writes it, else as if unreadable (only the lock's age counts)
    kinds = {"host": str, "pid": int, "boot": str, "start": int, "job": str, "token": str}
    return {
        k: v
        for k, v in holder.items()
        if k not in kinds or isinstance(v, kinds[k]) and not isinstance(v, bool)
    }


def _check_lock_file(path, flag):
    """LockError if `path` exists and is not a regular file: nothing this program writes (a FIFO, a
    device, a directory or a symbolic link); it is neither read nor taken over, and the user is told
    what to remove."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise LockError(f"{flag}: cannot read the lock file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = (
            "a directory"
            if stat.S_ISDIR(mode)
            else "a symbolic link"
            if stat.S_ISLNK(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket"
        )
        raise LockError(
            f"{flag}: the run lock {path} is {kind}, not a lock file this program wrote: remove it "
            "if no training run uses this directory"
        )


def _pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's process, or an unreadable pid: assume it runs
    return True


def _boot_id():
    """This host's boot (Linux), so that a pid recorded before a reboot is not taken for a live
    process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_time(pid):
    """When process `pid` started, in clock ticks since boot (Linux), or None: a pid reused by
    another process (a restarted container's pid 1, say) has another start time."""
    try:
        return int(Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, TypeError, IndexError, OverflowError):  # a lock's pid may be inf
        return None


def _holder_gone(holder):
    """Whether the lock's holder provably ended: it ran on this host and its process is gone (this
    host has rebooted since, or its pid is free, or now names a process started at another time)."""
    if holder.get("host") != socket.gethostname():
        return False  # another host's process: only its silent heartbeat can tell
    if holder.get("boot") and _boot_id() and holder["boot"] != _boot_id():
        return True
    if not _pid_alive(holder.get("pid")):
        return True
    return holder.get("start") is not None and _start_time(holder.get("pid")) not in (
        None,
        holder["start"],
    )


def _stale(path, holder):
    """Whether the run that holds `path` is gone."""
    try:
        silent = time.time() - path.lstat().st_mtime
    except FileNotFoundError:
        return True
    if silent > STALE_AFTER:
        return True
    return _holder_gone(holder)


class RunLock:
    """Held by rank 0 of a training run for the run's lifetime, over its checkpoint and log
    directories."""

    def __init__(self, directories):
        """directories: {what the user set, e.g. "--checkpoint_dir": the run directory under it}."""
        self.flags = {}
        for flag, directory in directories.items():
            self.flags.setdefault(str(Path(directory) / LOCK_NAME), flag)
        self.paths = [Path(path) for path in self.flags]
        self.token = uuid.uuid4().hex
        self.stopped = threading.Event()
        self.thread = None
        self.watcher = None

    def acquire(self, wait=STALE_AFTER + 2 * HEARTBEAT):
        """Take every lock, or raise LockError. A lock held from another host is waited on for up to
        `wait` seconds (it may be a run that was killed a moment ago, whose heartbeat has not gone
        stale yet)."""
        taken = []
        try:
            for path in self.paths:
                self._take(path, time.monotonic() + wait)
                taken.append(path)
        except BaseException:
            for path in taken:
                self._drop(path)
            raise
        self.thread = threading.Thread(target=self._beat, daemon=True, name="run-lock-heartbeat")
        self.thread.start()
        self.watcher = _remove_when_gone(self.paths, self.token)
        for path in self.paths:  # no one else writes there now: what killed writers left can go
            clean_leftovers(path.parent)

    def _take(self, path, deadline):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LockError(
                f"{self.flags[str(path)]}: cannot create the run directory {path.parent}: "
                f"{e.strerror or e}"
            ) from None
        info = json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "boot": _boot_id(),
                "start": _start_time(os.getpid()),
                "job": _job_id(),
                "token": self.token,
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:500],
            }
        )
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                _check_lock_file(path, self.flags[str(path)])
                holder = _read_holder(path)
                if _stale(path, holder):
                    # Renamed, not deleted, so that of two runs taking it over at once usually only
                    # one succeeds; in the microseconds where both can, the loser learns it at its
                    # first save (check_lock).
                    try:
                        os.replace(path, path.with_name(f"{LOCK_NAME}.stale-{self.token}"))
                        path.with_name(f"{LOCK_NAME}.stale-{self.token}").unlink()
                        print(
                            f"warning: {path.parent}: taking over the lock of a run that ended "
                            f"without releasing it ({_describe(holder)})",
                            file=sys.stderr,
                            flush=True,
                        )
                    except FileNotFoundError:
                        pass
                    except OSError as e:  # a run directory made read-only (or immutable) since
                        raise LockError(
                            f"{self.flags[str(path)]}: cannot take over the stale lock {path} of a "
                            f"run that ended ({_describe(holder)}): {e.strerror or e}"
                        ) from None
                    continue
                other_host = holder.get("host") not in (None, socket.gethostname())
                if other_host and time.monotonic() < deadline:
                    time.sleep(min(HEARTBEAT / 2, max(0.1, deadline - time.monotonic())))
                    continue
                raise LockError(
                    f"{path.parent} is in use by another training run ({_describe(holder)}): give "
                    f"this run another --run_name, or wait for that one to end (a run that died "
                    f"leaves {path}, taken over once it has been untouched for {STALE_AFTER:.0f} s)"
                ) from None
            except OSError as e:
                raise LockError(
                    f"{self.flags[str(path)]}: cannot write in the run directory {path.parent}: "
                    f"{e.strerror or e}"
                ) from None
            try:
                os.write(fd, info.encode())
                os.fsync(fd)
            except OSError as e:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise LockError(
                    f"{self.flags[str(path)]}: cannot write in the run directory {path.parent}: "
                    f"{e.strerror or e}"
                ) from None
            os.close(fd)
            _held[str(path)] = self.token
            return

    def _beat(self):
        while not self.stopped.wait(HEARTBEAT):
            for path in self.paths:
                try:
                    if _read_holder(path).get("token") == self.token:
                        os.utime(path)
                except OSError:
                    pass  # a file system hiccup: the next beat tries again

    def _drop(self, path):
        _held.pop(str(path), None)
        if _read_holder(path).get("token") == self.token:
            path.unlink(missing_ok=True)

    def release(self):
        """Give the locks back (a no-op where acquire did not succeed, e.g. on ranks other than
        0)."""
        if self.thread is None:
            return
        self.stopped.set()
        self.thread.join()
        self.thread = None
        for path in self.paths:
            try:
                self._drop(path)
            except OSError:
                pass
        if self.watcher is not None:  # nothing left for it to remove: it ends on the closed pipe
            self.watcher.stdin.close()
            self.watcher.wait()
            self.watcher = None


# Removes the lock files that still hold TOKEN once its stdin closes (read ends at EOF). A Ctrl-C
# twice under mpiexec, or mpiexec killed by SIGPIPE (`| tee` ended by the same Ctrl-C), ends the
# ranks with SIGKILL from their launcher: no code of this process runs, yet its locks go (the next
# run would take them over, with a warning each).
_WATCH = 'read -r _; for f in "$@"; do grep -qsF "$TOKEN" "$f" && rm -f "$f"; done; exit 0'


def _remove_when_gone(paths, token):
    """A small process of its own session (a Ctrl-C or the launcher's kill of this process group
    does not reach it) holding a pipe from this process: when this process ends, however it ends,
    the pipe closes and the lock files that still name `token` are removed. None where it cannot
    start (the heartbeat's staleness rule still frees the locks)."""
    try:
        return subprocess.Popen(
            ["bash", "-c", _WATCH, "run-lock-watch", *map(str, paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, TOKEN=token),
            start_new_session=True,
        )
    except OSError:
        return None


def drop_held_locks():
    """Remove the locks this process holds, at once: for an exit that skips every `finally` (Ctrl-C
    twice)."""
    for path, token in list(_held.items()):
        try:
            if _read_holder(Path(path)).get("token") == token:
                Path(path).unlink()
        except OSError:
            pass


def clean_leftovers(directory):
    """Remove what writers killed mid-write left in a run directory whose lock this process has just
    taken: write_atomic's temporaries (`.latest.tmp<pid>`), a take-over's `.lock.stale-*`, a save's
    `.tmp-step_N` and a replaced or pruned checkpoint's `.tmp-old-step_N`; the last is put back as
    `step_N` when that is missing (the save that moved it aside died before its own rename). Best
    effort: what cannot be removed stays."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not LEFTOVER.fullmatch(entry.name):
            continue
        path = Path(entry.path)
        try:
            original = path.with_name(entry.name[len(".tmp-old-") :])
            if entry.name.startswith(".tmp-old-") and not os.path.lexists(original):
                os.replace(path, original)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass


def _describe(holder):
    if not holder:
        return "unreadable lock file"
    job = f", job {shown(holder['job'], 40)}" if holder.get("job") else ""
    return (
        f"host {shown(holder.get('host'), 60)}, pid {holder.get('pid')}{job}, started "
        f"{shown(holder.get('started'), 40)}"
    )


def check_lock(directory):
    """Raise LockError if another run has taken over `directory`'s lock from this process (its
    heartbeat stalled past STALE_AFTER): then this run must not write there any more. A directory
    this process never locked (a test calling the saver directly) passes."""
    path = Path(directory) / LOCK_NAME
    token = _held.get(str(path))
    if token is not None and _read_holder(path).get("token") != token:
        raise LockError(
            f"another run took over {directory} (see {path}): this run stops without writing there"
        )

"""How far a run has trained, answered without importing torch: `minimal-fsdp progress [the run's
training flags]` prints "STEP LAST_STEP" of the run's newest complete checkpoint ("0 none" without
one). The PBS and SLURM job chains ask it twice a job (is the run done? did this job get anywhere?);
importing torch made each question take 5 s on a 2-core machine (10 s under load), against 0.2 s
without.

Complete here means, in the order resume tries the checkpoints: meta.json passes its schema with the
keys a run reads (meta.py, as verify reads it), every file it records is a regular file of
the size recorded at save, and every file but the shards (.metadata, the RNG states, the tokenizer:
small) has its recorded CRC-32. So a missing, truncated or damaged file is found, and a save that
crashed before its rename is never a candidate. Weaker than find.verify, which resume
runs: the shards' bytes are not read (they are nearly all of a checkpoint), and DCP's .metadata, a
pickle of torch classes that only safe_load's unpickler reads, is not unpickled, so a meta.json
edited to describe another model than the shards hold is not noticed. A checkpoint damaged only that
way is counted here, and the training run then skips it for an older one: docs/checkpoints.md says
what that can do to a chain.
"""

import errno

from minimal_fsdp.checkpoint.dirs import candidates, files_problem, skipping
from minimal_fsdp.checkpoint.meta import MetaError, check_run_keys, read_meta


def problem(path):
    """(why `path` is not a complete checkpoint by the checks above, or None; its meta.json when
    read)."""
    try:
        meta = read_meta(path)
        check_run_keys(meta)
    except MetaError as e:
        return str(e), None
    except OSError as e:
        return "meta.json is missing or unreadable" + (
            "" if e.errno == errno.ENOENT else f" ({e.strerror})"
        ), None
    # saved before meta.json listed its files: only verify can tell, with torch
    if not meta.get("files"):
        from minimal_fsdp.checkpoint.find import verify

        return verify(path, checksums=False), meta
    return files_problem(path, meta["files"], read=lambda name: not name.endswith(".distcp")), meta


def newest(run_dir):
    """The meta.json of the run's newest complete checkpoint, or None; each one skipped is reported
    in one line."""
    for path in candidates(run_dir):
        why, meta = problem(path)
        if why is None:
            return meta
        skipping(path, why)
    return None

"""Which collective hung, on which ranks, at which step: the line a collective timeout ends a run
with, instead of gloo's "Timed out waiting 5000ms for recv".

PyTorch's flight recorder keeps each rank's last collectives (name, sequence number, process group,
whether it has finished); record() turns it on before the process group exists. When a collective
times out on gloo, each rank that waited posts its oldest unfinished collective and the training
step in the rendezvous store and reads what the others posted within a few seconds (every rank
waiting in that collective times out alike); a rank that posts nothing never joined: it has
stopped or hangs (timeout_line). On GPUs, NCCL's watchdog ends the job itself; there the recorder
is dumped to one file per rank on timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), and torch's own analyzer
reads them: `python -m torch.distributed.flight_recorder.fr_trace` (docs/training.md, "When a run
hangs")."""

import json
import os
import threading
import time

import torch.distributed as dist

from minimal_fsdp.launch import failures

# entries kept per rank: several steps of FSDP's collectives
BUFFER_ENTRIES = 2000
KEY = "minimal_fsdp/timed_out"
# how long a rank that timed out waits for the others' reports; they time out within about the
# same --collective_timeout, so a few seconds cover them
WAIT_SECONDS = 5
_step = None  # the optimizer step in progress, counted from 1 as in the logs


def record():
    """Turn the flight recorder on for the process groups made after this, gloo's and NCCL's (a
    user's own setting wins, under either name: torch warns on every rank when it reads the older
    TORCH_NCCL_TRACE_BUFFER_SIZE, so that one is never set here)."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def at_step(step):
    """The training loop's step in progress (from 1), for the line."""
    global _step
    _step = step


def waiting_in():
    """This rank's oldest unfinished collective in the flight recorder as {"collective", "seq",
    "group"}, else its last one, or None when the recorder is off or empty."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # torch has no public reader

        entries = json.loads(_dump_fr_trace_json()).get("entries") or []
    except Exception:  # noqa: BLE001 - an older torch, or no recorder: the line says less
        return None
    if not entries:
        return None
    open_ = [e for e in entries if not e.get("retired") and e.get("state") != "completed"]
    entry = min(open_, key=lambda e: e.get("record_id", 0)) if open_ else entries[-1]
    group = entry.get("process_group") or ["?", "?"]
    return {
        "collective": str(entry.get("profiling_name", "?")),
        "seq": entry.get("collective_seq_id"),
        "group": str(group[1] or group[0]),
    }


def _exchange(report, world, wait):
    """Post this rank's report in the rendezvous store; every report posted within `wait` seconds
    (or once all `world` are in), as a list."""
    store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
    store.append(KEY, json.dumps(report) + "\n")
    posted = store.add(KEY + "/count", 1)
    deadline = time.monotonic() + wait
    while posted < world and time.monotonic() < deadline:
        time.sleep(0.1)
        posted = store.add(KEY + "/count", 0)
    return [json.loads(line) for line in store.get(KEY).decode().splitlines() if line]


def gathered(wait=WAIT_SECONDS):
    """Every report posted by ranks that timed out, this rank's among them. On a thread: a store
    request over a link that went down waits for good, and this rank must still speak and end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"rank": rank, "step": _step, **(waiting_in() or {})}
    reports = []

    def exchange_quietly():
        try:
            reports.extend(_exchange(mine, world, wait))
        except Exception:  # noqa: BLE001 - the store's rank 0 is gone: this rank's report alone
            pass

    exchange = threading.Thread(target=exchange_quietly, daemon=True)
    started = time.monotonic()
    exchange.start()
    exchange.join(wait + 5)
    # a rank that never posts is waited for here; exit_on_error's wait to agree counts this
    failures.waited_for_others(time.monotonic() - started)
    return reports or [mine]


def ranks_text(ranks):
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    ranks, spans = sorted(set(ranks)), []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def describe(reports, world):
    """The line's body from the ranks' reports: the collective each group of ranks waits in, at
    which step, and the ranks that posted nothing."""
    groups = {}
    for r in reports:
        where = (r.get("step"), r.get("collective"), r.get("seq"), r.get("group"))
        groups.setdefault(where, []).append(r["rank"])
    parts = []
    for (step, collective, seq, group), ranks in sorted(
        groups.items(), key=lambda item: min(item[1])
    ):
        what = (
            f"{collective} (collective #{seq} of process group {group})"
            if collective
            else "a collective (no flight recorder: set TORCH_FR_BUFFER_SIZE)"
        )
        at = f"at step {step}" if step is not None else "outside the training steps"
        parts.append(f"{ranks_text(ranks)} waited in {what} {at}")
    silent = sorted(set(range(world)) - {r["rank"] for r in reports})
    if silent:
        parts.append(
            f"{ranks_text(silent)} never joined it (stopped, hung, or cut off from the others)"
        )
    return "; ".join(parts)


def timeout_line(detail=""):
    """Collective, on a rank whose collective timed out: the one line that says where the job
    hung. detail: the backend's own words, kept short."""
    if not dist.is_initialized():  # before the process group: nothing recorded to say
        return (
            "a collective waited longer than --collective_timeout: another rank or its host has "
            f"died, hangs or cannot be reached ({detail})"
        )
    line = (
        "a collective waited longer than --collective_timeout: "
        f"{describe(gathered(), dist.get_world_size())}"
    )
    return line + (f" ({detail})" if detail else "")

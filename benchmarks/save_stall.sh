#!/usr/bin/env bash
# Issue 38's checkpoint targets on 2 GPUs, in one device call (a 2- or 4-GPU machine): how long a save of GPT-2 XL
# (1.5B, fp32 weights + AdamW: about 18 GB) stops training, synchronous against asynchronous, beside the disk's own
# write speed; and tokens/s of a run that saves every 20 steps against one that never saves.
# Usage on the GPU machine: bash benchmarks/save_stall.sh [disk] [stall] [steady] [api]   (default: api disk stall)
#   api     the torch.distributed.checkpoint names checkpoint_async.py uses exist in this torch
#   disk    dd's direct (O_DIRECT) write speed into checkpoints/, the same file system the saves go to
#   stall   the issue's command, --checkpoint_mode sync then async; per save: seconds training stopped (and how
#           many of them it waited for the save before), seconds to commit, and the background write's GB/s
#   steady  target 3: 60 steps saving every 20 (async; its files written by a writer process, then by threads in
#           the rank as before) against 60 steps saving only at the end; tokens/s of steps 11-60, the seconds
#           their saves stopped training included
# Logs go to $OUT (or ./gpu_out).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_hwloc_base_binding_policy=none
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
MPI="mpiexec --oversubscribe -n 2"
XL="python3 basic_training.py --model_preset gpt2-xl --meta_init --batch_size 4 --num_tokens 0"
parts=${*:-api disk stall}
mkdir -p checkpoints

stamped() {  # every line with the seconds since the part began, as the issue measured step to step
  python3 -u -c 'import sys, time
t = time.time()
for line in sys.stdin: print(f"{time.time() - t:7.1f}s {line}", end="", flush=True)'
}

saves() {  # the saves of run $1 from its metrics.jsonl, and the write speed of the background part
  python3 - "$1" <<'EOF'
import json, subprocess, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(f"logs/{run}/metrics.jsonl")]
size = int(subprocess.run(["du", "-sb", f"checkpoints/{run}"], capture_output=True, text=True).stdout.split()[0])
kept = len([l for l in subprocess.run(["ls", f"checkpoints/{run}"], capture_output=True, text=True).stdout.split()
            if l.startswith("step_")])
gb = size / max(kept, 1) / 1e9
for r in rows:
    if "save_total_s" in r:
        own = r["save_blocking_s"] - r["save_waited_s"]
        background = r["save_total_s"] - own  # the write after the copy to host memory (0: a synchronous save)
        speed = gb / (background if background > 0.01 else r["save_total_s"])
        print(f"{run} step {r['step']}: blocked {r['save_blocking_s']:.2f} s (waited {r['save_waited_s']:.2f} s for "
              f"the save before, {own:.2f} s its own), committed after {r['save_total_s']:.2f} s; {gb:.1f} GB at "
              f"{speed:.2f} GB/s {'in the background' if background > 0.01 else 'in all'}")
EOF
}

for part in $parts; do case $part in
api)
  python3 - <<'EOF' 2>&1 | tee "$OUT/api.txt"
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
print("torch", torch.__version__, "async_save", hasattr(dcp, "async_save"), "lookup_object",
      hasattr(DefaultSavePlanner, "lookup_object"), "rename", hasattr(FileSystem, "rename"),
      "cudaHostRegister", hasattr(torch.cuda.cudart(), "cudaHostRegister"), "enable_plan_caching",
      "enable_plan_caching" in __import__("inspect").signature(DefaultSavePlanner.__init__).parameters)
import time
from minimal_fsdp.checkpoint.writer import SharedMemory
memory = SharedMemory(pin=True)  # the writer process's staging memory: a memfd mapping, page-locked
memory.reserve(2**30)
host, _ = memory.tensor((2**28,), torch.float32)
gpu = torch.ones(2**28, device="cuda")
host.copy_(gpu, non_blocking=True); torch.cuda.synchronize()
start = time.perf_counter(); host.copy_(gpu, non_blocking=True); torch.cuda.synchronize()
print("memfd staging page-locked", memory.segments[0][3] is not None,
      f"copy {2**30 / (time.perf_counter() - start) / 1e9:.1f} GB/s", "equal", bool(host[-1] == 1))
memory.close()
EOF
  ;;
disk)
  # 8 GiB, larger than any write cache a controller holds; O_DIRECT bypasses the page cache, fsync the device's.
  dd if=/dev/zero of=checkpoints/dd.bin bs=64M count=128 oflag=direct conv=fsync 2>&1 | tail -1 | tee "$OUT/disk.txt"
  rm -f checkpoints/dd.bin ;;
stall)
  for mode in ${STALL_MODES:-sync async}; do  # STALL_MODES=async: the new one alone
    rm -rf "logs/stall_$mode" "checkpoints/stall_$mode"
    timeout 420 $MPI $XL --max_steps 6 --checkpoint_interval 2 --keep_last 1 --checkpoint_mode $mode \
      --run_name "stall_$mode" 2>&1 | stamped > "$OUT/stall_$mode.log"  # no progress bar under mpiexec
    grep -E '^ *[0-9.]+s (step|checkpoints|warning|error)' "$OUT/stall_$mode.log" | tail -14
    saves "stall_$mode" | tee -a "$OUT/stall.txt"
    rm -rf "checkpoints/stall_$mode"
  done
  cat "$OUT/disk.txt" 2>/dev/null ;;
steady)
  # One run that saves only at the end, then one saving every 20 steps per writer of asynchronous saves
  # ($STEADY_WRITERS; MINIMAL_FSDP_ASYNC_WRITER): "process" (opt-in, measured here) and "thread" (the default, in the rank).
  for run in 0 ${STEADY_WRITERS:-process thread}; do
    if [ "$run" = 0 ]; then every=0 name=steady_0; else every=20 name=steady_20_$run; fi
    rm -rf "logs/$name" "checkpoints/$name"
    MINIMAL_FSDP_ASYNC_WRITER=${run/#0/process} timeout 280 $MPI $XL --max_steps 60 --checkpoint_interval $every \
      --keep_last 1 --checkpoint_mode async --log_interval 5 --eval_interval 0 --run_name "$name" \
      > "$OUT/$name.log" 2>&1
    python3 - "$name" <<'EOF' | tee -a "$OUT/steady.txt"
import json, sys
rows = [json.loads(l) for l in open(f"logs/{sys.argv[1]}/metrics.jsonl")]
# Training time of the logged windows after step 10 (the log leaves evaluation and saves out of it), plus the
# seconds the saves in that span stopped training: the run's steady tokens/s with its saves' cost included.
steps, seconds, last = 0, 0.0, None
for r in rows:
    if "step_time" in r:
        if last is not None and last >= 10:
            steps += r["step"] - last
            seconds += r["step_time"] * (r["step"] - last)
        last = r["step"]
blocked = [r["save_blocking_s"] for r in rows if "save_blocking_s" in r and 10 < r["step"] < 60]
tokens_per_step = 2 * 4 * 1024
print(f"{sys.argv[1]}: {tokens_per_step * steps / (seconds + sum(blocked)):,.0f} tokens/s over steps 11-60 "
      f"({seconds:.1f} s training, {sum(blocked):.2f} s stopped by saves: {', '.join(f'{b:.2f}' for b in blocked)})")
EOF
    rm -rf "checkpoints/$name"
  done ;;
*) echo "unknown part $part" ;;
esac; done

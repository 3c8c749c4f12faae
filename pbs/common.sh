# Sourced by the PBS job scripts in this folder: Python environment, NCCL settings for Polaris-like systems
# (4 A100s and 32 cores per node, Slingshot, Cray MPICH with PALS mpiexec), and `launch`, which starts one
# rank per GPU with mpiexec (and, with CHAIN=1, submits the job's successor when the run is not done).
#
# Everything below can be overridden at submission time, e.g.
#   qsub -A PROJECT -v WORK_DIR=/eagle/PROJECT/$USER/fsdp,VENV=$HOME/venvs/fsdp pbs/train_multi_node.sh
#   ARGS="--model_preset gpt2 --precision bf16 --prompt 'ROMEO: Hi, you'" qsub -A PROJECT -v ARGS pbs/train_single_node.sh
# (`-v NAME` without a value takes NAME's value from qsub's environment as it is: commas, quotes, spaces.)
#
#   ARGS             extra training flags, split as a shell splits words (quotes group, nothing is expanded);
#                    a value with commas must come through `-v ARGS` (above): `-v ARGS=...` splits on commas
#   ARGS_FILE        a file of training flags, split the same way (lines are words too; # starts a comment);
#                    read before ARGS. Neither given: the training scripts train configs/shakespeare_char.toml
#                    (10.7M parameters, bf16, compiled: a GPU recipe that fits any GPU)
#   WORK_DIR         where checkpoints/, data/ and logs/ go: put it on the project file system (e.g.
#                    /eagle/PROJECT/...); default: the directory qsub ran in, with a warning when that is under
#                    $HOME (small quotas; one Llama 3 8B checkpoint is ~90 GiB). Flags in ARGS win over it
#   VENV             a virtual environment to activate, on top of the conda module it was built on (which is
#                    loaded first wherever `module` exists); default: the conda module alone
#   NRANKS_PER_NODE  ranks per node, one per GPU (4)
#   NDEPTH           CPU cores per rank, for binding and OMP_NUM_THREADS (8)
#   CPU_BIND         Cray placement flags ("--depth=$NDEPTH --cpu-bind depth"); set it empty for a Hydra mpiexec
#   MPIEXEC          the launcher (mpiexec)
#   PYTHON, ENTRY    the interpreter (python) and the training script (basic_training.py)
#   REPO             this checkout (default: the directory qsub ran in)
#   CHAIN            1: run as a chain of jobs (below; default 0)
#   QUEUE            the queue a chain submits its next job to (default: the queue the first job asked for)
#   CHAIN_MARGIN     seconds the chain leaves between --time_limit and the walltime, for the step in flight
#                    and the save (300)
#   AWS_OFI_NCCL, NCCL_*, FI_*   see the NCCL settings below
#
# Queues (Polaris, as ALCF documents them; the scripts' #PBS -q lines are the first two; `qsub -q` overrides
# them). qsub refuses a job whose nodes or walltime (5 min at least) are outside its queue's range:
#   debug            1-2 nodes, up to 1 h: pbs/train_single_node.sh's default, for trying things
#   debug-scaling    1-10 nodes, up to 1 h: pbs/train_multi_node.sh's default
#   preemptable      1-10 nodes, up to 72 h; a job there may be killed at any time without warning (when the
#                    demand queue needs its nodes): the scripts are rerunnable (#PBS -r y), so PBS runs the
#                    job again, and it resumes from the run's last checkpoint (--checkpoint_interval bounds
#                    what is lost)
#   prod             a routing queue, 10-496 nodes: 10-24 nodes go to small (up to 3 h), 25-99 to medium (6 h),
#                    100-496 to large (24 h). Submit to prod, never to those (qsub refuses them)
#
# Job chains. A run longer than the queue's walltime trains in a chain of jobs:
#   qsub -A PROJECT -q preemptable -l walltime=06:00:00 -v CHAIN=1,ARGS="--config configs/gpt2_124m_owt.toml" \
#       pbs/train_multi_node.sh
# Each job passes --time_limit (the walltime left, less CHAIN_MARGIN), so it saves a checkpoint and exits before
# the kill; a SIGTERM from PBS (walltime, preemption with a warning) makes the run save and exit too, and the
# job script waits for it. At its end, if the latest checkpoint is short of the run's last step, it submits its
# successor (qsub -W depend=afterany:THIS_JOB to the queue the first job asked for, e.g. prod, never the
# execution queue qstat reports; with this job's account, resources, rerunnability and every -v setting,
# yours included), which resumes from that checkpoint. A job PBS runs again (-r y) submits no second successor.
# The chain stops when the run is done, when a job fails, or when a job made no progress. A --time_limit in
# ARGS wins over the derived one.

set -euo pipefail
# The conda module first (a VENV made with --system-site-packages is built on it: its mpi4py is the one built
# for Cray MPICH), then the VENV. A failure stops the job here, not later with whatever Python is on PATH.
if [ -z "${CONDA_PREFIX:-}" ] && command -v module >/dev/null 2>&1; then
    module use /soft/modulefiles 2>/dev/null || true
    if ! { module load conda && conda activate base; }; then
        echo "error: module load conda && conda activate base failed: the job would run whatever Python is on" \
             "PATH; check the module (module avail conda) or set CONDA_PREFIX to skip it" >&2
        exit 2
    fi
fi
if [ -n "${VENV:-}" ]; then
    if [ ! -f "$VENV/bin/activate" ]; then
        echo "error: VENV=$VENV has no bin/activate: pass the virtual environment's directory" >&2
        exit 2
    fi
    set +u  # activate scripts read unset variables
    source "$VENV/bin/activate"
    set -u
fi

if [ -z "${PBS_NODEFILE:-}" ]; then
    echo "error: PBS_NODEFILE is not set: submit this script with qsub" >&2
    exit 2
elif [ ! -r "$PBS_NODEFILE" ]; then
    echo "error: PBS_NODEFILE=$PBS_NODEFILE does not exist or cannot be read: run inside the PBS job that wrote it" >&2
    exit 2
fi
# Distinct hosts, counted as minimal_fsdp.launch.environment.count_pbs_nodes counts them: blank lines skipped, case
# ignored, a fully qualified name taken as its short name (an IPv4 address stays whole).
NNODES=$(awk '{ h = tolower($1); sub(/\r$/, "", h) } h !~ /^[0-9.]+$/ { sub(/\..*/, "", h) }
              h != "" && !seen[h]++ { n++ } END { print n + 0 }' "$PBS_NODEFILE")
if [ "$NNODES" -eq 0 ]; then
    echo "error: PBS_NODEFILE=$PBS_NODEFILE lists no host" >&2
    exit 2
fi
NRANKS_PER_NODE=${NRANKS_PER_NODE:-4}
NDEPTH=${NDEPTH:-8}
NTOTRANKS=$((NNODES * NRANKS_PER_NODE))
CPU_BIND=${CPU_BIND-"--depth=$NDEPTH --cpu-bind depth"}
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
ENTRY=${ENTRY:-$REPO/basic_training.py}
ARGS=${ARGS:-}
ARGS_FILE=${ARGS_FILE:-}
CHAIN=${CHAIN:-0}
CHAIN_MARGIN=${CHAIN_MARGIN:-300}
export OMP_NUM_THREADS=$NDEPTH

# NCCL over Slingshot through the AWS OFI plugin (ALCF's recommended settings). The plugin is used only if
# its directory exists: AWS_OFI_NCCL, else the newest version under /soft/libraries/aws-ofi-nccl. Without it
# NCCL falls back to TCP sockets between nodes, silently: the job log says which network NCCL gets.
if [ -z "${AWS_OFI_NCCL:-}" ]; then
    AWS_OFI_NCCL=$(ls -d /soft/libraries/aws-ofi-nccl/*/lib 2>/dev/null | sort -V | tail -n 1 || true)
fi
if [ -n "$AWS_OFI_NCCL" ] && [ -d "$AWS_OFI_NCCL" ]; then
    echo "nccl: network AWS Libfabric (Slingshot), OFI plugin in $AWS_OFI_NCCL"
    export LD_LIBRARY_PATH="$AWS_OFI_NCCL:/soft/libraries/hwloc/lib:${LD_LIBRARY_PATH:-}"
    export NCCL_NET=${NCCL_NET:-"AWS Libfabric"}
    export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
    export NCCL_COLLNET_ENABLE=${NCCL_COLLNET_ENABLE:-1}
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
else
    echo "nccl: network TCP sockets between nodes (no OFI plugin at ${AWS_OFI_NCCL:-/soft/libraries/aws-ofi-nccl}:" \
         "set AWS_OFI_NCCL to its lib directory for Slingshot)"
fi
# The rendezvous: rank 0 offers its IPv4 address on a network every node shares (export MASTER_ADDR to choose).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# One GPU per rank. Polaris numbers its GPUs in the reverse order of the CPU cores beside them, so local
# rank 0 (cores 0-7 under --cpu-bind depth) gets GPU 3. The local rank comes from Cray PALS, Hydra or Open MPI.
BIND_GPU='local=${PALS_LOCAL_RANKID:-${PMI_LOCAL_RANK:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-0}}}}
export CUDA_VISIBLE_DEVICES=$(( NRANKS_PER_NODE - 1 - local % NRANKS_PER_NODE ))
exec "$@"'

# The training flags: ARGS_FILE's, then ARGS', split by pbs/helper.py (any characters; nothing expanded).
ARGV=()
if [ -n "$ARGS_FILE" ]; then
    mapfile -d '' -t words < <("$PYTHON" "$REPO/pbs/helper.py" words-file "$ARGS_FILE") && wait $! || exit 2
    ARGV+=("${words[@]}")
fi
if [ -n "$ARGS" ]; then
    mapfile -d '' -t words < <("$PYTHON" "$REPO/pbs/helper.py" words "$ARGS") && wait $! || exit 2
    ARGV+=("${words[@]}")
fi
if [ ${#ARGV[@]} -eq 0 ] && [ -n "${DEFAULT_ARGS:-}" ]; then
    ARGV=("${DEFAULT_ARGS[@]}")
    echo "args: no ARGS or ARGS_FILE: ${ARGV[*]} (pass -v ARGS=... or -v ARGS_FILE=... for your run)"
fi

# Checkpoints, data and logs under WORK_DIR, meant for the project file system. The flags go before ARGS, so a
# --checkpoint_dir, --data_dir or --log_dir there wins.
WORK_DIR=${WORK_DIR:-$PWD}
WORK_FLAGS=()
if [ "$(cd "$WORK_DIR" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
    mkdir -p "$WORK_DIR" || { echo "error: WORK_DIR=$WORK_DIR cannot be made: name a writable directory" >&2; exit 2; }
    WORK_FLAGS=(--checkpoint_dir "$WORK_DIR/checkpoints" --data_dir "$WORK_DIR/data" --log_dir "$WORK_DIR/logs")
fi
home=$(cd "${HOME:-/nonexistent}" 2>/dev/null && pwd -P || true)
if [ -n "$home" ] && [[ "$(cd "$WORK_DIR" && pwd -P)/" == "$home"/* ]]; then
    echo "warning: WORK_DIR=$WORK_DIR is under \$HOME (small quotas; a Llama 3 8B checkpoint is ~90 GiB):" \
         "pass -v WORK_DIR=/eagle/PROJECT/... (the project file system) for checkpoints, data and logs" >&2
fi
if [ "${PBS_ENVIRONMENT:-}" = PBS_BATCH ]; then  # set by PBS in a batch job
    echo "work: checkpoints, data and logs under $WORK_DIR; this job's output goes to" \
         "${PBS_O_WORKDIR:-$PWD}/${PBS_JOBNAME:-minimal_fsdp}.o${PBS_JOBID%%.*} when the job ends (qsub -o chooses)"
else
    echo "work: checkpoints, data and logs under $WORK_DIR"
fi

launch() {
    local chain_flags=()
    if [ "$CHAIN" = 1 ]; then
        chain_start "$@"
        chain_flags=(--time_limit "$CHAIN_TIME_LIMIT")
    fi
    # PBS sends SIGTERM before it kills a job (walltime, a preemption with a warning, qdel): the ranks save and
    # exit 0 by themselves, so the script must not die with them. Trapped, bash runs this once mpiexec is done.
    trap 'echo "job: SIGTERM from PBS: waiting for the run to save and stop"' TERM
    echo "job ${PBS_JOBID:-?}: $NNODES node(s) x $NRANKS_PER_NODE rank(s) = $NTOTRANKS rank(s), $NDEPTH core(s) each"
    # shellcheck disable=SC2086  # CPU_BIND is a list of words
    "$MPIEXEC" -n "$NTOTRANKS" --ppn "$NRANKS_PER_NODE" $CPU_BIND \
        env NRANKS_PER_NODE="$NRANKS_PER_NODE" bash -c "$BIND_GPU" bind-gpu \
        "$PYTHON" "$ENTRY" --environment pbs "$@" "${WORK_FLAGS[@]}" "${chain_flags[@]}" "${ARGV[@]}"
    if [ "$CHAIN" = 1 ]; then
        chain_next "$@"
    fi
}

# --- job chains (CHAIN=1) ---

seconds() {  # [[HH:]MM:]SS -> seconds
    local IFS=: part total=0
    for part in $1; do total=$((total * 60 + 10#$part)); done
    echo "$total"
}

# "STEP LAST_STEP" of the run's latest checkpoint ("0 none" without one), from the training flags; it imports
# no torch (minimal_fsdp/tools/progress.py), so asking costs a fraction of a second.
run_progress() {
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m minimal_fsdp progress "$@" "${WORK_FLAGS[@]}" "${ARGV[@]}"
}

chain_start() {
    : "${JOB_SCRIPT:?is not set: CHAIN=1 is for pbs/train_single_node.sh and pbs/train_multi_node.sh}"
    # This job's account, resources and settings: the -l, -A and -v given to the first qsub override the
    # script's #PBS lines, so the successor gets them again.
    QSTAT_JSON=$(qstat -f -F json "$PBS_JOBID")
    local walltime
    walltime=$("$PYTHON" "$REPO/pbs/helper.py" walltime <<<"$QSTAT_JSON")
    local left=$(( $(seconds "${walltime:?qstat -f shows no walltime}") - SECONDS - CHAIN_MARGIN ))
    if [ "$left" -le 0 ]; then
        echo "error: CHAIN_MARGIN=$CHAIN_MARGIN leaves no time to train in a walltime of $walltime" >&2
        exit 2
    fi
    CHAIN_TIME_LIMIT=$(printf '%02d:%02d:%02d' $((left / 3600)) $((left % 3600 / 60)) $((left % 60)))
    read -r CHAIN_START_STEP _ < <(run_progress "$@")
    # A --time_limit among the job's own arguments comes later on the command line, so it wins: say that one.
    local given="" word previous=""
    for word in "$@" "${ARGV[@]}"; do
        case $word in --time_limit=*) given=${word#--time_limit=} ;; esac
        [ "$previous" = --time_limit ] && given=$word
        previous=$word
    done
    local limit="--time_limit $CHAIN_TIME_LIMIT"
    [ -n "$given" ] && limit="--time_limit $given (yours; the walltime would allow $CHAIN_TIME_LIMIT)"
    echo "chain: walltime $walltime, $limit; the run is at step $CHAIN_START_STEP"
}

chain_next() {
    local step last
    read -r step last < <(run_progress "$@")
    # A job PBS runs again (rerunnable, after a preemption) may have submitted its successor already.
    local submitted="$WORK_DIR/.pbs_chain/$PBS_JOBID"
    if [ "$last" = none ]; then
        echo "chain: stops: no checkpoint of this run records its last step" >&2
    elif [ "$step" -ge "$last" ]; then
        echo "chain: the run reached its last step ($last)"
    elif [ -s "$submitted" ]; then
        echo "chain: at step $step of $last; job $PBS_JOBID submitted its successor before: $(cat "$submitted")"
    elif [ "$step" -le "$CHAIN_START_STEP" ]; then
        echo "chain: stops: this job made no progress (still at step $step)" >&2
    else
        local items options=() settings=() names=() item queue after=0
        mapfile -d '' -t items < <("$PYTHON" "$REPO/pbs/helper.py" successor <<<"$QSTAT_JSON")
        for item in "${items[@]}"; do  # the qsub options, "--", the settings
            if [ "$after" = 1 ]; then settings+=("$item") && names+=("${item%%=*}")
            elif [ "$item" = -- ]; then after=1
            else options+=("$item")
            fi
        done
        # The queue the first job asked for (PBS_O_QUEUE, e.g. the routing queue prod), never the execution
        # queue it runs in (small, medium, large: qsub refuses those).
        queue=${QUEUE:-${PBS_O_QUEUE:-}}
        [ -n "$queue" ] && options=(-q "$queue" "${options[@]}")
        # Each setting by name only: qsub takes its value from its own environment, commas and all.
        local list
        list=$(IFS=,; echo "${names[*]}")
        echo "chain: at step $step of $last; submitting the next job${queue:+ to $queue}"
        local id
        id=$(cd "${PBS_O_WORKDIR:-$PWD}" && env "${settings[@]}" \
            qsub -W depend=afterany:"$PBS_JOBID" "${options[@]}" ${list:+-v "$list"} "$REPO/$JOB_SCRIPT") || {
            echo "error: chain: qsub refused the next job (its line above); resubmit this job as you did" >&2
            exit 1
        }
        echo "chain: submitted $id"
        mkdir -p "$WORK_DIR/.pbs_chain" && echo "$id" > "$submitted"
    fi
}

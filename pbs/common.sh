# Sourced by the PBS job scripts in this folder: Python environment, NCCL settings for Polaris-like systems
# (4 A100s and 32 cores per node, Slingshot, Cray MPICH with PALS mpiexec), and `launch`, which starts one
# rank per GPU with mpiexec.
#
# Everything below can be overridden at submission time, e.g.
#   qsub -A PROJECT -v ARGS="--model_preset gpt2 --precision bf16",VENV=$HOME/venvs/fsdp pbs/train_multi_node.sh
#
#   ARGS             extra training flags, split on spaces (qsub -v splits on commas: keep commas out)
#   VENV             a virtual environment to activate (default: the conda module, if `module` exists)
#   NRANKS_PER_NODE  ranks per node, one per GPU (4)
#   NDEPTH           CPU cores per rank, for binding and OMP_NUM_THREADS (8)
#   CPU_BIND         Cray placement flags ("--depth=$NDEPTH --cpu-bind depth"); set it empty for a Hydra mpiexec
#   MPIEXEC          the launcher (mpiexec)
#   PYTHON, ENTRY    the interpreter (python) and the training script (basic_training.py)
#   REPO             this checkout (default: the directory qsub ran in; the job runs there too)

if [ -n "${VENV:-}" ]; then
    source "$VENV/bin/activate"
elif [ -z "${CONDA_PREFIX:-}" ] && command -v module >/dev/null 2>&1; then
    module use /soft/modulefiles 2>/dev/null
    module load conda && conda activate base
fi
set -euo pipefail

: "${PBS_NODEFILE:?is not set: submit this script with qsub}"
NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
NRANKS_PER_NODE=${NRANKS_PER_NODE:-4}
NDEPTH=${NDEPTH:-8}
NTOTRANKS=$((NNODES * NRANKS_PER_NODE))
CPU_BIND=${CPU_BIND-"--depth=$NDEPTH --cpu-bind depth"}
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
ENTRY=${ENTRY:-$REPO/basic_training.py}
ARGS=${ARGS:-}
export OMP_NUM_THREADS=$NDEPTH

# NCCL over Slingshot through the AWS OFI plugin (ALCF's recommended settings). The plugin is used only if
# its directory exists; point AWS_OFI_NCCL elsewhere if your site installs it in another place.
AWS_OFI_NCCL=${AWS_OFI_NCCL:-/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib}
if [ -d "$AWS_OFI_NCCL" ]; then
    export LD_LIBRARY_PATH="$AWS_OFI_NCCL:/soft/libraries/hwloc/lib:${LD_LIBRARY_PATH:-}"
    export NCCL_NET=${NCCL_NET:-"AWS Libfabric"}
    export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
    export NCCL_COLLNET_ENABLE=${NCCL_COLLNET_ENABLE:-1}
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
fi
# Rank 0's address is its hostname; on Polaris that resolves to the high-speed network.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# One GPU per rank. Polaris numbers its GPUs in the reverse order of the CPU cores beside them, so local
# rank 0 (cores 0-7 under --cpu-bind depth) gets GPU 3. The local rank comes from Cray PALS, Hydra or Open MPI.
BIND_GPU='local=${PALS_LOCAL_RANKID:-${PMI_LOCAL_RANK:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-0}}}}
export CUDA_VISIBLE_DEVICES=$(( NRANKS_PER_NODE - 1 - local % NRANKS_PER_NODE ))
exec "$@"'

launch() {
    echo "job ${PBS_JOBID:-?}: $NNODES node(s) x $NRANKS_PER_NODE rank(s) = $NTOTRANKS rank(s), $NDEPTH core(s) each"
    # shellcheck disable=SC2086  # CPU_BIND and ARGS are lists of words
    "$MPIEXEC" -n "$NTOTRANKS" --ppn "$NRANKS_PER_NODE" $CPU_BIND \
        env NRANKS_PER_NODE="$NRANKS_PER_NODE" bash -c "$BIND_GPU" bind-gpu \
        "$PYTHON" "$ENTRY" --environment pbs "$@" $ARGS
}

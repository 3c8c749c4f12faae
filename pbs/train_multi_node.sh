#!/bin/bash
# Train on several Polaris nodes with hybrid sharding: parameters are sharded over the 4 GPUs of a node and
# replicated across nodes, so the big all-gathers stay on NVLink. Submit from the minimal_fsdp checkout:
#   qsub -A PROJECT -l select=4:system=polaris -v WORK_DIR=/eagle/PROJECT/$USER/fsdp pbs/train_multi_node.sh
#   qsub -A PROJECT -v VENV=$HOME/venvs/fsdp,ARGS="--model_preset gpt2-xl --precision bf16 --activation_checkpoints" \
#       pbs/train_multi_node.sh
#   qsub -A PROJECT -q prod -l select=16:system=polaris -l walltime=03:00:00 pbs/train_multi_node.sh
#   qsub -A PROJECT -q preemptable -l walltime=06:00:00 -v CHAIN=1,ARGS="--config configs/gpt2_124m_owt.toml" \
#       pbs/train_multi_node.sh   # a chain of 6-hour jobs
# The queue below, debug-scaling, takes 1-10 nodes for up to 1 h; for longer jobs pass -q preemptable (1-10
# nodes, 72 h) or -q prod (a routing queue: 10-24 nodes up to 3 h, 25-99 up to 6 h, 100-496 up to 24 h).
# Without ARGS it trains configs/shakespeare_char.toml (a small GPU recipe). Settings you can pass with -v
# (WORK_DIR, VENV, ARGS, CHAIN=1, ...) and the queues' limits are in pbs/common.sh.
#PBS -N minimal_fsdp
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -q debug-scaling
#PBS -j oe
#PBS -r y

REPO=${REPO:-${PBS_O_WORKDIR:-$PWD}}
JOB_SCRIPT=pbs/train_multi_node.sh  # what a chain (CHAIN=1) submits again
cd "${PBS_O_WORKDIR:-$PWD}"  # checkpoints/, data/ and logs/ go here, or under WORK_DIR
# Checked first, then sourced on its own: inside `source ... || ...` bash ignores set -e, and a failing line of
# common.sh would go unnoticed.
[ -f "$REPO/pbs/common.sh" ] || { echo "error: pbs/common.sh not found in $REPO: qsub from the checkout or pass -v REPO=..." >&2; exit 2; }
DEFAULT_ARGS=(--config "$REPO/configs/shakespeare_char.toml")  # without ARGS or ARGS_FILE
source "$REPO/pbs/common.sh"

launch --sharding hybrid-full-shard

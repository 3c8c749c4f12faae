#!/bin/bash
# Train on one Polaris node (4 GPUs). Submit from the minimal_fsdp checkout:
#   qsub -A PROJECT -v WORK_DIR=/eagle/PROJECT/$USER/fsdp pbs/train_single_node.sh
#   qsub -A PROJECT -v VENV=$HOME/venvs/fsdp,ARGS="--model_preset gpt2 --tokenizer gpt2 --precision bf16" \
#       pbs/train_single_node.sh
#   qsub -A PROJECT -q preemptable -l walltime=06:00:00 -v CHAIN=1,ARGS="--run_name long --max_steps 20000" \
#       pbs/train_single_node.sh   # a chain of 6-hour jobs
# The queue below, debug, takes 1-2 nodes for up to 1 h; for longer jobs pass -q preemptable (72 h, may be
# preempted: the job is rerunnable and resumes). Without ARGS it trains configs/shakespeare_char.toml (a small
# GPU recipe). Settings you can pass with -v (WORK_DIR, VENV, ARGS, CHAIN=1, ...) and the queues' limits are
# in pbs/common.sh.
#PBS -N minimal_fsdp
#PBS -l select=1:system=polaris
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -q debug
#PBS -j oe
#PBS -r y

REPO=${REPO:-${PBS_O_WORKDIR:-$PWD}}
JOB_SCRIPT=pbs/train_single_node.sh  # what a chain (CHAIN=1) submits again
cd "${PBS_O_WORKDIR:-$PWD}"  # checkpoints/, data/ and logs/ go here, or under WORK_DIR
# Checked first, then sourced on its own: inside `source ... || ...` bash ignores set -e, and a failing line of
# common.sh would go unnoticed.
[ -f "$REPO/pbs/common.sh" ] || { echo "error: pbs/common.sh not found in $REPO: qsub from the checkout or pass -v REPO=..." >&2; exit 2; }
DEFAULT_ARGS=(--config "$REPO/configs/shakespeare_char.toml")  # without ARGS or ARGS_FILE
source "$REPO/pbs/common.sh"

launch --sharding full-shard

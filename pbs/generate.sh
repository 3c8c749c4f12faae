#!/bin/bash
# Generate from the run's latest checkpoint without training (--max_epochs -1). The model shape and tokenizer
# come from the checkpoint; any number of GPUs works. Submit from the minimal_fsdp checkout:
#   qsub -A PROJECT -v ARGS="--run_name shakespeare --prompt ROMEO: --num_tokens 300" pbs/generate.sh
# Settings you can pass with -v are listed in pbs/common.sh.
#PBS -N minimal_fsdp_generate
#PBS -l select=1:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:15:00
#PBS -l filesystems=home:eagle
#PBS -q debug
#PBS -j oe

REPO=${REPO:-${PBS_O_WORKDIR:-$PWD}}
cd "${PBS_O_WORKDIR:-$PWD}"  # checkpoints/ is looked up where qsub ran
# Checked first, then sourced on its own: inside `source ... || ...` bash ignores set -e, and a failing line of
# common.sh would go unnoticed.
[ -f "$REPO/pbs/common.sh" ] || { echo "error: pbs/common.sh not found in $REPO: qsub from the checkout or pass -v REPO=..." >&2; exit 2; }
source "$REPO/pbs/common.sh"

launch --max_epochs -1

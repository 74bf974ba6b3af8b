#!/bin/bash
# One task of a job step (run by srun from slurm/launch.sh): record where it runs as the first
# line of its log, give trainer ranks torchrun-style coordinates from Slurm's (so a stray RANK
# or WORLD_SIZE in the submitting shell's environment cannot leak in), then become the role.
#   bash slurm/task.sh trainer|rollout COMMAND...
role=$1; shift
if [ "$role" = trainer ]; then
  export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
  export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-1}
fi
echo "[slurm] role=$role task=$SLURM_PROCID step=$SLURM_JOB_ID.$SLURM_STEP_ID" \
  "node=$SLURMD_NODENAME host=$(hostname) cuda=${CUDA_VISIBLE_DEVICES:-none} threads=${DARL_THREADS:-}"
exec "$@"

#!/bin/bash
# Communication settings of every role of a Slurm run, in one place (sourced by slurm/launch.sh;
# srun passes the environment on to the job steps). Only defaults: a value already set in the
# environment at sbatch time wins. Put site-specific settings (InfiniBand HCAs, ...) here.
export PYTHONUNBUFFERED=1                    # logs appear as they are written
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # failed collective: raise, not hang
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron's TP overlap ordering
if [ -n "${NET_IFNAME:-}" ]; then            # the fabric interface, e.g. ib0 or eth0
  export NCCL_SOCKET_IFNAME=$NET_IFNAME GLOO_SOCKET_IFNAME=$NET_IFNAME
fi
# export NCCL_IB_HCA=mlx5                   # site: InfiniBand adapters for NCCL

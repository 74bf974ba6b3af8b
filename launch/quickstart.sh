#!/usr/bin/env bash
# The README's first command: install megatron_darl into a venv and run the main job on the
# embedded default (tiny model, built-in task, CPU or GPU, no Slurm).
# Environment: VENV, PYTHON, TORCH_SPEC (see launch/venv.sh); extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/venv.sh
darl_venv ""
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}  # Megatron warns loudly about absent TE/apex
# Until the D-ARL training loop learns on the built-in task (see README, Status), this runs
# the Qwen3 conversion + TP2 x PP2 parity demo.
exec python tools/qwen3_roundtrip_demo.py "$@"

#!/usr/bin/env bash
# The README's first command: install megatron_darl into a venv and run the main job on the
# embedded default (tiny model, built-in task, CPU or GPU, no Slurm).
#   VENV=path       venv to use or create (default .venv)
#   PYTHON=python3  interpreter that creates the venv
#   TORCH_SPEC=...  torch requirement installed first (default torch==2.13.0: the CPU wheel on
#                   our CPU machines; on a GPU machine preinstall a CUDA torch or set this)
#   extra arguments are passed to the job
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  echo "[quickstart] installing ${TORCH_SPEC:-torch==2.13.0}"
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
echo "[quickstart] installing megatron_darl"
python -m pip install -q -e .
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}  # Megatron warns loudly about absent TE/apex
# Until the D-ARL training loop lands this runs the Qwen3 conversion + parity demo.
exec python tools/qwen3_roundtrip_demo.py "$@"

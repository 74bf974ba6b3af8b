# Sourced by launch/quickstart.sh and tests/run.sh: create/activate the venv and install
# megatron_darl into it, torch first (the CPU wheel by default; see README, Supported versions).
#   VENV=path       venv to use or create (default .venv)
#   PYTHON=python3  interpreter that creates the venv
#   TORCH_SPEC=...  torch requirement installed first when torch is missing (default torch==2.13.0)
# Usage: darl_venv EXTRAS   (e.g. "" or "[test]")
darl_venv() {
  local venv=${VENV:-.venv}
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  if ! python -c "import torch" 2>/dev/null; then
    echo "[venv] installing ${TORCH_SPEC:-torch==2.13.0}"
    python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "[venv] installing megatron_darl$1"
  python -m pip install -q -e ".$1"
}

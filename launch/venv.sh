# Sourced by launch/quickstart.sh and tests/run.sh: create/activate the venv and install
# megatron_darl into it, torch first (the CPU wheel by default; see docs/guide.md, Install).
#   VENV=path       venv to use or create (default .venv)
#   PYTHON=python3  interpreter that creates the venv
#   TORCH_SPEC=...  torch requirement installed first when torch is missing (default torch==2.13.0)
# Usage: darl_venv EXTRAS   (e.g. "" or "[test]")
# pip runs quietly (its errors still show); each phase says what it does and how long it took.
_darl_step() {  # _darl_step "what" command...: one line before, one after with the seconds
  local what=$1 start=$SECONDS
  shift
  echo "[venv] $what ..."
  "$@" || { echo "[venv] failed: $what" >&2; return 1; }
  echo "[venv] done in $((SECONDS - start)) s: $what"
}

darl_venv() {
  local venv=${VENV:-.venv}
  if [ ! -x "$venv/bin/python" ]; then
    _darl_step "creating $venv with ${PYTHON:-python3}" "${PYTHON:-python3}" -m venv "$venv" || return 1
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  if ! python -c "import torch" 2>/dev/null; then
    _darl_step "installing ${TORCH_SPEC:-torch==2.13.0} (about 200 MB; 1-2 min from pip's cache, more to download)" \
      python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" || return 1
  fi
  _darl_step "installing megatron_darl$1 and its dependencies (megatron-core, transformers, hydra, ...)" \
    python -m pip install -q -e ".$1" || return 1
  echo "[venv] ready: $venv ($(python -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")'))"
}

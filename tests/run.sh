#!/usr/bin/env bash
# Install megatron_darl with its test extras into a venv and run the CPU test tiers.
# This is the README's test command and exactly what .ci/run calls.
#   VENV, PYTHON, TORCH_SPEC: see launch/venv.sh
#   extra arguments are passed to pytest (default: the unit, distributed and slurm tiers)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/venv.sh
darl_venv "[test]"
if [ "$#" -eq 0 ]; then
  set -- tests/unit tests/distributed tests/slurm tests/faults
fi
# The slurm tier runs against a real local Slurm: install its Debian packages when missing.
if [[ " $* " == *" tests/slurm"* ]] && ! PATH="$PATH:/usr/sbin" command -v slurmctld >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[tests/run.sh] installing slurmctld slurmd slurm-client munge"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurmctld slurmd slurm-client munge >/tmp/darl_slurm_apt.log 2>&1) \
      || echo "[tests/run.sh] Slurm install failed (see /tmp/darl_slurm_apt.log): tests/slurm will skip"
  else
    echo "[tests/run.sh] not root or no apt-get: tests/slurm will skip"
  fi
fi
exec python -m pytest -m "not gpu and not vllm" "$@"

#!/usr/bin/env bash
# Install megatron_darl with its test extras into a venv and run the CPU test tiers.
# This is the README's test command and exactly what .ci/run calls.
#   VENV, PYTHON, TORCH_SPEC: see launch/venv.sh
#   DARL_TEST_WORKERS=2  pytest-xdist workers for the unit and distributed tiers (0: one process)
#   extra arguments are passed to one serial pytest (default: every CPU tier, below)
# With no arguments the unit and distributed tiers run on two workers: their tests are
# CPU-bound processes that use about one core each (a CI machine has two), which cuts the
# suite by about 3 minutes; a file's tests stay on one worker (its module fixtures run once).
# The slurm and fault tiers stay serial: the slurm tier starts one local cluster per session,
# and the fault tier asserts deadlines ("named within the heartbeat timeout") that a doubly
# loaded machine could blur, and writes one results file per session
# (tools/reliability_report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/venv.sh
darl_venv "[test]"
tiers=0
if [ "$#" -eq 0 ]; then
  tiers=1
  set -- tests/slurm tests/faults
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
if [ "$tiers" = 1 ]; then
  rc=0
  python -m pytest -m "not gpu and not vllm" -n "${DARL_TEST_WORKERS:-2}" --dist loadfile \
    tests/unit tests/distributed || rc=$?
  python -m pytest -m "not gpu and not vllm" "$@" || rc=$?
  exit "$rc"
fi
exec python -m pytest -m "not gpu and not vllm" "$@"

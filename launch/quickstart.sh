#!/usr/bin/env bash
# The README's first command: install megatron_darl into a venv and run the main job on the
# embedded default (tiny model, built-in task, CPU or GPU, no Slurm).
# Environment: VENV, PYTHON, TORCH_SPEC (see launch/venv.sh); extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source launch/venv.sh
darl_venv ""
# D-ARL on the built-in arithmetic task from the warm-started tiny policy (fitted and cached on
# first use); prints the reward before and after and where the plot is (--verbose: Megatron's own
# logs and warnings too).
# Each quick start writes a fresh run dir unless one is given (a rerun never trips over the
# previous run's checkpoints).
case " $* " in
  *" loop.run_dir="*) exec python -m launch.train "$@" ;;
  *) exec python -m launch.train "loop.run_dir=runs/quickstart_$(date +%Y%m%d_%H%M%S)" "$@" ;;
esac

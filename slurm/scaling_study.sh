#!/bin/bash
# Scaling study: submit the same experiment at several node counts, each run to its own OUTPUT_DIR,
# plus a report job (tools/scaling_report.py) that runs after all of them (afterany).
#
#   NODES_LIST="1 2 4 8" bash slurm/scaling_study.sh [hydra overrides for every run...]
#
# Run it from the repository root (a login node with sbatch). Knobs:
#   NODES_LIST   node counts, one run each (default "1 2 4 8")
#   SCRIPT       sbatch script of the runs (default slurm/qwen3_4b_darl.sbatch)
#   STUDY_DIR    runs go to STUDY_DIR/nodes_<N>, the report to STUDY_DIR/report
#                (default runs/scaling_<date-time>)
#   SBATCH_ARGS  extra sbatch options for every run (e.g. "--time=01:00:00 --gpus-per-node=0")
#   REPORT_ARGS  sbatch options of the report job (default "--nodes=1 --ntasks=1")
#   SKIP_STEPS   warm-up steps left out of the averages (default 1)
#   WAIT=0       1: wait for the report job (at most WAIT_TIMEOUT_S, default 7200) and print it
# Every slurm/launch.sh knob (MODEL_PATH, TP, ROLLOUT_NODES, ...) reaches the runs through the
# environment. With ROLLOUT_NODES unset, N nodes run the trainer on N - N/2 and engines on N/2
# (N = 1: both share the node). Job ids go to STUDY_DIR/jobs.txt.
set -euo pipefail
die() { echo "scaling_study.sh: error: $*" >&2; exit 2; }
NODES_LIST=${NODES_LIST:-1 2 4 8}
SCRIPT=${SCRIPT:-slurm/qwen3_4b_darl.sbatch}
STUDY_DIR=${STUDY_DIR:-runs/scaling_$(date +%Y%m%d-%H%M%S)}
SKIP_STEPS=${SKIP_STEPS:-1}
REPORT_ARGS=${REPORT_ARGS:---nodes=1 --ntasks=1}
[ -f "$SCRIPT" ] || die "SCRIPT=$SCRIPT: no such file (run from the repository root)"
[ -f tools/scaling_report.py ] || die "run from the repository root (tools/scaling_report.py not found)"
for n in $NODES_LIST; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "NODES_LIST entry '$n' is not a positive integer"
done
[ -n "${NODES_LIST// /}" ] || die "NODES_LIST is empty"
PY=$(command -v "${DARL_PYTHON:-python}") || die "no python: activate the venv or set DARL_PYTHON"
mkdir -p "$STUDY_DIR"
STUDY_DIR=$(cd "$STUDY_DIR" && pwd)
name=$(basename "$SCRIPT" .sbatch)
ids=() dirs=()
for n in $NODES_LIST; do
  dir=$STUDY_DIR/nodes_$n
  # shellcheck disable=SC2086
  id=$(OUTPUT_DIR=$dir sbatch --parsable --nodes="$n" --job-name="${name}_n$n" \
       --output="$STUDY_DIR/nodes_$n.out" ${SBATCH_ARGS:-} "$SCRIPT" "$@") \
    || die "sbatch of the $n-node run failed (see above)"
  id=${id%%;*}
  echo "$n nodes: job $id -> $dir"
  echo "$id $n $dir" >>"$STUDY_DIR/jobs.txt"
  ids+=("$id") dirs+=("$dir")
done
deps=$(IFS=:; echo "${ids[*]}")
# shellcheck disable=SC2086
report=$(sbatch --parsable --job-name="${name}_report" --dependency="afterany:$deps" \
  --output="$STUDY_DIR/report.out" $REPORT_ARGS \
  --wrap "cd $(printf %q "$PWD") && $(printf %q "$PY") tools/scaling_report.py $(printf '%q ' "${dirs[@]}") --out $(printf %q "$STUDY_DIR/report") --skip-steps $SKIP_STEPS") \
  || die "sbatch of the report job failed"
report=${report%%;*}
echo "report: job $report -> $STUDY_DIR/report/scaling.md"
echo "$report report $STUDY_DIR/report" >>"$STUDY_DIR/jobs.txt"
[ "${WAIT:-0}" = 1 ] || exit 0
deadline=$((SECONDS + ${WAIT_TIMEOUT_S:-7200}))
while squeue -h -j "$report" 2>/dev/null | grep -q .; do
  [ $SECONDS -lt $deadline ] || die "report job $report still queued after ${WAIT_TIMEOUT_S:-7200}s"
  sleep 2
done
cat "$STUDY_DIR/report.out"
[ -f "$STUDY_DIR/report/scaling.md" ] || die "the report job wrote no $STUDY_DIR/report/scaling.md (see $STUDY_DIR/report.out)"

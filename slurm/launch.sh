#!/bin/bash
# The one Slurm launcher behind every slurm/*.sbatch: one allocation, the Megatron trainer as ONE
# job step (ranks = tasks) and each rollout engine as its own job step, meeting over our transport.
#
#   sbatch [sbatch options] slurm/qwen3_4b_darl.sbatch [hydra overrides...]
#   e.g. MODEL_PATH=/models/Qwen3-4B OUTPUT_DIR=runs/q4b sbatch --nodes=4 slurm/qwen3_4b_darl.sbatch loop.steps=500
#
# Arguments after the script are Hydra overrides (as for python -m launch.train), e.g.
# experiment=smoke, replay.k=8. Knobs (environment variables; sbatch exports the environment) use
# the names python -m launch.train --help prints: MODEL, ALGORITHM, DATA, ROLLOUT, TRAINER select
# those groups (a GROUP=PRESET argument wins), TRAINER_* / ROLLOUT_* are the two sides of the split
# (cluster.trainer_* / cluster.rollout_*; launch/slurm.py cluster_overrides maps them).
# TRAIN_NODES, TRAIN_GPUS_PER_NODE and ENGINE are not knobs: set, they stop the job with one line
# naming TRAINER_NODES, TRAINER_GPUS_PER_NODE or ROLLOUT.
#   MODEL          configs/model preset (the wrappers set it) or "tiny": the embedded tiny policy
#   MODEL_PATH     Hugging Face checkpoint dir of the initial policy (needed unless MODEL=tiny)
#   ALGORITHM      configs/algorithm preset (the darl, async and decoupled scripts: their *_paper preset);
#                  others: darl sync async decoupled darl_nofilter darl_nomis async_is_paper
#   DATA, DATA_PATH  configs/data preset (default gsm8k; builtin for MODEL=tiny) and its file
#   ROLLOUT        configs/rollout preset vllm | hf (default: vllm on GPU nodes, hf on a CPU run; a
#                  missing vLLM stops the job before any step: pip install -e .[vllm], or ROLLOUT=hf)
#   TRAINER        configs/trainer preset (default: "default" on GPU, cpu_tiny on CPU)
#   OUTPUT_DIR     run dir: metrics, checkpoints, logs (default runs/<job name>_<job id>);
#                  resubmitting with the same OUTPUT_DIR resumes from its latest checkpoint
#   RESUME=1       0: refuse an OUTPUT_DIR that already holds checkpoints
#   TRAINER_NODES  nodes of the trainer step (default: all but ROLLOUT_NODES)
#   ROLLOUT_NODES  nodes of rollout engines (default: half the nodes, rounded down; 0 = the
#                  engines share the trainer nodes, TRAINER_GPUS_PER_NODE GPUs each go to the trainer)
#   GPUS_PER_NODE  default: what the allocation has (SLURM_GPUS_ON_NODE); 0 = CPU run
#   TP, PP         trainer tensor / pipeline parallel sizes (DP = ranks / (TP x PP))
#   ROLLOUT_TP     GPUs per rollout engine (one engine = one worker = one job step)
#   THREADS        torch/OMP threads per process (default: CPUs per task; 1 on CPU runs)
#   CONVERT=0      1: convert MODEL_PATH once to a Megatron checkpoint (cached under CONVERT_CACHE,
#                  default ~/.cache/megatron_darl/converted, keyed on the dir, TP, PP, CONVERT_DTYPE);
#                  0: each trainer rank streams its own tensors straight from the HF safetensors
#   REQUEUE=0      1: on the warning signal (#SBATCH --signal=B:USR1@<s>) checkpoint, then
#                  scontrol requeue; the requeued job resumes in the same OUTPUT_DIR
#   GRACE_S=60     seconds rollout steps may take to leave after the trainer step ended
#   TRAINER_PORT, STORE_PORT  fixed ports (default 0: derived from the job id, 20000 + 2 * (id % 5000)
#                  and the next one; see launch/slurm.py job_ports)
#   DARL_RUN_SECRET  the run's control-store secret (default: 32 fresh random bytes); the job
#                  steps read it from LOG_DIR/run_secret (mode 0600, removed when the job ends),
#                  never from their environment
#   NET_IFNAME     network interface for NCCL/gloo (see slurm/env.sh, the NCCL settings)
#   STEP_MEM       --mem of each job step (clusters that track memory; default: none)
#   DARL_PYTHON    python with megatron_darl installed (default: python on PATH, i.e. the venv
#                  active at sbatch time); DARL_ROOT: the repository (default: the submit dir)
# Logs: OUTPUT_DIR/logs/job<id>_<restart>/{trainer-<rank>,rollout-<worker>}.log, steps.txt (the
# job steps and their nodes, from squeue), plan.sh; the batch output is sbatch's --output.
# Signals: SIGTERM (scancel, time limit) and SIGUSR1 (--signal) make the trainer finish its
# step, checkpoint, stop the workers and exit 0 (see docs/slurm.md, "Preemption").
set -uo pipefail

die() { echo "slurm/launch.sh: error: $*" >&2; exit 2; }
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job: submit with sbatch slurm/<script>.sbatch"
DARL_ROOT=${DARL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[ -f "$DARL_ROOT/launch/slurm.py" ] \
  || die "DARL_ROOT=$DARL_ROOT is not the megatron_darl repository: submit from it or set DARL_ROOT"
cd "$DARL_ROOT" || die "cannot cd to $DARL_ROOT"
PY=${DARL_PYTHON:-python}
command -v "$PY" >/dev/null \
  || die "'$PY' not found: activate the venv before sbatch (the environment is exported) or set DARL_PYTHON"
export OUTPUT_DIR=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME:-darl}_${SLURM_JOB_ID}}
case "$OUTPUT_DIR" in /*) ;; *) OUTPUT_DIR=${SLURM_SUBMIT_DIR:-$PWD}/$OUTPUT_DIR ;; esac
REQUEUE=${REQUEUE:-0}
GRACE_S=${GRACE_S:-60}
LOG_DIR=$OUTPUT_DIR/logs/job${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}
# One run at a time on OUTPUT_DIR (launch/run_lock.py): this script keeps the lock file open for
# the whole job; launch.slurm prepare locks it, or names the job that holds it and exits 2 before
# anything is written in OUTPUT_DIR.
mkdir -p "$OUTPUT_DIR" || die "cannot create $OUTPUT_DIR"
exec {DARL_RUN_LOCK_FD}<>"$OUTPUT_DIR/run.lock" || die "cannot open $OUTPUT_DIR/run.lock"
export DARL_RUN_LOCK_FD
# shellcheck source=slurm/env.sh
source "$DARL_ROOT/slurm/env.sh"
STOP_SIGNAL=""
TRAINER_PID=""
on_signal() {  # forward to the trainer step; it checkpoints and raises the stop flag
  STOP_SIGNAL=$1
  echo "[slurm] $(date +%T) batch got SIG$1: forwarding to the trainer step"
  # written down too (megatron_darl/loop/stop_request.py): a rank compiling a kernel when the
  # signal lands may never see it, and Slurm's warning signal comes once
  [ -n "${RUN_DIR:-}" ] && printf 'SIG%s\n' "$1" >"$RUN_DIR/.stop_request.tmp" \
    && mv -f "$RUN_DIR/.stop_request.tmp" "$RUN_DIR/stop_request"
  [ -n "$TRAINER_PID" ] && kill -"$1" "$TRAINER_PID" 2>/dev/null
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

echo "[slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: logs in $LOG_DIR"
"$PY" -m launch.slurm prepare --plan "$LOG_DIR/plan.sh" -- "$@" || exit $?
mkdir -p "$LOG_DIR" || die "cannot create $LOG_DIR"
# Only the run's own processes may act on its control store (launch/lifeline.py, docs/reliability.md).
# The steps get the secret in a file only this user can read: in their environment it would stay
# readable in /proc/PID/environ for their whole life.
run_secret=${DARL_RUN_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}
[ -n "$run_secret" ] || die "could not read /dev/urandom for the run secret"
unset DARL_RUN_SECRET
export DARL_RUN_SECRET_FILE=$LOG_DIR/run_secret
rm -f "$DARL_RUN_SECRET_FILE"
(umask 077 && printf '%s\n' "$run_secret" >"$DARL_RUN_SECRET_FILE") || die "cannot write $DARL_RUN_SECRET_FILE"
unset run_secret
trap 'rm -f "$DARL_RUN_SECRET_FILE"' EXIT
# shellcheck disable=SC1091
source "$LOG_DIR/plan.sh"
rm -f "$RUN_DIR/stop_request"  # a request is for the job in progress (a requeued job resumes)
if [ "$FINISHED" = 1 ]; then
  echo "[slurm] $RUN_DIR already finished ($START_STEP of $STEPS steps): nothing to do"; exit 0
fi
[ -z "$STOP_SIGNAL" ] || { echo "[slurm] stopped before any step started"; exit 0; }
# scancel sends SIGTERM to every step and SIGKILL KillWait later: the trainer's last step and its
# checkpoint must fit (the trainer logs each checkpoint's seconds); say the window up front
echo "[slurm] scancel leaves the trainer KillWait=$KILL_WAIT s to checkpoint;" \
  "scancel --batch --signal=USR1 $SLURM_JOB_ID stops it with no deadline"
export MASTER_ADDR MASTER_PORT OMP_NUM_THREADS=$THREADS DARL_THREADS=$THREADS
if [ "$TRAINER_GPUS_PER_NODE" = 0 ]; then export CUDA_VISIBLE_DEVICES=""; fi
mem=(); [ -n "${STEP_MEM:-}" ] && mem=(--mem="$STEP_MEM")

# Every step names its GPUs per node: a step inherits the job's SLURM_GPUS_PER_NODE (sbatch
# --gpus-per-node=G), which a per-step --gpus=1 does not replace, so each one-GPU engine would
# take all G GPUs of its node and the node's next engine wait for the first to end.
gpus() { [ "$1" -gt 0 ] && echo "--gpus-per-node=$1"; }  # a GPU option only on GPU runs
# shellcheck disable=SC2046
srun --exact --kill-on-bad-exit=1 --job-name=trainer --nodes="$TRAINER_NODES" \
  --nodelist="$TRAINER_NODELIST" --ntasks-per-node="$TRAINER_TASKS_PER_NODE" \
  --cpus-per-task="$TRAINER_CPUS_PER_TASK" $(gpus "$TRAINER_GPUS_PER_NODE") "${mem[@]}" \
  --output="$LOG_DIR/trainer-%t.log" \
  bash slurm/task.sh trainer "$PY" -m launch.trainer --config "$RUN_CONFIG" &
TRAINER_PID=$!
[ -z "$STOP_SIGNAL" ] || kill -"$STOP_SIGNAL" "$TRAINER_PID" 2>/dev/null
WORKER_PIDS=()
for wid in "${!ROLLOUT_WORKER_NODES[@]}"; do
  # shellcheck disable=SC2046
  srun --exact --job-name="rollout$wid" --nodes=1 --ntasks=1 --nodelist="${ROLLOUT_WORKER_NODES[$wid]}" \
    --cpus-per-task="$ROLLOUT_WORKER_CPUS_PER_TASK" $(gpus "$ROLLOUT_WORKER_GPUS") "${mem[@]}" \
    --output="$LOG_DIR/rollout-$wid.log" \
    bash slurm/task.sh rollout "$PY" -m launch.rollout --config "$RUN_CONFIG" --worker-id "$wid" \
    --defer-signals &
  WORKER_PIDS+=($!)
done
expected=$((1 + ${#ROLLOUT_WORKER_NODES[@]}))
(  # record the job steps and their nodes, as Slurm sees them, once all have started
  for _ in $(seq 120); do
    squeue -s -j "$SLURM_JOB_ID" -h -o "%i %j %N" >"$LOG_DIR/steps.tmp" 2>/dev/null
    [ "$(grep -cE ' (trainer|rollout[0-9]+) ' "$LOG_DIR/steps.tmp")" -ge "$expected" ] && break
    sleep 1
  done
  mv "$LOG_DIR/steps.tmp" "$LOG_DIR/steps.txt"
) &
STEPS_PID=$!
first_step_line() { grep -m1 "first trained step done" "$LOG_DIR/trainer-0.log" 2>/dev/null; }
(  # the batch output says when the first step is done (the trainer's log line, as the quick start's);
   # a stop signal does not end it: it leaves when the trainer step has
  trap '' TERM USR1
  while ! line=$(first_step_line); do
    kill -0 "$TRAINER_PID" 2>/dev/null || { line=$(first_step_line) || exit 0; break; }
    sleep 1
  done
  echo "[slurm] trainer: ${line#* INFO }"
) &
FIRST_PID=$!

while kill -0 "$TRAINER_PID" 2>/dev/null; do wait "$TRAINER_PID"; done  # a trap interrupts wait
wait "$TRAINER_PID"; rc=$?
while kill -0 "$FIRST_PID" 2>/dev/null; do wait "$FIRST_PID"; done  # its line first: it ends within 1 s
echo "[slurm] trainer step exited with code $rc"
deadline=$((SECONDS + GRACE_S))
for pid in "${WORKER_PIDS[@]}"; do
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 1; done
done
kill "$STEPS_PID" 2>/dev/null
if [ "$rc" != 0 ]; then
  echo "[slurm] trainer failed: last lines of $LOG_DIR/trainer-0.log:" >&2
  tail -n 20 "$LOG_DIR/trainer-0.log" >&2
  exit "$rc"
fi
# each bounded (a stalled filesystem): an unknown count is no finished run
last=$(timeout 120 "$PY" -m launch.slurm latest-step --run-dir "$RUN_DIR") || last=0  # newest complete checkpoint
trained=$(timeout 120 "$PY" -m launch.slurm trained-steps --run-dir "$RUN_DIR") || trained=0  # save_at_end=false: past it
if [ "$last" -ge "$STEPS" ] || [ "$trained" -ge "$STEPS" ]; then
  echo "[slurm] done: $RUN_DIR ($STEPS steps)"
  timeout 120 "$PY" -m launch.slurm outcome --run-dir "$RUN_DIR"  # the lines the quick start ends with
elif [ "$STOP_SIGNAL" = USR1 ] && [ "$REQUEUE" = 1 ]; then
  echo "[slurm] checkpointed at step $last of $STEPS: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
else
  echo "[slurm] stopped at step $last of $STEPS: resubmit with OUTPUT_DIR=$OUTPUT_DIR to resume"
fi
exit 0

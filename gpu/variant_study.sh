#!/usr/bin/env bash
# The variant study (benchmarks/variant_study.py) on the GPU machine, one device call at a time:
#
#   DARL_COMMIT=<sha> bash gpu/variant_study.sh SECONDS [benchmarks/variant_study.py args...]
#
# (carry .whl, made by gpu/wheels.sh: megatron-core, hydra-core, omegaconf, antlr4, math-verify,
# latex2sympy2_extended.)
# A study outlasts one call, so everything a later call needs stays in /tmp/darl_vs on the
# machine, which keeps it while warm: the fitted initial policy (warmstart/), the partial file of
# finished runs (partial.json) and the run dirs. The next call must come before the machine goes
# back (its idle release, 30 s: have it ready, change no code in between). A call on a fresh
# machine fits the initial policy again (~100 s, deterministic kernels: three 2x H200 machines fitted
# the same digest); a fit with another digest makes the partial file refuse the old runs (start
# a new one). SECONDS bounds the study (the call's own limit minus transfers): it is killed then;
# with --reuse-trained (pass it on every call) the next call resumes what it cut short: training
# from the run's latest checkpoint, evaluation from the points already written. The partial file
# is copied to $OUT every 10 s and at the end, so the finished runs come back whatever happens;
# the record (written once the plan is complete) and the log go to $OUT too.
# When the device time runs out first, the partial file that came back still makes a record of
# what finished: benchmarks/variant_study.py --record-finished --partial partial.json (same args).
# Measured on one H100 (16 cores, 57M, 200 steps, M = 4): 8 runs at once take ~2.2 s per step
# for sync and async and ~3.6 s for the variants with a log-prob pass; 9 at once (lr 3e-5)
# 1.6-2.2 s for sync and async, ~2 s for darl_once, 3.5-4 s for darl and darl_twice (replay);
# 12 at once 2.3-2.8 s (sync, async) and 3.5 s (darl). So a run-step costs ~0.2-0.3 s of one
# GPU's share of the host (16 cores a GPU), whatever the packing.
#
# The headline study's plan: grid sync (eta 0) + {async, decoupled, darl, darl_once, darl_nomis,
# darl_nofilter, darl_keta} x eta {1, 4, 8} = 22 runs a seed; K = 4 for the D-ARL cases, eta + 1
# for the queue baselines and darl_keta; degenerate groups dropped; lr 3e-5, B 16, G 8, M 4,
# 100 steps, held-out points every 25 steps (512 prompts, greedy + 4 sampled).
# Plan every call for a fresh machine: a call that follows the one before by more than the idle
# release (30 s) finds it gone and fits the warm start again; a call sent the moment the last
# one returned, with nothing read in between, found it warm (2x H200, 2026-11-28). So each call
# is a block of whole runs that finishes inside it: one staleness value of one seed (7-8 runs), e.g.
#   DARL_COMMIT=<sha> bash gpu/variant_study.sh 540 --seeds k --staleness 1 --parallel 8 \
#     --runs-per-gpu 4 --steps 100 --eval-every 25 --minibatches 4 --lr 3e-5 --budget 400
#   (then --staleness 4 / 8 with --variants async,decoupled,darl,darl_once,darl_nomis,darl_nofilter,darl_keta)
# and the blocks pool whatever machine fitted their warm start: each partial file names its own
# (save each call's $OUT/partial.json under its own name, e.g. benchmarks/results/partials/), then
#   python benchmarks/variant_study.py --record-finished --seeds 0,1,2 --steps 100 --eval-every 25 \
#     --minibatches 4 --lr 3e-5 --partial <first> --more-partials <next> ...
#   python tools/variant_report.py benchmarks/results/variant_study_<new>.json
# On a 4-GPU host one call takes a whole seed (--parallel 22 --runs-per-gpu 6).
# Measured on 2x H200 (32 cores, 81eca5f): blocks of 7, 8 and 7 runs took 441, 407 and 467 s warm.
# Measured on 2x H200 (32 cores, d7d9065): a block of 7-8 runs (4 a GPU) takes 448-481 s on a
# fresh machine (wheels, warm start 57 s) and 383 s on a warm one; each run starts in ~50 s,
# trains its 100 steps in 160-265 s (1.6-2.6 s a step) and scores its 5 points in 45-62 s.
# 22 runs at once (11 a GPU) did not finish in 540 s. $OUT/progress.txt says how far each run
# got when a call ends.
# Measured on one H200 (16 cores, 5c72442): 4 runs at once take 410 s on a fresh machine and
# 336-341 s on a warm one, 3 runs 338 s (the host's cores, not the GPU, bound a run-step), so a
# seed is six calls there, e.g. --staleness 1 --variants sync,async,decoupled,darl --parallel 4
# --runs-per-gpu 4, then darl_once,darl_nomis,darl_nofilter,darl_keta; about 2,100 s of device
# time a seed, more than one session's 1,800: send its calls back to back, four in a session.
set -u
OUT=${OUT:-/tmp/darl_vs_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
LIMIT=${1:?usage: variant_study.sh SECONDS [variant_study args...]}
shift
STATE=/tmp/darl_vs
PARTIAL=${DARL_VS_PARTIAL:-$STATE/partial.json}  # another file: a side study (other settings), same warm start
mkdir -p "$STATE"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "[device] installing .whl failed"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false DARL_COMMIT=${DARL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# DARL_MPS=1: the runs sharing a GPU (7-11 trainers and as many engines) become clients of one
# CUDA MPS server, so their kernels run side by side instead of in turns of the GPU's time
# slices. Measured at 4 runs a GPU (2x H200): no gain (mean training time 205 s with MPS for
# the eta 8 block, 200 s without for eta 4), so it is off by default. It changes no setting
# of the card (compute mode stays as found) and the server quits when this script exits. The
# runs' settings are unchanged (a colocated engine's CUDA IPC works between MPS clients on Volta
# and later), so their seeds pool with those run without it.
if [ "${DARL_MPS:-0}" = 1 ]; then
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/darl_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/darl_mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      trap 'echo quit | nvidia-cuda-mps-control; echo "[device] MPS server stopped"' EXIT
      echo "[device] MPS server started for the study's runs"
    else
      echo "[device] DARL_MPS=1: nvidia-cuda-mps-control -d failed: runs take turns on the GPUs"
    fi
  else
    echo "[device] DARL_MPS=1 but no nvidia-cuda-mps-control here: runs take turns on the GPUs"
  fi
fi
# progress.txt: each run's trained steps and scored points, so a call cut at its limit still says
# how far its runs got (the partial file lists finished runs only)
progress() {
  for d in "$STATE"/runs/*/; do
    [ -d "$d" ] || continue
    steps=$(grep -c . "$d/metrics.jsonl" 2>/dev/null)
    points=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["points"]))' \
      "$d/heldout.json" 2>/dev/null || echo 0)
    echo "$(basename "$d") steps ${steps:-0} scored_points $points"
  done > "$OUT/progress.txt.tmp" && mv -f "$OUT/progress.txt.tmp" "$OUT/progress.txt"
}
( while sleep 10; do cp -f "$PARTIAL" "$OUT/" 2>/dev/null; progress; done ) &
COPIER=$!
timeout --kill-after=15 "$LIMIT" python3 benchmarks/variant_study.py --partial "$PARTIAL" \
  --out-dir "$OUT" --warmstart-cache-dir "$STATE/warmstart" --run-root "$STATE/runs" "$@" \
  2>&1 | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
kill "$COPIER" 2>/dev/null
cp -f "$PARTIAL" "$OUT/" 2>/dev/null
progress
echo "[device] variant_study exit $rc (3: runs left for the next call; 124: killed at ${LIMIT}s)"
exit 0

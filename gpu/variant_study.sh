#!/usr/bin/env bash
# The variant study (benchmarks/variant_study.py) on the GPU machine, one device call at a time:
#
#   DARL_COMMIT=<sha> bash gpu/variant_study.sh SECONDS [benchmarks/variant_study.py args...]
#
# (carry .whl: megatron-core, hydra-core, omegaconf, antlr4, math-verify, latex2sympy2_extended.)
# A study outlasts one call, and a GPU warm start is not bitwise reproducible across machines, so
# everything a later call needs stays in /tmp/darl_vs on the machine, which keeps it while warm:
# the fitted initial policy (warmstart/), the partial file of finished runs (partial.json) and the
# run dirs. The next call must come before the machine goes back (its idle release, 30 s:
# have it ready, change no code in between); a call on a
# fresh machine fits a new policy and the partial file then refuses the old runs (start a new
# one). SECONDS bounds the study (the call's own limit minus transfers): it is killed then;
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
# The headline study's plan (part 3), on nvidia-h100-x4 (64 cores), carry [".whl"]:
#   grid: sync (eta 0) + {async, decoupled, darl, darl_once, darl_nomis, darl_nofilter, darl_keta}
#   x eta {1, 4, 8}: 25 runs a seed; K = 4 for the D-ARL cases, eta + 1 for the queue baselines
#   and darl_keta (named darl_k2/k5/k9); degenerate groups dropped; lr 3e-5 (sync 0.152 +- 0.002
#   at 200 steps, M = 4: 155949's record), B 16, G 8, M 4, 100 steps (sync has ~80% of its
#   200-step gain by step 100), held-out points every 25 steps (512 prompts, greedy + 4 sampled).
#   Full grid 5 seeds = 125 runs ~ 125 x 100 x 0.25 s / 4 GPUs ~ 13 min of training, plus launch and
#   evaluation per run and the warm start and staging per call: it does not fit 25 minutes as
#   10-minute calls of 32 slots at 200 steps (~50 min), hence 100 steps and one seed block a call.
#   One call = one seed: its 25 runs at once, 7 a GPU (~1.6 s/step: ~160 s of training, ~40 s
#   launch, ~50 s for 5 held-out points, ~250-300 s a run), after the warm start (a fresh machine
#   fits it, ~1-2 min, not measured at 57M on H100; a warm one reuses $STATE) and the .whl
#   install (~20 s): ~400-450 s a call, under the 540 s budget. Each call's block is complete
#   (every case of its seed, one warm start), so blocks from fresh machines pool as seeds.
#     call k (k = 0, 1, 2; then 3, 4 if the time is there):
#       DARL_COMMIT=<sha> bash gpu/variant_study.sh 560 --seeds k --seed-major \
#         --parallel 25 --runs-per-gpu 7 --steps 100 --eval-every 25 --minibatches 4 --lr 3e-5 \
#         --budget 480 --reuse-trained
#     (a machine still warm from the call before may take two seeds: --seeds k,k+1 --parallel 50
#     --runs-per-gpu 13, ~470 s, no fit.) Save each call's $OUT/partial.json here under its own name
#     (e.g. benchmarks/results/partials/issue39_call<k>.json); then
#       python benchmarks/variant_study.py --record-finished --seeds 0,1,2 --steps 100 --eval-every 25 \
#         --minibatches 4 --lr 3e-5 --partial <call 0's> --more-partials <call 1's> --more-partials <call 2's>
#       python tools/variant_report.py benchmarks/results/variant_study_<new>.json
#   3 seeds = 3 calls ~ 22-24 min of the session's device time; 5 seeds need 5 (two sessions).
# Measured on 2x H200 (32 cores; no 4-GPU host lent, 2026-11-28): seed 0's 22 runs at once
# (--parallel 22 --runs-per-gpu 11 would balance them; 13 a GPU put 13 and 9) took two calls on
# one warm machine, 560 s (warm start 57 s, cut at the limit) + 487 s (every run resumed from its
# checkpoint): ~1,050 s a seed, twice the 4-GPU plan's; each run trained for 140-400 s of its
# second call and evaluated its 5 held-out points in 80-130 s.
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
# slices. It changes no setting of the card (compute mode stays as found) and the server quits
# when this script exits. The runs' settings are unchanged (a colocated engine's CUDA IPC works
# between MPS clients on Volta and later), so their seeds pool with those run without it.
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
( while sleep 10; do cp -f "$PARTIAL" "$OUT/" 2>/dev/null; done ) &
COPIER=$!
timeout --kill-after=15 "$LIMIT" python3 benchmarks/variant_study.py --partial "$PARTIAL" \
  --out-dir "$OUT" --warmstart-cache-dir "$STATE/warmstart" --run-root "$STATE/runs" "$@" \
  2>&1 | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
kill "$COPIER" 2>/dev/null
cp -f "$PARTIAL" "$OUT/" 2>/dev/null
echo "[device] variant_study exit $rc (3: runs left for the next call; 124: killed at ${LIMIT}s)"
exit 0

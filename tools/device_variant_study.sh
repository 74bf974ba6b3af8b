#!/usr/bin/env bash
# Issue 17's variant study on the GPU machine, one device call at a time:
#
#   DARL_COMMIT=<sha> bash tools/device_variant_study.sh SECONDS [benchmarks/variant_study.py args...]
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
# 1.6-2.2 s for sync and async, ~2 s for darl_once, 3.5-4 s for darl and darl_twice (replay).
# Plan calls so (or resume across them); the machine goes back after 30 minutes held, warm or not.
set -u
OUT=${OUT:-/tmp/darl_vs_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
LIMIT=${1:?usage: device_variant_study.sh SECONDS [variant_study args...]}
shift
STATE=/tmp/darl_vs
mkdir -p "$STATE"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "[device] installing .whl failed"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false DARL_COMMIT=${DARL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
( while sleep 10; do cp -f "$STATE/partial.json" "$OUT/" 2>/dev/null; done ) &
COPIER=$!
timeout --kill-after=15 "$LIMIT" python3 benchmarks/variant_study.py --partial "$STATE/partial.json" \
  --out-dir "$OUT" --warmstart-cache-dir "$STATE/warmstart" --run-root "$STATE/runs" "$@" \
  2>&1 | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
kill "$COPIER" 2>/dev/null
cp -f "$STATE/partial.json" "$OUT/" 2>/dev/null
echo "[device] variant_study exit $rc (3: runs left for the next call; 124: killed at ${LIMIT}s)"
exit 0

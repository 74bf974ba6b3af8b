#!/usr/bin/env bash
# The vLLM tests and benchmark on the GPU machine, in one call, right after the kit's install.sh:
#
#   bash .vkit/bin/install.sh && DARL_COMMIT=<sha> bash gpu/vllm_run.sh
#
# (carry .whl, the project's wheels, if that checkout has them; vLLM must be in /tmp/vsite.)
# Each part runs under its own timeout, inside an overall budget (DARL_DEVICE_BUDGET_S, default
# 470 s), and the script goes on after a failure. Logs and benchmark records go to $OUT (at most
# 7 files); the last lines printed are a summary, also in $OUT/summary.txt. Parts, most
# important first:
#   env       vLLM imports, GPU seen
#   backend   tests/gpu/test_vllm_backend.py  (log-probs vs HF at T=1/0.7, weights in place, streaming, interrupt)
#   bench_vllm  benchmarks/generate.py --engines vllm  (tokens/s, weight update 1.7B and 4B vs bound)
#   mainjob   tests/gpu/test_main_job_vllm.py, update_mode=interrupt on 1 GPU (2-GPU case skips on one GPU)
#   mainjob_finish  the same main job with update_mode=finish
#   bench_hf  benchmarks/generate.py --engines hf --merge  (the same cases with hf; one record with both), if time is left
set -u
OUT=${OUT:-${1:-/tmp/darl_vllm_out}}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
BUDGET=${DARL_DEVICE_BUDGET_S:-470}
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "[device] installing .whl failed" | tee -a "$SUMMARY"
fi
export PYTHONPATH="/tmp/vsite:/tmp/site:$PWD:${PYTHONPATH:-}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export DARL_COMMIT=${DARL_COMMIT:-unknown}
export TOKENIZERS_PARALLELISM=false

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# part NAME CAP LOG CMD...: run CMD under timeout min(CAP, time left), append to LOG, record the outcome
part() {
  local name=$1 cap=$2 log=$3; shift 3
  local budget; budget=$(left)
  if [ "$budget" -lt 30 ]; then
    echo "$name: SKIPPED (budget spent)" | tee -a "$SUMMARY"; return 0
  fi
  local t=$(( cap < budget ? cap : budget ))
  local s; s=$(date +%s)
  echo "===== $name (timeout ${t}s) =====" >> "$log"
  timeout --kill-after=20 "$t" "$@" >> "$log" 2>&1
  local rc=$?
  local verdict=FAIL; [ $rc -eq 0 ] && verdict=OK; [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict=TIMEOUT
  echo "$name: $verdict (rc $rc, $(( $(date +%s) - s ))s)" | tee -a "$SUMMARY"
  return 0
}

PYTEST=(python3 -m pytest -q -rA -p no:cacheprovider -o addopts="" -s)

part env 90 "$OUT/backend.log" python3 -c "
import torch, vllm
print('vllm', vllm.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))
import megatron_darl.rollout.engines.vllm, megatron_darl.rollout.engines.vllm_worker
"
part backend 240 "$OUT/backend.log" "${PYTEST[@]}" tests/gpu/test_vllm_backend.py
part bench_vllm 210 "$OUT/bench.log" python3 benchmarks/generate.py --engines vllm --out-dir "$OUT" \
  --partial /tmp/darl_bench_vllm.json
part mainjob 200 "$OUT/mainjob.log" "${PYTEST[@]}" tests/gpu/test_main_job_vllm.py -k "interrupt or two_gpus"
part mainjob_finish 150 "$OUT/mainjob.log" "${PYTEST[@]}" tests/gpu/test_main_job_vllm.py -k finish
HF_BUDGET=$(( $(left) - 60 ))
if [ -f /tmp/darl_bench_vllm.json ]; then
  part bench_hf 300 "$OUT/bench.log" python3 benchmarks/generate.py --engines hf --out-dir "$OUT" \
    --merge /tmp/darl_bench_vllm.json --budget-s "$HF_BUDGET"
else
  part bench_hf 300 "$OUT/bench.log" python3 benchmarks/generate.py --engines hf --out-dir "$OUT" --budget-s "$HF_BUDGET"
fi

{
  echo "----- total $(( $(date +%s) - T0 ))s of ${BUDGET}s; commit $DARL_COMMIT"
  grep -h -E "^(PASSED|FAILED|ERROR|SKIPPED) |passed|failed" "$OUT/backend.log" "$OUT/mainjob.log" 2>/dev/null | tail -20
  grep -h -E "tokens/s|weight update" "$OUT/bench.log" 2>/dev/null | tail -12
  grep -h -E "^T=" "$OUT/backend.log" 2>/dev/null | tail -6
} | tee -a "$SUMMARY"

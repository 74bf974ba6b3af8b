#!/usr/bin/env bash
# The scaling runs of the loop (issue 29) on a 4-GPU host, in one device call:
#
#   DARL_COMMIT=<sha> bash tools/device_scaling_run.sh [PART ...]      (carry .whl)
#
# Parts (default: hf):
#   hf        benchmarks/loop_profile.py at Qwen3-1.7B shape, hf engine, splits 1:1 and 2:2 in
#             one invocation, with the weight-sync broadcast bound of each rollout count
#   hf_block  the same 2:2 with the weight sync blocking (transport.weight_sync.background=false)
#   vllm      the same splits with engine.backend=vllm (needs /tmp/vsite: ../shared/vllm-kit)
#   sync      the main job's tests on 1 and 2 GPUs (tests/gpu/test_main_job.py) and the trainer's
#             GPU tests (tests/gpu/test_trainer_gpu.py: bf16 log-probs, device snapshots)
#   trainer   only tests/gpu/test_trainer_gpu.py
#   variants  darl against decoupled at the same shape, disaggregated on 2 GPUs (gpu2): the step
#             cost of D-ARL's candidate pass and backfill (step_to_decoupled, per_sample_to_decoupled)
# Records and logs go to $OUT (at most 8 files come back); a part that fails prints its log tail
# and the script goes on. DARL_BUDGET_S (default 560) bounds the whole call.
set -u
OUT=${OUT:-/tmp/darl_scaling_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${DARL_BUDGET_S:-560}
# shellcheck source=tools/device_env.sh
source tools/device_env.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# run NAME LOG CMD...: CMD under timeout (time left), its tail printed when it fails
run() {
  local name=$1 log=$2; shift 2
  local t; t=$(left)
  if [ "$t" -lt 60 ]; then echo "$name: SKIPPED (budget spent)"; return 0; fi
  local s; s=$(date +%s)
  timeout --kill-after=15 "$t" "$@" > "$log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $(( $(date +%s) - s )) s"
  [ $rc -ne 0 ] && tail -40 "$log"
  grep -E "^(t[0-9]r[0-9]|gpu|layout)" "$log" | cut -c1-400
  return 0
}

# DARL_STEPS (default 10) steps per run, the first 3 left out; DARL_BOUND=0 skips the bound
PROFILE=(python3 benchmarks/loop_profile.py --model qwen3_1.7b --steps "${DARL_STEPS:-10}" --skip 3
         --out-dir "$OUT" --work-dir /tmp/darl_lp --timeout 500)
BOUND=(--bound); [ "${DARL_BOUND:-1}" = 0 ] && BOUND=()
for part in "${@:-hf}"; do
  case "$part" in
    hf) run hf "$OUT/hf.log" "${PROFILE[@]}" --splits 1:1,2:2 "${BOUND[@]}" ;;
    hf_block) run hf_block "$OUT/hf_block.log" "${PROFILE[@]}" --splits 2:2 transport.weight_sync.background=false ;;
    vllm) run vllm "$OUT/vllm.log" "${PROFILE[@]}" --splits 1:1,2:2 "rollout@_global_=vllm" ;;
    sync) run sync "$OUT/sync.log" python3 -m pytest -q -p no:cacheprovider -o addopts="" -s \
            tests/gpu/test_main_job.py tests/gpu/test_trainer_gpu.py ;;
    trainer) run trainer "$OUT/trainer.log" python3 -m pytest -q -p no:cacheprovider -o addopts="" -s tests/gpu/test_trainer_gpu.py ;;
    variants) run variants "$OUT/variants.log" "${PROFILE[@]}" --layouts gpu2 --variant darl,decoupled ;;
    *) echo "unknown part $part" ;;
  esac
done
# run dirs' worker logs of the last profile, for a look at what the workers did
for f in /tmp/darl_lp/t2r2/logs/rollout0.log; do [ -f "$f" ] && tail -c 20000 "$f" > "$OUT/rollout0_t2r2.log"; done
echo "total $(( $(date +%s) - T0 )) s; commit $DARL_COMMIT"

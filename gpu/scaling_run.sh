#!/usr/bin/env bash
# The loop's scaling runs on a 4-GPU host, in one device call (docs/benchmarks.md, loop scaling):
#
#   DARL_COMMIT=<sha> bash gpu/scaling_run.sh RUN [RUN ...]      (carry .whl)
#
# RUN is VARIANT@T:R[@ENGINE][@quick][@KEY=VALUE...]: benchmarks/loop_profile.py at Qwen3-1.7B shape
# with that variant (configs/algorithm), T trainer and R rollout GPUs, ENGINE vllm (default; needs
# /tmp/vsite, ../shared/vllm-kit) or hf, at the realistic batch 32 x 8 x 1024 (quick: 8 x 8 x 512),
# and Hydra overrides of the run.
#   e.g. darl@2:2 darl@1:1 decoupled@2:2 decoupled@1:1 darl@3:1 darl@1:3 darl@2:2@hf darl@2:2@vllm@quick
#        darl@2:2@quick@trainer.overlap_grad_reduce=true
# or `tests`: tests/gpu/test_main_job.py (the main job on 1 and 2 GPUs, and with the optional loss
# terms and held-out points) and test_trainer_gpu.py; or `posterior`:
# benchmarks/posterior_drift.py (one GPU, vLLM; its record with the others).
# Each run writes its record as it ends; its run dir's launch timeline, the tail of each process's
# log and the records go into $OUT/runs.tgz (one file: at most 8 come back), the summary lines into
# $OUT/summary.txt. The policy is built once per call (/tmp/darl_lp/policy) and runs skip the final
# checkpoint (loop.save_at_end=false). DARL_STEPS (default 8) steps per run, the first DARL_SKIP
# (default 3) left out (at 12 steps one start-up step of 10 s in the 4th cost a 2:2 run 0.15x);
# DARL_BUDGET_S (default 570) bounds the whole call: a run that cannot start in what is left is
# skipped, and one that runs out of time is killed with what it measured so far lost (say so).
set -u
OUT=${OUT:-/tmp/darl_scaling_out}
mkdir -p "$OUT/rec" "$OUT/runs"
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${DARL_BUDGET_S:-570}
# shellcheck source=gpu/env.sh
source gpu/env.sh
export TORCH_LOGS=${TORCH_LOGS:-recompiles}  # why a kernel recompiled, in the trainer logs
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }

# keep NAME RUN_DIR: the run's timeline and log tails under $OUT/runs/NAME
keep() {
  local dest="$OUT/runs/$1" dir=$2
  mkdir -p "$dest"
  cp "$dir"/launch_timeline.json "$dir"/metrics.jsonl "$dest"/ 2>/dev/null
  [ -f "$dir/launch_train.log" ] && tail -c 60000 "$dir/launch_train.log" > "$dest/launch_train.log"
  cp -r "$dir"/timeline "$dest"/ 2>/dev/null
  for f in "$dir"/logs/*.log; do [ -f "$f" ] && tail -c 30000 "$f" > "$dest/$(basename "$f")"; done
}

profile() {  # profile NAME VARIANT SPLIT ENGINE QUICK [OVERRIDE...]
  local name=$1 variant=$2 split=$3 engine=$4 quick=$5 t
  shift 5
  t=$(left)
  if [ "$t" -lt 150 ]; then say "$name: SKIPPED (${t}s left)"; return 0; fi
  local args=(--model qwen3_1.7b --splits "$split" --variant "$variant" --steps "${DARL_STEPS:-8}" --skip "${DARL_SKIP:-3}"
              --out-dir "$OUT/rec" --work-dir /tmp/darl_lp --timeout $(( t - 20 )) loop.save_at_end=false)
  [ "$quick" = quick ] && args=(--quick "${args[@]}")  # options before the overrides: argparse takes one run of them
  [ "$engine" = vllm ] && args+=("rollout=vllm")
  args+=("$@")
  local s; s=$(date +%s)
  timeout --kill-after=15 "$t" python3 benchmarks/loop_profile.py "${args[@]}" > "$OUT/runs/$name.log" 2>&1
  local rc=$?
  say "$name: rc $rc, $(( $(date +%s) - s )) s"
  [ $rc -ne 0 ] && tail -25 "$OUT/runs/$name.log"
  grep -hE "first trained step|compiled in|dynamo" "/tmp/darl_lp/t${split%:*}r${split#*:}_$variant"*.log "/tmp/darl_lp/t${split%:*}r${split#*:}_$variant"/logs/*.log 2>/dev/null | tail -3
  local run_dir="/tmp/darl_lp/t${split%:*}r${split#*:}_$variant"  # this run's only: earlier runs' dirs stay
  [ -d "$run_dir" ] && keep "$name" "$run_dir"
  [ -f "$run_dir.launch_train.log" ] && mkdir -p "$OUT/runs/$name" && tail -c 60000 "$run_dir.launch_train.log" > "$OUT/runs/$name/launch_train.log"
  python3 - "$OUT/rec" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys, pathlib
recs = sorted(pathlib.Path(sys.argv[1]).glob("loop_profile_*.json"), key=lambda p: p.stat().st_mtime)
if recs:
    r = json.loads(recs[-1].read_text()); m, c = r["metrics"], r["config"]
    keys = ("step_seconds", "samples_per_s", "receive_wait_seconds", "prefetch_seconds", "logprob_seconds",
            "backfill_seconds", "train_seconds", "train_forward_backward_seconds", "train_grad_reduce_seconds",
            "train_optimizer_seconds", "logprob_cache_hit_rate", "launch_to_first_step_seconds",
            "launch_processes_started_seconds", "launch_launcher_imports_seconds", "launch_launcher_checks_seconds",
            "launch_engine_start_seconds", "launch_trainer_compile_seconds", "launch_first_step_seconds",
            "dynamo_compiles_after_first_step")
    print(c.get("variant"), c.get("layout"), c.get("engine"), c.get("groups"), c.get("new_tokens"), c.get("overrides"),
          " ".join(f"{k}={m[k]:.3g}" for k in keys if isinstance(m.get(k), (int, float))))
EOF
  rm -rf /tmp/darl_lp/t*r*_*/checkpoints
}

for run in "$@"; do
  if [ "$run" = tests ]; then
    t=$(left); s=$(date +%s)
    timeout --kill-after=15 "$t" python3 -m pytest -q -p no:cacheprovider -o addopts="" -s \
      tests/gpu/test_main_job.py tests/gpu/test_trainer_gpu.py > "$OUT/runs/tests.log" 2>&1
    say "tests: rc $?, $(( $(date +%s) - s )) s"; tail -5 "$OUT/runs/tests.log"
    continue
  fi
  if [ "$run" = posterior ]; then  # benchmarks/posterior_drift.py: one GPU, vLLM
    t=$(left); s=$(date +%s)
    timeout --kill-after=15 "$t" python3 benchmarks/posterior_drift.py --out-dir "$OUT/rec" \
      --work-dir /tmp/darl_pd > "$OUT/runs/posterior.log" 2>&1
    say "posterior: rc $?, $(( $(date +%s) - s )) s"; grep -E "^scale|^  " "$OUT/runs/posterior.log" | tee -a "$OUT/summary.txt"
    tail -3 "$OUT/runs/posterior.log"; rm -rf /tmp/darl_pd/scaled
    continue
  fi
  IFS=@ read -r -a fields <<< "$run"
  variant=${fields[0]} split=${fields[1]} engine=vllm quick="" overrides=()
  for f in "${fields[@]:2}"; do
    case "$f" in vllm|hf) engine=$f ;; quick) quick=quick ;; *=*) overrides+=("$f") ;;
      *) say "$run: '$f' is neither an engine, quick nor KEY=VALUE: skipped"; continue 2 ;; esac
  done
  name=${run//[:@=.]/_}
  [ -e "$OUT/runs/$name.log" ] && name=${name}_again  # the same run twice: caches warm the second time
  profile "$name" "$variant" "$split" "$engine" "$quick" "${overrides[@]}"
done
cp "$OUT"/rec/*.json "$OUT/runs/" 2>/dev/null
tar -czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs" "$OUT/rec"
say "total $(( $(date +%s) - T0 )) s; commit $DARL_COMMIT"

#!/usr/bin/env bash
# sbatch on the GPU machine (issue 29, part 5): a real one-node Slurm with GRES gpu:N started from
# the Debian packages of tools/slurm_kit.sh, then the 1.7B D-ARL sbatch script at reduced steps on a
# random-init Qwen3 of its shape with the built-in task's tokenizer: the trainer as one job step,
# each rollout engine as its own, as on a cluster. In one device call:
#
#   here:  bash tools/slurm_kit.sh fetch .slurmkit          (once; .slurmkit is git-ignored)
#   call:  carry .whl and .slurmkit;  DARL_COMMIT=<sha> bash tools/device_slurm_run.sh [MODEL] [ENGINE]
#
# MODEL (default qwen3_1.7b) picks slurm/<model>_darl.sbatch; ENGINE hf (default) or vllm (needs
# /tmp/vsite from ../shared/vllm-kit). TRAIN_GPUS (default half the GPUs) go to the trainer step,
# the rest to one engine each (ROLLOUT_NODES=0). STEPS (default 6). Logs to $OUT.
set -u
OUT=${OUT:-/tmp/darl_slurm_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
MODEL=${1:-qwen3_1.7b}
ENGINE=${2:-hf}
# shellcheck source=tools/device_env.sh
source tools/device_env.sh
cat /etc/os-release | head -2; ldd --version | head -1
GPUS=$(nvidia-smi -L | wc -l)
TRAIN_GPUS=${TRAIN_GPUS:-$((GPUS / 2))}
bash tools/slurm_kit.sh unpack .slurmkit /opt/slurmkit 2>&1 | tee "$OUT/kit.log" | tail -5
# shellcheck disable=SC1090
source <(bash tools/slurm_kit.sh env /opt/slurmkit)
python3 - "$MODEL" <<'EOF' || { echo "[device] building the policy failed"; exit 1; }
import sys
from pathlib import Path
from benchmarks.loop_profile import build_policy
print("policy", build_policy(sys.argv[1], Path("/tmp/darl_slurm/policy")))
EOF
python3 - "$GPUS" "$TRAIN_GPUS" "$MODEL" "$ENGINE" "${STEPS:-6}" "$OUT" <<'EOF'
"""Start the cluster, submit the sbatch script, follow it, stop the cluster (whatever happens)."""
import os, shutil, sys, time
from pathlib import Path
from tests.slurm.local_cluster import LocalSlurm

gpus, train_gpus, model, engine, steps, out = sys.argv[1:]
root = Path("/tmp/darl_slurm/cluster")
shutil.rmtree(root, ignore_errors=True)
cluster = LocalSlurm(root, nodes=1, cpus_per_node=os.cpu_count(), memory_mb=200_000, gpus=int(gpus),
                     plugin_dir=os.environ["DARL_SLURM_PLUGIN_DIR"])
env = {"MODEL_PATH": "/tmp/darl_slurm/policy", "OUTPUT_DIR": "/tmp/darl_slurm/run", "ROLLOUT_NODES": "0",
       "TRAIN_GPUS_PER_NODE": train_gpus, "ENGINE": engine, "DATA": "builtin", "DARL_PYTHON": "python3",
       "GRACE_S": "60"}
os.environ.update(env)  # sbatch exports the submitting environment to the job
try:
    cluster.start(timeout=90)
    print(cluster.run(["sinfo", "-N", "-o", "%N %T %G"]).stdout)
    argv = ["sbatch", "--parsable", "--nodes=1", f"--gpus-per-node={gpus}", "--time=20",
            f"--output={out}/sbatch.out", f"slurm/{model}_darl.sbatch", f"loop.steps={steps}",
            "loop.checkpoint_interval=0", "replay.drop_degenerate=false"]
    job = cluster.run(argv, timeout=60)
    print("sbatch:", job.stdout, job.stderr)
    deadline = time.time() + 480
    while time.time() < deadline and cluster.run(["squeue", "-h"]).stdout.strip():
        time.sleep(5)
    print(cluster.run(["sacct", "-j", job.stdout.strip(), "-o", "JobID,JobName,State,ExitCode,NodeList"]).stdout)
finally:
    cluster.stop()
    for log in (root / "log").glob("*.log"):
        shutil.copy(log, Path(out) / f"slurm_{log.name}")
EOF
tail -30 "$OUT/sbatch.out" 2>/dev/null
ls /tmp/darl_slurm/run/logs/*/ 2>/dev/null && cp /tmp/darl_slurm/run/metrics.jsonl "$OUT/" 2>/dev/null
echo "commit $DARL_COMMIT"

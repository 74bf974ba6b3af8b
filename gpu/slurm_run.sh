#!/usr/bin/env bash
# sbatch on the GPU machine under a real Slurm, in one device call: Slurm and munge from the Debian
# packages of gpu/slurm_kit.sh, the host's GPUs split over emulated nodes, then one case of
# gpu/slurm_case.py (the headline sbatch with scancel and resubmission, or the scaling
# study) on a random-init Qwen3 of the script's shape with the built-in task's tokenizer.
#
#   here:  bash gpu/slurm_kit.sh fetch .slurmkit          (once; .slurmkit is git-ignored)
#   call:  carry .whl and .slurmkit (vLLM staged: ../shared/vllm-kit);
#          DARL_COMMIT=<sha> bash gpu/slurm_run.sh headline --model qwen3_4b --nodes 2
#          DARL_COMMIT=<sha> bash gpu/slurm_run.sh scaling --model qwen3_1.7b --nodes-list "1 2"
#
# Arguments go to gpu/slurm_case.py (its docstring). Everything comes back under $OUT.
set -u
OUT=${OUT:-/tmp/darl_slurm_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# shellcheck source=gpu/env.sh
source gpu/env.sh
{ head -2 /etc/os-release; ldd --version | head -1; nvidia-smi -L; ls /dev/nvidia* | tr '\n' ' '; echo;
  head -1 /proc/self/cgroup; } | tee "$OUT/host.txt"
if [ ! -x /opt/slurmkit/usr/sbin/slurmctld ]; then
  bash gpu/slurm_kit.sh unpack .slurmkit /opt/slurmkit 2>&1 | tee "$OUT/kit.log" | tail -5
fi
# shellcheck disable=SC1090
source <(bash gpu/slurm_kit.sh env /opt/slurmkit)
python3 gpu/slurm_case.py "$@" --out "$OUT"
rc=$?
echo "slurm_case rc $rc; commit $DARL_COMMIT" | tee -a "$OUT/host.txt"
# a device call brings back at most 8 files: the summary and the first logs to read stay apart,
# the rest (the other ranks' and engines' logs, slurmctld's and slurmd's) go into one archive
keep=(summary.json host.txt job1.out job2.out job1_trainer-0.log job2_trainer-0.log metrics.jsonl)
rest=()
for f in "$OUT"/*; do
  name=$(basename "$f"); [[ " ${keep[*]} " == *" $name "* ]] || rest+=("$name")
done
if [ ${#rest[@]} -gt 0 ]; then tar -czf "$OUT/rest.tgz" -C "$OUT" "${rest[@]}" && (cd "$OUT" && rm -rf "${rest[@]}"); fi
exit $rc

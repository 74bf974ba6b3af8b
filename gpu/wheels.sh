#!/usr/bin/env bash
# Here, on the CPU machine: the wheels the gpu/*.sh scripts carry to the GPU machine (its Python
# 3.12 lacks them), into .whl/ (git-excluded; each call names .whl in carry, 3 MiB):
#   bash gpu/wheels.sh
# The versions are those the GPU records ran with. hydra-core pins antlr4 4.9.*, published only
# as a source archive, so that one is built here (pure Python, one wheel for every interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl megatron-core==0.19.2 hydra-core==1.3.8 omegaconf==2.3.0 math-verify==0.9.0 \
  latex2sympy2_extended==1.11.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls .whl

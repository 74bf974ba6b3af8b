#!/usr/bin/env bash
# Sourced by the gpu/*_run.sh scripts on the GPU machine: the carried wheels (.whl, made here by
# gpu/wheels.sh: megatron-core, hydra-core, omegaconf, antlr4, math-verify, latex2sympy2_extended)
# installed once into /tmp/site, vLLM from /tmp/vsite when staged (../shared/vllm-kit), and the
# environment every run there wants.
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "[device] installing .whl failed"; exit 1; }
  # byte-compile what pip --no-compile left, as a user's pip install does: else a fresh
  # machine's first launch compiles megatron-core and vLLM module by module as it imports them
  # (vLLM's import took 36 s in the first launch of a fresh 4x H200)
  python3 -m compileall -q -j 0 /tmp/site /tmp/vsite >/dev/null 2>&1
fi
export PYTHONPATH="/tmp/vsite:/tmp/site:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false DARL_COMMIT=${DARL_COMMIT:-unknown}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1

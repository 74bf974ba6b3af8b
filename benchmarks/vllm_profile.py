"""Benchmark ``vllm_profile``: is the gap between vLLM and the ``hf`` engine in our adapter or in vLLM?

``benchmarks/generate.py`` measured vLLM through ``VLLMEngine`` at 2.3-2.4x the ``hf`` engine
(target 3x). This runs the same generation (Qwen3-1.7B dummy weights, bf16, ``--concurrency``
prompts of ``--prompt-tokens``, exactly ``--new-tokens`` new tokens, temperature 1) three ways,
each in a process of its own (one engine per process, so each gets the GPU to itself):

- ``raw``: vLLM's offline ``LLM.generate``, no log-probs: vLLM's own ceiling on this case;
- ``raw_logprobs``: the same with ``logprobs=0`` under ``logprobs_mode=processed_logprobs``
  (what the trainer needs): the cost of asking for the sampled tokens' log-probs;
- ``adapter``: ``VLLMEngine`` (AsyncLLM, one request per response, FINAL_ONLY outputs), as the
  rollout worker runs it; ``--batched-tokens N`` adds ``adapter_bt<N>`` with
  ``max_num_batched_tokens=N``.

Each way times a prefill-only call (1 new token) and the full call after a warm-up, so decode
ms per step = (full - prefill) / (new_tokens - 1); it also reports the scheduler's
``max_num_batched_tokens`` and ``max_num_seqs`` as the engine resolved them.

    python benchmarks/vllm_profile.py --out-dir OUT          # GPU, vLLM installed
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402

WAYS = ("raw", "raw_logprobs", "adapter")


def _scheduler(vllm_config) -> dict:
    sched = getattr(vllm_config, "scheduler_config", None)
    return {"max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            "max_num_seqs": getattr(sched, "max_num_seqs", None)}


def _raw(a, model_dir: Path, logprobs: bool) -> dict:
    from vllm import LLM, SamplingParams

    from benchmarks.generate import prompts_for

    llm = LLM(model=str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=a.concurrency,
              max_model_len=a.prompt_tokens + a.new_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
              enable_prefix_caching=True, seed=0, logprobs_mode="processed_logprobs")

    def run(prompts, new: int) -> float:
        params = SamplingParams(n=1, max_tokens=new, temperature=1.0, ignore_eos=True, detokenize=False,
                                logprobs=0 if logprobs else None)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        assert all((o.outputs[0].logprobs is not None) == logprobs for o in outs)
        return seconds

    run(prompts_for(8, a.prompt_tokens, seed=99), 16)  # warm-up
    prompts = prompts_for(a.concurrency, a.prompt_tokens)
    out = {"prefill_s": run(prompts, 1), "full_s": run(prompts, a.new_tokens)}
    out.update(_scheduler(llm.llm_engine.vllm_config))
    return out


def _adapter(a, model_dir: Path, batched_tokens: int | None) -> dict:
    from benchmarks.generate import prompts_for, timed
    from megatron_darl.rollout.engines import EngineConfig
    from megatron_darl.rollout.engines.vllm import VLLMEngine

    extra = {"max_num_batched_tokens": batched_tokens} if batched_tokens else {}
    engine = VLLMEngine(EngineConfig(backend="vllm", model_path=str(model_dir), dtype="bf16", compile=True,
                                     max_batch_size=a.concurrency, max_model_len=a.prompt_tokens + a.new_tokens,
                                     gpu_memory_utilization=a.gpu_memory_utilization, timeout_s=900,
                                     vllm_args={"load_format": "dummy", **extra}))
    try:
        timed(engine, prompts_for(8, a.prompt_tokens, seed=99), 16)  # warm-up
        prompts = prompts_for(a.concurrency, a.prompt_tokens)
        out = {"prefill_s": timed(engine, prompts, 1), "full_s": timed(engine, prompts, a.new_tokens)}
        out.update(_scheduler(getattr(engine.llm, "vllm_config", None)))
        return out
    finally:
        engine.close()


def one_way(a) -> None:
    """Child process: run ``a.way`` and print its JSON on the last line."""
    from benchmarks.generate import write_model_dir
    from launch.engine_env import apply_engine_env
    from megatron_darl.rollout.engines import EngineConfig

    apply_engine_env(EngineConfig(backend="vllm", model_path=str(a.work_dir)))
    model_dir = write_model_dir(a.work_dir / "1.7b", "1.7b", a.prompt_tokens + a.new_tokens)
    if a.way.startswith("raw"):
        out = _raw(a, model_dir, logprobs=a.way == "raw_logprobs")
    else:
        out = _adapter(a, model_dir, int(a.way.removeprefix("adapter_bt")) if "_bt" in a.way else None)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list among {', '.join(WAYS)}, adapter_bt<N>")
    p.add_argument("--timeout", type=float, default=360,
                   help="seconds per way (a first start on a machine compiles and captures CUDA graphs: minutes)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/darl_vllm_profile"))
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    p.add_argument("--way", default="", help=argparse.SUPPRESS)  # child process
    a = p.parse_args()
    if a.way:
        one_way(a)
        return
    rows, metrics = [], {}
    for way in [w for w in a.ways.split(",") if w]:
        cmd = [sys.executable, __file__, "--way", way, "--concurrency", str(a.concurrency), "--new-tokens",
               str(a.new_tokens), "--prompt-tokens", str(a.prompt_tokens), "--gpu-memory-utilization",
               str(a.gpu_memory_utilization), "--work-dir", str(a.work_dir)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{way}: failed (rc {proc.returncode})\n{(proc.stdout + proc.stderr)[-3000:]}", flush=True)
                continue
        except subprocess.TimeoutExpired as exc:  # say where it was: an engine start or a timed call
            tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                           for x in (exc.stdout, exc.stderr))
            print(f"{way}: timed out after {a.timeout:.0f} s\n{tail[-3000:]}", flush=True)
            continue
        r = json.loads(lines[-1].removeprefix("RESULT "))
        r["tokens_per_s"] = a.concurrency * a.new_tokens / r["full_s"]
        r["decode_ms_per_step"] = 1000 * (r["full_s"] - r["prefill_s"]) / max(1, a.new_tokens - 1)
        r["process_s"] = time.monotonic() - t0
        metrics[way] = r
        rows.append({"way": way, **r})
        print_table(rows[-1:])
    config = {"model": "1.7b", "dtype": "bfloat16", "concurrency": a.concurrency, "new_tokens": a.new_tokens,
              "prompt_tokens": a.prompt_tokens, "gpu_memory_utilization": a.gpu_memory_utilization}
    if metrics:
        print(write_result("vllm_profile", config, metrics, out_dir=a.out_dir))
        print_table(rows)


if __name__ == "__main__":
    main()

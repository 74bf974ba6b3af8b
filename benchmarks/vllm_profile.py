"""Benchmark ``vllm_profile``: is the gap between vLLM and the ``hf`` engine in our adapter or in vLLM?

``benchmarks/generate.py`` measured vLLM through ``VLLMEngine`` at 2.3-2.4x the ``hf`` engine
(target 3x). This runs the same generation (Qwen3-1.7B dummy weights, bf16, ``--concurrency``
prompts of ``--prompt-tokens``, exactly ``--new-tokens`` new tokens, temperature 1) in several
ways, each in a process of its own (one engine per process, so each gets the GPU to itself).
First answer (H100, 256 x 256, one call per measurement): vLLM alone 25.9k tokens/s without
log-probs, 17.6k with them; the adapter 15.6k, 17.3-20.3k with the offline scheduler defaults.

- ``raw``: vLLM's offline ``LLM.generate``, no log-probs: vLLM's own ceiling on this case;
- ``raw_logprobs``: the same with ``logprobs=0`` under ``logprobs_mode=processed_logprobs``
  (what the trainer needs): the cost of asking for the sampled tokens' log-probs;
- ``raw_logprobs_rawmode``: the same log-probs under ``logprobs_mode=raw_logprobs`` (of the
  logits before temperature): tells the cost of log-probs apart from that of processed ones;
- ``adapter``: ``VLLMEngine`` (AsyncLLM, one request per response, FINAL_ONLY outputs), as the
  rollout worker runs it; ``adapter_bt<N>`` the same with ``max_num_batched_tokens=N``;
- ``hf``: our ``hf`` engine (static cache + torch.compile, log-probs included) on the same case,
  so the ratio the issue's target is about comes from one record on one GPU (``over_hf``).

Each way times a prefill-only call (1 new token) and the full call after a warm-up, each
``--repeats`` times on prompts of its own; the median is reported and the spread as
``full_s_min`` / ``full_s_max`` (one 3-4 s call varied by up to 20 % between processes on an
H100). Decode ms per step = (full - prefill) / (new_tokens - 1); vLLM ways also report the
scheduler's ``max_num_batched_tokens`` and ``max_num_seqs`` as the engine resolved them.

    python benchmarks/vllm_profile.py --out-dir OUT          # GPU, vLLM installed
    python benchmarks/vllm_profile.py --ways hf --model tiny --concurrency 4 --new-tokens 8 \
        --prompt-tokens 8 --repeats 2 --out-dir /tmp/vp       # CPU check of the harness
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402

WAYS = ("raw", "raw_logprobs", "adapter", "hf")


def _scheduler(vllm_config) -> dict:
    sched = getattr(vllm_config, "scheduler_config", None)
    return {"max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            "max_num_seqs": getattr(sched, "max_num_seqs", None)}


def _measure(a, run) -> dict:
    """One full-size warm-up, then ``a.repeats`` prefill-only and full calls of ``run(prompts, new)``.

    Every call gets prompts of its own: vLLM's prefix cache would otherwise skip the prefill of a
    repeated prompt, which the ``hf`` engine (no prefix cache) cannot. The warm-up at the timed
    shape compiles the ``hf`` engine's decode and captures vLLM's graphs before any timing.
    """
    from benchmarks.generate import prompts_for

    calls = iter(range(1000, 2000))

    def once(new: int) -> float:
        return run(prompts_for(a.concurrency, a.prompt_tokens, seed=next(calls)), new)

    once(a.new_tokens)
    prefill = [once(1) for _ in range(a.repeats)]
    full = [once(a.new_tokens) for _ in range(a.repeats)]
    return {"prefill_s": statistics.median(prefill), "full_s": statistics.median(full),
            "full_s_min": min(full), "full_s_max": max(full)}


def _raw(a, model_dir: Path, logprobs_mode: str | None) -> dict:
    """vLLM's offline ``LLM``; ``logprobs_mode`` None asks for no log-probs."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), load_format="dummy", dtype="bfloat16", max_num_seqs=a.concurrency,
              max_model_len=a.prompt_tokens + a.new_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
              enable_prefix_caching=True, seed=0, logprobs_mode=logprobs_mode or "processed_logprobs")

    def run(prompts, new: int) -> float:
        params = SamplingParams(n=1, max_tokens=new, temperature=1.0, ignore_eos=True, detokenize=False,
                                logprobs=0 if logprobs_mode else None)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        assert all((o.outputs[0].logprobs is not None) == bool(logprobs_mode) for o in outs)
        return seconds

    return {**_measure(a, run), **_scheduler(llm.llm_engine.vllm_config)}


def _adapter(a, model_dir: Path, batched_tokens: int | None) -> dict:
    from benchmarks.generate import timed
    from megatron_darl.rollout.config import EngineConfig
    from megatron_darl.rollout.engines.vllm import VLLMEngine

    extra = {"max_num_batched_tokens": batched_tokens} if batched_tokens else {}
    engine = VLLMEngine(EngineConfig(backend="vllm", model_path=str(model_dir), dtype="bf16", compile=True,
                                     max_batch_size=a.concurrency, max_model_len=a.prompt_tokens + a.new_tokens,
                                     gpu_memory_utilization=a.gpu_memory_utilization, timeout_s=900,
                                     vllm_args={"load_format": "dummy", **extra}))
    try:
        out = _measure(a, lambda prompts, new: timed(engine, prompts, new))
        return {**out, **_scheduler(getattr(engine.llm, "vllm_config", None))}
    finally:
        engine.close()


def _hf(a) -> dict:
    """Our ``hf`` engine on the same case, as ``benchmarks/generate.py`` runs it (compiled on GPU)."""
    import torch

    from benchmarks.generate import timed
    from benchmarks.weight_sync import build_model
    from megatron_darl.rollout.config import EngineConfig
    from megatron_darl.rollout.engines.hf import HFEngine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(a.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.config.eos_token_id = None  # fixed-length generations
    engines = {}  # one engine per batch size: the static cache is sized to it

    def run(prompts, new: int) -> float:
        if len(prompts) not in engines:
            engines[len(prompts)] = HFEngine(EngineConfig(device=str(device), max_batch_size=len(prompts),
                                                          compile=device.type == "cuda"), model=model)
        return timed(engines[len(prompts)], prompts, new)

    return _measure(a, run)


def one_way(a) -> None:
    """Child process: run ``a.way`` and print its JSON on the last line."""
    if a.way == "hf":
        print("RESULT " + json.dumps(_hf(a)), flush=True)
        return
    from benchmarks.generate import write_model_dir
    from launch.engine_env import apply_engine_env
    from megatron_darl.rollout.config import EngineConfig

    apply_engine_env(EngineConfig(backend="vllm", model_path=str(a.work_dir)))
    model_dir = write_model_dir(a.work_dir / a.model, a.model, a.prompt_tokens + a.new_tokens)
    raw_modes = {"raw": None, "raw_logprobs": "processed_logprobs", "raw_logprobs_rawmode": "raw_logprobs"}
    if a.way in raw_modes:
        out = _raw(a, model_dir, raw_modes[a.way])
    elif a.way == "adapter" or a.way.startswith("adapter_bt"):
        out = _adapter(a, model_dir, int(a.way.removeprefix("adapter_bt")) if "_bt" in a.way else None)
    else:
        raise SystemExit(f"--ways: unknown way {a.way!r}")
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (the median is kept)")
    p.add_argument("--model", default="1.7b", help="a shape of benchmarks/weight_sync.py (tiny: a CPU check of hf)")
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
               str(a.gpu_memory_utilization), "--work-dir", str(a.work_dir), "--repeats", str(a.repeats),
               "--model", a.model]
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
        if "hf" in metrics:  # the ratio of the target, wherever both sides are in this record
            for m in metrics.values():
                m["over_hf"] = m["tokens_per_s"] / metrics["hf"]["tokens_per_s"]
        rows.append({"way": way, **r})
        print_table(rows[-1:])
    config = {"model": a.model, "dtype": "bfloat16", "repeats": a.repeats, "concurrency": a.concurrency, "new_tokens": a.new_tokens,
              "prompt_tokens": a.prompt_tokens, "gpu_memory_utilization": a.gpu_memory_utilization}
    if metrics:
        print(write_result("vllm_profile", config, metrics, out_dir=a.out_dir))
        print_table([{"way": way, **m} for way, m in metrics.items()])


if __name__ == "__main__":
    main()

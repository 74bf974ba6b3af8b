"""Benchmark ``generate``: ``vllm`` vs ``hf`` engine tokens/s on one GPU, and vLLM's weight update.

Random-init Qwen3-1.7B shapes in bf16 (vLLM: ``load_format=dummy`` on a config written here;
hf: transformers with static cache + torch.compile, as ``EngineConfig.compile`` runs it). Every
sequence generates exactly ``--new-tokens`` tokens (EOS ignored), one response per prompt, all
``concurrency`` sequences submitted at once; tokens/s = concurrency * new_tokens / seconds of a
timed call after a warm-up (vLLM: one short call after start; hf: the same call once, which
compiles). Record ``generate`` holds both engines per case (``c<concurrency>_t<new_tokens>``):
``vllm_tokens_per_s``, ``hf_tokens_per_s``, ``speedup`` (target >= 3).

Record ``vllm_weight_update``: HF-named bf16 tensors of the model (on this GPU, as the weight
sync delivers them) loaded into the running vLLM engine in place, pause to resume
(``VLLMEngine.load_weights``: CUDA-IPC hand-over, the model's own ``load_weights``, prefix-cache
reset); ``bound_seconds`` = one device-to-device copy of the same bytes in the same run (each
byte read and written once: what any in-place load must at least do).

    python benchmarks/generate.py --engines vllm,hf --out-dir OUT     # GPU (vLLM installed)
    python benchmarks/generate.py --engines hf --tiny                 # CPU smoke check of the hf part

``--budget-s`` starts no hf case that would not end within that many seconds of the start (an
estimate from the cases before; hf compiles each shape), and lists skipped cases in the record.
The two engines can run as two invocations (``gpu/vllm_run.sh`` does, each under its
own timeout): ``--engines vllm --partial FILE`` saves the vLLM cases, and ``--engines hf --merge
FILE`` writes the record with both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.record import print_table, write_result  # noqa: E402
from benchmarks.weight_sync import SHAPES, build_model, export  # noqa: E402
from megatron_darl.rollout.config import EngineConfig, SamplingConfig  # noqa: E402
from megatron_darl.rollout.engines.hf import HFEngine  # noqa: E402

PROMPT_VOCAB = 100  # prompt ids are drawn below this (the written tokenizer's size); outputs use the full vocab


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts_for(concurrency: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, PROMPT_VOCAB, (prompt_tokens,), generator=gen).tolist() for _ in range(concurrency)]


def timed(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds of one ``generate`` of one fixed-length response per prompt."""
    sampling = SamplingConfig(n=1, max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    _sync()
    seconds = time.perf_counter() - t0
    assert all(g[0].token_ids.numel() == new_tokens == g[0].logprobs.numel() for g in out)
    return seconds


def write_model_dir(path: Path, size: str, max_len: int) -> Path:
    """config.json of a Qwen3 shape plus a small tokenizer: enough for vLLM's dummy weights."""
    import transformers

    from megatron_darl.data.builtin import build_builtin_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_builtin_tokenizer(path)
    cfg = transformers.Qwen3Config(**SHAPES[size], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   tie_word_embeddings=True, max_position_embeddings=max_len,
                                   torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"])
    cfg.save_pretrained(str(path))
    return path


def vllm_engine(model_dir: Path, max_seqs: int, max_len: int, util: float, compile_: bool):
    from megatron_darl.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(EngineConfig(backend="vllm", model_path=str(model_dir), dtype="bf16", compile=compile_,
                                   max_batch_size=max_seqs, max_model_len=max_len, gpu_memory_utilization=util,
                                   timeout_s=900, vllm_args={"load_format": "dummy"}))


def copy_bound(nbytes: int, repeats: int = 5) -> float:
    """Seconds of one device-to-device copy of ``nbytes`` (best of ``repeats``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return best


def update_seconds(engine, named: list[tuple[str, torch.Tensor]], repeats: int = 3) -> float:
    """Best of ``repeats`` in-place loads of ``named`` into the running engine, pause to resume."""
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        engine.pause(interrupt=False)
        engine.load_weights(named)
        engine.resume(engine.version + 1)
        best = min(best, time.perf_counter() - t0)
    return best


def run_vllm(a, work: Path, make_model) -> tuple[dict, dict]:
    """Throughput cases and the 1.7B weight update on one engine, then the 4B update.

    The engine starts before this process touches CUDA (``make_model`` builds the HF model
    after), so vLLM can fork its engine process instead of spawning it.
    """
    max_len = a.prompt_tokens + max(a.new_tokens)
    engine = vllm_engine(write_model_dir(work / a.model, a.model, max_len), max(a.concurrency), max_len,
                         a.gpu_memory_utilization, compile_=True)
    tput, updates = {}, {}
    try:
        hf_model = make_model()
        timed(engine, prompts_for(8, a.prompt_tokens, seed=99), min(16, max(a.new_tokens)))  # warm-up
        for new in a.new_tokens:
            for conc in a.concurrency:
                seconds = timed(engine, prompts_for(conc, a.prompt_tokens), new)
                tput[f"c{conc}_t{new}"] = {"vllm_tokens_per_s": conc * new / seconds, "vllm_seconds": seconds}
                print(f"vllm c{conc} t{new}: {conc * new / seconds:.0f} tokens/s", flush=True)
        named = export(hf_model)
        updates[a.model] = _update_case(engine, named)
    finally:
        engine.close()
    if a.update_4b:
        model4 = build_model("4b", torch.device("cuda"), torch.bfloat16)
        engine = vllm_engine(write_model_dir(work / "4b", "4b", 1024), 8, 1024, 0.4, compile_=False)
        try:
            updates["4b"] = _update_case(engine, export(model4))
        finally:
            engine.close()
            del model4
            torch.cuda.empty_cache()
    return tput, updates


def _update_case(engine, named) -> dict:
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    seconds, bound = update_seconds(engine, named), copy_bound(nbytes)
    print(f"weight update {nbytes / 2**30:.2f} GiB: {seconds:.3f} s (bound {bound:.4f} s)", flush=True)
    return {"seconds": seconds, "bound_seconds": bound, "ratio_to_bound": seconds / bound, "bytes": nbytes}


def run_hf(a, model, device: torch.device, deadline: float) -> tuple[dict, list[str]]:
    """hf tokens/s per case (warm-up call that compiles, then the timed call), cheapest first,
    each only if it is estimated to end before ``deadline``."""
    out, skipped, tps, compile_s = {}, [], 0.0, 60.0
    cases = sorted(((c, n) for n in a.new_tokens for c in a.concurrency), key=lambda cn: cn[0] * cn[1])
    for conc, new in cases:
        estimate = compile_s + 2 * conc * new / max(tps, 1000.0)
        if time.monotonic() + estimate > deadline:
            skipped.append(f"c{conc}_t{new}")
            continue
        t0 = time.monotonic()
        engine = HFEngine(EngineConfig(device=str(device), max_batch_size=conc, compile=not a.no_compile), model=model)
        prompts = prompts_for(conc, a.prompt_tokens)
        timed(engine, prompts, new)  # warm-up (compiles on GPU)
        seconds = timed(engine, prompts, new)
        tps = max(tps, conc * new / seconds)
        compile_s = max(10.0, time.monotonic() - t0 - 2 * seconds)
        out[f"c{conc}_t{new}"] = {"hf_tokens_per_s": conc * new / seconds, "hf_seconds": seconds}
        print(f"hf c{conc} t{new}: {conc * new / seconds:.0f} tokens/s", flush=True)
    return out, skipped


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="vllm,hf", help="comma list of vllm, hf")
    p.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    p.add_argument("--no-update-4b", dest="update_4b", action="store_false", help="skip the 4B weight update")
    p.add_argument("--no-compile", action="store_true", help="hf without static cache + torch.compile")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no hf case after this many seconds")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/darl_generate_bench"))
    p.add_argument("--partial", type=Path, default=None, help="save the vLLM cases here (JSON)")
    p.add_argument("--merge", type=Path, default=None, help="vLLM cases saved by --partial, for one record")
    p.add_argument("--out-dir", type=Path, default=None, help="results dir (default benchmarks/results)")
    p.add_argument("--tiny", action="store_true", help="tiny model, hf only, on CPU (smoke check)")
    a = p.parse_args()
    if a.tiny:
        a.model, a.concurrency, a.prompt_tokens, a.new_tokens, a.engines = "tiny", [4, 8], 16, [16], "hf"
    a.engines = [e for e in a.engines.split(",") if e]
    if set(a.engines) - {"vllm", "hf"}:
        p.error(f"--engines: unknown {sorted(set(a.engines) - {'vllm', 'hf'})}")
    return a


def main() -> None:
    a = _parse()
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    built = []

    def make_model():
        if not built:
            built.append(build_model(a.model, device, dtype))
            built[0].config.eos_token_id = None  # fixed-length generations: tokens/s is well defined
        return built[0]

    cases: dict[str, dict] = {}
    updates: dict[str, dict] = {}
    skipped: list[str] = []
    if a.merge is not None:
        for k, v in json.loads(a.merge.read_text()).items():
            cases.setdefault(k, {}).update(v)
    if "vllm" in a.engines:
        from launch.engine_env import apply_engine_env

        apply_engine_env(EngineConfig(backend="vllm", model_path=str(a.work_dir)))
        tput, updates = run_vllm(a, a.work_dir, make_model)
        for k, v in tput.items():
            cases.setdefault(k, {}).update(v)
        if a.partial is not None:
            a.partial.write_text(json.dumps(tput))
    if "hf" in a.engines:
        tput, skipped = run_hf(a, make_model(), device, start + a.budget_s)
        for k, v in tput.items():
            cases.setdefault(k, {}).update(v)
    for v in cases.values():
        if "vllm_tokens_per_s" in v and "hf_tokens_per_s" in v:
            v["speedup"] = v["vllm_tokens_per_s"] / v["hf_tokens_per_s"]
    engines = sorted({e for v in cases.values() for e in ("vllm", "hf") if f"{e}_tokens_per_s" in v})
    config = {"model": a.model, "prompt_tokens": a.prompt_tokens, "dtype": str(dtype).removeprefix("torch."),
              "engines": engines, "hf_compile": device.type == "cuda" and not a.no_compile, "hf_skipped": skipped}
    write_result("generate", config, cases, out_dir=a.out_dir)
    if updates:
        write_result("vllm_weight_update", {"dtype": "bfloat16", "transfer": "ipc"}, updates, out_dir=a.out_dir)
    print_table([{"case": k, **v} for k, v in cases.items()])
    if updates:
        print_table([{"model": k, **v} for k, v in updates.items()])
    print(json.dumps({"generate": cases, "vllm_weight_update": updates, "hf_skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()

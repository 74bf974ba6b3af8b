"""Evaluate an HF or Megatron checkpoint on the reasoning and code benchmarks.

    python tools/eval.py --model DIR --benchmarks gsm8k,math500,aime24,aime25,humaneval,livecodebench --n 16

Writes ``results.json``, ``results.md`` and one ``samples_<benchmark>.jsonl`` per benchmark to
``--out-dir``. Benchmark files are found under ``--benchmark-dir`` (default
``$DARL_BENCHMARK_DIR``, else ``data/benchmarks`` under the repo, which
``python tools/prepare_data.py gsm8k math500 aime24 humaneval`` fills, else a shared copy at
``<repo>/../shared/data/benchmarks``) at the paths in ``configs/eval/benchmarks.yaml``, or at
``--<name>-path``. ``--limit`` takes the first N prompts of each benchmark, or a fraction of them
(``--limit 0.1``); a bar per benchmark shows the prompts done. A Megatron checkpoint (a directory
with ``megatron_darl.json``: a training checkpoint ``runs/<run>/checkpoints/step_NNNNNN`` or a
converted one) is converted to a temporary HF directory first, with the tokenizer it carries.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

from megatron_darl.data.loaders import load_records
from megatron_darl.data.locations import benchmark_home
from megatron_darl.checkpoint.hf_dir import resolve_hf_dir
from megatron_darl.eval.benchmarks import load_benchmark_table, resolve_benchmark
from megatron_darl.eval.harness import evaluate_benchmark, markdown_table, write_results
from megatron_darl.eval.config import EvalConfig, check_limit
from megatron_darl.rewards import CodeRewardConfig, MathRewardConfig, RewardConfig, reference_check
from megatron_darl.rollout.config import EngineConfig
from megatron_darl.rollout.engines import build_engine

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "configs" / "eval" / "benchmarks.yaml"
DATA_PRESETS = REPO / "configs" / "data"
CONVERTER = REPO / "tools" / "convert_megatron_to_hf.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    table = load_benchmark_table(TABLE)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model dir, or a Megatron checkpoint (runs/<run>/checkpoints/step_N)")
    p.add_argument("--benchmarks", default="gsm8k,math500,aime24", help=f"comma list of {','.join(table)}")
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--k", default="", help="comma list of pass@k values (default: powers of 2 and n)")
    p.add_argument("--out-dir", default="outputs/eval", help="where results go")
    p.add_argument("--benchmark-dir", default=str(benchmark_home(os.environ.get("DARL_BENCHMARK_DIR"))),
                   help="directory of the benchmark files (default: %(default)s)")
    for name in table:
        p.add_argument(f"--{name}-path", default="", help=f"{name} file (overrides --benchmark-dir)")
    p.add_argument("--limit", type=limit_arg, default=-1,
                   help="first N prompts per benchmark, or a fraction of them (0.1); -1: all")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-prompts", type=int, default=8, help="prompts per generate call")
    p.add_argument("--math-answer-pattern", action="append", default=[],
                   help="regex whose group 1 is the final answer (LightEval style); repeatable, tried first")
    p.add_argument("--stdio-scoring", choices=["all", "fraction"], default="all")
    p.add_argument("--enable-thinking", choices=["default", "on", "off"], default="default")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences the engine generates at once")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm only")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true", help="the libraries' notices and deprecations too")
    return p.parse_args(argv)


def limit_arg(text: str) -> float:
    """``--limit``: a count N >= 1, a fraction in (0, 1), or -1 (all)."""
    try:
        value = float(text)
        check_limit(value, "--limit")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc) if "--limit" in str(exc) else f"--limit {text!r}: not a number")
    return value


def eval_config(args: argparse.Namespace) -> EvalConfig:
    reward = RewardConfig(math=MathRewardConfig(answer_patterns=list(args.math_answer_pattern)),
                          code=CodeRewardConfig(stdio_scoring=args.stdio_scoring))
    thinking = {"default": None, "on": True, "off": False}[args.enable_thinking]
    return EvalConfig(
        n=args.n, ks=[int(k) for k in args.k.split(",") if k], temperature=args.temperature,
        top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
        batch_prompts=args.batch_prompts, limit=args.limit, enable_thinking=thinking,
        reward=reward, progress=not args.no_progress,
    )


def resolve_datasets(args: argparse.Namespace) -> dict:
    """{name: DataConfig}; fails on unknown names and missing files before any model is loaded."""
    table = load_benchmark_table(TABLE)
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in names if b not in table]
    if unknown:
        raise ValueError(f"--benchmarks: unknown {unknown}; known: {sorted(table)}")
    return {
        name: resolve_benchmark(name, table[name], DATA_PRESETS, Path(args.benchmark_dir),
                                getattr(args, f"{name}_path"))
        for name in names
    }


def run(args: argparse.Namespace) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    cfg = eval_config(args)
    datasets = resolve_datasets(args)
    out_dir = Path(args.out_dir)
    with tempfile.TemporaryDirectory(prefix="darl_eval_") as tmp:
        model_dir = resolve_hf_dir(args.model, tmp, CONVERTER)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        engine = build_engine(EngineConfig(
            backend=args.backend, model_path=str(model_dir), dtype=args.dtype, device=args.device,
            max_batch_size=args.max_batch_size, tensor_parallel_size=args.tensor_parallel_size,
        ))
        try:
            results = []
            for name, data_cfg in datasets.items():
                loaded = load_records(data_cfg, reference_check(data_cfg.task))
                if loaded.skipped:
                    print(f"[eval] {name}: skipped {loaded.skipped} malformed rows", file=sys.stderr)
                results.append(evaluate_benchmark(name, loaded.records, engine, tokenizer, cfg,
                                                  out_dir / f"samples_{name}.jsonl"))
        finally:
            engine.close()
    meta = {"model": str(args.model), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "backend": args.backend, "n": cfg.n, "temperature": cfg.temperature, "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "files": {name: d.path for name, d in datasets.items()}}
    paths = write_results(results, out_dir, meta)
    print(markdown_table(results))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        from megatron_darl.quiet import quiet_libraries

        quiet_libraries()
    try:
        json_path, md_path = run(args)
    except (FileNotFoundError, ValueError) as exc:  # user mistakes: say what, no traceback
        print(f"[eval] error: {exc}", file=sys.stderr)
        return 2
    print(f"[eval] wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

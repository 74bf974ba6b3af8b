"""Benchmark evaluation: sample n responses per prompt, score them, report avg@n and pass@k.

The harness talks to generation only through the engine contract
(``megatron_darl.rollout.engines.base.Engine``): chat-templated prompt token ids in, ``n``
``Generation``s per prompt out. Scores come from the reward registry under each record's task,
so the harness has no per-benchmark code. Results are written as one JSON file and one markdown
table, plus a jsonl of every sample for inspection.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from megatron_darl.data.records import PromptRecord
from megatron_darl.data.templates import encode_prompt
from megatron_darl.eval.config import EvalConfig, check_limit
from megatron_darl.eval.metrics import avg_at_n, default_ks, mean_pass_at_k
from megatron_darl.rewards.registry import THREAD_SAFE_TASKS, Task, get_reward_fn
from megatron_darl.rollout.config import SamplingConfig
from megatron_darl.rollout.engines.base import Engine


def take_limit(records: list, limit: float) -> list:
    """The first ``limit`` records: a count, or a fraction of them (rounded up: at least one)."""
    check_limit(limit)
    if limit == -1:
        return records
    count = int(limit) if limit >= 1 else math.ceil(limit * len(records))
    return records[:count]


@dataclass
class BenchmarkResult:
    """Scores of one benchmark."""

    benchmark: str  # benchmark name
    task: str  # reward task of its records
    num_prompts: int  # prompts evaluated
    n: int  # samples per prompt
    avg_at_n: float  # mean reward over all samples
    pass_at_k: dict[str, float]  # {"pass@k": value}
    mean_response_tokens: float  # average generated length
    truncated_fraction: float  # share of samples that hit max_new_tokens
    seconds: float  # wall-clock time of generation and scoring


def sampling_config(cfg: EvalConfig) -> SamplingConfig:
    """The engine's sampling settings for this evaluation."""
    return SamplingConfig(n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, seed=cfg.seed)


def _score_all(records: list[PromptRecord], texts: list[list[str]], cfg: EvalConfig) -> list[list[float]]:
    pairs = [(r, t) for r, ts in zip(records, texts) for t in ts]
    fns = {task: get_reward_fn(task, cfg.reward) for task in {r.task for r in records}}
    threaded = cfg.score_workers > 1 and all(Task(r.task) in THREAD_SAFE_TASKS for r in records)
    if threaded:
        with ThreadPoolExecutor(cfg.score_workers) as pool:
            flat = list(pool.map(lambda p: fns[p[0].task](*p), pairs))
    else:
        flat = [fns[r.task](r, t) for r, t in pairs]
    return [flat[i * cfg.n : (i + 1) * cfg.n] for i in range(len(records))]


def evaluate_benchmark(
    name: str, records: list[PromptRecord], engine: Engine, tokenizer, cfg: EvalConfig,
    samples_path: Path | None = None,
) -> BenchmarkResult:
    """Generate ``cfg.n`` responses for every record, score them and aggregate."""
    records = take_limit(records, cfg.limit)
    if not records:
        raise ValueError(f"benchmark {name}: no prompts to evaluate")
    start = time.monotonic()
    sampling = sampling_config(cfg)
    texts: list[list[str]] = []
    lengths: list[int] = []
    truncated = 0
    bar = tqdm(total=len(records), desc=name, unit="prompt", disable=not cfg.progress)
    for lo in range(0, len(records), cfg.batch_prompts):
        batch = records[lo : lo + cfg.batch_prompts]
        prompts = [encode_prompt(tokenizer, r.messages, cfg.enable_thinking) for r in batch]
        for gens in engine.generate(prompts, sampling):
            if len(gens) != cfg.n:
                raise RuntimeError(f"engine returned {len(gens)} generations for a prompt, expected {cfg.n}")
            texts.append([tokenizer.decode(g.token_ids.tolist(), skip_special_tokens=True) for g in gens])
            lengths += [int(g.token_ids.numel()) for g in gens]
            truncated += sum(g.finish_reason == "length" for g in gens)
        bar.update(len(batch))
    bar.close()
    rewards = _score_all(records, texts, cfg)
    if samples_path is not None:
        _write_samples(samples_path, records, texts, rewards)
    correct = [sum(1 for r in rs if r >= 1.0) for rs in rewards]
    ks = cfg.ks or default_ks(cfg.n)
    return BenchmarkResult(
        benchmark=name, task=records[0].task, num_prompts=len(records), n=cfg.n,
        avg_at_n=avg_at_n(rewards),
        pass_at_k={f"pass@{k}": mean_pass_at_k(correct, cfg.n, k) for k in ks},
        mean_response_tokens=sum(lengths) / len(lengths),
        truncated_fraction=truncated / len(lengths),
        seconds=time.monotonic() - start,
    )


def _write_samples(path: Path, records: list[PromptRecord], texts, rewards) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record, responses, scores in zip(records, texts, rewards):
            row = {"prompt_id": record.prompt_id, "source_id": record.metadata.get("source_id"),
                   "responses": responses, "rewards": scores}
            f.write(json.dumps(row, default=str) + "\n")


def markdown_table(results: list[BenchmarkResult]) -> str:
    """One row per benchmark: prompts, n, avg@n, every pass@k, mean length."""
    ks = sorted({k for r in results for k in r.pass_at_k}, key=lambda s: int(s.split("@")[1]))
    head = ["benchmark", "prompts", "n", "avg@n", *ks, "mean tokens", "truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r.benchmark, str(r.num_prompts), str(r.n), f"{100 * r.avg_at_n:.2f}",
                 *(f"{100 * r.pass_at_k[k]:.2f}" if k in r.pass_at_k else "-" for k in ks),
                 f"{r.mean_response_tokens:.1f}", f"{100 * r.truncated_fraction:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(results: list[BenchmarkResult], out_dir: str | Path, meta: dict) -> tuple[Path, Path]:
    """Write ``results.json`` (meta + per-benchmark numbers) and ``results.md``; return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    payload = {**meta, "results": {r.benchmark: asdict(r) for r in results}}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    title = f"# Evaluation of {meta.get('model', '?')}\n\nScores in percent.\n\n"
    md_path.write_text(title + markdown_table(results), encoding="utf-8")
    return json_path, md_path

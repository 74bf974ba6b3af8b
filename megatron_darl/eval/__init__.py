"""Benchmark evaluation: avg@n and unbiased pass@k over the rollout engine backends."""

from megatron_darl.eval.benchmarks import load_benchmark_table, resolve_benchmark
from megatron_darl.checkpoint.hf_dir import is_megatron_checkpoint, resolve_hf_dir
from megatron_darl.eval.harness import BenchmarkResult, evaluate_benchmark, markdown_table, write_results
from megatron_darl.eval.metrics import avg_at_n, default_ks, mean_pass_at_k, pass_at_k

__all__ = [
    "BenchmarkResult",
    "avg_at_n",
    "default_ks",
    "evaluate_benchmark",
    "is_megatron_checkpoint",
    "load_benchmark_table",
    "markdown_table",
    "mean_pass_at_k",
    "pass_at_k",
    "resolve_benchmark",
    "resolve_hf_dir",
    "write_results",
]

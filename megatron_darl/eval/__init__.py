"""Benchmark evaluation: avg@n and unbiased pass@k over the rollout engine backends."""

"""Prompt datasets (jsonl/parquet), chat templates and the built-in synthetic task."""

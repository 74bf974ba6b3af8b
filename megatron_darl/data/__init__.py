"""Prompt datasets (jsonl/parquet), chat templates and the built-in synthetic task."""

from megatron_darl.data.builtin import (
    build_builtin_tokenizer,
    builtin_prompts,
    builtin_records,
    reference_solution,
)
from megatron_darl.data.config import (
    BuiltinTaskConfig,
    DataConfig,
    FieldMapConfig,
    TemplateConfig,
    load_data_config,
)
from megatron_darl.data.loaders import LoadResult, MalformedRowError, load_dataset, load_records
from megatron_darl.data.records import PromptRecord
from megatron_darl.data.templates import encode_prompt, render_prompt


__all__ = [
    "BuiltinTaskConfig",
    "DataConfig",
    "FieldMapConfig",
    "LoadResult",
    "MalformedRowError",
    "PromptRecord",
    "TemplateConfig",
    "build_builtin_tokenizer",
    "builtin_prompts",
    "builtin_records",
    "encode_prompt",
    "load_data_config",
    "load_dataset",
    "load_records",
    "reference_solution",
    "render_prompt",
]

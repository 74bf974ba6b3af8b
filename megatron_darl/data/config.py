"""Typed dataset configuration: which file, which columns, which template, which reward.

One ``DataConfig`` per ``configs/data/*.yaml``. The YAML files are presets composed by Hydra
(or read by ``load_data_config``); library code only ever sees the dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from megatron_darl.data.locations import register_resolver



GENERATED_TASKS = ("builtin", "countdown")  # tasks ``source: builtin`` can generate
OVERLONG = ("refuse", "drop")  # data.overlong_prompts


OPERATOR_SYMBOLS = "+-*"  # what a countdown chain may use (data/countdown.py OPERATORS)
SPLITS = ("train", "test")
ORDERS = ("left", "any")  # chains combine the numbers left to right, or any two available


@dataclass
class CountdownTaskConfig:
    """Difficulty and size of the generated countdown problems (``configs/data/countdown*.yaml``)."""

    num_prompts: int = 4096  # problems generated (independent draws of the split)
    seed: int = 0  # generator seed (same seed and knobs, same problems)
    split: str = "train"  # "train" or "test" (held out by a hash of the problem)
    test_fraction: float = 0.1  # share of all problems that belong to the test split
    min_numbers: int = 3  # fewest numbers in a problem
    max_numbers: int = 4  # most numbers in a problem
    max_value: int = 9  # numbers are drawn from 1..max_value
    max_target: int = 100  # targets lie in 1..max_target
    operators: str = "+-*"  # operations a chain may use
    order: str = "any"  # "left": targets come from left-to-right chains (choose the operators);
    # "any": from chains over any pair order (the full countdown search)
    valid_chain_reward: float = 0.0  # reward of a valid chain that misses the target (partial credit)

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise ValueError(f"countdown: need 2 <= min_numbers ({self.min_numbers}) <= "
                             f"max_numbers ({self.max_numbers})")
        if self.max_value < 1 or self.max_target < 1:
            raise ValueError(f"countdown: max_value={self.max_value} and max_target="
                             f"{self.max_target} must be >= 1")
        if not self.operators or any(op not in OPERATOR_SYMBOLS for op in self.operators):
            raise ValueError(f"countdown: operators={self.operators!r}; choose from {OPERATOR_SYMBOLS}")
        if self.order not in ORDERS:
            raise ValueError(f"countdown: order={self.order!r}; use one of {ORDERS}")
        if self.split not in SPLITS:
            raise ValueError(f"countdown: split={self.split!r}; use one of {SPLITS}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"countdown: test_fraction={self.test_fraction} must be in (0, 1)")
        if self.num_prompts < 1:
            raise ValueError(f"countdown: num_prompts={self.num_prompts} must be >= 1")
        if not 0.0 <= self.valid_chain_reward < 1.0:
            raise ValueError(f"countdown: valid_chain_reward={self.valid_chain_reward} must be in [0, 1)")


@dataclass
class FieldMapConfig:
    """Which column of a row holds which part of a ``PromptRecord``."""

    prompt: str = "question"  # problem text
    reference: str = ""  # reference answer / test code; "" = none
    id: str = ""  # source id kept in metadata["source_id"]; "" = row index
    tests: str = ""  # stdio test cases (list or JSON string); "" = none
    extra_tests: str = ""  # a second test column appended to `tests` (LiveCodeBench private)
    metadata: list[str] = field(default_factory=list)  # further columns copied to metadata


@dataclass
class TemplateConfig:
    """How the problem text becomes chat messages."""

    system: str = ""  # system message; "" = none
    user: str = "{prompt}"  # user message; {prompt} and any metadata column are substituted


@dataclass
class BuiltinTaskConfig:
    """The procedurally generated arithmetic task (``megatron_darl.data.builtin``)."""

    num_prompts: int = 4096  # prompts generated
    seed: int = 0  # generator seed (same seed, same prompts)
    min_operands: int = 2  # fewest numbers in an expression
    max_operands: int = 3  # most numbers in an expression
    max_value: int = 9  # operands are drawn from 0..max_value
    operators: str = "+-"  # operator characters drawn from


@dataclass
class DataConfig:
    """One prompt dataset."""

    name: str = "builtin"  # dataset name (logs, result tables)
    task: str = "builtin"  # reward registry key; with source "builtin" also the generator (builtin, countdown)
    source: str = "builtin"  # "builtin" (generated) or "file" (jsonl, jsonl.gz or parquet at path)
    path: str = ""  # dataset file when source is "file"
    fields: FieldMapConfig = field(default_factory=FieldMapConfig)  # column mapping
    template: TemplateConfig = field(default_factory=TemplateConfig)  # message construction
    builtin: BuiltinTaskConfig = field(default_factory=BuiltinTaskConfig)  # generator settings
    countdown: CountdownTaskConfig = field(default_factory=CountdownTaskConfig)  # task countdown
    skip_malformed: bool = False  # skip and count bad rows instead of raising
    max_records: int = -1  # keep the first N records; -1 = all
    tests_format: str = "list"  # "list" (cases as stored) or "livecodebench" (JSON/compressed)
    # a prompt leaving no room for sampling.max_new_tokens in the context: "refuse" (the launcher
    # stops naming its file and line) or "drop" (skipped, counted and logged by launcher and workers)
    overlong_prompts: str = "refuse"

    def __post_init__(self) -> None:
        if self.source not in ("builtin", "file"):
            raise ValueError(f"data.source={self.source!r}: use 'builtin' or 'file'")
        if self.source == "builtin" and self.task not in GENERATED_TASKS:
            raise ValueError(f"data.task={self.task!r} with source 'builtin': the generated tasks "
                             f"are {', '.join(GENERATED_TASKS)}")
        if self.tests_format not in ("list", "livecodebench"):
            raise ValueError(f"data.tests_format={self.tests_format!r}: use 'list' or 'livecodebench'")
        if self.overlong_prompts not in OVERLONG:
            raise ValueError(f"data.overlong_prompts={self.overlong_prompts!r}: use one of {OVERLONG}")


def load_data_config(preset: str | Path, overrides: dict | None = None) -> DataConfig:
    """Read a ``configs/data/*.yaml`` preset into a ``DataConfig`` (``overrides`` win)."""
    preset = Path(preset)
    if not preset.is_file():
        raise FileNotFoundError(f"data config {preset} does not exist")
    register_resolver()  # ${benchmark_home:} in the benchmark presets
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(preset), overrides or {})
    return OmegaConf.to_object(merged)

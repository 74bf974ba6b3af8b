"""``PromptRecord``: one prompt of a dataset, in the same shape whatever file it came from.

Loaders map each dataset's own columns onto it (``configs/data/*.yaml``), the rollout worker
turns its messages into token ids, and the reward registry scores responses against its
reference or tests, so neither needs to know which benchmark a prompt came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptRecord:
    """One prompt with what is needed to score a response to it."""

    prompt_id: int  # position in its source (row index); SampleGroup.prompt_id
    prompt: str  # the problem text as stored (before any template)
    messages: list[dict[str, str]]  # chat messages ({"role", "content"}) the model is shown
    task: str  # reward registry key: math, gsm8k, humaneval, stdio, builtin
    reference: str = ""  # reference answer as stored (math/builtin) or test code (humaneval)
    tests: list[dict[str, str]] = field(default_factory=list)  # stdio cases {"input","output"}
    metadata: dict = field(default_factory=dict)  # source id, entry point, level, ...
    source: str = field(default="", compare=False)  # "file:line" (row for parquet); "" if generated

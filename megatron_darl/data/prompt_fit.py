"""Which prompts fit the context: one rule for the launcher's check and the rollout workers.

A prompt of P tokens is generated to at most ``sampling.max_new_tokens`` more, and the whole
sequence must fit the smallest of the policy's ``max_position_embeddings``, the trainer's
``trainer.micro_batch.max_seq_len`` and (when set) the engine's ``engine.max_model_len``. A
prompt past that budget must never reach the engine: one 1 MB prompt drives a worker to
21.7 GB and the host's OOM killer after 171 s, and a prompt longer than the context would train
silently. With ``data.overlong_prompts: refuse`` (the default) the launcher stops before any
process starts, naming the file and line; with ``drop`` such prompts are skipped by the launcher
and by every worker alike (same tokenizer, same template, same budget), counted and logged.

The launcher counts through ``prompt_tokenizer``: a policy whose tokenizer is a plain
``tokenizer.json`` with no chat template (the built-in tasks' tokenizer) is read with
``tokenizers`` alone, the library HF's fast tokenizer encodes with, since importing
``transformers`` costs the launch seconds (it imports torch) before any process starts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from megatron_darl.data.templates import encode_prompt

log = logging.getLogger(__name__)


@dataclass
class PromptFit:
    """The prompts that fit the budget, token ids included, and what was dropped."""

    records: list[Any]  # data.PromptRecord, in dataset order
    token_ids: list[list[int]]  # chat-templated prompt ids of each kept record
    budget: int  # most prompt tokens allowed
    dropped: list[str] = field(default_factory=list)  # "where (n tokens)" of each dropped prompt


_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # HF's wrappers of a tokenizer.json


class FileTokenizer:
    """A ``tokenizer.json`` without a chat template, encoded as HF's fast tokenizer encodes it (its
    post-processor adds the special tokens)."""

    chat_template = None

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}


def prompt_tokenizer(model_dir: str | Path):
    """The tokenizer to count ``model_dir``'s prompts with: a ``FileTokenizer`` when its
    ``tokenizer_config.json`` names a plain fast tokenizer with no chat template and no BOS/EOS
    switches of its own, else ``transformers.AutoTokenizer``."""
    root = Path(model_dir)
    config = root / "tokenizer_config.json"
    if ((root / "tokenizer.json").is_file() and config.is_file()
            and not any((root / name).exists() for name in ("chat_template.jinja", "chat_template.json"))):
        settings = json.loads(config.read_text())
        if (settings.get("tokenizer_class") in _PLAIN_CLASSES and not settings.get("chat_template")
                and not {"add_bos_token", "add_eos_token"} & set(settings)):
            return FileTokenizer(root / "tokenizer.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def prompt_budget(cfg, max_position_embeddings: int) -> tuple[int, str]:
    """Most prompt tokens a run allows, and the sum it comes from (for messages)."""
    limits = [(max_position_embeddings, "the model's max_position_embeddings"),
              (cfg.trainer.micro_batch.max_seq_len, "trainer.micro_batch.max_seq_len")]
    if cfg.engine.max_model_len > 0:
        limits.append((cfg.engine.max_model_len, "engine.max_model_len"))
    context, name = min(limits)
    new = cfg.sampling.max_new_tokens
    return context - new, f"{name}={context} - sampling.max_new_tokens={new}"


def where(record, data_name: str) -> str:
    return record.source or f"data {data_name} prompt {record.prompt_id}"


def fit_prompts(cfg, records: Sequence[Any], tokenizer, max_position_embeddings: int) -> PromptFit:
    """Tokenize ``records`` and apply ``data.overlong_prompts`` to those past the budget.

    Raises:
        ValueError: naming the first over-long prompt's file and line, its length and the
            budget (``refuse``).
    """
    budget, rule = prompt_budget(cfg, max_position_embeddings)
    fit = PromptFit([], [], budget)
    for record in records:
        ids = encode_prompt(tokenizer, record.messages)
        if len(ids) <= budget:
            fit.records.append(record)
            fit.token_ids.append(ids)
            continue
        if cfg.data.overlong_prompts != "drop":
            raise ValueError(f"{where(record, cfg.data.name)}: prompt of {len(ids)} tokens is longer than the "
                             f"{budget} a prompt may have ({rule}); shorten or remove it, or set "
                             "data.overlong_prompts=drop to skip such prompts (counted and logged)")
        fit.dropped.append(f"{where(record, cfg.data.name)} ({len(ids)} tokens)")
    if fit.dropped:
        log.warning("data.overlong_prompts=drop: %d prompt(s) longer than %d tokens (%s) dropped, first %s",
                    len(fit.dropped), budget, rule, fit.dropped[0])
    return fit

"""The built-in task: seeded multi-step arithmetic that a ~1-5M parameter model learns on a CPU.

The embedded default (``python -m launch.train`` with no cluster, no GPU and no downloads)
needs a task whose reward visibly rises within minutes. Short expressions of 2-3 small operands
(``8+7-5=``) are verifiable exactly, cost nothing to generate and come with a step-by-step
reference solution for a supervised warm start::

    prompt:    8+7-5=
    solution:  8+7=15
               15-5=10
               answer: 10

The reward is exact match on the integer after the last ``answer:`` in the response
(``megatron_darl.rewards.builtin_answer``, with the other verifiers). The task
ships its own tokenizer: one token per printable ASCII character plus newline, and the special
tokens ``<pad> <bos> <eos> <unk>``, built locally with ``tokenizers`` and saved as a
``PreTrainedTokenizerFast`` directory (``AutoTokenizer.from_pretrained`` loads it). It has no
chat template, so prompts go through the plain fallback of ``data.templates`` and stay short
(at most 1 + 3*2 + 2 + 1 = 10 tokens with the defaults).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from pathlib import Path

from megatron_darl.data.config import BuiltinTaskConfig
from megatron_darl.data.records import PromptRecord

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3, in this order
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticProblem:
    """One expression, evaluated left to right (no precedence: every step is shown anyway)."""

    operands: tuple[int, ...]  # the numbers, in order
    operators: tuple[str, ...]  # one fewer than operands

    @property
    def text(self) -> str:
        """The prompt, e.g. ``12+7-5=``."""
        parts = [str(self.operands[0])]
        for op, value in zip(self.operators, self.operands[1:]):
            parts += [op, str(value)]
        return "".join(parts) + "="

    def steps(self) -> list[tuple[int, str, int, int]]:
        """(left, op, right, result) per step."""
        acc, out = self.operands[0], []
        for op, value in zip(self.operators, self.operands[1:]):
            result = _OPS[op](acc, value)
            out.append((acc, op, value, result))
            acc = result
        return out

    @property
    def answer(self) -> int:
        """The final value."""
        return self.steps()[-1][3]


def _check_difficulty(min_operands: int, max_operands: int, max_value: int, operators: str) -> None:
    if not 2 <= min_operands <= max_operands:
        raise ValueError(f"builtin task: need 2 <= min_operands ({min_operands}) <= max_operands ({max_operands})")
    if max_value < 1:
        raise ValueError(f"builtin task: max_value={max_value} must be >= 1")
    if not operators or any(op not in _OPS for op in operators):
        raise ValueError(f"builtin task: operators={operators!r}; choose from {''.join(_OPS)}")


def builtin_prompts(
    n: int, seed: int = 0, *, min_operands: int = 2, max_operands: int = 3,
    max_value: int = 9, operators: str = "+-",
) -> list[PromptRecord]:
    """``n`` seeded arithmetic prompts (same arguments, same prompts) as ``builtin`` records."""
    _check_difficulty(min_operands, max_operands, max_value, operators)
    rng = random.Random(seed)
    records = []
    for i in range(n):
        k = rng.randint(min_operands, max_operands)
        problem = ArithmeticProblem(
            tuple(rng.randint(0, max_value) for _ in range(k)),
            tuple(rng.choice(operators) for _ in range(k - 1)),
        )
        records.append(PromptRecord(
            prompt_id=i, prompt=problem.text,
            messages=[{"role": "user", "content": problem.text}], task="builtin",
            reference=str(problem.answer),
            metadata={"operands": list(problem.operands), "operators": list(problem.operators)},
        ))
    return records


def builtin_records(cfg: BuiltinTaskConfig) -> list[PromptRecord]:
    """``builtin_prompts`` from a config preset."""
    return builtin_prompts(cfg.num_prompts, cfg.seed, min_operands=cfg.min_operands,
                           max_operands=cfg.max_operands, max_value=cfg.max_value,
                           operators=cfg.operators)


def parse_problem(prompt: str) -> ArithmeticProblem:
    """Inverse of ``ArithmeticProblem.text``."""
    match = re.fullmatch(r"(\d+)((?:[-+*]\d+)+)=", prompt.strip())
    if not match:
        raise ValueError(f"not a built-in arithmetic prompt: {prompt!r}")
    pairs = re.findall(r"([-+*])(\d+)", match.group(2))
    return ArithmeticProblem((int(match.group(1)), *(int(v) for _, v in pairs)),
                             tuple(op for op, _ in pairs))


def reference_solution(prompt: str | PromptRecord, show_steps: bool = True) -> str:
    """The target response for a prompt (for a supervised warm start), ending ``answer: N``."""
    problem = parse_problem(prompt.prompt if isinstance(prompt, PromptRecord) else prompt)
    lines = [f"{a}{op}{b}={r}" for a, op, b, r in problem.steps()] if show_steps else []
    return "\n".join(lines + [f"answer: {problem.answer}"])


def builtin_vocab() -> dict[str, int]:
    """Token -> id: the special tokens, newline, then the printable ASCII characters."""
    chars = ["\n"] + [c for c in string.printable if c not in "\n\r\t\x0b\x0c"]
    return {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}


def build_builtin_tokenizer(out_dir: str | Path):
    """Build the character tokenizer, save it to ``out_dir`` and return it (HF fast tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = builtin_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", padding_side="left",
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf

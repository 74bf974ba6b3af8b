"""Turn a record's chat messages into prompt token ids through the tokenizer's chat template.

Instruct checkpoints (Qwen3) ship a chat template and get exactly the format they were tuned on
(``apply_chat_template(..., add_generation_prompt=True)``). A tokenizer without one (a base
model, or the built-in task's character tokenizer) gets the plain fallback instead: the message
contents joined by a blank line, no role markers, encoded with the tokenizer's own special
tokens (its BOS, if it adds one). The fallback adds nothing else on purpose: the built-in task's
prompts must stay a few dozen characters long.
"""

from __future__ import annotations

PLAIN_SEPARATOR = "\n\n"  # between message contents in the plain fallback


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, messages: list[dict[str, str]], enable_thinking: bool | None = None) -> str:
    """The prompt text (chat template or plain fallback), ready for the assistant's turn."""
    if not messages:
        raise ValueError("render_prompt: no messages")
    if has_chat_template(tokenizer):
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    return PLAIN_SEPARATOR.join(m["content"] for m in messages)


def encode_prompt(tokenizer, messages: list[dict[str, str]], enable_thinking: bool | None = None) -> list[int]:
    """Prompt token ids; the template already places special tokens, the fallback lets the
    tokenizer add its own."""
    text = render_prompt(tokenizer, messages, enable_thinking)
    add_special = not has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])

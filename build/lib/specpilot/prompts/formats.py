"""Prompt formats: each benchmark's first user turn, and the chat template around a conversation.

gsm8k and math500 append :data:`BOXED_SUFFIX`; humaneval wraps the prompt in
:data:`HUMANEVAL_PREFIX` / :data:`HUMANEVAL_SUFFIX`; mbpp uses the task text and mt-bench the first
turn raw (the DFlash harness, dflash/benchmark.py). The chat template is applied with
``add_generation_prompt=True`` and :data:`CHAT_TEMPLATE_KWARGS` (``enable_thinking=False``).
"""

from __future__ import annotations

from typing import Any

from ..errors import SpecpilotError
from .sources import row_field

CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}
BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HUMANEVAL_SUFFIX = "\n```"


def user_turns(benchmark: str, row: dict, index: int) -> list[str]:
    """User turns of one row of ``benchmark`` (row ``index`` in errors): the first formatted for
    the benchmark, any further ones (mt-bench's second turn) raw.

    Raises:
        SpecpilotError: the row lacks its text field, or mt-bench ``turns`` is not a non-empty
            list of strings.
    """
    if benchmark == "gsm8k":
        return [row_field(row, "question", benchmark, index) + BOXED_SUFFIX]
    if benchmark == "math500":
        return [row_field(row, "problem", benchmark, index) + BOXED_SUFFIX]
    if benchmark == "humaneval":
        return [HUMANEVAL_PREFIX + row_field(row, "prompt", benchmark, index) + HUMANEVAL_SUFFIX]
    if benchmark == "mbpp":
        return [row_field(row, "text", benchmark, index)]
    turns = row_field(row, "turns", benchmark, index, list)
    if not turns or not all(isinstance(t, str) for t in turns):
        raise SpecpilotError(f"benchmark {benchmark!r} row {index}: 'turns' must be a non-empty list of strings")
    return list(turns)


def format_prompt(tokenizer: Any, turns_so_far_messages: list[dict], template_kwargs: dict | None = None) -> str:
    """Apply the tokenizer's chat template to a conversation, ready for the assistant's reply.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        turns_so_far_messages: ``[{"role": "user"|"assistant"|"system", "content": str}, ...]``,
            ending with the user turn to answer.
        template_kwargs: extra chat-template variables; default :data:`CHAT_TEMPLATE_KWARGS`
            (``enable_thinking=False``). The same settings must be used for every turn of one
            conversation (prompt rows record them as ``chat_template_kwargs``).

    Returns:
        ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
        **template_kwargs)`` (templates without a thinking switch ignore the flag).

    Raises:
        SpecpilotError: the messages are malformed or the tokenizer has no chat template.
    """
    if not isinstance(turns_so_far_messages, list) or not turns_so_far_messages:
        raise SpecpilotError(f"messages must be a non-empty list of role/content dicts, got {turns_so_far_messages!r:.80}")
    for m in turns_so_far_messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SpecpilotError(f"malformed chat message {m!r:.80}: needs string 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise SpecpilotError(f"tokenizer {name!r} has no chat template")
    kwargs = dict(CHAT_TEMPLATE_KWARGS if template_kwargs is None else template_kwargs)
    return tokenizer.apply_chat_template(turns_so_far_messages, add_generation_prompt=True, tokenize=False, **kwargs)

"""Prompt files: one benchmark's chat-templated, tokenized prompts written as JSON lines."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import SpecpilotError
from ..io import write_jsonl
from .formats import CHAT_TEMPLATE_KWARGS, format_prompt
from .subsets import select


def load_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(tokenizer_dir)`` (a folder or Hub id).

    Raises:
        SpecpilotError: a path-like name (``/``, ``.``, ``~``) that is no folder; a tokenizer that
            cannot be loaded (transformers' whole reason, on one line).
    """
    from transformers import AutoTokenizer

    name = str(tokenizer_dir)
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise SpecpilotError(f"tokenizer folder {name!r} not found")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, TypeError) as e:
        # the whole message (transformers explains over several lines what it looked for), on one line
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        raise SpecpilotError(f"cannot load a tokenizer from {str(tokenizer_dir)!r}: {reason}") from None


def write_prompt_file(
    benchmark: str,
    tokenizer_dir: str | os.PathLike,
    out: str | os.PathLike,
    n_prompts: int | str,
    seed: int = 0,
    role: str = "eval",
    data_dir: str | os.PathLike | None = None,
    max_prompt_tokens: int | None = None,
    *,
    n_eval: int | str | None = None,
) -> list[dict]:
    """Write one benchmark's formatted, tokenized prompts as JSON lines (atomically).

    Each line is ``{"request_id", "benchmark", "prompt_text", "prompt_ids", "turns",
    "chat_template_kwargs"}``: ``prompt_text`` is the chat-templated first turn
    (:func:`~specpilot.prompts.formats.format_prompt`), ``prompt_ids`` its token ids (list of int,
    ``add_special_tokens=False`` since the template already holds the special tokens), ``turns``
    all user turns (see :func:`~specpilot.prompts.subsets.select`), ``chat_template_kwargs`` the
    template settings used (:data:`~specpilot.prompts.formats.CHAT_TEMPLATE_KWARGS`), which later
    turns of a multi-turn prompt must be rendered with too.

    Args:
        benchmark, n_prompts, seed, role, data_dir, n_eval: as for ``select``.
        tokenizer_dir: folder (or Hub id) for ``transformers.AutoTokenizer.from_pretrained``.
        out: output ``.jsonl`` path.
        max_prompt_tokens: if given, a prompt longer than this many tokens is an error.

    Returns:
        The rows written.

    Raises:
        SpecpilotError: as for ``select``; the tokenizer cannot be loaded; a bad
            ``max_prompt_tokens``; a prompt exceeding it (request id and length named).
    """
    if max_prompt_tokens is not None and (
        isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens <= 0
    ):
        raise SpecpilotError(f"max_prompt_tokens must be a positive integer, got {max_prompt_tokens!r}")
    selected = select(benchmark, n_prompts, seed=seed, role=role, data_dir=data_dir, n_eval=n_eval)
    tokenizer = load_tokenizer(tokenizer_dir)
    rows = []
    for row in selected:
        text = format_prompt(tokenizer, [{"role": "user", "content": row["turns"][0]}], CHAT_TEMPLATE_KWARGS)
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise SpecpilotError(
                f"prompt {row['request_id']} has {len(ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
            )
        rows.append({"request_id": row["request_id"], "benchmark": benchmark, "prompt_text": text,
                     "prompt_ids": ids, "turns": row["turns"], "chat_template_kwargs": dict(CHAT_TEMPLATE_KWARGS)})
    write_jsonl(out, rows)
    return rows

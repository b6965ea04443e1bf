"""The five benchmark prompt sets: loading, deterministic subsets, prompt formats, prompt files.

Benchmarks and sources (the DFlash harness, dflash/benchmark.py; see shared/notes/anchors.md):

| name      | rows | local file (under the data dir) | Hugging Face Hub dataset                     |
| --------- | ---- | ------------------------------- | -------------------------------------------- |
| gsm8k     | 1319 | gsm8k/test.jsonl                | openai/gsm8k, config "main", split test      |
| humaneval | 164  | humaneval/test.jsonl            | openai/openai_humaneval, split test          |
| math500   | 500  | math500/test.jsonl              | HuggingFaceH4/MATH-500, split test           |
| mbpp      | 500  | mbpp/mbpp.jsonl, task_id 11-510 | google-research-datasets/mbpp, config "full" |
| mt-bench  | 80   | mt_bench/question.jsonl         | HuggingFaceH4/mt_bench_prompts, split train  |

MBPP is the full set's test split (task ids 11..510), not DFlash's "sanitized" subset: the local copy
holds the full set only. The data dir is ``data_dir`` when given, else ``$SPECPILOT_DATA_DIR``, laid
out like ``shared/data/benchmarks``; with neither, rows come from the Hub through ``datasets``.

Prompt formats (first user turn): gsm8k and math500 append
``"\\nPlease reason step by step, and put your final answer within \\\\boxed{}."``; humaneval wraps the
prompt as ``"Write a solution to the following problem and make sure that it passes the
tests:\\n```python\\n" + prompt + "\\n```"``; mbpp uses the task text and mt-bench the first turn raw.
The chat template is applied with ``add_generation_prompt=True`` and ``enable_thinking=False``.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

from .errors import SpecpilotError
from .io import read_jsonl, write_jsonl

BENCHMARKS: tuple[str, ...] = ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")
ROLES: tuple[str, ...] = ("eval", "calibration")
DATA_DIR_ENV = "SPECPILOT_DATA_DIR"
MBPP_TEST_TASK_IDS = range(11, 511)  # the full MBPP set's test split (500 tasks)

BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HUMANEVAL_SUFFIX = "\n```"

# source key -> (file under the data dir, Hub repo, Hub config, Hub splits)
_SOURCES: dict[str, tuple[str, str, str | None, tuple[str, ...]]] = {
    "gsm8k": ("gsm8k/test.jsonl", "openai/gsm8k", "main", ("test",)),
    "gsm8k-train": ("gsm8k/train.jsonl", "openai/gsm8k", "main", ("train",)),
    "humaneval": ("humaneval/test.jsonl", "openai/openai_humaneval", None, ("test",)),
    "math500": ("math500/test.jsonl", "HuggingFaceH4/MATH-500", None, ("test",)),
    "mbpp-all": ("mbpp/mbpp.jsonl", "google-research-datasets/mbpp", "full", ("prompt", "test", "validation", "train")),
    "mt-bench": ("mt_bench/question.jsonl", "HuggingFaceH4/mt_bench_prompts", None, ("train",)),
}


def _check_benchmark(benchmark: Any) -> str:
    if benchmark not in BENCHMARKS:
        raise SpecpilotError(f"unknown benchmark {benchmark!r}; valid names: {', '.join(BENCHMARKS)}")
    return benchmark


def _resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get(DATA_DIR_ENV) or None
    if data_dir is None:
        return None
    path = Path(data_dir)
    if not path.is_dir():
        raise SpecpilotError(f"benchmark data dir {str(path)!r} is not a directory")
    return path


def _load_hub(key: str, benchmark: str) -> list[dict]:
    _, repo, config, splits = _SOURCES[key]
    hint = (
        f"cannot load benchmark {benchmark!r}: no local data dir was configured (pass data_dir / --data-dir, "
        f"or set {DATA_DIR_ENV}, to a folder laid out like shared/data/benchmarks)"
    )
    try:
        from datasets import load_dataset
    except ImportError:
        raise SpecpilotError(f"{hint}, and the 'datasets' package needed for the Hugging Face Hub is not installed") from None
    rows: list[dict] = []
    try:
        for split in splits:
            rows.extend(load_dataset(repo, config, split=split).to_list())
    except Exception as e:  # the hub client raises many types (ConnectionError, HfHubHTTPError, ...)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpecpilotError(f"{hint}, and the Hugging Face Hub dataset {repo} could not be loaded: {reason}") from None
    if key == "mbpp-all":
        rows.sort(key=lambda r: r["task_id"])
    if key == "mt-bench":  # the Hub copy renamed FastChat's "turns" to "prompt"
        rows = [{**r, "turns": list(r["prompt"])} for r in rows]
    return rows


def _load_source(key: str, benchmark: str, data_dir: str | os.PathLike | None) -> list[dict]:
    root = _resolve_data_dir(data_dir)
    if root is None:
        return _load_hub(key, benchmark)
    path = root / _SOURCES[key][0]
    if not path.is_file():
        raise SpecpilotError(f"benchmark {benchmark!r}: {path} not found in the data dir {str(root)!r}")
    return read_jsonl(path)


def _field(row: dict, name: str, benchmark: str, index: int, kind: type = str) -> Any:
    value = row.get(name)
    if not isinstance(value, kind):
        raise SpecpilotError(f"benchmark {benchmark!r} row {index}: field {name!r} is missing or not a {kind.__name__}")
    return value


def load_rows(benchmark: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """The benchmark's evaluation rows, unformatted, in the source file's order.

    Args:
        benchmark: one of :data:`BENCHMARKS`.
        data_dir: folder laid out like ``shared/data/benchmarks``; ``None`` falls back to
            ``$SPECPILOT_DATA_DIR`` and then to the Hugging Face Hub.

    Returns:
        The original rows (fields as in the source: gsm8k ``question``/``answer``, humaneval
        ``prompt``..., math500 ``problem``..., mbpp ``text``/``code``/``task_id``..., mt-bench
        ``turns``...). mbpp returns only the test split (task ids 11..510, 500 rows).

    Raises:
        SpecpilotError: unknown benchmark; the data dir or its file is missing; no data dir is
            configured and the Hub is unreachable (one line naming the benchmark).
    """
    _check_benchmark(benchmark)
    if benchmark == "mbpp":
        rows = _load_source("mbpp-all", benchmark, data_dir)
        return [r for r in rows if r.get("task_id") in MBPP_TEST_TASK_IDS]
    return _load_source(benchmark, benchmark, data_dir)


def _turns(benchmark: str, row: dict, index: int) -> list[str]:
    """User turns of one row: the first formatted for ``benchmark``, any further ones raw."""
    if benchmark == "gsm8k":
        return [_field(row, "question", benchmark, index) + BOXED_SUFFIX]
    if benchmark == "math500":
        return [_field(row, "problem", benchmark, index) + BOXED_SUFFIX]
    if benchmark == "humaneval":
        return [HUMANEVAL_PREFIX + _field(row, "prompt", benchmark, index) + HUMANEVAL_SUFFIX]
    if benchmark == "mbpp":
        return [_field(row, "text", benchmark, index)]
    turns = _field(row, "turns", benchmark, index, list)
    if not turns or not all(isinstance(t, str) for t in turns):
        raise SpecpilotError(f"benchmark {benchmark!r} row {index}: 'turns' must be a non-empty list of strings")
    return list(turns)


def _parse_n(n: Any, what: str = "n_prompts") -> int | None:
    """``n`` as a positive int, or None for all rows (0 or "all")."""
    if isinstance(n, str):
        if n.strip().lower() == "all":
            return None
        try:
            n = int(n)
        except ValueError:
            raise SpecpilotError(f"{what} must be a non-negative integer or 'all', got {n!r}") from None
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SpecpilotError(f"{what} must be a non-negative integer or 'all', got {n!r}")
    return n or None


def select(
    benchmark: str,
    n: int | str,
    seed: int = 0,
    role: str = "eval",
    data_dir: str | os.PathLike | None = None,
    *,
    n_eval: int | str | None = None,
) -> list[dict]:
    """A deterministic subset of a benchmark's prompts.

    The row indices are permuted with ``random.Random(seed).shuffle`` (stable across Python
    versions). Role ``"eval"`` takes the first ``n`` indices of the permutation; ``"calibration"``
    takes ``n`` from its end (last index first). So a smaller subset is a prefix of a larger one of
    the same role, and eval and calibration prompts are disjoint while ``n_eval + n <= rows``.

    Args:
        benchmark: one of :data:`BENCHMARKS`.
        n: number of prompts; 0 or ``"all"`` means every row (role ``"eval"`` only).
        seed: permutation seed.
        role: ``"eval"`` or ``"calibration"``.
        data_dir: see :func:`load_rows`.
        n_eval: for role ``"calibration"``, the eval subset size to stay disjoint from (0 or
            ``"all"`` = every row); ``None`` skips the check.

    Returns:
        Rows ``{"request_id": f"{benchmark}/{i:04d}", "benchmark", "turns": [str, ...]}`` in
        permutation order, where ``i`` is the row's index in :func:`load_rows` order (for mbpp,
        ``mbpp/0000`` is task 11). ``turns`` holds the user turns: the first formatted for the
        benchmark, further ones (mt-bench's second turn) raw.

    Raises:
        SpecpilotError: unknown benchmark or role, bad ``n``/``seed``, ``n`` larger than the
            benchmark, calibration of all rows, or calibration overlapping ``n_eval``.
    """
    _check_benchmark(benchmark)
    if role not in ROLES:
        raise SpecpilotError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpecpilotError(f"seed must be an integer, got {seed!r}")
    count = _parse_n(n)
    rows = load_rows(benchmark, data_dir)
    total = len(rows)
    if count is None:
        if role == "calibration":
            raise SpecpilotError(f"calibration prompts for {benchmark!r} must be a number, not all rows (n={n!r})")
        count = total
    if count > total:
        raise SpecpilotError(f"{benchmark!r} has {total} prompts, cannot select n={count}")
    order = list(range(total))
    random.Random(seed).shuffle(order)
    if role == "calibration":
        if n_eval is not None:
            eval_count = _parse_n(n_eval, "n_eval")
            eval_count = total if eval_count is None else eval_count
            if eval_count + count > total:
                raise SpecpilotError(
                    f"{benchmark!r}: {count} calibration + {eval_count} eval prompts exceed its {total} rows; they would overlap"
                )
        chosen = order[::-1][:count]
    else:
        chosen = order[:count]
    return [
        {"request_id": f"{benchmark}/{i:04d}", "benchmark": benchmark, "turns": _turns(benchmark, rows[i], i)}
        for i in chosen
    ]


def format_prompt(tokenizer: Any, turns_so_far_messages: list[dict]) -> str:
    """Apply the tokenizer's chat template to a conversation, ready for the assistant's reply.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        turns_so_far_messages: ``[{"role": "user"|"assistant"|"system", "content": str}, ...]``,
            ending with the user turn to answer.

    Returns:
        ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
        enable_thinking=False)`` (templates without a thinking switch ignore the flag).

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
    return tokenizer.apply_chat_template(
        turns_so_far_messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )


def _load_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    name = str(tokenizer_dir)
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise SpecpilotError(f"tokenizer folder {name!r} not found")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
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

    Each line is ``{"request_id", "benchmark", "prompt_text", "prompt_ids", "turns"}``:
    ``prompt_text`` is the chat-templated first turn (:func:`format_prompt`), ``prompt_ids`` its
    token ids (list of int, ``add_special_tokens=False`` since the template already holds the
    special tokens), ``turns`` all user turns (see :func:`select`).

    Args:
        benchmark, n_prompts, seed, role, data_dir, n_eval: as for :func:`select`.
        tokenizer_dir: folder (or Hub id) for ``transformers.AutoTokenizer.from_pretrained``.
        out: output ``.jsonl`` path.
        max_prompt_tokens: if given, a prompt longer than this many tokens is an error.

    Returns:
        The rows written.

    Raises:
        SpecpilotError: as for :func:`select`; the tokenizer cannot be loaded; a bad
            ``max_prompt_tokens``; a prompt exceeding it (request id and length named).
    """
    if max_prompt_tokens is not None and (
        isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens <= 0
    ):
        raise SpecpilotError(f"max_prompt_tokens must be a positive integer, got {max_prompt_tokens!r}")
    selected = select(benchmark, n_prompts, seed=seed, role=role, data_dir=data_dir, n_eval=n_eval)
    tokenizer = _load_tokenizer(tokenizer_dir)
    rows = []
    for row in selected:
        text = format_prompt(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise SpecpilotError(
                f"prompt {row['request_id']} has {len(ids)} tokens, more than max_prompt_tokens={max_prompt_tokens}"
            )
        rows.append({"request_id": row["request_id"], "benchmark": benchmark, "prompt_text": text,
                     "prompt_ids": ids, "turns": row["turns"]})
    write_jsonl(out, rows)
    return rows


def training_pairs(data_dir: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """(user, assistant) texts for training the tiny deployment; never a test-split row.

    GSM8K train (user = question formatted like the gsm8k prompt, assistant = the worked answer),
    then MBPP tasks outside 11..510 (user = task text, assistant = its ``code`` with ``\\r\\n`` ->
    ``\\n``). A pair whose user text equals a gsm8k or mbpp test prompt is dropped as well (MBPP
    tasks 602, 704 and 872 repeat the text of test tasks 217, 248 and 216).

    Raises:
        SpecpilotError: a source is missing (see :func:`load_rows`) or a row lacks a field.
    """
    test_prompts = {t for b in ("gsm8k", "mbpp") for r in select(b, "all", data_dir=data_dir) for t in r["turns"]}
    pairs = []
    for i, row in enumerate(_load_source("gsm8k-train", "gsm8k", data_dir)):
        user = _field(row, "question", "gsm8k train", i) + BOXED_SUFFIX
        pairs.append((user, _field(row, "answer", "gsm8k train", i)))
    for i, row in enumerate(_load_source("mbpp-all", "mbpp", data_dir)):
        if row.get("task_id") in MBPP_TEST_TASK_IDS:
            continue
        code = _field(row, "code", "mbpp", i).replace("\r\n", "\n")
        pairs.append((_field(row, "text", "mbpp", i), code))
    return [p for p in pairs if p[0] not in test_prompts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``specpilot prompts``."""
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (or Hub id) of the target model")
    parser.add_argument("--benchmark", required=True, help=f"one of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--n-prompts", required=True, help="number of prompts; 0 or 'all' = every row (eval only)")
    parser.add_argument("--seed", type=int, default=0, help="subset permutation seed (default 0)")
    parser.add_argument("--role", choices=ROLES, default="eval", help="eval: start of the permutation; calibration: its end")
    parser.add_argument("--n-eval", default=None, help="calibration only: eval subset size to stay disjoint from")
    parser.add_argument("--data-dir", default=None, help=f"local benchmark folder (default ${DATA_DIR_ENV}, else the HF Hub)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="fail if a prompt is longer than this")
    parser.add_argument("--out", required=True, help="output .jsonl file")


def run(args: argparse.Namespace) -> int:
    """Run ``specpilot prompts``: write the prompt file; returns 0."""
    rows = write_prompt_file(
        args.benchmark, args.tokenizer, args.out, args.n_prompts, seed=args.seed, role=args.role,
        data_dir=args.data_dir, max_prompt_tokens=args.max_prompt_tokens, n_eval=args.n_eval,
    )
    print(f"wrote {len(rows)} {args.benchmark} prompts to {args.out}")
    return 0

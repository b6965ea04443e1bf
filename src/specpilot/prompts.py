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
holds the full set only. The data dir is resolved by :func:`resolve_data_dir`: ``data_dir`` when
given, else ``$SPECPILOT_DATA_DIR``, else ``shared/data/benchmarks`` beside the repository when it
exists; with none of them, rows come from the Hub through ``datasets``.

Calibration prompts (the agent rounds) never come from the evaluation rows, whatever ``n_prompts``
is (:func:`calibration_pool`): gsm8k's come from its train split and mbpp's from its non-test tasks
(task ids 1-10 and 511-974, minus three whose text repeats a test task), each from a fixed reserve
of :data:`TRAIN_RESERVE` rows that :func:`training_pairs` leaves out of the tiny deployment's
training text. humaneval, math500 and mt-bench have no other split: a fixed slice of
:data:`TEST_RESERVE` rows (half the rows for a benchmark of fewer than ``2 * TEST_RESERVE``) is
reserved for calibration and is never an evaluation prompt, so ``n_prompts: all`` there means every
row but the reserve (156 humaneval, 492 math500, 72 mt-bench prompts).

Prompt formats (first user turn): gsm8k and math500 append
``"\\nPlease reason step by step, and put your final answer within \\\\boxed{}."``; humaneval wraps the
prompt as ``"Write a solution to the following problem and make sure that it passes the
tests:\\n```python\\n" + prompt + "\\n```"``; mbpp uses the task text and mt-bench the first turn raw.
The chat template is applied with ``add_generation_prompt=True`` and the settings in
:data:`CHAT_TEMPLATE_KWARGS` (``enable_thinking=False``); every prompt row records them
(``chat_template_kwargs``) so that later turns of a conversation are rendered the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
from pathlib import Path
from typing import Any

from .errors import SpecpilotError
from .io import comma_list, one_out_each, read_jsonl, write_jsonl

BENCHMARKS: tuple[str, ...] = ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")
ROLES: tuple[str, ...] = ("eval", "calibration")
DATA_DIR_ENV = "SPECPILOT_DATA_DIR"
MBPP_TEST_TASK_IDS = range(11, 511)  # the full MBPP set's test split (500 tasks)
# Calibration reserves (see the module docstring). Fixed: they depend neither on the seed nor on
# n_prompts, so eval and calibration stay disjoint and an eval subset never moves when the
# calibration count changes.
TRAIN_RESERVE = 64   # gsm8k train / mbpp non-test rows kept out of the tiny training text
TEST_RESERVE = 8     # test rows of humaneval, math500, mt-bench never used for evaluation
RESERVE_SEED = 0     # seed of the fixed permutation the reserves are taken from
CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}

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


def repo_data_dir(repo: str | os.PathLike | None = None) -> Path:
    """``shared/data/benchmarks`` beside the repository (``repo``: its root; default: the checkout
    this package was imported from, two levels above ``src/specpilot``)."""
    root = Path(repo) if repo is not None else Path(__file__).resolve().parents[2]
    return root.resolve().parent / "shared" / "data" / "benchmarks"


def resolve_data_dir(data_dir: str | os.PathLike | None = None, repo: str | os.PathLike | None = None
                     ) -> Path | None:
    """Where the benchmark files are read from.

    Order: ``data_dir`` (config ``data_dir`` / ``--data-dir``), else ``$SPECPILOT_DATA_DIR``, else
    :func:`repo_data_dir` when it holds a ``MANIFEST.json`` (the folder the tests use), else
    ``None`` (the Hugging Face Hub).

    Raises:
        SpecpilotError: an explicitly named folder (argument or variable) is not a directory.
    """
    for value, what in ((data_dir, "data_dir"), (os.environ.get(DATA_DIR_ENV), f"${DATA_DIR_ENV}")):
        if value is None or str(value) == "":
            continue
        path = Path(value).expanduser()
        if not path.is_dir():
            raise SpecpilotError(f"benchmark data dir {str(path)!r} ({what}) is not a directory")
        return path
    beside = repo_data_dir(repo)
    return beside if (beside / "MANIFEST.json").is_file() else None


def data_checksum(data_dir: str | os.PathLike | None) -> str:
    """Identity of the benchmark data, for the workflow's params (a path would make the DAG
    depend on where the data lies): ``"hub"`` for the Hugging Face Hub, else the first 16 hex
    digits of the SHA-256 of the folder's ``MANIFEST.json``, or, without one, of the benchmark
    files it holds (names and contents)."""
    if data_dir is None:
        return "hub"
    root = Path(data_dir)
    h = hashlib.sha256()
    manifest = root / "MANIFEST.json"
    if manifest.is_file():
        h.update(manifest.read_bytes())
    else:
        for rel in sorted({v[0] for v in _SOURCES.values()}):
            f = root / rel
            if f.is_file():
                h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def _resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    return resolve_data_dir(data_dir)


def check_data_id(data_dir: str | os.PathLike | None, data_id: str | None) -> Path | None:
    """Resolve the data dir and check it is the data the workflow planned with.

    Args:
        data_dir: as for :func:`resolve_data_dir`.
        data_id: the expected :func:`data_checksum` (``--data-id``), or None to skip the check.

    Returns:
        The resolved folder (None = the Hub).

    Raises:
        SpecpilotError: the data found here has another checksum (both named, and what to set).
    """
    root = resolve_data_dir(data_dir)
    if data_id is not None and data_checksum(root) != data_id:
        where = str(root) if root is not None else "the Hugging Face Hub"
        raise SpecpilotError(
            f"the benchmark data found here ({where}, id {data_checksum(root)}) is not the data the workflow "
            f"planned with (id {data_id}); set config data_dir or {DATA_DIR_ENV} to that folder")
    return root


def _load_hub(key: str, benchmark: str) -> list[dict]:
    _, repo, config, splits = _SOURCES[key]
    hint = (
        f"cannot load benchmark {benchmark!r}: no local data dir was configured (set config data_dir / "
        f"--data-dir, or the environment variable {DATA_DIR_ENV}, to a folder laid out like shared/data/benchmarks)"
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


def _permutation(total: int, seed: int) -> list[int]:
    order = list(range(total))
    random.Random(seed).shuffle(order)
    return order


def test_reserve(total: int) -> list[int]:
    """Row indices (in :func:`load_rows` order) reserved for calibration on a benchmark without a
    train split: the last ``min(TEST_RESERVE, total // 2)`` indices of the fixed permutation
    (seed :data:`RESERVE_SEED`), last first."""
    size = min(TEST_RESERVE, total // 2)
    return _permutation(total, RESERVE_SEED)[::-1][:size]


def _reserved_eval_rows(benchmark: str, total: int) -> set[int]:
    """Evaluation rows held back for calibration (none where a train split supplies it)."""
    return set() if benchmark in ("gsm8k", "mbpp") else set(test_reserve(total))


def calibration_pool(benchmark: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every row calibration prompts of ``benchmark`` may come from, disjoint from evaluation.

    gsm8k: the first :data:`TRAIN_RESERVE` rows of a fixed permutation of its train split;
    mbpp: the same of its non-test tasks (ids outside 11..510) whose text is no test task's text;
    humaneval, math500, mt-bench: the :func:`test_reserve` rows of the test split, which
    :func:`select` never returns for role ``"eval"``.

    Returns:
        Rows ``{"request_id", "benchmark", "turns"}`` in the reserve's fixed order. Request ids say
        where a row comes from: ``gsm8k/train-{i:04d}`` (train split row i), ``mbpp/task-{id:04d}``
        (MBPP task id), ``{benchmark}/{i:04d}`` (reserved test row i).

    Raises:
        SpecpilotError: as for :func:`load_rows`.
    """
    _check_benchmark(benchmark)
    if benchmark == "gsm8k":
        rows = _load_source("gsm8k-train", benchmark, data_dir)
        chosen = _permutation(len(rows), RESERVE_SEED)[:TRAIN_RESERVE]
        return [{"request_id": f"gsm8k/train-{i:04d}", "benchmark": benchmark,
                 "turns": _turns(benchmark, rows[i], i)} for i in chosen]
    if benchmark == "mbpp":
        test_texts = {r.get("text") for r in load_rows("mbpp", data_dir)}
        rows = [r for r in _load_source("mbpp-all", benchmark, data_dir)
                if r.get("task_id") not in MBPP_TEST_TASK_IDS and r.get("text") not in test_texts]
        chosen = _permutation(len(rows), RESERVE_SEED)[:TRAIN_RESERVE]
        return [{"request_id": f"mbpp/task-{int(rows[i]['task_id']):04d}", "benchmark": benchmark,
                 "turns": _turns(benchmark, rows[i], i)} for i in chosen]
    rows = load_rows(benchmark, data_dir)
    return [{"request_id": f"{benchmark}/{i:04d}", "benchmark": benchmark, "turns": _turns(benchmark, rows[i], i)}
            for i in test_reserve(len(rows))]


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

    Role ``"eval"``: the row indices are permuted with ``random.Random(seed).shuffle`` (stable
    across Python versions), the calibration reserve (:func:`test_reserve`; none for gsm8k and
    mbpp) is dropped, and the first ``n`` are taken. Role ``"calibration"``: the
    :func:`calibration_pool` shuffled with the same seed, first ``n``. So a smaller subset is a
    prefix of a larger one of the same role, and eval and calibration prompts are disjoint for
    every ``n``, including ``"all"``.

    Args:
        benchmark: one of :data:`BENCHMARKS`.
        n: number of prompts; 0 or ``"all"`` means every evaluation row (role ``"eval"`` only).
        seed: permutation seed.
        role: ``"eval"`` or ``"calibration"``.
        data_dir: see :func:`load_rows`.
        n_eval: accepted for compatibility and checked (an integer or ``"all"``); calibration no
            longer depends on it.

    Returns:
        Rows ``{"request_id", "benchmark", "turns": [str, ...]}``. Eval request ids are
        ``f"{benchmark}/{i:04d}"``, ``i`` the row's index in :func:`load_rows` order (for mbpp,
        ``mbpp/0000`` is task 11); calibration ids as in :func:`calibration_pool`. ``turns`` holds
        the user turns: the first formatted for the benchmark, further ones (mt-bench's second
        turn) raw.

    Raises:
        SpecpilotError: unknown benchmark or role, bad ``n``/``seed``/``n_eval``, ``n`` larger than
            the evaluation rows or the calibration reserve, calibration of all rows.
    """
    _check_benchmark(benchmark)
    if role not in ROLES:
        raise SpecpilotError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpecpilotError(f"seed must be an integer, got {seed!r}")
    count = _parse_n(n)
    if n_eval is not None:
        _parse_n(n_eval, "n_eval")
    if role == "calibration":
        if count is None:
            raise SpecpilotError(f"calibration prompts for {benchmark!r} must be a number, not all rows (n={n!r})")
        pool = calibration_pool(benchmark, data_dir)
        if count > len(pool):
            raise SpecpilotError(
                f"{count} calibration prompts asked for {benchmark!r}, but {len(pool)} are reserved for "
                f"calibration (config rounds.calibration_prompts must be <= {len(pool)})")
        order = _permutation(len(pool), seed)
        return [pool[i] for i in order[:count]]
    rows = load_rows(benchmark, data_dir)
    total = len(rows)
    reserved = _reserved_eval_rows(benchmark, total)
    order = [i for i in _permutation(total, seed) if i not in reserved]
    count = len(order) if count is None else count
    if count > len(order):
        extra = f" ({len(reserved)} of its {total} rows are reserved for calibration)" if reserved else ""
        raise SpecpilotError(f"{benchmark!r} has {len(order)} evaluation prompts{extra}, cannot select n={count}")
    return [
        {"request_id": f"{benchmark}/{i:04d}", "benchmark": benchmark, "turns": _turns(benchmark, rows[i], i)}
        for i in order[:count]
    ]


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


def _load_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
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
    (:func:`format_prompt`), ``prompt_ids`` its token ids (list of int, ``add_special_tokens=False``
    since the template already holds the special tokens), ``turns`` all user turns (see
    :func:`select`), ``chat_template_kwargs`` the template settings used (:data:`CHAT_TEMPLATE_KWARGS`),
    which later turns of a multi-turn prompt must be rendered with too.

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


def training_pairs(data_dir: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """(user, assistant) texts for training the tiny deployment; never a test-split row.

    GSM8K train (user = question formatted like the gsm8k prompt, assistant = the worked answer),
    then MBPP tasks outside 11..510 (user = task text, assistant = its ``code`` with ``\\r\\n`` ->
    ``\\n``). A pair whose user text equals a gsm8k or mbpp test prompt is dropped as well (MBPP
    tasks 602, 704 and 872 repeat the text of test tasks 217, 248 and 216), and so is every
    calibration prompt (:func:`calibration_pool`: 64 gsm8k train rows, 64 mbpp tasks), so the
    agent rounds never calibrate on the tiny drafter's training text.

    Raises:
        SpecpilotError: a source is missing (see :func:`load_rows`) or a row lacks a field.
    """
    held_out = {t for b in ("gsm8k", "mbpp") for r in select(b, "all", data_dir=data_dir) for t in r["turns"]}
    held_out |= {t for b in ("gsm8k", "mbpp") for r in calibration_pool(b, data_dir) for t in r["turns"]}
    pairs = []
    for i, row in enumerate(_load_source("gsm8k-train", "gsm8k", data_dir)):
        user = _field(row, "question", "gsm8k train", i) + BOXED_SUFFIX
        pairs.append((user, _field(row, "answer", "gsm8k train", i)))
    for i, row in enumerate(_load_source("mbpp-all", "mbpp", data_dir)):
        if row.get("task_id") in MBPP_TEST_TASK_IDS:
            continue
        code = _field(row, "code", "mbpp", i).replace("\r\n", "\n")
        pairs.append((_field(row, "text", "mbpp", i), code))
    return [p for p in pairs if p[0] not in held_out]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``specpilot prompts``."""
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (or Hub id) of the target model")
    parser.add_argument("--benchmark", required=True, type=comma_list,
                        help=f"one of: {', '.join(BENCHMARKS)}; several comma-separated, one --out each")
    parser.add_argument("--n-prompts", required=True, help="number of prompts; 0 or 'all' = every row (eval only)")
    parser.add_argument("--seed", type=int, default=0, help="subset permutation seed (default 0)")
    parser.add_argument("--role", choices=ROLES, default="eval",
                        help="eval: evaluation rows; calibration: the rows reserved for the agent rounds (a train "
                             "split where the benchmark has one), disjoint from every evaluation row")
    parser.add_argument("--n-eval", default=None, help="ignored (calibration no longer depends on the eval count)")
    parser.add_argument("--data-dir", default=None, help=f"local benchmark folder (default ${DATA_DIR_ENV}, else "
                        "shared/data/benchmarks beside the repository, else the HF Hub)")
    parser.add_argument("--data-id", default=None,
                        help="expected checksum of the data (the workflow passes it): refuse other data")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="fail if a prompt is longer than this")
    parser.add_argument("--out", required=True, type=comma_list,
                        help="output .jsonl file; comma-separated, one per --benchmark")


def run(args: argparse.Namespace) -> int:
    """Run ``specpilot prompts``: write the prompt file; returns 0."""
    pairs = one_out_each(args.out, args.benchmark, "benchmark(s)")
    data_dir = check_data_id(args.data_dir, args.data_id)
    for benchmark, out in pairs:
        rows = write_prompt_file(
            benchmark, args.tokenizer, out, args.n_prompts, seed=args.seed, role=args.role,
            data_dir=data_dir, max_prompt_tokens=args.max_prompt_tokens, n_eval=args.n_eval,
        )
        print(f"wrote {len(rows)} {benchmark} prompts to {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# distillation prompts for the tiny drafters (never an evaluation or calibration prompt)

# kind -> share of the distillation prompts (sums to 1); see :func:`distillation_prompts`
DISTILL_MIX: dict[str, float] = {"word_maths": 0.3, "code_task": 0.15, "code_completion": 0.2,
                                 "competition_maths": 0.175, "chat": 0.175}
# share of the code_completion and chat prompts given a long context (2-5 solved MBPP functions
# before the stub; 4-10 other instructions before the chat request), as HumanEval's and MT-Bench's
# longer prompts (200-500 tokens of the tiny tokenizer) have: without it the drafters' tau fell to
# ~1.2-1.5 on every prompt longer than ~190 tokens (README, Measured)
DISTILL_LONG: float = 0.5

_MATH_TEMPLATES = (
    "What is the value of ${a}^2 - {b}^2$?",
    "Find the remainder when ${n}$ is divided by ${m}$.",
    "Solve for $x$: ${a}x + {b} = {c}$.",
    "How many positive divisors does ${n}$ have?",
    "Simplify $\\frac{{{n}}}{{{m}}}$.",
    "If $f(x) = {a}x^2 + {b}x + {c}$, what is $f({d})$?",
    "What is the sum of the first ${n}$ positive odd integers?",
    "Compute $\\dbinom{{{a}}}{{{d}}}$.",
    "The sum of two numbers is ${n}$ and their difference is ${b}$. What is the larger number?",
    "Find the greatest common divisor of ${n}$ and ${m}$.",
    "A rectangle has a perimeter of ${n}$ units and a length of ${a}$ units. What is its area, in square units?",
    "What is the smallest positive integer $n$ such that ${a}n \\equiv {b} \\pmod{{{m}}}$?",
    "Evaluate $\\log_{{{d}}} {n}$ to the nearest integer.",
    "The first term of an arithmetic sequence is ${a}$ and the common difference is ${b}$. What is the ${c}$th term?",
    "How many ways are there to choose ${d}$ books from a shelf of ${a}$ different books?",
    "Find the area of a triangle with vertices $(0,0)$, $({a},0)$ and $(0,{b})$.",
)
_CHAT_TEMPLATES = (
    "Write a {adj} {form} about {topic}.",
    "Explain {concept} to a {audience} in a few paragraphs.",
    "Give me {k} tips for {activity}.",
    "Compose an email to your {person} asking for {thing}.",
    "What are the main differences between {concept} and {concept2}?",
    "Describe a {place} you would like to visit and explain why.",
    "Imagine you are a {role}. How would you {task}?",
    "Summarize the advantages and disadvantages of {topic}.",
    "Draft a short speech for {event} that mentions {topic}.",
    "Rewrite the following sentence in a more {adj} tone: \"{topic} is important for everyone.\"",
)
_CHAT_WORDS = {
    "adj": ("engaging", "formal", "friendly", "persuasive", "humorous", "concise", "poetic", "professional"),
    "form": ("blog post", "short story", "poem", "product description", "letter", "news article", "dialogue"),
    "topic": ("a recent trip to the mountains", "renewable energy", "a small bakery", "learning a new language",
              "city gardens", "a rainy weekend", "public libraries", "electric cars", "a school science fair",
              "remote work", "healthy breakfasts", "an old lighthouse"),
    "concept": ("photosynthesis", "inflation", "machine learning", "the water cycle", "compound interest",
                "gravity", "supply and demand", "vaccination", "recycling", "democracy"),
    "concept2": ("respiration", "deflation", "statistics", "the carbon cycle", "simple interest", "magnetism",
                 "taxation", "medication", "composting", "monarchy"),
    "audience": ("child", "high school student", "new employee", "grandparent", "beginner programmer"),
    "activity": ("studying for exams", "saving money", "running a marathon", "public speaking", "cooking rice",
                 "writing a resume", "sleeping better", "planning a trip"),
    "person": ("supervisor", "teacher", "landlord", "colleague", "neighbor", "customer"),
    "thing": ("feedback on a report", "a day off", "a meeting next week", "a reference letter", "help with a move"),
    "place": ("city", "national park", "museum", "island", "village", "market"),
    "role": ("ship captain", "museum guide", "chef", "detective", "teacher", "mayor"),
    "task": ("plan a busy week", "explain your job to a child", "handle an unhappy customer",
             "organize a charity event"),
    "event": ("a graduation", "a wedding", "a team meeting", "a product launch", "a retirement party"),
}


def _math_problem(rng: random.Random) -> str:
    t = rng.choice(_MATH_TEMPLATES)
    v = dict(a=rng.randint(2, 40), b=rng.randint(1, 30), c=rng.randint(3, 99), d=rng.randint(2, 9),
             n=rng.randint(12, 999), m=rng.randint(3, 48))
    return t.format(**v) + BOXED_SUFFIX


def _chat_prompt(rng: random.Random) -> str:
    t = rng.choice(_CHAT_TEMPLATES)
    v = {k: rng.choice(words) for k, words in _CHAT_WORDS.items()}
    return t.format(k=rng.randint(3, 7), **v)


def _stub(row: dict) -> str | None:
    """A HumanEval-style prompt from an MBPP task: the code's first ``def`` line, the task text
    as docstring, its first test as a doctest (None when the code has no top-level def)."""
    code = row.get("code", "").replace("\r\n", "\n")
    m = re.search(r"^def \w+\(.*\)\s*:", code, re.M)
    if not m:
        return None
    doc = f'    """ {row.get("text", "").strip()}\n'
    tests = row.get("test_list") or []
    t = re.match(r"assert\s+(.+?)\s*==\s*(.+)$", tests[0].strip()) if tests else None
    if t:
        doc += f"    >>> {t.group(1)}\n    {t.group(2)}\n"
    return HUMANEVAL_PREFIX + m.group(0).rstrip() + "\n" + doc + '    """\n' + HUMANEVAL_SUFFIX


def distillation_prompts(n: int, rng: random.Random, data_dir: str | os.PathLike | None = None
                         ) -> list[tuple[str, str]]:
    """``n`` (kind, user text) prompts the tiny drafters are distilled on, covering every
    benchmark's kind of text, none of them an evaluation or calibration prompt.

    Kinds and shares (:data:`DISTILL_MIX`; a :data:`DISTILL_LONG` share of the code_completion
    and chat prompts has a long context, :func:`_long_context`): ``word_maths`` = gsm8k train questions with the
    gsm8k suffix; ``code_task`` = MBPP non-test task texts; ``code_completion`` = HumanEval-style
    prompts synthesized from MBPP non-test tasks (:func:`_stub`); ``competition_maths`` =
    MATH-style problems from templates with random numbers, with the boxed suffix;
    ``chat`` = MT-Bench-style instructions from templates. The rows come from
    :func:`training_pairs` (so the held-out texts are already excluded); a synthesized text
    equal to any evaluation or calibration prompt is dropped. Deterministic for a given ``rng``
    state. Raises SpecpilotError as :func:`training_pairs`.
    """
    pairs = training_pairs(data_dir)
    mbpp_texts = {_field(r, "text", "mbpp", i) for i, r in enumerate(_load_source("mbpp-all", "mbpp", data_dir))
                  if r.get("task_id") not in MBPP_TEST_TASK_IDS}
    word = [u for u, _ in pairs if u.endswith(BOXED_SUFFIX)]
    code = [u for u, _ in pairs if u in mbpp_texts]
    stubs = [s for r in _load_source("mbpp-all", "mbpp", data_dir)
             if r.get("task_id") not in MBPP_TEST_TASK_IDS and r.get("text") in set(code)
             for s in [_stub(r)] if s]
    held = {t for b in BENCHMARKS for r in select(b, "all", data_dir=data_dir) for t in r["turns"][:1]}
    held |= {t for b in BENCHMARKS for r in calibration_pool(b, data_dir) for t in r["turns"][:1]}
    counts = {k: int(round(share * n)) for k, share in DISTILL_MIX.items()}
    counts["word_maths"] += n - sum(counts.values())
    out: list[tuple[str, str]] = []
    for kind, k in counts.items():
        if kind == "word_maths":
            texts = rng.sample(word, min(k, len(word)))
        elif kind == "code_task":
            texts = rng.sample(code, min(k, len(code)))
        elif kind == "code_completion":
            texts = rng.sample(stubs, min(k, len(stubs)))
        else:
            make = _math_problem if kind == "competition_maths" else _chat_prompt
            texts = []
            while len(texts) < k:
                t = make(rng)
                if t not in held and t not in texts:
                    texts.append(t)
        out += [(kind, t) for t in texts if t not in held]
    solutions = [r["code"].replace("\r\n", "\n").replace("\t", "    ").strip()
                 for r in _load_source("mbpp-all", "mbpp", data_dir)
                 if r.get("task_id") not in MBPP_TEST_TASK_IDS and r.get("code")]
    return _long_context(out, rng, solutions)


def _long_context(prompts: list[tuple[str, str]], rng: random.Random, solutions: list[str]
                  ) -> list[tuple[str, str]]:
    """A :data:`DISTILL_LONG` share of the code_completion and chat prompts with context before
    them: 2-5 solved MBPP non-test functions inside the code block before the stub (a file with
    helpers, as many HumanEval prompts are), 4-10 other chat instructions before the request. Context comes only from the distillation pool and MBPP's non-test rows."""
    chats = [t for k, t in prompts if k == "chat"]
    out = list(prompts)
    for i, (kind, text) in enumerate(prompts):
        if kind not in ("code_completion", "chat") or rng.random() >= DISTILL_LONG:
            continue
        n = rng.randint(2, 5) if kind == "code_completion" else rng.randint(4, 10)
        if kind == "code_completion" and solutions and text.startswith(HUMANEVAL_PREFIX):
            ctx = "\n\n\n".join(rng.choice(solutions) for _ in range(n))
            out[i] = (kind, HUMANEVAL_PREFIX + ctx + "\n\n\n" + text[len(HUMANEVAL_PREFIX):])
        elif kind == "chat" and len(chats) > 1:
            ctx = [c for c in (rng.choice(chats) for _ in range(n)) if c != text]
            out[i] = (kind, "\n\n".join(ctx + [text]))
    return out

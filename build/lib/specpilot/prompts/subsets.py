"""Deterministic subsets of a benchmark: evaluation prompts, calibration prompts, training text.

Calibration prompts (the agent rounds) never come from the evaluation rows, whatever ``n_prompts``
is (:func:`calibration_pool`): gsm8k's come from its train split and mbpp's from its non-test tasks
(task ids 1-10 and 511-974, minus three whose text repeats a test task), each from a fixed reserve
of :data:`TRAIN_RESERVE` rows that :func:`training_pairs` leaves out of the tiny deployment's
training text. humaneval, math500 and mt-bench have no other split: a fixed slice of
:data:`TEST_RESERVE` rows (half the rows for a benchmark of fewer than ``2 * TEST_RESERVE``) is
reserved for calibration and is never an evaluation prompt, so ``n_prompts: all`` there means every
row but the reserve (156 humaneval, 492 math500, 72 mt-bench prompts).
"""

from __future__ import annotations

import os
import random
from typing import Any

from ..errors import SpecpilotError
from .formats import BOXED_SUFFIX, user_turns
from .sources import MBPP_TEST_TASK_IDS, check_benchmark, load_rows, load_source, row_field

ROLES: tuple[str, ...] = ("eval", "calibration")
# Calibration reserves (see the module docstring). Fixed: they depend neither on the seed nor on
# n_prompts, so eval and calibration stay disjoint and an eval subset never moves when the
# calibration count changes.
TRAIN_RESERVE = 64   # gsm8k train / mbpp non-test rows kept out of the tiny training text
TEST_RESERVE = 8     # test rows of humaneval, math500, mt-bench never used for evaluation
RESERVE_SEED = 0     # seed of the fixed permutation the reserves are taken from


def parse_n(n: Any, what: str = "n_prompts") -> int | None:
    """``n`` as a positive int, or None for all rows (0 or "all"); ``what`` names it in errors.

    Raises:
        SpecpilotError: not a non-negative integer (or its string) nor ``"all"``.
    """
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


def permutation(total: int, seed: int) -> list[int]:
    """``range(total)`` shuffled by ``random.Random(seed)`` (stable across Python versions)."""
    order = list(range(total))
    random.Random(seed).shuffle(order)
    return order


def test_reserve(total: int) -> list[int]:
    """Row indices (in :func:`~specpilot.prompts.sources.load_rows` order) reserved for calibration
    on a benchmark without a train split: the last ``min(TEST_RESERVE, total // 2)`` indices of the
    fixed permutation (seed :data:`RESERVE_SEED`), last first."""
    size = min(TEST_RESERVE, total // 2)
    return permutation(total, RESERVE_SEED)[::-1][:size]


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
        SpecpilotError: as for :func:`~specpilot.prompts.sources.load_rows`.
    """
    check_benchmark(benchmark)
    if benchmark == "gsm8k":
        rows = load_source("gsm8k-train", benchmark, data_dir)
        chosen = permutation(len(rows), RESERVE_SEED)[:TRAIN_RESERVE]
        return [{"request_id": f"gsm8k/train-{i:04d}", "benchmark": benchmark,
                 "turns": user_turns(benchmark, rows[i], i)} for i in chosen]
    if benchmark == "mbpp":
        test_texts = {r.get("text") for r in load_rows("mbpp", data_dir)}
        rows = [r for r in load_source("mbpp-all", benchmark, data_dir)
                if r.get("task_id") not in MBPP_TEST_TASK_IDS and r.get("text") not in test_texts]
        chosen = permutation(len(rows), RESERVE_SEED)[:TRAIN_RESERVE]
        return [{"request_id": f"mbpp/task-{int(rows[i]['task_id']):04d}", "benchmark": benchmark,
                 "turns": user_turns(benchmark, rows[i], i)} for i in chosen]
    rows = load_rows(benchmark, data_dir)
    return [{"request_id": f"{benchmark}/{i:04d}", "benchmark": benchmark, "turns": user_turns(benchmark, rows[i], i)}
            for i in test_reserve(len(rows))]


def _calibration_subset(benchmark: str, count: int | None, n: Any, seed: int,
                        data_dir: str | os.PathLike | None) -> list[dict]:
    """:func:`select`'s role ``"calibration"``: the pool shuffled with ``seed``, first ``count``."""
    if count is None:
        raise SpecpilotError(f"calibration prompts for {benchmark!r} must be a number, not all rows (n={n!r})")
    pool = calibration_pool(benchmark, data_dir)
    if count > len(pool):
        raise SpecpilotError(
            f"{count} calibration prompts asked for {benchmark!r}, but {len(pool)} are reserved for "
            f"calibration (config rounds.calibration_prompts must be <= {len(pool)})")
    order = permutation(len(pool), seed)
    return [pool[i] for i in order[:count]]


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
        benchmark: one of :data:`~specpilot.prompts.sources.BENCHMARKS`.
        n: number of prompts; 0 or ``"all"`` means every evaluation row (role ``"eval"`` only).
        seed: permutation seed.
        role: ``"eval"`` or ``"calibration"``.
        data_dir: see :func:`~specpilot.prompts.sources.load_rows`.
        n_eval: accepted for compatibility and checked (an integer or ``"all"``); calibration no
            longer depends on it.

    Returns:
        Rows ``{"request_id", "benchmark", "turns": [str, ...]}``. Eval request ids are
        ``f"{benchmark}/{i:04d}"``, ``i`` the row's index in ``load_rows`` order (for mbpp,
        ``mbpp/0000`` is task 11); calibration ids as in :func:`calibration_pool`. ``turns`` holds
        the user turns: the first formatted for the benchmark, further ones (mt-bench's second
        turn) raw.

    Raises:
        SpecpilotError: unknown benchmark or role, bad ``n``/``seed``/``n_eval``, ``n`` larger than
            the evaluation rows or the calibration reserve, calibration of all rows.
    """
    check_benchmark(benchmark)
    if role not in ROLES:
        raise SpecpilotError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpecpilotError(f"seed must be an integer, got {seed!r}")
    count = parse_n(n)
    if n_eval is not None:
        parse_n(n_eval, "n_eval")
    if role == "calibration":
        return _calibration_subset(benchmark, count, n, seed, data_dir)
    rows = load_rows(benchmark, data_dir)
    total = len(rows)
    reserved = _reserved_eval_rows(benchmark, total)
    order = [i for i in permutation(total, seed) if i not in reserved]
    count = len(order) if count is None else count
    if count > len(order):
        extra = f" ({len(reserved)} of its {total} rows are reserved for calibration)" if reserved else ""
        raise SpecpilotError(f"{benchmark!r} has {len(order)} evaluation prompts{extra}, cannot select n={count}")
    return [
        {"request_id": f"{benchmark}/{i:04d}", "benchmark": benchmark, "turns": user_turns(benchmark, rows[i], i)}
        for i in order[:count]
    ]


def training_pairs(data_dir: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """(user, assistant) texts for training the tiny deployment; never a test-split row.

    GSM8K train (user = question formatted like the gsm8k prompt, assistant = the worked answer),
    then MBPP tasks outside 11..510 (user = task text, assistant = its ``code`` with ``\\r\\n`` ->
    ``\\n``). A pair whose user text equals a gsm8k or mbpp test prompt is dropped as well (MBPP
    tasks 602, 704 and 872 repeat the text of test tasks 217, 248 and 216), and so is every
    calibration prompt (:func:`calibration_pool`: 64 gsm8k train rows, 64 mbpp tasks), so the
    agent rounds never calibrate on the tiny drafter's training text.

    Raises:
        SpecpilotError: a source is missing (see :func:`~specpilot.prompts.sources.load_rows`) or a
            row lacks a field.
    """
    held_out = {t for b in ("gsm8k", "mbpp") for r in select(b, "all", data_dir=data_dir) for t in r["turns"]}
    held_out |= {t for b in ("gsm8k", "mbpp") for r in calibration_pool(b, data_dir) for t in r["turns"]}
    pairs = []
    for i, row in enumerate(load_source("gsm8k-train", "gsm8k", data_dir)):
        user = row_field(row, "question", "gsm8k train", i) + BOXED_SUFFIX
        pairs.append((user, row_field(row, "answer", "gsm8k train", i)))
    for i, row in enumerate(load_source("mbpp-all", "mbpp", data_dir)):
        if row.get("task_id") in MBPP_TEST_TASK_IDS:
            continue
        code = row_field(row, "code", "mbpp", i).replace("\r\n", "\n")
        pairs.append((row_field(row, "text", "mbpp", i), code))
    return [p for p in pairs if p[0] not in held_out]

"""Where the benchmark rows come from: the local data dir or the Hugging Face Hub.

| name      | rows | local file (under the data dir) | Hugging Face Hub dataset                     |
| --------- | ---- | ------------------------------- | -------------------------------------------- |
| gsm8k     | 1319 | gsm8k/test.jsonl                | openai/gsm8k, config "main", split test      |
| humaneval | 164  | humaneval/test.jsonl            | openai/openai_humaneval, split test          |
| math500   | 500  | math500/test.jsonl              | HuggingFaceH4/MATH-500, split test           |
| mbpp      | 500  | mbpp/mbpp.jsonl, task_id 11-510 | google-research-datasets/mbpp, config "full" |
| mt-bench  | 80   | mt_bench/question.jsonl         | HuggingFaceH4/mt_bench_prompts, split train  |

The data dir is resolved by :func:`resolve_data_dir`: ``data_dir`` when given, else
``$SPECPILOT_DATA_DIR``, else ``shared/data/benchmarks`` beside the repository when it exists; with
none of them, rows come from the Hub through ``datasets``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ..errors import SpecpilotError
from ..io import read_jsonl

BENCHMARKS: tuple[str, ...] = ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")
DATA_DIR_ENV = "SPECPILOT_DATA_DIR"
MBPP_TEST_TASK_IDS = range(11, 511)  # the full MBPP set's test split (500 tasks)

# source key -> (file under the data dir, Hub repo, Hub config, Hub splits)
SOURCES: dict[str, tuple[str, str, str | None, tuple[str, ...]]] = {
    "gsm8k": ("gsm8k/test.jsonl", "openai/gsm8k", "main", ("test",)),
    "gsm8k-train": ("gsm8k/train.jsonl", "openai/gsm8k", "main", ("train",)),
    "humaneval": ("humaneval/test.jsonl", "openai/openai_humaneval", None, ("test",)),
    "math500": ("math500/test.jsonl", "HuggingFaceH4/MATH-500", None, ("test",)),
    "mbpp-all": ("mbpp/mbpp.jsonl", "google-research-datasets/mbpp", "full", ("prompt", "test", "validation", "train")),
    "mt-bench": ("mt_bench/question.jsonl", "HuggingFaceH4/mt_bench_prompts", None, ("train",)),
}


def check_benchmark(benchmark: Any) -> str:
    """``benchmark`` itself when it is one of :data:`BENCHMARKS`; else SpecpilotError naming it."""
    if benchmark not in BENCHMARKS:
        raise SpecpilotError(f"unknown benchmark {benchmark!r}; valid names: {', '.join(BENCHMARKS)}")
    return benchmark


def repo_data_dir(repo: str | os.PathLike | None = None) -> Path:
    """``shared/data/benchmarks`` beside the repository (``repo``: its root; default: the checkout
    this package was imported from, the folder holding ``src/specpilot``)."""
    root = Path(repo) if repo is not None else Path(__file__).resolve().parents[3]
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
        for rel in sorted({v[0] for v in SOURCES.values()}):
            f = root / rel
            if f.is_file():
                h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


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
    """The rows of source ``key`` from the Hub, in the local files' layout (mbpp sorted by task id,
    mt-bench's ``prompt`` renamed ``turns``); one SpecpilotError when ``datasets`` is missing or
    the Hub cannot be reached."""
    _, repo, config, splits = SOURCES[key]
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


def load_source(key: str, benchmark: str, data_dir: str | os.PathLike | None) -> list[dict]:
    """Every row of source ``key`` of :data:`SOURCES` (e.g. ``gsm8k-train``, ``mbpp-all``), from
    the resolved data dir or the Hub; ``benchmark`` names it in errors.

    Raises:
        SpecpilotError: the file is missing from the data dir; the Hub cannot be used.
    """
    root = resolve_data_dir(data_dir)
    if root is None:
        return _load_hub(key, benchmark)
    path = root / SOURCES[key][0]
    if not path.is_file():
        raise SpecpilotError(f"benchmark {benchmark!r}: {path} not found in the data dir {str(root)!r}")
    return read_jsonl(path)


def row_field(row: dict, name: str, benchmark: str, index: int, kind: type = str) -> Any:
    """``row[name]`` when it is a ``kind``; else SpecpilotError naming the benchmark, row and field."""
    value = row.get(name)
    if not isinstance(value, kind):
        raise SpecpilotError(f"benchmark {benchmark!r} row {index}: field {name!r} is missing or not a {kind.__name__}")
    return value


def load_rows(benchmark: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """The benchmark's evaluation rows, unformatted, in the source file's order.

    Args:
        benchmark: one of :data:`BENCHMARKS`.
        data_dir: folder laid out like ``shared/data/benchmarks``; ``None`` falls back to
            ``$SPECPILOT_DATA_DIR``, then to ``shared/data/benchmarks`` beside the repository and
            then to the Hugging Face Hub (:func:`resolve_data_dir`).

    Returns:
        The original rows (fields as in the source: gsm8k ``question``/``answer``, humaneval
        ``prompt``..., math500 ``problem``..., mbpp ``text``/``code``/``task_id``..., mt-bench
        ``turns``...). mbpp returns only the test split (task ids 11..510, 500 rows).

    Raises:
        SpecpilotError: unknown benchmark; the data dir or its file is missing; no data dir is
            configured and the Hub is unreachable (one line naming the benchmark).
    """
    check_benchmark(benchmark)
    if benchmark == "mbpp":
        rows = load_source("mbpp-all", benchmark, data_dir)
        return [r for r in rows if r.get("task_id") in MBPP_TEST_TASK_IDS]
    return load_source(benchmark, benchmark, data_dir)

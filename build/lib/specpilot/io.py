"""Atomic file output and JSON-lines input.

Every result file is written to a temporary file in the same directory and renamed into place,
so a killed run never leaves a half-written result that a rerun would mistake for a finished one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .errors import SpecpilotError


def _umask() -> int:
    """The process's file-mode creation mask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same directory + ``os.replace``).

    The file gets the mode a plain ``open(path, "w")`` would give it (0o666 less the umask, e.g.
    0o644), not the 0o600 of a temporary file, so others on a shared filesystem can read results.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write one JSON document atomically (indented, keys in insertion order)."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> None:
    """Write JSON lines atomically: one compact JSON object per line."""
    atomic_write_text(path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def read_json(path: str | os.PathLike) -> Any:
    """Read one JSON document; a missing or corrupt file raises SpecpilotError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise SpecpilotError(f"file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise SpecpilotError(f"{path} is not valid JSON: {e}") from None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file into a list of dicts.

    Raises:
        SpecpilotError: the file is missing, or a line is not a JSON object (line number given).
    """
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecpilotError(f"{path}:{i} is not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise SpecpilotError(f"{path}:{i} is not a JSON object")
                rows.append(row)
    except FileNotFoundError:
        raise SpecpilotError(f"file not found: {path}") from None
    return rows


def comma_list(value: str) -> list[str]:
    """An argparse ``type``: ``"a,b,c"`` -> ``["a", "b", "c"]`` (options naming one file per item)."""
    return value.split(",")


def one_out_each(outs: list[str], items: list, what: str) -> list[tuple]:
    """``(item, out)`` pairs of a command writing one ``--out`` file per item.

    Raises:
        SpecpilotError: the two lists differ in length (both counts named).
    """
    if len(outs) != len(items):
        raise SpecpilotError(f"--out names {len(outs)} file(s) for {len(items)} {what}")
    return list(zip(items, outs))


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read a prompt file (JSON lines with request_id, benchmark, prompt_ids; ``specpilot prompts``
    writes them), the first ``limit`` rows (None: all). Raises SpecpilotError for a missing file,
    a malformed line or a row without one of those fields (file and line named)."""
    rows = read_jsonl(path)
    for i, r in enumerate(rows):
        for key in ("request_id", "benchmark", "prompt_ids"):
            if key not in r:
                raise SpecpilotError(f"{path}:{i + 1} lacks field {key!r}")
    return rows[:limit] if limit else rows

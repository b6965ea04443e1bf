"""Structured memory: one JSON-lines store of validated mechanisms, shared across deployments.

Each entry: id, direction, params, deployment, gpu, target, drafter, gain (measured speedup of
the candidate over its round's base, > 1 is better), evidence (paths), round, status
(``valid``/``invalidated``), reason. An invalidated entry is marked, never deleted. Writers take an
exclusive file lock, so parallel Snakemake jobs can record into the same file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from ..io import atomic_write_text


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read(path: str | os.PathLike) -> list[dict]:
    """All entries (empty when the file does not exist yet)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _key(e: dict) -> tuple:
    return (e["direction"], json.dumps(e["params"], sort_keys=True), e["deployment"], e["gpu"], e["round"])


def record(path: str | os.PathLike, entry: dict) -> dict:
    """Insert or update (same direction, params, deployment, gpu, round) a validated mechanism."""
    p = Path(path)
    entry = {"status": "valid", "reason": "", **entry}
    with _locked(p):
        entries = read(p)
        keys = [_key(e) for e in entries]
        if _key(entry) in keys:
            entry["id"] = entries[keys.index(_key(entry))]["id"]
            entries[keys.index(_key(entry))] = entry
        else:
            entry["id"] = f"m{len(entries) + 1:04d}"
            entries.append(entry)
        atomic_write_text(p, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
    return entry


def invalidate(path: str | os.PathLike, entry_id: str, reason: str) -> None:
    """Mark an entry invalidated (kept in the file with the reason)."""
    p = Path(path)
    with _locked(p):
        entries = read(p)
        for e in entries:
            if e["id"] == entry_id:
                e["status"], e["reason"] = "invalidated", reason
        atomic_write_text(p, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))


def best_known(path: str | os.PathLike, ctx: dict) -> dict[str, dict]:
    """Best valid entry per direction that applies to a deployment context.

    Entries from the same deployment and GPU rank first; then the same target or drafter on any
    GPU (transfer to other deployments); within a tier, the higher gain wins.
    """
    def tier(e):
        if e["deployment"] == ctx.get("deployment") and e["gpu"] == ctx.get("gpu"):
            return 0
        if e.get("drafter") == ctx.get("drafter") or e.get("target") == ctx.get("target"):
            return 1
        return 2

    best: dict[str, dict] = {}
    for e in read(path):
        if e["status"] != "valid" or e["gain"] <= 1.0:
            continue
        cur = best.get(e["direction"])
        if cur is None or (tier(e), -e["gain"]) < (tier(cur), -cur["gain"]):
            best[e["direction"]] = e
    return best

"""Structured memory: validated mechanisms as immutable JSON-lines snapshots.

Each round of a (gpu, deployment) reads one snapshot and writes a new one (both declared files of
the workflow), so what a round knew is a file Snakemake tracks, and a rerun with the same inputs
writes the same memory. Memory shared across deployments is a declared merge of their snapshots
(:func:`merge`); who learned from whom is the DAG.

Entry fields: ``id`` (derived from the key below, so the same mechanism found in two branches
gets the same id), ``direction``, ``params``, ``deployment``, ``gpu``, ``target``, ``drafter``,
``regime`` and ``concurrency`` (the serving regime and the concurrency its round tuned at),
``gain`` (measured speedup of the candidate over its round's base, > 1 is better), ``evidence``
(paths), ``round``, ``status`` (``valid`` / ``invalidated``), ``reason``. An invalidated entry is
marked, never deleted.

All functions but :func:`read` and :func:`write` are pure: they take and return entry lists.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from ..errors import SpecpilotError
from ..io import atomic_write_text, read_jsonl

REQUIRED = ("direction", "params", "deployment", "gpu", "gain", "round")


def read(path: str | os.PathLike | None) -> list[dict]:
    """All entries of a snapshot file; ``None`` means the empty memory.

    Raises:
        SpecpilotError: the file is missing, not JSON lines, or an entry lacks a required field.
    """
    if path is None:
        return []
    entries = read_jsonl(path)
    for i, e in enumerate(entries, 1):
        missing = [k for k in REQUIRED if k not in e]
        if missing:
            raise SpecpilotError(f"{path}:{i}: memory entry lacks {', '.join(missing)}")
    return entries


def write(path: str | os.PathLike, entries: Iterable[dict]) -> None:
    """Write a snapshot atomically, one entry per line, sorted by id (a canonical, diffable file)."""
    rows = sorted(entries, key=lambda e: e["id"])
    atomic_write_text(Path(path), "".join(json.dumps(e, sort_keys=True) + "\n" for e in rows))


def _key(e: dict) -> tuple:
    key = (e["direction"], json.dumps(e["params"], sort_keys=True), e["deployment"], e["gpu"], int(e["round"]))
    return key + (e["regime"],) if e.get("regime") else key  # entries from before regimes keep their ids


def entry_id(e: dict) -> str:
    """Stable id of an entry: ``m`` + 10 hex digits of the SHA-1 of (direction, params, deployment,
    gpu, round[, regime])."""
    return "m" + hashlib.sha1(json.dumps(_key(e)).encode()).hexdigest()[:10]


def record(entries: list[dict], entry: dict) -> list[dict]:
    """A new list with ``entry`` inserted, or replacing the entry of the same key (same id)."""
    new = {"status": "valid", "reason": "", **entry}
    new["id"] = entry_id(new)
    return [e for e in entries if e["id"] != new["id"]] + [new]


def invalidate(entries: list[dict], entry_id_: str, reason: str) -> list[dict]:
    """A new list with entry ``entry_id_`` marked invalidated with ``reason`` (kept, not deleted).

    Raises:
        SpecpilotError: no entry has that id.
    """
    if not any(e["id"] == entry_id_ for e in entries):
        raise SpecpilotError(f"memory has no entry {entry_id_!r}")
    return [{**e, "status": "invalidated", "reason": reason} if e["id"] == entry_id_ else e for e in entries]


def merge(snapshots: Iterable[list[dict]]) -> list[dict]:
    """Union of snapshots by id, independent of their order.

    An entry invalidated in any snapshot is invalidated in the merge (reasons joined, sorted); of
    several valid copies of one id (the same measurement inherited along different paths) the one
    with the highest gain is kept.
    """
    by_id: dict[str, dict] = {}
    reasons: dict[str, set[str]] = {}
    for entries in snapshots:
        for e in entries:
            if e["status"] == "invalidated":
                reasons.setdefault(e["id"], set()).add(e["reason"])
            cur = by_id.get(e["id"])
            if cur is None or (e["gain"], json.dumps(e, sort_keys=True)) > (cur["gain"], json.dumps(cur, sort_keys=True)):
                by_id[e["id"]] = e
    out = []
    for i, e in sorted(by_id.items()):
        if i in reasons:
            e = {**e, "status": "invalidated", "reason": "; ".join(sorted(reasons[i]))}
        out.append(e)
    return out


def valid_for(entries: list[dict], direction: str) -> list[dict]:
    """Valid entries of one direction, best gain first (hints for that direction's agent)."""
    return sorted((e for e in entries if e["direction"] == direction and e["status"] == "valid"),
                  key=lambda e: (-e["gain"], e["id"]))


def best_known(entries: list[dict], ctx: dict) -> dict[str, dict]:
    """Best valid entry per direction that applies to a deployment context.

    Entries from the same deployment and GPU rank first; then the same target or drafter on the
    same GPU (another drafter of the target: a step path of the target, an acceptance setting of a
    similar drafter, measured on this device's costs); then the same target or drafter on another
    GPU; then the rest. Within a tier an entry of the context's serving regime (``ctx["regime"]``)
    ranks before one of another regime (an earlier regime's entry is a candidate the later regime
    re-measures at its own concurrency), then the higher gain wins (then the id, so the choice never
    depends on file order). What a candidate applies to is the directions' business
    (:func:`specpilot.agent.directions.applicable`), and a transferred entry is trialled behind the
    token-forcing gate before it counts (``round plan``).
    """
    def tier(e):
        if e["deployment"] == ctx.get("deployment") and e["gpu"] == ctx.get("gpu"):
            return 0
        kin = e.get("drafter") == ctx.get("drafter") or e.get("target") == ctx.get("target")
        if kin and e["gpu"] == ctx.get("gpu"):
            return 1
        return 2 if kin else 3

    best: dict[str, dict] = {}
    for e in entries:
        if e["status"] != "valid" or e["gain"] <= 1.0:
            continue
        cur = best.get(e["direction"])
        rank = lambda x: (tier(x), x.get("regime", "single") != ctx.get("regime", "single"), -x["gain"], x["id"])  # noqa: E731
        if cur is None or rank(e) < rank(cur):
            best[e["direction"]] = e
    return best


def add_arguments(p) -> None:
    p.add_argument("--snapshots", nargs="*", default=[], help="memory snapshots to merge")
    p.add_argument("--out", required=True, help="merged memory (JSON lines)")


def run(args) -> int:
    """``specpilot memory``: merge snapshots into one file (the shared memory of a study)."""
    merged = merge(read(p) for p in args.snapshots)
    write(args.out, merged)
    valid = sum(e["status"] == "valid" for e in merged)
    print(f"memory: {len(merged)} entries ({valid} valid) from {len(args.snapshots)} snapshots -> {args.out}")
    return 0

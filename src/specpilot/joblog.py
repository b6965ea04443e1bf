"""What a run's jobs said: a failed job's one clear line, and each rule's time, for the console.

Every workflow job writes its output to a log file (``logs/...``); a job that stops on bad input
prints ``specpilot: error: <message>`` there (:class:`specpilot.errors.SpecpilotError`), and
Snakemake's console shows only "CalledProcessError ... exit status 2". The workflow's ``onerror``
handler calls :func:`failed_job_lines` on Snakemake's own log of the run and prints, per failed
job, the rule, its log file and the line that says why. ``onsuccess`` calls :func:`rule_times`
on the same log and prints each rule's wall time on this run (:func:`times_lines`).

GPU seconds per job (:func:`gpu_seconds`): every GPU job runs under the device wrapper
(:func:`specpilot.devices.run_on_device`), which writes into the job's log when it took the device
and, when the job ends, how long it held it. Read from the logs, not from Snakemake's, so they exist
also when the time guard stopped the run (no ``onsuccess``): a job stopped while it held the device
has no release line and counts until its log was last written. :func:`merge_gpu_seconds` keeps every
call's jobs in one file across resumed calls (a rerun job's log is overwritten; the file keeps both).
"""

from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from .io import atomic_write_text

_BLOCK = re.compile(r"^Error in rule (?P<rule>\S+):\n(?P<body>(?:    .*\n?)+)", re.M)
_LOG = re.compile(r"^    log: (?P<logs>.*?)(?: \(check log file\(s\) for error details\))?$", re.M)
_STAMP = re.compile(r"^\[(?P<when>\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_START = re.compile(r"^(?:local)?(?:rule|checkpoint) (?P<rule>\w+):$")
_JOBID = re.compile(r"^    jobid: (?P<id>\d+)$")
_DONE = re.compile(r"^Finished jobid: (?P<id>\d+)")
_TAKEN = re.compile(r"^specpilot: device (?P<index>\d+) \((?P<uuid>[^,)]+)(?:, [^)]*)?\) taken at (?P<at>\S+)")
_RELEASED = re.compile(r"^specpilot: device \d+ \([^)]+\) released at (?P<at>\S+) after (?P<s>[\d.]+) s "
                       r"\(exit (?P<rc>-?\d+)\)")
GPU_SECONDS_FIELDS = ("job", "taken_at", "seconds", "status")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*")


def reason(log_text: str) -> str | None:
    """The line of a job's log that says why it failed: the last ``specpilot: error:`` line, else
    the last line of a Python traceback (``SomeError: ...``), else None."""
    lines = [ln.strip() for ln in log_text.splitlines()]
    for ln in reversed(lines):
        if ln.startswith("specpilot: error:"):
            return ln
    for ln in reversed(lines):
        if _EXCEPTION.match(ln):
            return ln
    return None


def _read(snakemake_log) -> str:
    paths = [snakemake_log] if isinstance(snakemake_log, (str, Path)) else list(snakemake_log or [])
    text = ""
    for path in paths:
        try:
            text += Path(path).read_text(errors="replace")
        except OSError:
            pass
    return text


def rule_times(snakemake_log) -> dict[str, list[float]]:
    """Wall seconds of every job this run ran, by rule, from Snakemake's log of the run (the
    ``log`` variable of ``onsuccess``): from the time stamp above a job's ``rule NAME:`` block to
    the one above its ``Finished jobid: N`` line (one-second resolution, as Snakemake stamps).
    A job without a finish line (a dry run, a failure) is left out."""
    started: dict[str, tuple[str, datetime]] = {}
    out: dict[str, list[float]] = defaultdict(list)
    when, rule = None, None
    for line in _read(snakemake_log).splitlines():
        if m := _STAMP.match(line):
            when = datetime.strptime(m["when"], "%a %b %d %H:%M:%S %Y")
        elif m := _START.match(line):
            rule = (m["rule"], when)
        elif (m := _JOBID.match(line)) and rule is not None:
            started[m["id"]], rule = rule, None
        elif (m := _DONE.match(line)) and m["id"] in started and when is not None:
            name, t0 = started.pop(m["id"])
            if t0 is not None:
                out[name].append((when - t0).total_seconds())
    return dict(out)


def times_lines(times: dict[str, list[float]]) -> list[str]:
    """The run summary of :func:`rule_times`: one line per rule, longest total first:
    ``RULE  TOTAL s  (N jobs, longest S s)``, then the sum over jobs."""
    rows = sorted(times.items(), key=lambda kv: -sum(kv[1]))
    width = max((len(r) for r in times), default=4)
    lines = [f"{rule:<{width}}  {sum(t):7.0f} s  ({len(t)} job{'s' if len(t) != 1 else ''}, longest {max(t):.0f} s)"
             for rule, t in rows]
    return lines + [f"{'all jobs':<{width}}  {sum(sum(t) for t in times.values()):7.0f} s  (job time, not wall time: jobs overlap)"]


def failed_job_lines(snakemake_log, root: str | Path = ".") -> list[str]:
    """One line per failed job of a run: ``rule RULE failed (LOG): WHY``.

    Args:
        snakemake_log: Snakemake's log of the run: the ``log`` variable of ``onerror`` (a path, or
            a list of paths in Snakemake 9).
        root: the folder the jobs' log paths are relative to (the working directory).
    Returns:
        The lines in the order the jobs failed; a job whose log names no reason gives
        ``see LOG``. Empty when the log is unreadable or names no failed job.
    """
    text = _read(snakemake_log)
    out, seen = [], set()
    for block in _BLOCK.finditer(text):
        m = _LOG.search(block["body"])
        logs = [p.strip() for p in m["logs"].split(",")] if m else []
        for log in logs or [""]:
            key = (block["rule"], log)
            if key in seen:
                continue
            seen.add(key)
            why = None
            if log:  # every rule of this workflow has one; a job without is named all the same
                try:
                    why = reason((Path(root) / log).read_text(errors="replace"))
                except OSError:
                    pass
            if why and why.startswith("specpilot: error: "):
                why = why[len("specpilot: error: "):]
            if log:
                out.append(f"rule {block['rule']} failed ({log}): {why or 'see ' + log}")
            else:
                out.append(f"rule {block['rule']}: failed (it has no log)")
    return out


def gpu_seconds(root: str | Path = "logs") -> list[dict]:
    """Seconds each GPU job held its device, from the device wrapper's lines in the job logs under
    ``root`` (every ``*.log``).

    Returns:
        One dict per device hold, in log path order: ``job`` (the log's path under ``root``, without
        ``.log``), ``taken_at`` (ISO time the job took the device), ``seconds`` (float) and
        ``status``: ``finished`` (exit 0), ``exit N`` (failed), or ``stopped`` (no release line: the
        run was stopped while the job held the device; counted until the log's last write, its
        modification time).
    """
    rows = []
    base = Path(root)
    for path in sorted(base.rglob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        job, taken = str(path.relative_to(base))[: -len(".log")], None
        for line in text.splitlines():
            if m := _TAKEN.match(line):
                taken = m["at"]
            elif (m := _RELEASED.match(line)) and taken is not None:
                rc = int(m["rc"])
                rows.append({"job": job, "taken_at": taken, "seconds": float(m["s"]),
                             "status": "finished" if rc == 0 else f"exit {rc}"})
                taken = None
        if taken is not None:
            try:
                t0 = datetime.fromisoformat(taken)
                t1 = datetime.fromtimestamp(path.stat().st_mtime, t0.tzinfo)
                held = max(0.0, (t1 - t0).total_seconds())
            except (OSError, ValueError):
                held = float("nan")
            rows.append({"job": job, "taken_at": taken, "seconds": held, "status": "stopped"})
    return rows


def merge_gpu_seconds(path: str | Path, rows: list[dict]) -> list[dict]:
    """Add ``rows`` (:func:`gpu_seconds`) to the tab-separated file ``path`` (header
    :data:`GPU_SECONDS_FIELDS`), one row per (job, taken_at): a hold already there is replaced by
    the newer reading (a stopped job read again keeps its one row). Written atomically; returns every
    row of the file, in the order taken."""
    p = Path(path)
    have: dict[tuple[str, str], dict] = {}
    if p.is_file():
        lines = p.read_text().splitlines()
        for line in lines[1:]:
            parts = line.split("\t")
            if len(parts) == len(GPU_SECONDS_FIELDS):
                row = dict(zip(GPU_SECONDS_FIELDS, parts))
                row["seconds"] = float(row["seconds"])
                have[(row["job"], row["taken_at"])] = row
    for row in rows:
        have[(row["job"], row["taken_at"])] = dict(row)
    out = sorted(have.values(), key=lambda r: r["taken_at"])
    atomic_write_text(p, "\t".join(GPU_SECONDS_FIELDS) + "\n" + "".join(
        "\t".join(str(round(r[k], 1)) if k == "seconds" else str(r[k]) for k in GPU_SECONDS_FIELDS) + "\n"
        for r in out))
    return out


def gpu_seconds_lines(rows: list[dict], top: int = 60) -> list[str]:
    """The summary of :func:`gpu_seconds` rows: the total and per status, then the ``top`` longest
    holds, ``SECONDS s  JOB  (STATUS, taken TAKEN_AT)``."""
    total = sum(r["seconds"] for r in rows if r["seconds"] == r["seconds"])
    by = defaultdict(float)
    for r in rows:
        by[r["status"]] += r["seconds"] if r["seconds"] == r["seconds"] else 0.0
    out = [f"GPU-held seconds: {total:.0f} s over {len(rows)} job(s) ("
           + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(by.items())) + ")"]
    for r in sorted(rows, key=lambda r: -(r["seconds"] if r["seconds"] == r["seconds"] else 0.0))[:top]:
        out.append(f"  {r['seconds']:7.1f} s  {r['job']}  ({r['status']}, taken {r['taken_at']})")
    return out


"""What a run's jobs said: a failed job's one clear line, and each rule's time, for the console.

Every workflow job writes its output to a log file (``logs/...``); a job that stops on bad input
prints ``specpilot: error: <message>`` there (:class:`specpilot.errors.SpecpilotError`), and
Snakemake's console shows only "CalledProcessError ... exit status 2". The workflow's ``onerror``
handler calls :func:`failed_job_lines` on Snakemake's own log of the run and prints, per failed
job, the rule, its log file and the line that says why. ``onsuccess`` calls :func:`rule_times`
on the same log and prints each rule's wall time on this run (:func:`times_lines`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime
from pathlib import Path

_BLOCK = re.compile(r"^Error in rule (?P<rule>\S+):\n(?P<body>(?:    .*\n?)+)", re.M)
_LOG = re.compile(r"^    log: (?P<logs>.*?)(?: \(check log file\(s\) for error details\))?$", re.M)
_STAMP = re.compile(r"^\[(?P<when>\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_START = re.compile(r"^(?:local)?(?:rule|checkpoint) (?P<rule>\w+):$")
_JOBID = re.compile(r"^    jobid: (?P<id>\d+)$")
_DONE = re.compile(r"^Finished jobid: (?P<id>\d+)")
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

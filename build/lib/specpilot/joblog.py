"""What a failed job said: its one clear line, for the console.

Every workflow job writes its output to a log file (``logs/...``); a job that stops on bad input
prints ``specpilot: error: <message>`` there (:class:`specpilot.errors.SpecpilotError`), and
Snakemake's console shows only "CalledProcessError ... exit status 2". The workflow's ``onerror``
handler calls :func:`failed_job_lines` on Snakemake's own log of the run and prints, per failed
job, the rule, its log file and the line that says why.
"""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"^Error in rule (?P<rule>\S+):\n(?P<body>(?:    .*\n?)+)", re.M)
_LOG = re.compile(r"^    log: (?P<logs>.*?)(?: \(check log file\(s\) for error details\))?$", re.M)
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
    paths = [snakemake_log] if isinstance(snakemake_log, (str, Path)) else list(snakemake_log or [])
    text = ""
    for path in paths:
        try:
            text += Path(path).read_text(errors="replace")
        except OSError:
            pass
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

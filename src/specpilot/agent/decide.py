"""Decisions of the agent rounds that hold above timing noise.

A trial (:meth:`specpilot.agent.trial.Evaluator.trial`) measures a candidate's gain over its base
with the interval the study table uses for its speedups (:func:`specpilot.aggregate.bootstrap_interval`:
a seeded percentile bootstrap over requests and repeats, 95 %). Here:

- :func:`settle`: where a sequential trial stops (:meth:`specpilot.agent.trial.Evaluator.trial`
  measures a trial whose interval straddles ``min_gain`` on the next rung of calibration prompts,
  up to a cap, unless its point gain is at most ``min_gain``; one still straddling at the cap is
  "undecided at the cap" and does not clear);
- :func:`clears`: a candidate counts only when the lower end of that interval is at least
  ``min_gain``, so a gain that timing noise alone could explain never changes the engine;
- :func:`rank`: among candidates the measurement cannot tell apart (intervals overlapping the best
  one's) a fixed order decides, not the luckiest timing;
- :func:`choose`: the first ranked candidate that clears ``min_gain``, else None (the base stays).

So a round run again on the same machine keeps the same config when its winner is clear of
``min_gain``, and keeps its base otherwise. A trial without an interval (``gain_lo``/``gain_hi``
absent) is read as the point ``gain``.
"""

from __future__ import annotations

from typing import Any, Callable


def _lo(r: dict) -> float:
    return r["gain_lo"] if r.get("gain_lo") is not None else r["gain"]


def _hi(r: dict) -> float:
    return r["gain_hi"] if r.get("gain_hi") is not None else r["gain"]


def settle(lo: float, hi: float, min_gain: float, gain: float | None = None) -> str:
    """Where a trial's 95 % gain interval ``[lo, hi]`` and point ``gain`` stand against ``min_gain``:

    - ``"clears"``: ``lo >= min_gain`` (a win);
    - ``"below"``: ``hi < min_gain`` (the gain, if any, is smaller than asked);
    - ``"futile"``: the point ``gain`` is at most ``min_gain``: more requests narrow the interval
      around it, so it would not clear (the futility bound of a group-sequential design, Jennison
      & Turnbull, Group Sequential Methods with Applications to Clinical Trials, 2000, ch. 10). On
      tiny's request-to-request spread it stops a 0 % candidate after 6.5 requests on average
      instead of 18 and loses a real 20 % gain in 1 of 60 re-runs more (tests/test_decisions.py);
    - ``"straddles"``: measure more requests.

    Without ``gain``: only ``clears`` / ``below`` / ``straddles``. A NaN interval straddles."""
    if lo >= min_gain:
        return "clears"
    if hi < min_gain:
        return "below"
    if gain is not None and gain <= min_gain:
        return "futile"
    return "straddles"


def clears(result: dict, min_gain: float) -> bool:
    """True when a trial passed token forcing and the lower end of its gain's 95 % interval
    (``gain_lo``) is at least ``min_gain``: the gain holds above timing noise."""
    return bool(result["gate"]["passed"]) and result.get("gain") is not None and _lo(result) >= min_gain


def rank(results: list[dict], order: Callable[[dict], Any]) -> list[dict]:
    """Trials that passed token forcing, best first, in an order timing noise does not reshuffle.

    The trials statistically tied with the best point gain (the upper end of their interval at
    least the best's lower end) come first, in the fixed ``order`` (e.g. the candidate's place in
    its direction's grid: no timing in it); the rest follow by point gain. A tie is what the
    measurement cannot resolve, so it is broken by something that does not change between runs.
    """
    ok = [r for r in results if r["gate"]["passed"] and r.get("gain") is not None]
    if not ok:
        return []
    best = max(ok, key=lambda r: r["gain"])
    tied = [r for r in ok if _hi(r) >= _lo(best)]
    rest = [r for r in ok if _hi(r) < _lo(best)]
    return sorted(tied, key=order) + sorted(rest, key=lambda r: -r["gain"])


def choose(results: list[dict], order: Callable[[dict], Any], min_gain: float) -> dict | None:
    """The trial a decision keeps: the first of :func:`rank` among those that :func:`clears`
    ``min_gain``; None when none does (the base stays)."""
    ranked = rank([r for r in results if clears(r, min_gain)], order)
    return ranked[0] if ranked else None

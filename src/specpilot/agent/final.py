"""``specpilot final``: the specpilot engine config of a (deployment, serving regime) = its last
round's integrated config (``results/{gpu}/{deployment}/{regime}/specpilot.json``).

Kept apart from :mod:`specpilot.agent.rounds` so that this step, on the critical path between a
deployment's last round and its engine cells, imports no torch (a job of well under a second
instead of ~5 s of imports: the GPU study's one-call budget, issue 46).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import SpecpilotError
from ..io import read_json, write_json


def gain_over_stock(integrated: dict) -> float | None:
    """The round's kept config's gain over **stock** on the calibration requests (issue 61; not over
    the round's base, which is not stock once memory transferred something): its speedup over AR
    there / stock's (both geometric means over the same requests against the same AR references,
    so the ratio is the geomean of stock / kept decode seconds). None when either is missing."""
    kept, stock = integrated.get("speedup_vs_ar"), integrated.get("stock_speedup_vs_ar")
    if not kept or not stock:
        return None
    return float(kept) / float(stock)


def final_config(integrated: dict, costmodel_text: str | None = None, regime: str | None = None) -> dict:
    """The content of ``specpilot.json`` from a round's ``integrated.json`` content.

    Returns ``engine_config`` (the round's config), ``round``, the calibration speedup over AR,
    its gain over stock there (:func:`gain_over_stock`) and tau, whether token forcing validated it, the serving regime and the concurrency its rounds tuned
    at (``regime``, else the round's own) and, given ``costmodel_text``, the cost model of that
    config as lines (where the time goes with it).

    Raises:
        SpecpilotError: ``integrated`` lacks a key a round's integration writes.
    """
    missing = [k for k in ("config", "round", "speedup_vs_ar", "tau", "gate") if k not in integrated]
    if missing:
        raise SpecpilotError(f"--integrated is not a round's integrated.json: no {', '.join(missing)}")
    out = {"engine_config": integrated["config"], "round": integrated["round"],
           "speedup_vs_ar_calibration": integrated["speedup_vs_ar"],
           "gain_over_stock_calibration": gain_over_stock(integrated), "tau_calibration": integrated["tau"],
           "validated_by_token_forcing": integrated["gate"]["passed"],
           "regime": regime or integrated.get("regime"), "tuned_concurrency": integrated.get("concurrency")}
    if costmodel_text is not None:
        out["costmodel"] = costmodel_text.splitlines()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``specpilot final``."""
    p.add_argument("--integrated", required=True, help="integrated.json of the deployment's last round")
    p.add_argument("--costmodel-text", help="costmodel-integrated.txt of that round (copied in as lines)")
    p.add_argument("--regime", help="the serving regime whose engine config this is (recorded)")
    p.add_argument("--out", required=True, help="specpilot.json to write (atomically)")


def run(args) -> int:
    """Write ``--out`` from ``--integrated`` (and ``--costmodel-text``)."""
    text = Path(args.costmodel_text).read_text() if args.costmodel_text else None
    write_json(args.out, final_config(read_json(args.integrated), text, args.regime))
    return 0

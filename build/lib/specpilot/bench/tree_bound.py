"""``specpilot bench tree-bound``: how far token trees can take tau, and the speedup over stock,
under one replay profile (issues 16 and 20). CPU, seconds; its dry run is the run.

For each node budget N the optimal static tree (:func:`optimal_tree`: the N most probable rank
paths, positions' ranks independent; Sequoia, arXiv 2402.12374) gives the largest expected tau any
tree of N nodes reaches under the profile's rank model; ``--depth`` bounds the draft positions (a
second block on top: 31). With a step-cost model (AR step; stock's draft, verify and the rest; a
tree's verify by its rows: linear between measured points, beyond them the last point scaled by
the rows, at least the arithmetic floor 2 x params x rows / peak), the best tree's speedup over
stock; the bound column charges a tree only max(the fewest-rows verify, the floor) and no extra
draft or host time: an upper bound for every tree and two-level mechanism of that budget.

The cost model's defaults are the H200 numbers of the Qwen3-8B shape at c1 (BENCHMARKS.md,
2026-12-02: ``specpilot bench verify`` and the serving c1 cell). Replaces gpu_bench/tree_bound.py.
"""

from __future__ import annotations

import argparse
import json

from . import _engine as E
from ._common import Run, add_common, fmt



def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "tree-bound")
    p.add_argument("--profile", default="study_stock", help="replay profile with rank_recall")
    p.add_argument("--block", type=int, default=16, help="stock's block (anchor + drafts)")
    p.add_argument("--depth", type=int, nargs="+", default=[15, 31], help="tree depths (draft positions) to bound")
    p.add_argument("--nodes", type=int, nargs="+", default=[15, 31, 63, 127, 255, 511, 1023, 4095])
    p.add_argument("--max-rank", type=int, default=16, help="deepest candidate rank a node may take")
    p.add_argument("--ar-ms", type=float, default=4.689, help="AR step [ms]")
    p.add_argument("--stock-draft-ms", type=float, default=1.00)
    p.add_argument("--stock-rest-ms", type=float, default=0.34, help="host work and launches per stock step")
    p.add_argument("--verify-points", default='{"16": 4.866, "32": 5.032, "64": 5.572, "256": 8.835, "384": 11.637}',
                   help="JSON rows -> verify ms (chain 16/32/64 at batch 1; 256 / 384 rows = 16 / 24 requests x 16)")
    p.add_argument("--params", type=float, default=8.19e9, help="target parameters")
    p.add_argument("--peak", type=float, default=7.9e14, help="bf16 matmul rate [FLOP/s]")


def floor_ms(rows: int, params: float, peak: float) -> float:
    """The matmul floor of a verify of ``rows`` rows [ms]: 2 x params x rows / ``peak``."""
    return 2.0 * params * rows / peak * 1e3


def verify_ms(nodes: int, points: dict[int, float], params: float, peak: float) -> float:
    """Estimated verify time [ms] of ``nodes`` + 1 rows: linear between the measured points
    (rows -> ms), beyond the last the last point scaled by the rows, never below the floor."""
    rows, xs = nodes + 1, sorted(points)
    if rows <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if rows <= b:
            return points[a] + (points[b] - points[a]) * (rows - a) / (b - a)
    return max(points[xs[-1]] * rows / xs[-1], floor_ms(rows, params, peak))


def verify_bound_ms(nodes: int, points: dict[int, float], params: float, peak: float) -> float:
    """A lower bound of the verify time of ``nodes`` + 1 rows [ms]: the fewest-rows verify (every
    weight read once) and the matmul floor."""
    return max(points[min(points)], floor_ms(nodes + 1, params, peak))


def bound(a: argparse.Namespace) -> dict:
    prof = E.load_profile(a.profile)
    points = {int(k): float(v) for k, v in json.loads(a.verify_points).items()}
    stock_tau = E.expected_tau(prof, a.block)
    rest = a.stock_draft_ms + a.stock_rest_ms
    stock_rate = stock_tau / (rest + verify_ms(a.block - 1, points, a.params, a.peak))
    rows = []
    for depth in a.depth:
        for n in a.nodes:
            shape = E.optimal_tree(prof, n, depth, a.max_rank)
            step = rest + verify_ms(n, points, a.params, a.peak)
            low = rest + verify_bound_ms(n, points, a.params, a.peak)
            rows.append({"depth": depth, "nodes": n, "tau": shape.expected_tau, "tau_vs_stock": shape.expected_tau / stock_tau,
                         "step_ms": step, "speedup_vs_stock": shape.expected_tau / step / stock_rate,
                         "speedup_vs_ar": shape.expected_tau / step * a.ar_ms, "step_ms_bound": low,
                         "speedup_vs_stock_bound": shape.expected_tau / low / stock_rate, "max_rank": max(shape.ranks)})
    return {"profile": prof.name, "stock_tau": stock_tau, "stock_speedup_vs_ar": stock_rate * a.ar_ms,
            "cost_model": {k: getattr(a, k) for k in ("ar_ms", "stock_draft_ms", "stock_rest_ms", "params", "peak")}
            | {"verify_points": points}, "rows": rows,
            "best": max(rows, key=lambda r: r["speedup_vs_stock"]),
            "bound": max(rows, key=lambda r: r["speedup_vs_stock_bound"])}


def table(R: dict) -> list[str]:
    b = R.get("bound")
    if not b:
        return []
    L = [f"profile {b['profile']}: stock tau {fmt(b['stock_tau'])}, {fmt(b['stock_speedup_vs_ar'], '{:.2f}')}x AR",
         "depth nodes    tau  tau/stock  x stock (est.)  x stock (bound)"]
    for r in b["rows"]:
        L.append(f"{r['depth']:5d} {r['nodes']:5d} {r['tau']:6.2f} {r['tau_vs_stock']:9.3f} {r['speedup_vs_stock']:15.3f} "
                 f"{r['speedup_vs_stock_bound']:16.3f}")
    L.append(f"bound: at most {fmt(b['bound']['speedup_vs_stock_bound'])}x stock ({b['bound']['nodes']} nodes, "
             f"depth {b['bound']['depth']})")
    return L


def run(args: argparse.Namespace) -> int:
    rn = Run("tree-bound", args)
    rn.phase("bound", lambda: bound(args))
    return rn.finish(table(rn.R))

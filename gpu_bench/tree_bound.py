#!/usr/bin/env python
"""How far trees can take tau and the speedup over stock under one replay profile (issues 16, 20).

For each node budget N the optimal static tree (:func:`specpilot.drafters.static_tree.optimal_tree`:
the N most probable rank paths, positions' ranks independent, Sequoia's tree) gives the largest
expected tau any tree of N nodes can reach under the profile's rank model; deeper blocks (a second
level) are modelled by ``--depth``. With a step-cost model (AR step, stock's draft + verify +
rest, verify of a tree as a function of its nodes: measured points, then the arithmetic floor
2 x params x rows / peak matmul rate beyond them), the speedup over stock of the best tree is an
upper bound for every tree and two-level mechanism of that budget (it charges the tree no extra
draft or host time). Defaults: the H200 numbers of BENCHMARKS.md (2026-12-02; 8B shape, c1).

Prints one table and writes ``--out`` (JSON). Runs on the CPU in a second.

    python gpu_bench/tree_bound.py --profile study_stock --out gpu_bench/tree_bound_study_stock.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specpilot.drafters.static_tree import optimal_tree  # noqa: E402
from specpilot.engine.replay import expected_tau, load_profile  # noqa: E402


def floor_ms(rows: int, params: float, peak: float) -> float:
    """The matmul floor of a verify of ``rows`` rows [ms]: 2 x params x rows / ``peak``."""
    return 2.0 * params * rows / peak * 1e3


def verify_ms(nodes: int, points: dict[int, float], params: float, peak: float) -> float:
    """Estimated verify time [ms] of ``nodes`` + 1 rows: linear between the measured points
    (rows -> ms), beyond the last one that point scaled by the rows (compute-bound)."""
    rows = nodes + 1
    xs = sorted(points)
    if rows <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if rows <= b:
            return points[a] + (points[b] - points[a]) * (rows - a) / (b - a)
    return max(points[xs[-1]] * rows / xs[-1], floor_ms(rows, params, peak))


def verify_bound_ms(nodes: int, points: dict[int, float], params: float, peak: float) -> float:
    """A lower bound of the verify time of ``nodes`` + 1 rows [ms]: at least the measured chain
    verify of the fewest rows (every weight read once) and at least the matmul floor."""
    return max(points[min(points)], floor_ms(nodes + 1, params, peak))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="study_stock")
    ap.add_argument("--block", type=int, default=16, help="stock's block (anchor + drafts)")
    ap.add_argument("--depth", type=int, nargs="+", default=[15, 31],
                    help="tree depths (draft positions) to bound: the block's drafts, and a second block on top")
    ap.add_argument("--nodes", type=int, nargs="+", default=[15, 31, 63, 127, 255, 511, 1023, 4095])
    ap.add_argument("--max-rank", type=int, default=16, help="deepest candidate rank a node may take (the profile's K)")
    ap.add_argument("--ar-ms", type=float, default=4.689, help="AR step (BENCHMARKS.md, tree verify run)")
    ap.add_argument("--stock-draft-ms", type=float, default=1.00)
    ap.add_argument("--stock-rest-ms", type=float, default=0.34)
    ap.add_argument("--verify-points", default='{"16": 4.866, "32": 5.032, "64": 5.572, "256": 8.835, "384": 11.637}',
                    help="JSON rows -> verify ms: chain 16/32/64 at batch 1 (tree verify run), 256 / 384 rows "
                         "= 16 / 24 requests x 16 (verify run after the fold; their KV reads are 16 / 24 caches)")
    ap.add_argument("--params", type=float, default=8.19e9, help="target parameters (Qwen3-8B shape)")
    ap.add_argument("--peak", type=float, default=7.9e14, help="bf16 matmul rate [FLOP/s]")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    prof = load_profile(args.profile)
    points = {int(k): float(v) for k, v in json.loads(args.verify_points).items()}
    stock_tau = expected_tau(prof, args.block)
    stock_step = args.stock_draft_ms + verify_ms(args.block - 1, points, args.params, args.peak) + args.stock_rest_ms
    stock_rate = stock_tau / stock_step
    rows = []
    for depth in args.depth:
        for n in args.nodes:
            shape = optimal_tree(prof, n, depth, args.max_rank)
            step = args.stock_draft_ms + verify_ms(n, points, args.params, args.peak) + args.stock_rest_ms
            low = args.stock_draft_ms + verify_bound_ms(n, points, args.params, args.peak) + args.stock_rest_ms
            rows.append({"depth": depth, "nodes": n, "tau": round(shape.expected_tau, 4),
                         "tau_vs_stock": round(shape.expected_tau / stock_tau, 4), "step_ms": round(step, 3),
                         "speedup_vs_stock": round(shape.expected_tau / step / stock_rate, 4),
                         "speedup_vs_ar": round(shape.expected_tau / step * args.ar_ms, 4),
                         "step_ms_bound": round(low, 3),
                         "speedup_vs_stock_bound": round(shape.expected_tau / low / stock_rate, 4),
                         "max_rank": max(shape.ranks), "side_depth": shape.side_depth})
    best = max(rows, key=lambda r: r["speedup_vs_stock"])
    bound = max(rows, key=lambda r: r["speedup_vs_stock_bound"])
    res = {"profile": prof.name, "profile_source": prof.source, "stock_tau": round(stock_tau, 4),
           "stock_step_ms": round(stock_step, 3), "stock_speedup_vs_ar": round(stock_rate * args.ar_ms, 4),
           "cost_model": {k: getattr(args, k) for k in ("ar_ms", "stock_draft_ms", "stock_rest_ms", "params", "peak")}
           | {"verify_points": points}, "rows": rows, "best": best, "bound": bound}
    print(f"profile {prof.name}: stock (block {args.block}) tau {stock_tau:.3f}, step {stock_step:.2f} ms, "
          f"{stock_rate * args.ar_ms:.2f}x AR")
    print("depth nodes    tau  tau/stock  step ms  x stock   x AR | floor step ms  x stock (bound)  max rank")
    for r in rows:
        print(f"{r['depth']:5d} {r['nodes']:5d} {r['tau']:6.2f} {r['tau_vs_stock']:9.3f} {r['step_ms']:8.2f} "
              f"{r['speedup_vs_stock']:8.3f} {r['speedup_vs_ar']:6.2f} | {r['step_ms_bound']:13.2f} "
              f"{r['speedup_vs_stock_bound']:16.3f} {r['max_rank']:9d}")
    print(f"best (estimated costs): {best['nodes']} nodes, depth {best['depth']}: {best['speedup_vs_stock']:.3f}x stock "
          f"(tau {best['tau']:.2f} = {best['tau_vs_stock']:.2f}x stock's)")
    print(f"bound (verify at its floor, no extra draft or host time): {bound['speedup_vs_stock_bound']:.3f}x stock "
          f"at {bound['nodes']} nodes, depth {bound['depth']}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

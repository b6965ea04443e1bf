"""One line per figure of scripts/gpu_trees.sh (issue 63's GPU bars, and 54's and 47's), from the
results it wrote (either call's; a figure whose result is missing prints "-").

Usage: python3 scripts/gpu_trees_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specpilot.bench.verify_trees import VS_CHAIN  # the tree-vs-chain bars (scripts run with PYTHONPATH=src)


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def fmt(x, spec="{:.3f}") -> str:
    return spec.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def cells_ok(R: dict) -> tuple[int, int, list[str]]:
    """(cells whose every output equals AR and whose forcing passed, cells, their teacher paths)."""
    ok = n = 0
    paths = []
    for cell in R.get("cells", {}).values():
        for v in cell.values():
            if isinstance(v, dict) and "speedup_geomean" in v:
                n += 1
                f = v.get("forcing") or {}
                ok += int(v["equal_outputs"] == v["n_requests"] and bool(f.get("passed")))
                paths.append(f.get("teacher_forced_path") or "-")
    return ok, n, sorted(set(paths))


def best_vs_stock(R: dict, cell: str = "c1") -> tuple[str, float | None, dict]:
    """(best variant, its speedup / stock's, every variant's ratio) in ``cell``."""
    c = R.get("cells", {}).get(cell, {})
    stock = (c.get("stock") or {}).get("speedup_geomean")
    ratios = {k: v["speedup_geomean"] / stock for k, v in c.items()
              if isinstance(v, dict) and k != "stock" and v.get("speedup_geomean") and stock}
    best = max(ratios, key=ratios.get) if ratios else "-"
    return best, ratios.get(best), ratios


def verify_lines(out: Path) -> list[str]:
    """Issue 54's verify bars: chains against the 16-token chain, trees against their chains, the
    per-kernel and outside-the-step differences, the nodes' bit checks; issue 47's x AR."""
    V = load(out / "verify_trees.json").get("trees", {})
    widths = load(out / "verify_widths.json").get("widths", {})
    shp = widths.get("timed_shape", {}).get("default", {})  # issue 63: the B x T each step was checked to run
    W = {k: v for k, v in widths.get("step_ms", {}).get("default", {}).items()
         if shp.get(k) == [int(x) for x in k.split("x")]}
    lines = []
    for T, bar in (("64", 1.08), ("128", 1.20), ("256", 1.45)):
        x = W[f"1x{T}"] / W["1x16"] if f"1x{T}" in W and "1x16" in W else None
        verdict = " (not measured, or not checked to run 1 x T tokens)" if x is None else \
            f" (bar <= {bar}: {'met' if x <= bar else 'MISSED'})"
        lines.append(f"chain verify {T} tokens: {fmt(x)}x the 16-token chain ({fmt(W.get(f'1x{T}'))} / "
                     f"{fmt(W.get('1x16'))} ms; AR {fmt(W.get('1x1'))} ms){verdict}")
    for name, chain, bar47 in (("lattice63", "chain64", None), ("lattice127", "chain128", 1.25),
                               ("lattice255", "chain256", 1.60)):
        x, xa, c = V.get("x_chain", {}).get(name), V.get("x_ar", {}).get(name), V.get("checks", {}).get(name, {})
        bar = VS_CHAIN[name][1]  # issue 63's
        verdict = "" if x is None else f" (bar <= {bar}: {'met' if x <= bar else 'MISSED'})"
        lines.append(f"verify {name}: {fmt(x)}x {chain}{verdict}; {fmt(xa)}x an AR step"
                     + ("" if bar47 is None or xa is None else f" (issue 47 bar <= {bar47}: {'met' if xa <= bar47 else 'MISSED'})")
                     + f"; nodes bit-equal to their paths {c.get('leaves_bit_equal', '-')}/{c.get('leaves_checked', '-')}")
        K = V.get("kernels", {})
        if name in K and chain in K:
            kt, kc = K[name]["kernels"], K[chain]["kernels"]
            diff = sorted(((kt.get(k, {}).get("ms", 0.0) - kc.get(k, {}).get("ms", 0.0), k) for k in set(kt) | set(kc)),
                          reverse=True)[:4]
            lines.append(f"  kernels {name} - {chain}: sum {fmt(K[name]['kernel_sum_ms'] - K[chain]['kernel_sum_ms'])} ms; "
                         + ", ".join(f"{k[:36]} {d:+.4f}" for d, k in diff))
        h = V.get("host_side_ms", {}).get(name)
        if h:
            lines.append(f"  {name} outside the step (eager ms): " + ", ".join(f"{k} {fmt(v, '{:.4f}')}" for k, v in h.items()))
    return lines


def main(out: Path) -> int:
    lines = verify_lines(out)
    for label, fname, bar in (("8B lattice profile", "serving_lattice_8b.json", 1.20),
                              ("27B hybrid lattice profile", "serving_lattice_27b.json", 1.10),
                              ("8B study_stock", "serving_study.json", None)):
        R = load(out / fname)
        best, ratio, ratios = best_vs_stock(R)
        stock = R.get("cells", {}).get("c1", {}).get("stock", {})
        verdict = "" if ratio is None or bar is None else f" (bar >= {bar}: {'met' if ratio >= bar else 'MISSED'})"
        lines.append(f"{label}, c1: best tree {best} {fmt(ratio)}x stock{verdict}; stock {fmt(stock.get('speedup_geomean'))}x "
                     f"AR tau {fmt(stock.get('tau'), '{:.2f}')}; all: "
                     + ", ".join(f"{k} {fmt(v)}" for k, v in sorted(ratios.items())))
        ok, n, paths = cells_ok(R)
        lines.append(f"{label}: {ok}/{n} cells with every output = AR and forcing passing (teacher pass {', '.join(paths)})")
    for fname in ("serving_lattice_8b.json", "serving_study.json"):  # issue 63: <= 0.40 ms at c1, every lattice tree
        S = load(out / fname).get("cells", {})
        for cell in ("c1", "c16"):
            hosts = {k: v.get("host_ms") for k, v in S.get(cell, {}).items() if isinstance(v, dict) and "host_ms" in v}
            if not hosts:
                continue
            worst = max((v for k, v in hosts.items() if isinstance(v, (int, float)) and k.startswith("lat")), default=None)
            verdict = "" if cell != "c1" or worst is None else f" (bar <= 0.40: {'met' if worst <= 0.40 else 'MISSED'})"
            lines.append(f"rest of the step ms (decode - draft - verify), {fname[:-5]} {cell}: worst lattice tree {fmt(worst)}"
                         f"{verdict}; " + ", ".join(f"{k} {fmt(v)}" for k, v in hosts.items()))
    H = load(out / "host.json").get("cells", {})
    if H:
        lines.append("bench host (this machine's CPU, stand-in target, wall ms per step): " + ", ".join(
            f"{k} {fmt(v.get('host_ms_per_step'), '{:.4f}')}" for k, v in H.items()))
    print("\n".join(lines))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

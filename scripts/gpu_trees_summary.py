"""One line per figure of scripts/gpu_trees.sh (issue 47's GPU bars), from the results it wrote.

Usage: python3 scripts/gpu_trees_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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


def main(out: Path) -> int:
    V = load(out / "verify_trees.json").get("trees", {})
    lines = []
    for name, bar in (("lattice63", None), ("lattice127", 1.25), ("lattice255", 1.60)):
        x, c = V.get("x_ar", {}).get(name), V.get("checks", {}).get(name, {})
        verdict = "" if bar is None or x is None else f" (bar <= {bar}: {'met' if x <= bar else 'MISSED'})"
        lines.append(f"verify {name}: {fmt(x)}x an AR step{verdict}; nodes bit-equal to their paths "
                     f"{c.get('leaves_bit_equal', '-')}/{c.get('leaves_checked', '-')}")
    for label, fname, bar in (("8B study_stock", "serving_study.json", 1.10),
                              ("8B lattice profile", "serving_lattice_8b.json", 1.15),
                              ("27B hybrid lattice profile", "serving_lattice_27b.json", 1.20)):
        R = load(out / fname)
        best, ratio, ratios = best_vs_stock(R)
        stock = R.get("cells", {}).get("c1", {}).get("stock", {})
        verdict = "" if ratio is None else f" (bar >= {bar}: {'met' if ratio >= bar else 'MISSED'})"
        lines.append(f"{label}, c1: best tree {best} {fmt(ratio)}x stock{verdict}; stock {fmt(stock.get('speedup_geomean'))}x "
                     f"AR tau {fmt(stock.get('tau'), '{:.2f}')}; all: "
                     + ", ".join(f"{k} {fmt(v)}" for k, v in sorted(ratios.items())))
        ok, n, paths = cells_ok(R)
        lines.append(f"{label}: {ok}/{n} cells with every output = AR and forcing passing (teacher pass {', '.join(paths)})")
    S = load(out / "serving_study.json").get("cells", {})
    for cell, bar in (("c1", 0.15), ("c16", 0.5)):
        h = (S.get(cell, {}).get("stock") or {}).get("host_ms")
        hosts = {k: v.get("host_ms") for k, v in S.get(cell, {}).items() if isinstance(v, dict) and "host_ms" in v}
        verdict = "" if h is None else f" (bar <= {bar}: {'met' if h <= bar else 'MISSED'})"
        lines.append(f"host time per step, stock {cell}: {fmt(h)} ms{verdict}; "
                     + ", ".join(f"{k} {fmt(v)}" for k, v in hosts.items()))
    print("\n".join(lines))
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

"""Engine configs against stock and AR on one deployment, timed interleaved (CPU or GPU).

For each drafter of a tiny (or any) build and each engine config given, runs
``specpilot run --engine ar,stock,specpilot`` over 4 prompts of each benchmark (one process: at
concurrency 1 on the CPU every request is decoded by the three engines in turn), and prints per
drafter: stock / AR, specpilot / AR and specpilot / stock (geometric means over requests of
decode-time ratios), stock and specpilot tau per benchmark, and the per-step phase times (draft,
verify, host = the rest) from the records. Writes everything to ``--out`` as JSON.

    python gpu_bench/interleaved_sweep.py --build resources/deployments/tiny \
        --config '{}' --config '{"tree_branch": 3, "tree_depth": 3}' --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections import defaultdict
from datetime import date
from pathlib import Path

BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
BLOCK = {"dflash": 8, "dflash2": 8, "dspark": 7}


def records(path: Path) -> dict[str, dict]:
    return {r["request_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def geomean_ratio(base: dict, eng: dict) -> float:
    logs = [math.log(base[k]["decode_s"] / eng[k]["decode_s"]) for k in base]
    return math.exp(sum(logs) / len(logs))


def taus(recs: dict) -> dict[str, float]:
    steps = defaultdict(list)
    for r in recs.values():
        steps[r["benchmark"]] += r["committed_per_step"]
    return {b: round(sum(v) / len(v), 3) for b, v in steps.items()}


def phases(recs: dict) -> dict[str, float]:
    n = sum(r["verify_steps"] for r in recs.values())
    d = sum(r["draft_s"] for r in recs.values())
    v = sum(r["verify_s"] for r in recs.values())
    t = sum(r["decode_s"] for r in recs.values())
    return {"draft_ms": 1e3 * d / n, "verify_ms": 1e3 * v / n, "host_ms": 1e3 * (t - d - v) / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", required=True, help="deployment folder with target/ and drafter-{kind}/")
    p.add_argument("--drafters", default="dflash,dflash2,dspark")
    p.add_argument("--config", action="append", required=True, help="specpilot engine config (JSON), repeatable")
    p.add_argument("--n-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    build = Path(a.build)
    out = {"date": date.today().isoformat(), "build": str(build), "n_prompts": a.n_prompts,
           "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "threads": a.threads, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = [tmp / f"p-{b}.jsonl" for b in BENCHMARKS]
        cmd = [sys.executable, "-m", "specpilot", "prompts", "--tokenizer", str(build / "target"),
               "--benchmark", ",".join(BENCHMARKS), "--n-prompts", str(a.n_prompts), "--seed", "0",
               "--role", "eval", "--out", ",".join(map(str, files))]
        if a.data_dir:
            cmd += ["--data-dir", a.data_dir]
        subprocess.run(cmd, check=True, capture_output=True)
        prompts = tmp / "p.jsonl"
        prompts.write_text("".join(f.read_text() for f in files))
        for kind in a.drafters.split(","):
            for cfg in a.config:
                (tmp / "cfg.json").write_text(cfg)
                paths = [tmp / f"{e}.jsonl" for e in ("ar", "stock", "specpilot")]
                subprocess.run([sys.executable, "-m", "specpilot", "run", "--engine", "ar,stock,specpilot",
                                "--out", ",".join(map(str, paths)), "--engine-config", str(tmp / "cfg.json"),
                                "--target", str(build / "target"), "--drafter", str(build / f"drafter-{kind}"),
                                "--drafter-name", kind, "--prompts", str(prompts),
                                "--max-new-tokens", str(a.max_new_tokens), "--block-size", str(BLOCK.get(kind, 8)),
                                "--threads", str(a.threads), "--timing-repeats", str(a.repeats)],
                               check=True, capture_output=True)
                ar, st, sp = (records(x) for x in paths)
                cell = {"drafter": kind, "config": json.loads(cfg),
                        "stock_over_ar": geomean_ratio(ar, st), "specpilot_over_ar": geomean_ratio(ar, sp),
                        "specpilot_over_stock": geomean_ratio(st, sp),
                        "stock_tau": taus(st), "specpilot_tau": taus(sp),
                        "stock_phases": phases(st), "specpilot_phases": phases(sp),
                        "ar_ms_per_token": 1e3 * sum(r["decode_s"] for r in ar.values())
                        / sum(r["new_tokens"] - 1 for r in ar.values()),
                        "outputs_equal_ar": all(sp[k]["output_ids"] == ar[k]["output_ids"] == st[k]["output_ids"]
                                                for k in ar)}
                out["cells"].append(cell)
                print(f"{kind} {cfg}: stock/AR {cell['stock_over_ar']:.2f}  specpilot/AR {cell['specpilot_over_ar']:.2f}"
                      f"  specpilot/stock {cell['specpilot_over_stock']:.2f}  tau {cell['stock_tau']} -> "
                      f"{cell['specpilot_tau']}", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The workflow's interleaved engine cell and per-cell forcing job on a GPU (correctness, not speed).

On a tiny deployment (built on CPU, carried; bf16 on CUDA, CUDA graphs on): for concurrency 1 and
4, one ``specpilot run --engine ar,stock,specpilot`` (specpilot with a tree config) against the
three engines run one by one, then ``specpilot force --candidate stock,specpilot`` on the cell.
Checks: each engine's tokens in the cell equal its separate run's, stock and specpilot equal AR,
every verdict passes. Writes ``check_interleaved_gpu.json`` to ``--out``; exit 1 on a failed check.

    python gpu_bench/check_interleaved_gpu.py --build resources/deployments/tiny --prompts p.jsonl --out $OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def cli(*args) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "specpilot", *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"specpilot {' '.join(map(str, args[:3]))} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def outputs(path: Path) -> list[list[int]]:
    return [json.loads(x)["output_ids"] for x in path.read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--drafter", default="dflash")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    work = out / "cells"
    work.mkdir(parents=True, exist_ok=True)
    b = Path(a.build)
    cfg = work / "specpilot.json"
    cfg.write_text(json.dumps({"tree_branch": 2, "tree_depth": 2}))
    common = ["--target", b / "target", "--drafter", b / f"drafter-{a.drafter}", "--drafter-name", a.drafter,
              "--prompts", a.prompts, "--max-new-tokens", a.max_new_tokens, "--block-size", 8,
              "--device", "cuda", "--dtype", "bf16"]
    engines = ("ar", "stock", "specpilot")
    report = {"build": str(b), "drafter": a.drafter, "cells": []}
    ok = True
    for c in (1, 4):
        cell = [work / f"{e}-c{c}.jsonl" for e in engines]
        t_cell = cli("run", "--engine", ",".join(engines), "--out", ",".join(map(str, cell)),
                     "--engine-config", cfg, "--concurrency", c, "--timing-repeats", 2, *common)
        alone = {}
        for e in engines:
            path = work / f"alone-{e}-c{c}.jsonl"
            cli("run", "--engine", e, "--out", path, "--concurrency", c, *common,
                *(["--engine-config", cfg] if e == "specpilot" else []))
            alone[e] = outputs(path)
        verdicts = [work / f"{e}-c{c}.forcing.json" for e in engines[1:]]
        cli("force", "--candidate", ",".join(map(str, cell[1:])), "--reference", cell[0], "--target", b / "target",
            "--drafter", b / f"drafter-{a.drafter}", "--prompts", a.prompts, "--max-new-tokens", a.max_new_tokens,
            "--engine-config", cfg, "--tolerance", 0.1, "--device", "cuda", "--dtype", "bf16",
            "--out", ",".join(map(str, verdicts)), "--report-only")
        v = [json.loads(x.read_text()) for x in verdicts]
        got = {e: outputs(x) for e, x in zip(engines, cell)}
        row = {"concurrency": c, "cell_seconds": round(t_cell, 2),
               "cell_equals_alone": {e: got[e] == alone[e] for e in engines},
               "equals_ar": {e: got[e] == got["ar"] for e in engines[1:]},
               "forcing": {e: {"passed": x["passed"], "violations": x["violations"], "near_ties": x["near_ties"],
                               "tokens_checked": x["tokens_checked"], "path": x["teacher_forced_path"],
                               "references": sorted(Path(r).name for r in x["references"])}
                           for e, x in zip(engines[1:], v)}}
        row_ok = all(row["cell_equals_alone"].values()) and all(row["equals_ar"].values()) and \
            all(x["passed"] for x in v)
        row["ok"] = row_ok
        ok &= row_ok
        report["cells"].append(row)
        print(json.dumps(row), flush=True)
    report["ok"] = ok
    (out / "check_interleaved_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

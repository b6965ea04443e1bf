"""Stock tau per benchmark for each drafter of a tiny deployment (no timing; the build's quality).

    python gpu_bench/benchmark_taus.py --deployment resources/deployments/tiny --n 8 --new 128 \
        --width 8 --out gpu_bench/benchmark_taus_cpu.json

For every benchmark (its first ``--n`` eval prompts, ``--new`` new tokens) and every drafter in
the deployment (dflash, dflash2: DFlash counting, block = width; dspark: gamma = width - 1) plus
prompt lookup: tau = committed tokens per verify step over all steps, bonus included (the table's
``stock_tau``), at concurrency 1; every output is compared with AR token for token.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from specpilot.engine.serve import EngineSpec, serve
from specpilot.io import write_json
from specpilot.models.loading import load_drafter, load_target
from specpilot.prompts import BENCHMARKS, write_prompt_file

META = {"deployment": "tiny", "target": "tiny", "drafter": "x", "gpu": "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dep = Path(a.deployment)
    data = os.environ.get("SPECPILOT_DATA_DIR")
    tmp = Path(a.out).with_suffix(".prompts")
    tmp.mkdir(parents=True, exist_ok=True)
    target = load_target(dep / "target")
    runs = {"lookup": (EngineSpec("lookup", a.width), None)}
    for kind in ("dflash", "dflash2", "dspark"):
        if (dep / f"drafter-{kind}").is_dir():
            runs[kind] = (EngineSpec("stock", a.width - 1 if kind == "dspark" else a.width),
                          load_drafter(dep / f"drafter-{kind}"))
    out = {"deployment": str(dep), "n_prompts": a.n, "new_tokens": a.new, "verify_width": a.width, "tau": {}}
    with torch.inference_mode():
        for bench in a.benchmarks.split(","):
            prompts = write_prompt_file(bench, dep / "target", tmp / f"{bench}.jsonl", a.n, data_dir=data)
            ar = serve(EngineSpec("ar"), target, None, prompts, a.new, 1, META, progress=False, warmup=False)
            row = {}
            for name, (spec, net) in runs.items():
                recs = serve(spec, target, net, prompts, a.new, 1, dict(META, drafter=name), progress=False,
                             warmup=False)
                steps = [c for r in recs for c in r.committed_per_step]
                row[name] = {"tau": round(sum(steps) / len(steps), 3),
                             "equals_ar": all(r.output_ids == x.output_ids for r, x in zip(recs, ar))}
            out["tau"][bench] = row
            print(bench, json.dumps(row), flush=True)
    write_json(a.out, out)


if __name__ == "__main__":
    main()

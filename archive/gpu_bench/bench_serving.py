"""Continuous batching against the earlier static batches, same prompts, same engine.

For each engine (ar, stock) and concurrency c, serves the prompts twice through
:func:`specpilot.engine.serve.serve`: ``regime="static"`` (batches of c in lock step, a runner per
batch) and ``regime="continuous"`` (the scheduler: c slots refilled from the queue). Reports the
wall time of each run, the system throughput (output tokens / wall seconds), the per-request
speedup of stock over AR within each regime (geomean of AR decode_s / stock decode_s), and checks
that every run's outputs equal AR's at c = 1 token for token.

    PYTHONPATH=src python benchmarks/bench_serving.py --deployment /work/cache/tiny \\
        --benchmark gsm8k --n 12 --max-new-tokens 64 --concurrency 1 4 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def main() -> int:
    from specpilot.benchmarks import write_prompt_file
    from specpilot.engine.serve import EngineSpec, serve
    from specpilot.io import atomic_write_text
    from specpilot.models.loading import load_drafter, load_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", required=True, help="folder with target/ and drafter-dflash/")
    ap.add_argument("--benchmark", default="gsm8k")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="continuous regime: prefill chunk")
    ap.add_argument("--regimes", nargs="+", default=["static", "continuous"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dep = Path(args.deployment)
    target, drafter = load_target(dep / "target"), load_drafter(dep / "drafter-dflash")
    tmp = Path(args.out).with_suffix(".prompts.jsonl")
    kw = {"data_dir": Path(args.data_dir)} if args.data_dir else {}
    prompts = write_prompt_file(args.benchmark, dep / "target", tmp, args.n, **kw)
    meta = {"deployment": dep.name, "target": "t", "drafter": "dflash", "gpu": "cpu"}

    def run(engine, c, regime):
        t0 = time.perf_counter()
        recs = serve(EngineSpec(engine, args.block_size), target, drafter if engine != "ar" else None, prompts,
                     args.max_new_tokens, c, meta, progress=False, regime=regime,
                     prefill_chunk=args.prefill_chunk if regime == "continuous" else None)
        return recs, time.perf_counter() - t0

    ref, _ = run("ar", 1, "continuous")
    rows = []
    for c in args.concurrency:
        for regime in args.regimes:
            res = {}
            for engine in ("ar", "stock"):
                recs, wall = run(engine, c, regime)
                assert [r.output_ids for r in recs] == [r.output_ids for r in ref], (engine, c, regime)
                toks = sum(r.new_tokens for r in recs)
                res[engine] = (recs, wall)
                rows.append({"engine": engine, "concurrency": c, "regime": regime, "wall_s": round(wall, 3),
                             "throughput_tok_s": round(toks / wall, 1),
                             "decode_s_sum": round(sum(r.decode_s for r in recs), 3),
                             "tau": round(sum(sum(r.committed_per_step) for r in recs)
                                          / sum(r.verify_steps for r in recs), 3)})
            ar = {r.request_id: r for r in res["ar"][0]}
            sp = [ar[r.request_id].decode_s / r.decode_s for r in res["stock"][0] if r.decode_s > 0]
            rows[-1]["stock_speedup_geomean"] = round(math.exp(sum(map(math.log, sp)) / len(sp)), 3)
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
    atomic_write_text(args.out, json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

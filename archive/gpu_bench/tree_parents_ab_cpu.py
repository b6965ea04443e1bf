#!/usr/bin/env python
"""CPU A/B of one engine change: tree proposals whose parents tensor is reused per shape (since
2026-12-02) against one built anew every step (before), on a built tiny deployment.

    python gpu_bench/tree_parents_ab_cpu.py --deployment resources/deployments/tiny --out ab.json

specpilot with a tree config (default: the embedded default's round result for DFlash, block 10,
one side leaf on the first two positions) over ``--n`` gsm8k prompts, ``--new`` new tokens,
concurrency 1, the two variants interleaved ``--repeats`` times (drift hits both alike); reports
each run's summed decode seconds, the ratio of the minima, and whether the outputs are equal. The
"before" variant patches :func:`specpilot.drafters.proposal._static_parents` with the old
construction, so the runner's tree-mask cache (keyed by the parents tensor) misses every step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from specpilot.drafters import proposal as P
from specpilot.engine.serve import EngineSpec, serve
from specpilot.io import write_json
from specpilot.models.loading import load_drafter, load_target
from specpilot.prompts import write_prompt_file


def _fresh(k, branch, depth, batch, device):
    """The parents tensor as built before: a new tensor every step."""
    row = torch.tensor(P.spine_tree_parents(k, branch, depth), dtype=torch.long, device=device)
    return row[None].expand(batch, -1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--config", default='{"block_size": 10, "tree_branch": 1, "tree_depth": 2}')
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dep, cfg = Path(a.deployment), json.loads(a.config)
    rows = write_prompt_file("gsm8k", dep / "target", Path(a.out).with_suffix(".prompts.jsonl"), a.n,
                             data_dir=os.environ.get("SPECPILOT_DATA_DIR"))
    target, net = load_target(dep / "target"), load_drafter(dep / f"drafter-{a.drafter}")
    meta = {"deployment": dep.name, "target": "tiny", "drafter": a.drafter, "gpu": "cpu"}
    variants = {"reused": P._static_parents, "rebuilt": _fresh}
    runs, outs = {k: [] for k in variants}, {}
    try:
        for rep in range(a.repeats):
            for name, fn in variants.items():
                P._static_parents = fn
                recs = serve(EngineSpec("specpilot", int(cfg["block_size"]), cfg), target, net, rows, a.new, 1, meta,
                             progress=False)
                runs[name].append(sum(r.decode_s for r in recs))
                outs[name] = [r.output_ids for r in recs]
                print(name, rep, round(runs[name][-1], 3), "s decode", flush=True)
    finally:
        P._static_parents = variants["reused"]
    res = {"date": time.strftime("%Y-%m-%d"), "args": vars(a), "decode_s": runs,
           "rebuilt_over_reused_min": min(runs["rebuilt"]) / min(runs["reused"]),
           "outputs_equal": outs["reused"] == outs["rebuilt"]}
    write_json(a.out, res)
    print(json.dumps({k: res[k] for k in ("rebuilt_over_reused_min", "outputs_equal")}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Tau of chain, tree and two-level verification at equal verify width on a tiny deployment (CPU).

    python gpu_bench/mechanism_taus.py --deployment /path/to/tiny --n 20 --new 128 --out taus.json

On the first ``--n`` gsm8k eval prompts, ``--new`` new tokens, concurrency 1, the deployment's DFlash
drafter: stock chains of block B (``--block``) and of B + ``--extra`` (the wider chain), a tree
with side branches adding ``--extra`` nodes (branch 2 at the first extra/2 positions), and
two-level drafting with ``second_level`` = extra (and with ``--static-tree`` the optimal static
tree of the same verify width, :mod:`specpilot.drafters.static_tree`); every engine's outputs are compared with AR token
for token. tau = committed tokens per verify step (bonus included), over all steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from specpilot.engine.serve import EngineSpec, serve
from specpilot.io import write_json
from specpilot.models.loading import load_drafter, load_target
from specpilot.prompts import write_prompt_file

META = {"deployment": "tiny", "target": "tiny", "drafter": "dflash", "gpu": "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--extra", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--static-tree", action="store_true",
                    help="also the static tree (tree_nodes) of the same verify width, at block B and B + extra")
    ap.add_argument("--tree-profile", default="tiny_dflash_ranks", help="rank profile the static tree is chosen from")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dep = Path(a.deployment)
    tmp = Path(a.out).with_suffix(".prompts")
    tmp.mkdir(parents=True, exist_ok=True)
    rows = write_prompt_file("gsm8k", dep / "target", tmp / "eval.jsonl", a.n,
                             data_dir=os.environ.get("SPECPILOT_DATA_DIR"))
    target, net = load_target(dep / "target"), load_drafter(dep / "drafter-dflash")
    B, X = a.block, a.extra
    engines = {
        f"chain B={B}": EngineSpec("stock", B),
        f"chain B={B + X}": EngineSpec("stock", B + X),
        f"tree B={B} + {X} side nodes": EngineSpec("specpilot", B, {"tree_branch": 2, "tree_depth": max(1, X // 2)}),
        f"two-level B={B} + {X}": EngineSpec("specpilot", B, {"second_level": X}),
    }
    if a.static_tree:  # the optimal static tree of the same verify width, drafted at block B and B + X
        for blk in (B, B + X):
            engines[f"static tree {B + X - 1} nodes, block {blk}"] = EngineSpec(
                "specpilot", blk, {"tree_nodes": B + X - 1, "tree_profile": a.tree_profile})
    t0 = time.time()
    ar = serve(EngineSpec("ar"), target, None, rows, a.new, 1, META, progress=False)
    res = {"n_prompts": a.n, "new_tokens": a.new, "block": B, "extra": X, "engines": {}}
    for name, spec in engines.items():
        t = time.time()
        recs = serve(spec, target, net, rows, a.new, 1, META, progress=False)
        steps = [c for r in recs for c in r.committed_per_step]
        res["engines"][name] = {
            "engine_config": {"block_size": spec.block_size, **spec.config}, "verify_width": spec.verify_width - 1,
            "tau": sum(steps) / len(steps), "max_committed": max(steps),
            "equals_ar": all(r.output_ids == x.output_ids for r, x in zip(recs, ar)), "wall_s": round(time.time() - t, 1)}
        print(name, json.dumps(res["engines"][name]), flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    write_json(a.out, res)


if __name__ == "__main__":
    main()

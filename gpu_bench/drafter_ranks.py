#!/usr/bin/env python
"""Per-position rank recall of a real (tiny) drafter: a replay profile with ``rank_recall`` (issue 16).

    python gpu_bench/drafter_ranks.py --deployment resources/deployments/tiny --drafter dflash2 \
        --n 20 --new 128 --width 8 --out src/specpilot/replay_profiles/tiny_dflash2_ranks.json

The replay drafter models side-branch trees from, per draft position j, the distribution of the
rank of the correct token among the drafter's candidates given the drafts before j were accepted
(:mod:`specpilot.engine.replay`). This measures it: the deployment's target decodes ``--n`` eval
prompts of each ``--benchmark`` greedily (the AR reference), then the drafter runs the speculative
loop (a chain of ``--width`` tokens, anchor included) and, at every step, the rank of the reference
token in the drafter's scores at each position is read (1 + the number of tokens scored higher;
a token outside a DFlash2 selector's K candidates has rank K + 1), counted at position j only while
positions 1..j-1 of that step had rank 1 (the spine was right so far). Writes the profile: the
conditional acceptance (rank 1), the cumulative recall for ranks 1..``--ranks``, the sample counts,
and its expected tau for a chain and a few trees. Every output of the loop is checked to equal AR.
On the CPU; the drafter runs eagerly.

The model's check: ``--tree BRANCH,DEPTH`` (repeatable) also runs the same drafter proposing the
engine's spine + side-branch tree on the same prompts and records its measured tau beside the tau
the profile predicts for that tree (:func:`specpilot.engine.replay.expected_tau_tree`, which
treats the positions' ranks as independent given the earlier drafts were right).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specpilot.drafters import make_proposer  # noqa: E402
from specpilot.engine.generate import generate, generate_ar  # noqa: E402
from specpilot.engine.replay import AcceptanceProfile, expected_tau, expected_tau_tree  # noqa: E402
from specpilot.engine.runner import TargetRunner  # noqa: E402
from specpilot.io import write_json  # noqa: E402
from specpilot.models.loading import load_drafter, load_target  # noqa: E402
from specpilot.prompts import write_prompt_file  # noqa: E402


def rank_of(scores: torch.Tensor, token: int, cap: int) -> int:
    """1 + the number of tokens scored above ``token`` (capped at ``cap``; an unscored, -inf token: cap)."""
    s = scores[token]
    if not torch.isfinite(s):
        return cap
    return min(cap, 1 + int((scores > s).sum()))


def hook(net, log: list) -> None:
    """Record (start [B], scores [B, k, V]) of every draft forward of ``net`` (its full draft when it
    has one, DSpark's Markov walk, else ``draft``)."""
    name = "draft_full" if hasattr(net, "draft_full") else "draft"
    orig = getattr(net, name)

    def wrapped(anchor, start, *args, **kw):
        out = orig(anchor, start, *args, **kw)
        log.append((start.clone().cpu(), out[1].float().cpu()))
        return out

    setattr(net, name, wrapped)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deployment", required=True, help="a built deployment: target/ and drafter-{drafter}/")
    ap.add_argument("--drafter", default="dflash", choices=("dflash", "dflash2", "dspark"))
    ap.add_argument("--benchmark", nargs="+", default=["gsm8k"])
    ap.add_argument("--n", type=int, default=20, help="eval prompts per benchmark")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--width", type=int, default=8, help="chain verify width (anchor + drafts)")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", action="append", default=[], help="BRANCH,DEPTH: also measure this tree's tau")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    dep = Path(a.deployment)
    target = load_target(dep / "target", device="cpu", dtype=torch.float32)
    drafter = load_drafter(dep / f"drafter-{a.drafter}", device="cpu", dtype=torch.float32)
    data = os.environ.get("SPECPILOT_DATA_DIR")
    prompts = []
    with tempfile.TemporaryDirectory() as tmp:
        for bench in a.benchmark:
            prompts += [r["prompt_ids"] for r in write_prompt_file(bench, dep / "target", Path(tmp) / f"{bench}.jsonl",
                                                                   a.n, data_dir=data)]
    B, k, K = len(prompts), a.width - 1, a.ranks
    max_seq = max(map(len, prompts)) + a.new + a.width + 1
    ref = [r.output_ids for r in generate_ar(TargetRunner(target, B, max_seq), prompts, a.new)]
    block = a.width - 1 if a.drafter == "dspark" else a.width  # the drafter's own counting
    prop = make_proposer(drafter, block, {}, graphs=False)
    log: list = []
    hook(prop.drafter, log)
    rows = generate(TargetRunner(target, B, max_seq, prop.capture), prop, prompts, a.new)
    equal = sum(r.output_ids == x for r, x in zip(rows, ref))
    counts = [[0] * (K + 1) for _ in range(k)]  # counts[j-1][r-1]: rank r at position j (r = K + 1: beyond)
    for start, scores in log:
        for b in range(B):
            anchor_idx = int(start[b]) - len(prompts[b])  # output index of the step's anchor
            for j in range(1, k + 1):
                idx = anchor_idx + j
                if idx >= len(ref[b]) or anchor_idx < 0:
                    break
                r = rank_of(scores[b, j - 1], ref[b][idx], K + 1)
                counts[j - 1][r - 1] += 1
                if r != 1:
                    break
    recall, rates = [], []
    for j in range(k):
        n = sum(counts[j])
        if n == 0:  # never reached: the position before it stands in
            recall.append(list(recall[-1]) if recall else [0.0] * K)
        else:
            c, row = 0, []
            for r in range(K):
                c += counts[j][r]
                row.append(round(c / n, 6))
            recall.append(row)
        rates.append(recall[-1][0])
    prof = AcceptanceProfile(Path(a.out).stem, rates, block_size=a.width, recall=recall)
    trees = {f"branch{b}_depth{d}": round(expected_tau_tree(prof, a.width, b, d), 4)
             for b, d in ((1, k), (2, k), (3, 3), (3, k), (4, k))}
    checks = {}
    for spec in a.tree:
        b, d = (int(x) for x in spec.split(","))
        tp = make_proposer(drafter, block, {"tree_branch": b, "tree_depth": d}, graphs=False)
        trows = generate(TargetRunner(target, B, max_seq + b * d, tp.capture), tp, prompts, a.new)
        steps = [c for r in trows for c in r.committed_per_step[:-1]]  # the budget cuts each row's last step
        checks[f"branch{b}_depth{d}"] = {
            "measured_tau": round(sum(steps) / len(steps), 4), "steps": len(steps),
            "predicted_tau": round(expected_tau_tree(prof, a.width, b, d), 4),
            "chain_measured_tau": round(sum(c for r in rows for c in r.committed_per_step[:-1]) /
                                        sum(len(r.committed_per_step) - 1 for r in rows), 4),
            "outputs_equal_ar": f"{sum(r.output_ids == x for r, x in zip(trows, ref))}/{B}"}
    out = {"name": prof.name, "block_size": a.width,
           "source": (f"measured: the {a.drafter} drafter of {dep.name} against its target "
                      f"(gpu_bench/drafter_ranks.py, {time.strftime('%Y-%m-%d')}): {a.n} eval prompts of "
                      f"{', '.join(a.benchmark)}, {a.new} new tokens, chain width {a.width}, CPU, eager; ranks of "
                      f"the AR token among the drafter's scores, counted at position j while 1..j-1 had rank 1"),
           "expected_tau": round(expected_tau(prof, a.width), 4), "expected_tau_trees": trees,
           "measured_tau": round(sum(c for r in rows for c in r.committed_per_step) /
                                 sum(len(r.committed_per_step) for r in rows), 4),
           "outputs_equal_ar": f"{equal}/{B}", "tree_checks": checks,
           "samples_per_position": [sum(c) for c in counts],
           "rank_counts": counts, "conditional_acceptance": rates, "rank_recall": recall,
           "seconds": round(time.time() - t0, 1)}
    write_json(a.out, out)
    print(json.dumps({k_: v for k_, v in out.items() if k_ not in ("rank_counts", "rank_recall")}, indent=1))
    ok = equal == B and all(c["outputs_equal_ar"] == f"{B}/{B}" for c in checks.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``specpilot bench ranks``: per-position rank recall of a real drafter, written as a replay profile
with ``rank_recall`` (issue 16). CPU, the drafter eager.

The replay drafter models side-branch trees from, per draft position j, the distribution of the
rank of the correct token among the drafter's candidates given the drafts before j were accepted
(:mod:`specpilot.drafters.replay`). This measures it: the deployment's target decodes ``--n`` eval
prompts of each ``--benchmark`` greedily (the AR reference), then the drafter runs the speculative
loop (a chain of ``--width`` tokens, anchor included) and at every step the rank of the reference
token in the drafter's scores at each position is read (1 + the number of tokens scored higher; a
token outside a DFlash2 selector's K candidates has rank K + 1), counted at position j only while
positions 1..j-1 of that step had rank 1. The profile holds the conditional acceptance (rank 1),
the cumulative recall for ranks 1..``--ranks``, the sample counts, and its expected tau for a chain
and a few trees; ``--profile-out`` writes it as a packaged profile
(``src/specpilot/replay_profiles/tiny_{drafter}_ranks.json`` came from here). Every output of the
loop is checked to equal AR.

The model's check: ``--tree BRANCH,DEPTH`` (repeatable) runs the same drafter proposing the
engine's spine + side-branch tree on the same prompts and records its measured tau beside the tau
the profile predicts (:func:`expected_tau_tree`: the positions' ranks independent given the
earlier drafts were right). A dry run uses an in-memory random target and drafter and random prompts.

Replaces gpu_bench/drafter_ranks.py.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from ..errors import SpecpilotError
from ..io import write_json
from ..prompts import write_prompt_file
from . import _engine as E
from ._common import Run, add_common, fmt, random_tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "ranks")
    p.add_argument("--deployment", help="a built deployment: target/ and drafter-{drafter}/ (required but on a dry run)")
    p.add_argument("--drafter", default="dflash", choices=("dflash", "dflash2", "dspark"))
    p.add_argument("--benchmark", nargs="+", default=["gsm8k"])
    p.add_argument("--n", type=int, default=20, help="eval prompts per benchmark")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--width", type=int, default=8, help="chain verify width (anchor + drafts)")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tree", action="append", default=[], help="BRANCH,DEPTH: also measure this tree's tau")
    p.add_argument("--profile-out", help="write the measured profile here (a replay profile file)")


def rank_of(scores: torch.Tensor, token: int, cap: int) -> int:
    """1 + the number of tokens scored above ``token`` (capped at ``cap``; an unscored, -inf token: cap)."""
    s = scores[token]
    if not torch.isfinite(s):
        return cap
    return min(cap, 1 + int((scores > s).sum()))


def hook(net, log: list) -> None:
    """Record (start [B], scores [B, k, V]) of every draft forward of ``net`` (its full draft when
    it has one, DSpark's Markov walk, else ``draft``)."""
    name = "draft_full" if hasattr(net, "draft_full") else "draft"
    orig = getattr(net, name)

    def wrapped(anchor, start, *args, **kw):
        out = orig(anchor, start, *args, **kw)
        log.append((start.clone().cpu(), out[1].float().cpu()))
        return out

    setattr(net, name, wrapped)


def load(a: argparse.Namespace):
    """(target, drafter, prompts): the deployment's, or a dry run's random ones."""
    if a.dry_run:
        target = E.dry_target(seed=a.seed)
        drafter = E.dry_drafter(target, block_size=a.width, seed=a.seed)
        V = target.config.vocab_size
        return target, drafter, [random_tokens(12, V, a.seed + i) for i in range(a.n)]
    if not a.deployment:
        raise SpecpilotError("ranks: --deployment (a built deployment folder) is required")
    dep = Path(a.deployment)
    target = E.load_target(dep / "target", device="cpu", dtype=torch.float32)
    drafter = E.load_drafter(dep / f"drafter-{a.drafter}", device="cpu", dtype=torch.float32)
    prompts = []
    with tempfile.TemporaryDirectory() as tmp:
        for bench in a.benchmark:
            prompts += [r["prompt_ids"] for r in write_prompt_file(bench, dep / "target", Path(tmp) / f"{bench}.jsonl", a.n,
                                                                   data_dir=os.environ.get("SPECPILOT_DATA_DIR"))]
    return target, drafter, prompts


def count(log: list, prompts: list, ref: list, k: int, K: int) -> list[list[int]]:
    """counts[j-1][r-1]: steps whose reference token had rank r at position j (r = K + 1: beyond),
    counted while positions 1..j-1 of the step had rank 1."""
    counts = [[0] * (K + 1) for _ in range(k)]
    for start, scores in log:
        for b in range(len(prompts)):
            anchor = int(start[b]) - len(prompts[b])  # output index of the step's anchor
            for j in range(1, k + 1):
                idx = anchor + j
                if idx >= len(ref[b]) or anchor < 0:
                    break
                r = rank_of(scores[b, j - 1], ref[b][idx], K + 1)
                counts[j - 1][r - 1] += 1
                if r != 1:
                    break
    return counts


def recall_of(counts: list[list[int]], K: int) -> list[list[float]]:
    """Cumulative recall per position for ranks 1..K (a position never reached takes the one before)."""
    recall = []
    for row in counts:
        n = sum(row)
        if n == 0:
            recall.append(list(recall[-1]) if recall else [0.0] * K)
            continue
        c, out = 0, []
        for r in range(K):
            c += row[r]
            out.append(round(c / n, 6))
        recall.append(out)
    return recall


def tau(rows, cut_last: bool = False) -> float:
    steps = [c for r in rows for c in (r.committed_per_step[:-1] if cut_last else r.committed_per_step)]
    return round(sum(steps) / len(steps), 4)


def measure(a: argparse.Namespace, name: str) -> dict:
    target, drafter, prompts = load(a)
    B, k, K = len(prompts), a.width - 1, a.ranks
    max_seq = max(map(len, prompts)) + a.new + a.width + 1
    ref = [r.output_ids for r in E.generate_ar(E.TargetRunner(target, B, max_seq), prompts, a.new)]
    block = a.width - 1 if a.drafter == "dspark" else a.width  # the drafter's own counting
    prop = E.make_proposer(drafter, block, {})
    log: list = []
    hook(prop.drafter, log)
    rows = E.generate(E.TargetRunner(target, B, max_seq, prop.capture), prop, prompts, a.new)
    counts = count(log, prompts, ref, k, K)
    recall = recall_of(counts, K)
    prof = E.AcceptanceProfile(name, [r[0] for r in recall], block_size=a.width, recall=recall)
    checks = {}
    for spec in a.tree:
        b, d = (int(x) for x in spec.split(","))
        tp = E.make_proposer(drafter, block, {"tree_branch": b, "tree_depth": d})
        trows = E.generate(E.TargetRunner(target, B, max_seq + b * d, tp.capture, verify_width=tp.verify_width), tp,
                           prompts, a.new)
        checks[f"branch{b}_depth{d}"] = {  # the token budget cuts each row's last step: left out
            "measured_tau": tau(trows, True), "predicted_tau": round(E.expected_tau_tree(prof, a.width, b, d), 4),
            "chain_measured_tau": tau(rows, True),
            "outputs_equal_ar": f"{sum(r.output_ids == x for r, x in zip(trows, ref))}/{B}"}
    return {"name": name, "block_size": a.width,
            "source": (f"measured: the {a.drafter} drafter of {a.deployment or 'a dry run'} against its target "
                       f"(specpilot bench ranks): {a.n} eval prompts of {', '.join(a.benchmark)}, {a.new} new tokens, "
                       f"chain width {a.width}, CPU, eager; ranks of the AR token among the drafter's scores, "
                       f"counted at position j while 1..j-1 had rank 1"),
            "expected_tau": round(E.expected_tau(prof, a.width), 4),
            "expected_tau_trees": {f"branch{b}_depth{d}": round(E.expected_tau_tree(prof, a.width, b, d), 4)
                                   for b, d in ((1, k), (2, k), (3, 3), (3, k), (4, k))},
            "measured_tau": tau(rows), "outputs_equal_ar": f"{sum(r.output_ids == x for r, x in zip(rows, ref))}/{B}",
            "tree_checks": checks, "samples_per_position": [sum(c) for c in counts], "rank_counts": counts,
            "conditional_acceptance": prof.rates, "rank_recall": recall}


def table(R: dict) -> list[str]:
    p = R.get("profile")
    if not p:
        return []
    L = [f"{p['name']}: measured tau {fmt(p['measured_tau'], '{:.2f}')}, the profile's {fmt(p['expected_tau'], '{:.2f}')}; "
         f"outputs = AR {p['outputs_equal_ar']}",
         "top-1 / top-2 / top-4 recall at position 1: " + " / ".join(fmt(p["rank_recall"][0][r], "{:.2f}") for r in (0, 1, 3)
                                                                      if r < len(p["rank_recall"][0]))]
    for name, c in p["tree_checks"].items():
        L.append(f"tree {name}: measured tau {c['measured_tau']}, predicted {c['predicted_tau']} (chain "
                 f"{c['chain_measured_tau']}), outputs = AR {c['outputs_equal_ar']}")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.n, args.new, args.width, args.ranks = 2, 24, 4, 64  # 64 of the 256 tokens: recall above 0
    torch.set_num_threads(args.threads)
    rn = Run("ranks", args)
    name = Path(args.profile_out).stem if args.profile_out else f"{args.drafter}_ranks"
    prof = rn.phase("profile", lambda: measure(args, name))
    if prof is not None and args.profile_out:
        write_json(args.profile_out, prof)
    ok = prof is not None and prof["outputs_equal_ar"].split("/")[0] == prof["outputs_equal_ar"].split("/")[1] \
        and all(c["outputs_equal_ar"].split("/")[0] == c["outputs_equal_ar"].split("/")[1]
                for c in prof["tree_checks"].values())
    return max(rn.finish(table(rn.R)), 0 if ok else 1)

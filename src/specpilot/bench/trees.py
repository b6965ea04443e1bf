"""``specpilot bench trees``: tau against node budget for the token-tree builders on real drafters
(issue 47). CPU, the drafters eager; token counts, so a loaded machine does not change them.

On ``--n`` eval prompts of each ``--benchmark`` the deployment's target decodes greedily (the AR
reference), then each builder runs through the engine (:func:`~specpilot.engine.proposers.make_engine_proposer`,
the drafter's own block unless ``--block``) at every ``--nodes`` budget:

- ``dflash-static`` / ``dflash2-static``: the static tree of N nodes (``tree_nodes``) chosen from
  the drafter's rank profile, measured here at the same block on ``--calibration-n`` calibration
  prompts per benchmark (disjoint from the eval prompts);
- ``dflash2-spine``: the selector walk plus side branches (``tree_branch`` x ``tree_depth`` filling
  the budget; it saturates at (K - 1) x (B - 1) side nodes);
- ``dflash2-lattice``: the path-conditioned lattice tree (``tree_lattice``, :mod:`specpilot.drafters.lattice`).

tau per benchmark pools its rows' verify steps, each row's last step left out (the token budget
cuts it); the summary is the geometric mean over the benchmarks and its ratio to the same
drafter's chain. Every output is compared with AR, and the target's teacher-forced pass
(:func:`~specpilot.forcing.teacher.teacher_forced`, the CPU forcing path) checks AR's outputs (an
output equal to AR has AR's verdict; any other is checked itself).

The lattice runs also record, at every step, the best-first rank of the correct continuation's
prefix of each depth among all lattice nodes (:func:`~specpilot.drafters.lattice.prefix_ranks`,
up to ``--rank-width``) and whether it is in the lattice at all (the oracle): the tau a tree of
any budget would reach, and the bound of an unlimited one. ``--profile-out`` writes the DFlash2
chain's rank profile plus this ``lattice`` section as a replay profile
(:mod:`specpilot.drafters.lattice_profile`; the replay drafter then emulates lattice trees), with
its predicted tau beside the measured one per budget. A dry run uses random models and prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from ..drafters.lattice_profile import LatticeRecorder, pooled_profile
from ..errors import SpecpilotError
from ..io import write_json
from ..prompts import BENCHMARKS, write_prompt_file
from . import _engine as E
from ._common import Run, add_common, fmt, random_tokens
from .ranks import count, hook, recall_of

BUILDERS = ("dflash-static", "dflash2-spine", "dflash2-static", "dflash2-lattice")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "trees")
    p.add_argument("--deployment", help="a built deployment: target/, drafter-dflash/, drafter-dflash2/ "
                                        "(required but on a dry run)")
    p.add_argument("--benchmark", nargs="+", default=list(BENCHMARKS))
    p.add_argument("--n", type=int, default=4, help="eval prompts per benchmark")
    p.add_argument("--calibration-n", type=int, default=4, help="calibration prompts per benchmark (rank profiles)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--nodes", type=int, nargs="+", default=[15, 31, 63, 127, 255])
    p.add_argument("--block", type=int, help="verify width of a chain (default: each drafter's config)")
    p.add_argument("--builders", nargs="+", default=list(BUILDERS), choices=BUILDERS)
    p.add_argument("--rank-width", type=int, default=1024, help="lattice prefix ranks measured up to this rank")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile-out", help="write the DFlash2 lattice replay profile here")


def _prompts(a, dep: Path | None, role: str, n: int, vocab: int) -> dict[str, list[list[int]]]:
    """Prompt ids per benchmark (a dry run: random tokens)."""
    if dep is None:
        return {b: [random_tokens(10 + i, vocab, a.seed + 100 * j + i + (50 if role == "calibration" else 0))
                    for i in range(n)] for j, b in enumerate(a.benchmark)}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for b in a.benchmark:
            rows = write_prompt_file(b, dep / "target", Path(tmp) / f"{b}.jsonl", n, role=role,
                                     data_dir=os.environ.get("SPECPILOT_DATA_DIR"))
            out[b] = [r["prompt_ids"] for r in rows]
    return out


def load(a: argparse.Namespace):
    """(target, {kind: drafter network}, eval prompts, calibration prompts) per benchmark."""
    kinds = sorted({b.split("-")[0] for b in a.builders})
    if a.dry_run:
        target = E.dry_target(seed=a.seed)
        nets = {k: E.dry_drafter(target, block_size=a.block or 6, seed=a.seed + i, kind=k) for i, k in enumerate(kinds)}
        V, dep = target.config.vocab_size, None
    else:
        if not a.deployment:
            raise SpecpilotError("trees: --deployment (a built deployment folder) is required")
        dep = Path(a.deployment)
        target = E.load_target(dep / "target", device="cpu", dtype=torch.float32)
        nets = {k: E.load_drafter(dep / f"drafter-{k}", device="cpu", dtype=torch.float32) for k in kinds}
        V = target.config.vocab_size
    return target, nets, _prompts(a, dep, "eval", a.n, V), _prompts(a, dep, "calibration", a.calibration_n, V)


def _flat(groups: dict[str, list]) -> tuple[list, list[str]]:
    prompts, names = [], []
    for b, ps in groups.items():
        prompts += ps
        names += [b] * len(ps)
    return prompts, names


def _engine_run(target, net, block: int, cfg: dict, prompts: list[list[int]], new: int, wrap=None):
    """(rows, proposer) of engine ``specpilot`` with config ``cfg`` over ``prompts``."""
    spec = E.EngineSpec("specpilot", block, cfg)
    prop = E.make_engine_proposer(spec, target, net)
    if wrap is not None:
        wrap(prop)
    max_seq = max(map(len, prompts)) + new + max(spec.verify_width, prop.verify_width) + 1
    rows = E.generate(E.TargetRunner(target, len(prompts), max_seq, prop.capture), prop, prompts, new, profile=False)
    return rows, prop


def _taus(rows, names: list[str]) -> dict[str, float]:
    """tau per benchmark: its rows' committed tokens per verify step, each row's last step left out."""
    out = {}
    for b in dict.fromkeys(names):
        steps = [c for r, n in zip(rows, names) if n == b for c in r.committed_per_step[:-1]]
        out[b] = round(sum(steps) / len(steps), 4) if steps else None
    return out


def _summary(taus: dict[str, float]) -> float | None:
    vals = [v for v in taus.values() if v]
    return round(statistics.geometric_mean(vals), 4) if vals else None


def rank_profile(target, net, block: int, prompts: list[list[int]], new: int, K: int, name: str):
    """The drafter's rank profile at ``block`` (:mod:`specpilot.bench.ranks`): its chain on ``prompts``."""
    ref = [r.output_ids for r in E.generate_ar(E.TargetRunner(target, len(prompts), max(map(len, prompts)) + new + 1),
                                               prompts, new)]
    log: list = []
    _engine_run(target, net, block, {}, prompts, new, wrap=lambda p: hook(p.drafter, log))
    counts = count(log, prompts, ref, block - 1, K)
    recall = recall_of(counts, K)
    return E.AcceptanceProfile(name, [r[0] for r in recall], block_size=block, recall=recall), counts


def spine_shape(nodes: int, k: int, K: int) -> tuple[int, int]:
    """(tree_branch, tree_depth) of the spine tree filling a budget of ``nodes`` over ``k`` drafts and
    K candidates: b = ceil((N - k) / k) side branches (at most K - 1) on d = (N - k) // b positions
    (at most k); (0, 1) when the budget holds only the chain."""
    extra = nodes - k
    if extra < 1:
        return 0, 1
    b = min(K - 1, -(-extra // k))
    return b, min(k, extra // b)


def _forcing(target, prompts, outputs, ar_outputs, ar_verdict) -> int:
    """Violations (margin > the fp32 tolerance) of the teacher-forced pass over ``outputs``: an output
    equal to AR's has AR's count."""
    bad = 0
    for p, o, r, v in zip(prompts, outputs, ar_outputs, ar_verdict):
        if o == r:
            bad += v
        else:
            bad += sum(m > 1e-3 for m in E.teacher_forced(target, p, o)[1])
    return bad


def measure(a: argparse.Namespace) -> dict:
    target, nets, groups, calib = load(a)
    prompts, names = _flat(groups)
    cprompts, _ = _flat(calib)
    B = len(prompts)
    ar = [r.output_ids for r in E.generate_ar(E.TargetRunner(target, B, max(map(len, prompts)) + a.new + 1), prompts, a.new)]
    ar_bad = [sum(m > 1e-3 for m in E.teacher_forced(target, p, o)[1]) for p, o in zip(prompts, ar)]
    res = {"benchmarks": list(groups), "prompts_per_benchmark": a.n, "new_tokens": a.new, "nodes": a.nodes,
           "forcing_violations_ar": sum(ar_bad), "drafters": {}}
    tmp = tempfile.TemporaryDirectory()
    for kind, net in nets.items():
        block = a.block or int(net.config.block_size)
        K = int(net.candidate_selector.top_k) if kind == "dflash2" else 8
        k = block - 1
        entry = res["drafters"][kind] = {"block": block, "K": K, "curves": {}}

        def record(label: str, nodes: int, cfg: dict, wrap=None) -> None:
            rows, prop = _engine_run(target, net, block, cfg, prompts, a.new, wrap)
            outs = [r.output_ids for r in rows]
            taus = _taus(rows, names)
            entry["curves"].setdefault(label, []).append({
                "budget": nodes, "nodes": prop.verify_width - 1, "config": cfg, "tau": taus, "geomean": _summary(taus),
                "pooled_tau": _taus(rows, ["all"] * B)["all"],
                "outputs_equal_ar": f"{sum(o == r for o, r in zip(outs, ar))}/{B}",
                "forcing_violations": _forcing(target, prompts, outs, ar, ar_bad)})

        chain_log: list = []
        record("chain", k, {}, wrap=lambda p: hook(p.drafter, chain_log))
        counts = count(chain_log, prompts, ar, k, K)
        entry["chain_ranks"] = {"conditional_acceptance": [r[0] for r in recall_of(counts, K)],
                                "rank_recall": recall_of(counts, K), "rank_counts": counts}
        if f"{kind}-static" in a.builders:
            prof, counts = rank_profile(target, net, block, cprompts, a.new, K, f"{kind}_ranks_block{block}")
            path = Path(tmp.name) / f"{kind}.json"
            path.write_text(json.dumps(prof.to_dict()))
            entry["calibration_ranks"] = {"conditional_acceptance": prof.rates, "rank_recall": prof.recall,
                                          "rank_counts": counts}
            for n in a.nodes:
                record("static", n, {"tree_nodes": n, "tree_profile": str(path)})
        if kind == "dflash2" and "dflash2-spine" in a.builders:
            for n in a.nodes:
                b, d = spine_shape(n, k, K)  # (0, 1): the budget holds only the chain
                record("spine", n, {"tree_branch": b, "tree_depth": d} if b else {})
        if kind == "dflash2" and "dflash2-lattice" in a.builders:
            logs = []
            for n in a.nodes:
                logs.append(LatticeRecorder(prompts, ar, a.rank_width))
                record("lattice", n, {"tree_lattice": n}, wrap=logs[-1].wrap)
            entry["lattice"] = lattice_summary(logs, entry["curves"]["lattice"], k)
        chain = entry["curves"]["chain"][0]["geomean"]
        for curve in entry["curves"].values():
            for c in curve:
                c["x_chain"] = round(c["geomean"] / chain, 4) if c["geomean"] and chain else None
    tmp.cleanup()
    return res


def lattice_summary(logs: list[LatticeRecorder], runs: list[dict], k: int) -> dict:
    """The lattice section from the pooled recorders of the lattice runs (one per run), with its
    predicted tau beside each run's pooled measured tau."""
    shapes = {str(c["nodes"]): log.mean_shape(k) for c, log in zip(runs, logs) if log.depths}
    prof = pooled_profile(logs, k, shapes)
    fit = {}
    for c in runs:
        pred = round(prof.expected_tau(c["nodes"]), 4)
        fit[str(c["nodes"])] = {"measured": c["pooled_tau"], "predicted": pred,
                                "error": round(pred / c["pooled_tau"] - 1, 4) if c["pooled_tau"] else None}
    errs = [abs(f["error"]) for f in fit.values() if f["error"] is not None]
    return {"profile": prof.to_dict(), "fit": fit, "max_fit_error": max(errs) if errs else None,
            "predicted_tau": {str(g): round(prof.expected_tau(g), 4) for g in (511, 1023)},
            "oracle_tau": round(1 + sum(prof.oracle), 4)}


def write_profile(R: dict, a: argparse.Namespace, date: str) -> dict:
    """The DFlash2 replay profile with its lattice section (``--profile-out``): the eval chain's rank
    profile (its own chain as stock) and the lattice runs' prefix ranks."""
    d = R["drafters"].get("dflash2")
    if not d or "lattice" not in d:
        raise SpecpilotError("trees: --profile-out needs the dflash2-lattice builder")
    ch = d["chain_ranks"]
    prof = E.AcceptanceProfile(Path(a.profile_out).stem, ch["conditional_acceptance"], block_size=d["block"],
                               recall=ch["rank_recall"])
    out = {**prof.to_dict(),
           "source": (f"measured: the dflash2 drafter of {a.deployment or 'a dry run'} against its target (specpilot "
                      f"bench trees, {date}): {a.n} eval prompts of {', '.join(R['benchmarks'])}, {a.new} new "
                      f"tokens, block {d['block']}, CPU, eager; chain ranks of the AR token among the selector's "
                      f"scores (positions 1..j-1 right), lattice prefix ranks pooled over the lattice runs of "
                      f"{', '.join(str(c['nodes']) for c in d['curves']['lattice'])} nodes"),
           "measured_tau": d["curves"]["chain"][0]["pooled_tau"], "rank_counts": ch["rank_counts"],
           "lattice": d["lattice"]["profile"],
           "lattice_fit": d["lattice"]["fit"]}
    write_json(a.profile_out, out)
    return {"path": a.profile_out, "expected_tau_chain": out["expected_tau"]}


def table(R: dict) -> list[str]:
    m = R.get("trees")
    if not m:
        return []
    L = [f"tau (geomean over {', '.join(m['benchmarks'])}; {m['prompts_per_benchmark']} prompts x {m['new_tokens']} "
         f"tokens) against node budget; x chain in brackets; AR forcing violations {m['forcing_violations_ar']}"]
    for kind, d in m["drafters"].items():
        chain = d["curves"]["chain"][0]
        L.append(f"{kind} (block {d['block']}, K {d['K']}): chain {fmt(chain['geomean'], '{:.2f}')} "
                 f"(= AR {chain['outputs_equal_ar']})")
        for label, curve in d["curves"].items():
            if label == "chain":
                continue
            cells = [f"{c['budget']}:{fmt(c['geomean'], '{:.2f}')}({fmt(c['x_chain'], '{:.3f}')})"
                     + ("" if c["nodes"] == c["budget"] else f"[{c['nodes']}n]") for c in curve]
            ok = all(c["outputs_equal_ar"].split("/")[0] == c["outputs_equal_ar"].split("/")[1]
                     and c["forcing_violations"] == 0 for c in curve)
            L.append(f"  {label:8s} " + " ".join(cells) + f"  outputs = AR, forcing: {'all' if ok else 'NOT ALL'}")
        lat = d.get("lattice")
        if lat:
            L.append(f"  lattice bound: oracle tau {fmt(lat['oracle_tau'], '{:.2f}')} (every prefix in the lattice), "
                     f"predicted 511 / 1023 nodes {fmt(lat['predicted_tau']['511'], '{:.2f}')} / "
                     f"{fmt(lat['predicted_tau']['1023'], '{:.2f}')}; profile fit error max "
                     f"{fmt(lat['max_fit_error'], '{:.3f}')} over {lat['profile']['samples']} steps")
    return L


def _ok(R: dict) -> bool:
    m = R.get("trees")
    return bool(m) and all(c["outputs_equal_ar"].split("/")[0] == c["outputs_equal_ar"].split("/")[1]
                           and c["forcing_violations"] == 0
                           for d in m["drafters"].values() for curve in d["curves"].values() for c in curve)


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.n, args.calibration_n, args.new, args.nodes, args.rank_width = 2, 2, 24, [3, 9], 64
        args.benchmark = args.benchmark[:2]
    torch.set_num_threads(1 if args.dry_run else args.threads)
    rn = Run("trees", args)
    if rn.phase("trees", lambda: measure(args)) is not None and args.profile_out:
        rn.phase("profile", lambda: write_profile(rn.R["trees"], args, rn.R["date"]))
    return max(rn.finish(table(rn.R)), 0 if _ok(rn.R) else 1)

"""The lattice tree's node budget from the cost model (issue 47): tokens per millisecond against
the budget, from a tau curve and a verify-cost curve both measured for the deployment on its device.

- tau curve: one lattice-tree run at the largest budget on the calibration prompts, recorded
  against the AR references (:class:`~specpilot.drafters.lattice_profile.LatticeRecorder`): the
  prefix ranks give the tau of every smaller budget at once (a tree of N nodes holds the correct
  prefix of depth d exactly when its best-first rank is <= N);
- verify-cost curve: the target's verify of a tree of each budget's width and that run's mean
  geometry (the path form, as the engine runs a lattice tree) at the calibration prompts' context
  and the round's concurrency, timed on the device (CUDA events; the host clock on a CPU);
- the rest of a step (draft, host) is the base config's measured per-step time (the cost model's
  ``measured_step_s``).

A budget's predicted rate is tau(N) / (draft + host + verify(N)) tokens per second; the plan step
ranks the direction ``tree_lattice``'s budgets by it (:func:`plan_order`) and its agent tries them
in that order. "No tree" (budget 0: a chain of the base's block, whose tau the base's own run
measured, its verify timed the same way as the trees') is ranked with them, so a plan can say
that trees do not pay at this deployment (``trees_pay`` False: no budget is predicted faster than
the chain; measured GPU steps, issue 54: a 63-node tree's verify 1.19x the chain's at the same
drafter) (the DSpark planner's and SmartSpec's idea, goodput = expected tokens x profiled
steps per second, applied to the tree size; DSpark arXiv 2607.05147 Alg. 1, SmartSpec arXiv 2406.14066).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..drafters.lattice import LatticeTreeProposer
from ..drafters.lattice_profile import LatticeRecorder, pooled_profile, shape_parents
from ..engine.loop import generate
from ..engine.runner import TargetRunner
from ..tuning.timing import median_ms


def tau_curve(dep, prompts: list[list[int]], references: list[list[int]], block: int, nodes: int,
              width: int = 1024):
    """The :class:`~specpilot.drafters.lattice_profile.LatticeProfile` of one lattice run of
    ``nodes`` nodes over ``prompts`` (a static batch) against ``references`` (per row the AR
    output ids), block ``block`` (anchor + drafts); its ``shapes`` hold that run's geometry."""
    prop = LatticeTreeProposer(dep.drafter, block_size=block, nodes=nodes)
    rec = LatticeRecorder(prompts, references, width)
    rec.wrap(prop)
    new = max(map(len, references))
    max_seq = max(map(len, prompts)) + new + nodes + 2
    with torch.inference_mode():
        generate(TargetRunner(dep.target, len(prompts), max_seq, prop.capture, dep.backend, prop.verify_width), prop, prompts, new,
                 profile=False)
    k = block - 1
    return pooled_profile([rec], k, {str(nodes): rec.mean_shape(k)})


def verify_ms(dep, lattice, budgets: list[int], batch: int, context: int, repeats: int = 5,
              chain: int = 0) -> dict[int, float]:
    """Median milliseconds of the target's verify of a lattice-shaped tree of each budget (its
    geometry from ``lattice``: :meth:`~specpilot.drafters.lattice_profile.LatticeProfile.counts`)
    at ``context`` committed tokens, ``batch`` rows; nothing is committed. ``chain`` > 0: also a
    chain verify of that many tokens, under key 0 ("no tree")."""
    dev = dep.target.lm_head.weight.device
    V = dep.target.config.vocab_size
    width = max(max(budgets) + 1, chain)
    runner = TargetRunner(dep.target, batch, context + width + 1, backend=dep.backend, verify_width=width)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        runner.prefill([torch.randint(0, V, (context,), generator=g).tolist()] * batch)
    out = {}
    for n in budgets:
        parents, _ = shape_parents(lattice.counts(n))
        par = torch.tensor([parents], dtype=torch.long, device=dev).expand(batch, -1).contiguous()
        tok = torch.randint(0, V, (batch, n + 1), generator=g).to(dev)
        fn = lambda: runner.verify(tok, par, lattice.depth)  # noqa: E731
        out[n] = median_ms(fn, repeats) if dev.type == "cuda" else _wall_ms(fn, repeats)
    if chain:  # "no tree": a chain of ``chain`` tokens (the base's block), timed the same way
        tok = torch.randint(0, V, (batch, chain), generator=g).to(dev)
        fn = lambda: runner.verify(tok)  # noqa: E731
        out[0] = median_ms(fn, repeats) if dev.type == "cuda" else _wall_ms(fn, repeats)
    return out


def _wall_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rank_budgets(taus: dict[int, float], verify: dict[int, float], other_ms: float) -> list[dict]:
    """Budgets by predicted tokens per millisecond, best first: tau(N) / (``other_ms`` + verify(N)).
    Budget 0 is "no tree" (a chain: ``"tree": False``). Ties keep the smaller budget first (no
    tree before any tree)."""
    rows = [{"nodes": n, "tree": n > 0, "tau": round(taus[n], 4), "step_ms": round(other_ms + verify[n], 4),
             "tokens_per_ms": round(taus[n] / (other_ms + verify[n]), 5)} for n in sorted(taus)]
    return sorted(rows, key=lambda r: (-r["tokens_per_ms"], r["nodes"]))


def chain_tau(base: dict, analysis: dict) -> float | None:
    """The tau of "no tree" at this deployment: the base run's measured tau when the base config
    verifies a chain (no ``tree_lattice`` / ``tree_nodes`` / ``tree_branch``), else None (a tree
    base measured no chain's acceptance)."""
    tree = any(int(base.get(k) or 0) > 0 for k in ("tree_lattice", "tree_nodes", "tree_branch"))
    return None if tree else float(analysis["tau"])


def plan_order(ev, base: dict, analysis: dict, budgets: list[int]) -> dict:
    """The lattice budgets of ``budgets`` ranked for the deployment of evaluator ``ev`` (its
    calibration prompts, AR references, concurrency) from the base config's measured step
    (``analysis``: :func:`~specpilot.agent.costmodel.analyze`), with "no tree" (budget 0, a chain of
    the base's block; :func:`chain_tau`) among them when the base verifies a chain. Returns
    ``{"order": [params of the trees, best first], "ranked": [rows of rank_budgets], "trees_pay":
    bool | None (None: no chain to rank against), "tau_samples": int}``; ``trees_pay`` False: no
    budget is predicted faster than the chain (the agent still measures the order given)."""
    nodes = [n for n in budgets if n > 0]
    block = int(base.get("block_size") or ev.drafter.config.block_size)
    prompts = [p["prompt_ids"] for p in ev.prompts]
    refs = [r.output_ids for r in ev.ar]
    lat = tau_curve(ev.dep, prompts, refs, block, max(nodes))
    ctx = int(statistics.median(len(p) for p in prompts)) + ev.max_new // 2
    tau0 = chain_tau(base, analysis)
    verify = verify_ms(ev.dep, lat, nodes, max(1, int(ev.concurrency)), ctx, chain=block if tau0 else 0)
    ms = analysis["measured_step_s"]
    taus = {n: lat.expected_tau(n) for n in nodes} | ({0: tau0} if tau0 else {})
    ranked = rank_budgets(taus, verify, (ms["draft"] + ms["host"]) * 1e3)
    return {"order": [{"tree_lattice": r["nodes"]} for r in ranked if r["tree"]], "ranked": ranked,
            "trees_pay": (ranked[0]["tree"] if tau0 else None), "tau_samples": lat.samples}

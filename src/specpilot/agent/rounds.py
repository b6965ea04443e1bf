"""``specpilot round``: the agent rounds as resumable steps (Snakemake runs each as a job).

Every file a step reads was written by an earlier step (declared inputs), and every file it writes
is a declared output:

- ``references``: AR and stock records on the calibration prompts (the token-forcing references and
  the AR speed every step compares against; measured once per (gpu, deployment)).
- ``plan``: measure the round's base config (round 1: stock, or the best entries of the memory it
  starts from that transfer and pass here; round k: round k-1's integrated config), run the cost
  model (``costmodel.json`` / ``.txt``), and choose the directions registered for the largest gaps,
  one per ranked term first (:func:`specpilot.agent.directions.plan_directions`; ``plan.json``; a
  Snakemake checkpoint: the directions decide the agent jobs).
- ``agent``: one direction's agent trials candidates through its policy behind the token-forcing
  gate (``agent-{direction}.json``; the trials' records in ``agent-{direction}/``).
- ``integrate``: merge the winners into one config, re-validate and re-measure it
  (``integrated.json``), and write the round's memory snapshot (``memory.jsonl``: the snapshot it
  started from, the plan's invalidations, and the mechanisms integrated this round).
``specpilot final`` (:mod:`specpilot.agent.final`) copies the last round's integrated config to
``specpilot.json``; ``kernels`` is the kernel sub-agent (:mod:`specpilot.agent.kernel_agent`).

Method parameters (command-line options, from config ``rounds``): ``min_gain`` (a candidate
counts as a win only when the lower end of its gain's 95 % interval, the interval the table uses:
seeded bootstrap over requests and repeats, is at least this factor; :mod:`specpilot.agent.decide`),
``confirm_factor`` (the merged config of several winners is kept only when its gain is at least this
fraction of the best single winner's), ``repeats`` (alternating timing repeats per trial). The
integration confirms its choice on a fresh measurement with one more repeat (the winners' own
trials picked them, so their timings are biased upwards) and keeps it only when that interval is
clear of ``min_gain`` too; otherwise the base stays. Every decision records its interval.
``calibration_rungs`` (config ``rounds.calibration_cap``): every trial that decides something is
sequential (:meth:`specpilot.agent.trial.Evaluator.trial`): measured on more calibration prompts
while its interval straddles ``min_gain``, each rung recorded (docs/decisions.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from ..aggregate import geomean
from ..deployment import load_deployment
from ..device import pick_device, pick_dtype
from ..devices import device_identity
from ..engine.cli import resolve_block
from ..errors import SpecpilotError
from ..drafters.replay import load_profile
from ..io import atomic_write_text, comma_list, read_json, read_prompts, write_json
from ..kernels_build import engine_tables, use_kernel_outputs
from ..models.loading import load_target
from ..records import read_records, record_from_dict, write_records
from . import directions as dirs
from . import memory
from .costmodel import analyze, report_text
from .tree_budget import plan_order
from .decide import choose, clears
from .kernel_agent import tune
from .policies import grid_order, make_policy
from .trial import Evaluator, Evidence

log = logging.getLogger("specpilot.agent")


def _ctx(args, dtype: str) -> dict:
    return {"deployment": args.deployment, "gpu": args.gpu, "regime": args.regime,
            "target": args.target_name or args.target,
            "drafter": args.drafter_name, "dtype": dtype, "concurrency": args.concurrency,
            "replay": args.replay_profile, "directions": args.directions}


def device_context(dep, device: torch.device) -> dict:
    """What the directions' ``applies`` read of the loaded deployment: whether the target is dense
    (the Triton dense step: the w12 fast path), its weight bytes and the device's memory in GB
    (whether a second, 12-bit copy of the target fits beside it)."""
    target = dep.target
    nbytes = sum(p.numel() * p.element_size() for p in target.parameters())
    free = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return {"dense": bool(target.config.is_dense), "target_gb": nbytes / 1e9,
            "device_gb": None if free is None else free / 1e9}


def _evaluator(args, references: bool = True) -> tuple[Evaluator, dict]:
    """The loaded deployment + calibration prompts; ``references``: read ``--references-ar/-stock``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    dep = load_deployment(args.target, args.drafter, device=device, dtype=dtype)
    prompts = read_prompts(args.prompts)
    kernels = use_kernel_outputs(args.kernels_manifest, args.kernel_agent)
    # the sub-agent's engine matmul tables in the target's Triton step, as the engine cells run it
    # (the gate's teacher-forced pass copies them from the step graphs)
    tables = engine_tables(kernels.get("engine_configs"))
    if dep.backend.install_tables(tables):
        kernels["engine_tables"] = tables
    drafter_tables = engine_tables(kernels.get("drafter_engine_configs"))  # the draft step's, as the cells run it
    if dep.backend.install_drafter_tables(drafter_tables):
        kernels["drafter_engine_tables"] = drafter_tables
    meta = {"deployment": args.deployment, "target": args.target_name or args.target,
            "drafter": args.drafter_name, "gpu": args.gpu}
    ev = Evaluator(dep, prompts, args.max_new_tokens, args.concurrency, meta,
                   args.block_size, args.tolerance, repeats=args.repeats,
                   reload_target=lambda: load_target(args.target, dtype=dtype, device=device),
                   references=(read_records(args.references_ar), read_records(args.references_stock))
                   if references else None,
                   replay=load_profile(args.replay_profile) if args.replay_profile else None,
                   rungs=args.calibration_rungs, min_gain=args.min_gain, reuse_base=args.reuse_base)
    if args.reuse_base and args.base_evidence:  # the plan timed the round's base: not again here
        log.info("the round's base: %d record(s) of the plan's timing reused",
                 ev.keep(read_json(args.plan)["base_config"], Evidence.read(args.base_evidence, "base")))
    ctx = _ctx(args, "bf16" if dtype == torch.bfloat16 else "fp32")
    ctx.update(device_context(dep, device))
    ctx["kernels"] = kernels
    ctx["device"] = device_identity()  # which GPU timed this step (the device wrapper's)
    return ev, ctx


def _base_config(args) -> dict:
    if args.previous:
        return dict(read_json(args.previous)["config"])
    return {"block_size": args.block_size}


def references(args) -> int:
    """AR and stock records on the calibration prompts: ``repeats`` runs each, fastest kept."""
    ev, _ = _evaluator(args, references=False)
    write_records(args.out, ev.pool_ar)
    write_records(args.out_stock, ev.pool_stock)
    print(f"references: {len(ev.pool_ar)} calibration requests ({len(ev.ar)} in rung 0), ar and stock "
          f"(block {args.block_size})")
    return 0


def _invalidated(entries: list[dict], plan: dict) -> list[dict]:
    """The snapshot with the plan's invalidations applied."""
    for inv in plan.get("memory_invalidated", []):
        entries = memory.invalidate(entries, inv["entry"], inv["reason"])
    return entries


def plan(args) -> int:
    """Cost model on the base config, memory transfer, and the choice of directions."""
    log.info("round %d plan for %s on %s: AR and stock references first", args.round, args.deployment, args.gpu)
    ev, ctx = _evaluator(args)
    out = Path(args.out)
    evidence = Evidence(args.evidence)
    base = _base_config(args)
    transferred, invalidated, tried = [], [], []
    if not args.previous:  # round 1 starts from the best entries of its memory that apply here
        base, transferred, invalidated, tried = transfer(ev, ctx, base, memory.read(args.memory), evidence,
                                                         args.min_gain)
    previous = read_json(args.previous) if args.previous else {}
    if previous.get("costmodel") and args.previous_costmodel:
        # round k > 1: the base is round k-1's config, whose cost model its integration measured last
        log.info("the base config %s: round %d's cost model of it (its last measurement)", json.dumps(base),
                 previous["round"])
        analysis, base_speedup = previous["costmodel"], previous["speedup_vs_ar"]
        report = Path(args.previous_costmodel).read_text()
    else:
        log.info("measuring the round's base config %s", json.dumps(base))
        base_recs = ev.time_config(base) if args.reuse_base else ev.measure(base, base)[0]
        if args.reuse_base:  # the agents and the integration compare against these (--base-evidence)
            evidence.add("base", base_recs)
        block = int(base.get("block_size", args.block_size))
        analysis = analyze(base_recs, ev.target.config, ev.drafter.config if ev.drafter is not None else None,
                           read_json(args.ceilings), 2 if ctx["dtype"] == "bf16" else 4, block, ar=ev.ar)
        report = report_text(analysis, f"cost model: {args.deployment} on {args.gpu}, round {args.round}")
        ar = {r.request_id: r for r in ev.ar}
        base_speedup = geomean([ar[r.request_id].decode_s / r.decode_s for r in base_recs])
    gaps = {t["term"]: t["gap_s_per_token"] for t in analysis["terms"]}
    # a direction whose every candidate the memory trials above measured here gets no agent of its own
    covered = [d.name for d in dirs.applicable(ctx) if dirs.covered(d, base, tried)]
    chosen = dirs.plan_directions(ctx, gaps, base, args.agents, covered)
    ranked = sorted(dirs.applicable(ctx), key=lambda d: -gaps.get(d.cost_term, 0.0))
    order = {}
    if "tree_lattice" in chosen:  # the budgets ranked by the cost model (tau curve x verify cost, this device)
        log.info("tree budgets: the lattice tau curve and the verify-cost curve")
        order["tree_lattice"] = plan_order(ev, base, analysis, dirs.REGISTRY["tree_lattice"].space["tree_lattice"])
    ar = {r.request_id: r for r in ev.ar}
    stock_speedup = geomean([ar[r.request_id].decode_s / r.decode_s for r in ev.stock])
    evidence.write()
    write_json(args.costmodel, analysis)
    Path(args.costmodel_text).write_text(report)
    write_json(out, {"round": args.round, "deployment": args.deployment, "gpu": args.gpu, "regime": args.regime,
                     "concurrency": args.concurrency, "costmodel_batch": analysis.get("batch"), "base_config": base,
                     "directions": chosen, "ranked_terms": [t["term"] for t in analysis["terms"]],
                     "ranked_directions": [{"direction": d.name, "cost_term": d.cost_term,
                                            "gap_s_per_token": gaps.get(d.cost_term, 0.0)} for d in ranked],
                     "memory_tried": tried, "memory_transferred": transferred, "memory_invalidated": invalidated,
                     "covered_by_memory": covered,
                     "stock_speedup_vs_ar": stock_speedup, "base_speedup_vs_ar": base_speedup,
                     "base_tau": analysis["tau"], "context": ctx, "candidate_order": order})
    print(report, end="")
    print(f"directions for round {args.round}: {', '.join(chosen) or 'none'}"
          + (f" (measured whole by the memory trials: {', '.join(covered)})" if covered else ""))
    return 0


def transfer(ev, ctx: dict, base: dict, entries: list[dict], evidence: Evidence | None, min_gain: float):
    """Round 1's start from memory: the best valid entry per direction that applies here
    (:func:`specpilot.agent.memory.best_known`), each trialled behind the token-forcing gate.

    All of them merged into ``base`` are trialled first; when that passes and clears ``min_gain``
    every entry transfers at once (one trial, not one per entry). Otherwise each is trialled on its
    own, best gain first, and kept when it clears ``min_gain``; one that fails the gate is
    invalidated here -- unless the base itself (stock's records) fails the gate here, which says
    nothing about the entry (it is then only listed as tried).

    Returns:
        (the new base, transferred entries, invalidations ``{entry, reason}``, every entry tried).
    """
    best = memory.best_known(entries, ctx)
    applicable = {d.name for d in dirs.applicable(ctx)}
    picks = [(n, e) for n, e in sorted(best.items(), key=lambda kv: (-kv[1]["gain"], kv[0])) if n in applicable]
    transferred, invalidated, tried = [], [], []
    base_passes = None  # whether stock's own records pass the gate here (asked once, when needed)

    def note(name, entry, res, together):
        tried.append({"entry": entry["id"], "direction": name, "params": entry["params"],
                      "from": f"{entry['deployment']}/{entry['gpu']}" + (f"/{entry['regime']}" if entry.get("regime") else ""),
                      "regime": entry.get("regime"), "passed": res["gate"]["passed"],
                      "gain": res["gain"], "gain_lo": res["gain_lo"], "gain_hi": res["gain_hi"],
                      "decision": res.get("decision"), "rungs": res.get("rungs"), "merged": together})

    if len(picks) > 1:
        merged = base
        for name, entry in reversed(picks):  # the best last, so its exclusions hold
            merged = dirs.REGISTRY[name].apply(merged, entry["params"])
        res = ev.trial(merged, base, evidence, tag="memory-merged")
        for name, entry in picks:
            note(name, entry, res, True)
        if clears(res, min_gain):
            return merged, [{"entry": e["id"], "direction": n, "params": e["params"], "gain": res["gain"],
                             "merged": True} for n, e in picks], invalidated, tried
    for name, entry in picks:
        cand = dirs.REGISTRY[name].apply(base, entry["params"])
        res = ev.trial(cand, base, evidence, tag=f"memory-{name}")
        note(name, entry, res, False)
        if not res["gate"]["passed"]:
            if base_passes is None:
                base_passes = bool(ev.gate(ev.stock)["passed"])
            if base_passes:
                invalidated.append({"entry": entry["id"],
                                    "reason": f"failed token forcing on {ctx['deployment']}/{ctx['gpu']}"})
                log.warning("memory entry %s (%s) failed the gate here: invalidated", entry["id"], name)
            else:  # stock's own records fail the gate here: that says nothing about the entry
                tried[-1]["note"] = "not invalidated: stock's own records fail token forcing here"
                log.warning("memory entry %s (%s) failed the gate, as stock does here: kept", entry["id"], name)
        elif clears(res, min_gain):
            base = cand
            transferred.append({"entry": entry["id"], "direction": name, "params": entry["params"],
                                "gain": res["gain"], "merged": False})
    return base, transferred, invalidated, tried


def search(ev, direction, base: dict, budget: int, policy, hints: list[dict], context: dict,
           evidence: Evidence | None, min_gain: float) -> dict:
    """One direction's agent: ``policy`` trials candidates (``ev.trial``, token-forcing gate and
    timing) within ``budget``; the best is kept only when it clears ``min_gain``
    (:func:`specpilot.agent.decide.choose`, ties broken by the policy's grid order).

    Returns:
        The agent file's content: trials, the ones token forcing rejected, and ``best`` (None when
        no candidate's interval is clear of ``min_gain``).
    """
    half = ev.prompts[::2]
    counter = iter(range(10_000))

    def trial(params: dict, full: bool) -> dict:
        i = next(counter)
        res = ev.trial(direction.apply(base, params), base, evidence, None if full else half, tag=f"trial-{i:02d}")
        verdict = (f"refused: {res['gate']['refused']}" if res["gate"].get("refused") else
                   "rejected by token forcing" if not res["gate"]["passed"] else
                   f"gain {res['gain']:.3f} (95% interval {res['gain_lo']:.3f}-{res['gain_hi']:.3f})")
        log.info("trial %d %s: %s (tau %s)", i, json.dumps(params), verdict,
                 "-" if res["tau"] is None else f"{res['tau']:.2f}")
        return res

    trials = policy.search(direction, base, budget, trial, hints, context)
    order = grid_order(direction, base, hints)
    full = [t for t in trials if t.get("rung") == 1 and t["gain"] is not None]
    best = choose(full, lambda t: order.index(t["params"]) if t["params"] in order else len(order), min_gain)
    rejected = [{"params": t["params"], "gate": t["gate"], "evidence": t["evidence"]}
                for t in trials if not t["gate"]["passed"]]
    return {"direction": direction.name, "cost_term": direction.cost_term, "policy": policy.name,
            "base_config": base, "min_gain": min_gain, "trials": trials, "rejected": rejected, "best": best}


def agent(args) -> int:
    """One direction's agent: policy-driven trials behind the token-forcing gate."""
    p = read_json(args.plan)
    if args.direction not in dirs.REGISTRY:
        raise SpecpilotError(f"unknown direction {args.direction!r}; registered: {', '.join(dirs.REGISTRY)}")
    direction = dirs.REGISTRY[args.direction]
    ev, ctx = _evaluator(args)
    known = _invalidated(memory.read(args.memory), p)
    hints = [e["params"] for e in memory.valid_for(known, direction.name)]
    ranked = (p.get("candidate_order") or {}).get(direction.name, {}).get("order", [])
    hints += [c for c in ranked if c not in hints]  # after memory: the plan's cost-model order
    context = {"report": Path(args.costmodel_text).read_text(), "memory": sorted(known, key=lambda e: e["id"])[-20:]}
    policy = make_policy(json.loads(args.llm) if args.llm else None)
    evidence = Evidence(args.evidence)
    res = search(ev, direction, p["base_config"], args.budget, policy, hints, context, evidence, args.min_gain)
    evidence.write()
    write_json(args.out, res)
    best = res["best"]
    best_txt = ("none clear of min_gain %.3f" % args.min_gain if not best else "%s gain %.3f (95%% interval %.3f-%.3f)"
                % (json.dumps(best["params"]), best["gain"], best["gain_lo"], best["gain_hi"]))
    print(f"agent {direction.name}: {len(res['trials'])} trials, {len(res['rejected'])} rejected by token forcing, "
          f"best {best_txt}")
    return 0


def decide(ev, base: dict, winners: list[tuple[str, dict]], min_gain: float, confirm_factor: float,
           evidence: Evidence | None, trials: list[dict] | None = None) -> tuple[dict, dict, str]:
    """The round's config from its agents' winners (``(direction, best trial)``, best gain first).

    The winners merged (the best last, so its exclusions hold) are kept when their gain clears
    ``min_gain`` and is at least ``confirm_factor`` x the best single winner's; else the best single
    winner alone when it clears ``min_gain``. The choice is then confirmed on a fresh measurement
    with one more repeat (``ev.repeats`` + 1): it stays only when that interval clears ``min_gain``.

    Every trial but the last is sequential (:meth:`~specpilot.agent.trial.Evaluator.trial`: more
    calibration rungs while its interval straddles ``min_gain``); the base re-measured when nothing
    is kept decides nothing and is measured once. ``trials``: a list each trial is appended to.

    Returns:
        (config, its trial against ``base``, why): with nothing kept, ``base`` re-measured.
    """
    seen = [] if trials is None else trials

    def trial(config, tag, sequential=True):
        seen.append(ev.trial(config, base, evidence, tag=tag, sequential=sequential))
        return seen[-1]

    chosen, result, why = base, None, "no agent found a candidate clear of min_gain"
    if winners:
        merged = dict(base)
        for name, w in reversed(winners):
            merged = dirs.REGISTRY[name].apply(merged, w["params"])
        res = trial(merged, "merged")
        if clears(res, min_gain) and res["gain"] >= confirm_factor * winners[0][1]["gain"]:
            chosen, result = merged, res
        else:
            single = dirs.REGISTRY[winners[0][0]].apply(base, winners[0][1]["params"])
            if single != merged:  # one winner: the merged config is the single one, measured already
                res = trial(single, "single")
            if clears(res, min_gain):
                chosen, result = single, res
        why = "the winners' config did not clear min_gain again" if result is None else why
    if result is not None:  # confirm on a fresh, longer measurement before it counts
        repeats, ev.repeats = ev.repeats, ev.repeats + 1
        try:
            result = trial(chosen, "confirmation")
        finally:
            ev.repeats = repeats
        if clears(result, min_gain):
            why = "confirmed: gain interval clear of min_gain on a fresh measurement"
        else:
            log.info("config %s not confirmed (gain %s, 95%% interval %.3f-%.3f, min_gain %.3f): the base stays",
                     chosen, result["gain"], result["gain_lo"], result["gain_hi"], min_gain)
            why = (f"not confirmed on a fresh measurement (gain interval {result['gain_lo']:.3f}-"
                   f"{result['gain_hi']:.3f} on {result['requests']} requests, {result.get('decision')}, "
                   f"min_gain {min_gain})")
            chosen, result = base, None
    if result is None:  # nothing validated: the base stays, re-measured for the rounds figure
        result = trial(base, "base", sequential=False)
    return chosen, result, why


def integrate(args) -> int:
    """Merge the agents' winners, confirm, write the round's config and memory snapshot."""
    p = read_json(args.plan)
    terms = {t["term"]: t["gap_s_per_token"] for t in read_json(args.costmodel)["terms"]}
    base = p["base_config"]
    winners = []
    for f in args.agent_files:
        a = read_json(f)
        if a.get("best"):
            winners.append((a["direction"], a["best"]))
    winners.sort(key=lambda w: (-w[1]["gain"], w[0]))
    ev, ctx = _evaluator(args)
    evidence = Evidence(args.evidence)
    trials: list[dict] = []
    chosen, result, why = decide(ev, base, winners, args.min_gain, args.confirm_factor, evidence, trials)
    evidence.write()
    if not result["gate"]["passed"]:
        if chosen != base:
            raise SpecpilotError(f"round {args.round}: the integrated config failed token forcing: {result['gate']}")
        # the base itself (round 1: stock's config) fails forcing here: nothing can be validated on top of
        # it; the round keeps it and says so (the cells' own verdicts show the failure in the table)
        g = result["gate"]
        why = (f"nothing validated: the base config itself fails token forcing on this deployment "
               f"({g.get('refused') or str(g.get('violations')) + ' violation(s)'})")
        log.warning("round %d: %s", args.round, why)
    analysis = _integrated_costmodel(args, ev, ctx, chosen, result, evidence)
    known = _invalidated(memory.read(args.memory), p)
    for name, w in winners:
        if all(chosen.get(k) == v for k, v in w["params"].items()):
            known = memory.record(known, {
                "direction": name, "params": w["params"], "deployment": args.deployment, "gpu": args.gpu,
                "regime": args.regime, "concurrency": args.concurrency,
                "target": ctx["target"], "drafter": ctx["drafter"], "gain": w["gain"], "round": args.round,
                "evidence": [w["evidence"], result["evidence"]]})
    memory.write(args.memory_out, known)
    kept = chosen != base
    write_json(args.out, {"round": args.round, "regime": args.regime, "concurrency": args.concurrency, "config": chosen,
                          "winners": [{"direction": n, "params": w["params"], "gain": w["gain"],
                                       "gain_lo": w.get("gain_lo"), "gain_hi": w.get("gain_hi"),
                                       "cost_term": dirs.REGISTRY[n].cost_term,
                                       "gap_s_per_token": terms.get(dirs.REGISTRY[n].cost_term)} for n, w in winners],
                          "gain_vs_base": result["gain"] if kept else 1.0,
                          "gain_lo": result["gain_lo"] if kept else None, "gain_hi": result["gain_hi"] if kept else None,
                          "min_gain": args.min_gain, "decision": why,
                          "trials": [{"tag": (t["evidence"] or "#").rsplit("#", 1)[-1], "config": t["config"],
                                      "decision": t.get("decision"), "rungs": t.get("rungs")} for t in trials],
                          "speedup_vs_ar": result["speedup_vs_ar"], "tau": result["tau"], "gate": result["gate"],
                          "stock_speedup_vs_ar": p["stock_speedup_vs_ar"], "kernels": ctx["kernels"],
                          "device": ctx["device"], "costmodel": analysis})
    print(f"round {args.round} integrated: {json.dumps(chosen)} ({why}; speedup vs AR {result['speedup_vs_ar']:.2f}, "
          f"tau {result['tau']:.2f}); memory: {len(known)} entries")
    return 0


def _integrated_costmodel(args, ev, ctx: dict, chosen: dict, result: dict, evidence: Evidence) -> dict:
    """The cost model of the round's config on its last measurement (the confirmation's records, or
    the base re-measured), written to ``--costmodel-text``: where the time goes after the round."""
    tag = result["evidence"].rsplit("#", 1)[-1]
    recs = [record_from_dict(r, "trial record") for r in evidence.rows if r["trial"] == tag]
    analysis = analyze(recs, ev.target.config, ev.drafter.config if ev.drafter is not None else None,
                       read_json(args.ceilings), 2 if ctx["dtype"] == "bf16" else 4,
                       int(chosen.get("block_size", args.block_size)), ar=ev.ar)
    text = report_text(analysis, f"cost model: {args.deployment} on {args.gpu}, after round {args.round} "
                                 f"(config {json.dumps(chosen, sort_keys=True)})")
    atomic_write_text(Path(args.costmodel_text), text)
    print(text, end="")
    return analysis


KERNEL_SECTIONS = ("w12", "engine", "w12_fast")  # the kernel sub-agent's sections (kernel_agent.tune's switches)


def _rows(values: list[str] | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(v) for v in values) if values else None
    except ValueError:
        raise SpecpilotError(f"--engine-rows must be integers (16, 32, 64, 128, 256), got {','.join(values)}") from None


def kernels(args) -> int:
    """The kernel sub-agent (see :mod:`specpilot.agent.kernel_agent`)."""
    manifest = read_json(args.kernels_manifest) if args.kernels_manifest else None
    if manifest is not None and manifest.get("gpu") != args.gpu:
        raise SpecpilotError(f"{args.kernels_manifest} is for gpu {manifest.get('gpu')!r}, not {args.gpu!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = None
    if args.gpu == "cpu" and args.prompts:
        cpu = {"drafter": args.drafter, "prompts": read_prompts(args.prompts), "tolerance": args.tolerance,
               "block": resolve_block(args.block_size, args.drafter, "--block-size")}
    res = tune(args.target, args.gpu, args.ceilings, args.out, manifest=manifest, manifest_path=args.kernels_manifest,
               top=args.top, max_configs=args.max_configs, max_engine_configs=args.max_configs,
               engine_rows=_rows(args.engine_rows), cpu=cpu, drafter_dir=args.drafter if args.gpu != "cpu" else None,
               **{s: s in args.sections for s in KERNEL_SECTIONS})
    if "cpu" in res:
        print("kernel sub-agent on cpu: " + "; ".join(res["cpu"]["why"]))
        return 0
    engine = sum(len(v) for v in res.get("engine_configs", {}).values())
    why = f" ({res['engine_reason']})" if res.get("engine_reason") else ""
    print(f"kernel sub-agent on {args.gpu}: " + ("nothing applies (" + res["reason"] + ")" if not res["applies"]
                                                  else f"{len(res['configs'])} w12 shapes tuned, {engine} engine "
                                                       f"matmul entries differ from the defaults{why}, w12 fast-path "
                                                       f"roles {sorted(res.get('w12_choice', {})) or 'none'}"))
    return 0


# the input and output files of the steps: option -> what it holds (which steps use it)
_FILE_OPTIONS = {
    "--prompts": "calibration prompt file (disjoint from the evaluation prompts)",
    "--references-ar": "AR records on the calibration prompts (round references)",
    "--references-stock": "stock records on the calibration prompts (round references)",
    "--ceilings": "ceilings.json of the device (plan, integrate)",
    "--costmodel": "costmodel.json: written by plan, read by integrate",
    "--costmodel-text": "costmodel.txt: written by plan, read by agent (policy context); integrate writes the "
                        "integrated config's (costmodel-integrated.txt), `specpilot final` copies it into specpilot.json",
    "--kernels-manifest": "results/{gpu}/kernels/manifest.json",
    "--kernel-agent": "the kernel sub-agent's kernel-agent.json (tuned kernels used)",
    "--memory": "memory snapshot this round starts from (none = empty)",
    "--memory-out": "memory snapshot after this round (integrate)",
    "--evidence": "the step's trial records, kept as evidence (one JSON-lines file, each record tagged with its trial)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step", choices=("references", "plan", "agent", "integrate", "kernels"))
    p.add_argument("--out", required=True)
    p.add_argument("--out-stock", help="stock references to write (references; --out gets AR's)")
    p.add_argument("--round", type=int, default=1)
    p.add_argument("--plan", help="plan.json of this round (agent, integrate)")
    p.add_argument("--previous", help="integrated.json of the previous round (plan)")
    p.add_argument("--previous-costmodel", help="costmodel-integrated.txt of the previous round (plan: the cost "
                                                "model of its base, measured by that round's integration)")
    p.add_argument("--agent-files", nargs="*", default=[])
    p.add_argument("--direction")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--target-name")
    p.add_argument("--drafter-name", default="dflash")
    p.add_argument("--deployment", default="custom")
    p.add_argument("--regime", default="single", help="the serving regime tuned (config regimes; --concurrency its tune)")
    p.add_argument("--gpu", default="cpu")
    for flag, help_ in _FILE_OPTIONS.items():
        p.add_argument(flag, help=help_)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--block-size", default="auto",
                   help="the stock block size in the drafter's own counting, or 'auto' (default): the drafter "
                        "config's block_size, the block it was trained for")
    p.add_argument("--agents", type=int, default=2, help="directions per round")
    p.add_argument("--budget", type=int, default=6, help="trials per agent")
    p.add_argument("--repeats", type=int, default=2, help="alternating timing repeats per trial")
    p.add_argument("--reuse-base", action="store_true",
                   help="time the round's base once (the plan) and reuse its records as every trial's base")
    p.add_argument("--base-evidence", help="agent, integrate with --reuse-base: the plan's evidence file (its "
                                           "'base' records)")
    p.add_argument("--calibration-rungs", type=comma_list, default=None,
                   help="sequential trials: prompts per benchmark at each rung, rising (e.g. 1,2,4; the last is "
                        "the cap; the --prompts file holds at least that many per benchmark). A trial whose gain "
                        "interval straddles --min-gain is measured on the next rung; default: one rung of every "
                        "prompt in the file")
    p.add_argument("--min-gain", type=float, default=1.02,
                   help="a candidate must beat its base by this factor (geomean decode time) to count as a win")
    p.add_argument("--confirm-factor", type=float, default=0.98,
                   help="the merged winners are kept when their gain >= this x the best single winner's")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--llm", help="JSON {base_url, model, api_key_env} for the LLM policy")
    p.add_argument("--top", type=int, default=3, help="kernels: the w12 shapes furthest from the bandwidth tuned")
    p.add_argument("--max-configs", type=int, default=16,
                   help="kernels: candidate configs per tuned w12 shape and per engine matmul row bucket")
    p.add_argument("--sections", type=comma_list, default=list(KERNEL_SECTIONS),
                   help="kernels: the sub-agent's sections to run (w12 kernel configs, engine matmul tables, "
                        "w12 fast-path roles; default all); a section left out keeps its defaults")
    p.add_argument("--engine-rows", type=comma_list, default=None,
                   help="kernels: engine matmul row buckets tuned (comma-separated, among 16,32,64,128,256; default 16,32,64)")
    p.add_argument("--replay-profile", help="synthetic deployments: drafting engines run the replay drafter with this "
                   "acceptance profile over the AR references (records marked synthetic)")
    p.add_argument("--directions", type=comma_list, default=None,
                   help="the directions the plan may choose (comma-separated registry names; default all)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.top < 0 or args.max_configs < 1:
        raise SpecpilotError(f"need --top >= 0 and --max-configs >= 1; got {args.top}, {args.max_configs}")
    unknown = [x for x in args.sections if x not in KERNEL_SECTIONS and x]
    if unknown:
        raise SpecpilotError(f"--sections: unknown section(s) {', '.join(unknown)}; use {', '.join(KERNEL_SECTIONS)}")
    if args.min_gain < 1.0 or not 0.0 < args.confirm_factor <= 1.0 or args.repeats < 1:
        raise SpecpilotError(f"need --min-gain >= 1, 0 < --confirm-factor <= 1, --repeats >= 1; got "
                             f"{args.min_gain}, {args.confirm_factor}, {args.repeats}")
    if args.calibration_rungs:
        try:
            args.calibration_rungs = [int(v) for v in args.calibration_rungs]
        except ValueError:
            raise SpecpilotError(f"--calibration-rungs must be integers (e.g. 1,2,4), got "
                                 f"{','.join(args.calibration_rungs)}") from None
    if args.step != "kernels":  # the stock block: an integer, or the drafter's own (auto)
        args.block_size = resolve_block(args.block_size, args.drafter, "--block-size")
    return {"references": references, "plan": plan, "agent": agent, "integrate": integrate,
            "kernels": kernels}[args.step](args)

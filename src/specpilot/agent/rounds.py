"""``specpilot round``: one agent round in three resumable steps (Snakemake runs each as a job).

- ``plan``: measure the round's base config (round 1: stock, or the best memory entries that
  transfer; round k: round k-1's integrated config) on calibration prompts, run the cost model,
  and choose the directions registered for the largest gaps (``plan.json``; a Snakemake
  checkpoint: the directions decide the agent jobs).
- ``agent``: one direction's agent trials candidates through its policy behind the token-forcing
  gate (``agent-{direction}.json``, trial records as evidence).
- ``integrate``: merge the winners into one config, re-validate and re-measure it
  (``integrated.json``), and record validated mechanisms in the structured memory.
``final`` copies the last round's integrated config to ``specpilot.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from ..errors import SpecpilotError
from ..io import read_json, write_json
from . import directions as dirs
from . import memory
from .costmodel import analyze, report_text
from .policies import make_policy
from .trial import Evaluator

log = logging.getLogger("specpilot.agent")
MIN_GAIN = 1.02  # a candidate must beat its base by 2% (geomean decode time) to count as a win


def _ctx(args, dtype: str) -> dict:
    return {"deployment": args.deployment, "gpu": args.gpu, "target": args.target_name or args.target,
            "drafter": args.drafter_name, "dtype": dtype, "concurrency": args.concurrency}


def _evaluator(args) -> tuple[Evaluator, dict]:
    from ..deployment import load_deployment
    from ..engine.serve import pick_device, pick_dtype, read_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    dep = load_deployment(args.target, args.drafter, device=device, dtype=dtype)
    prompts = read_prompts(args.prompts)
    meta = {"deployment": args.deployment, "target": args.target_name or args.target,
            "drafter": args.drafter_name, "gpu": args.gpu}
    from ..models.loading import load_target

    ev = Evaluator(dep.target, dep.drafter, prompts, args.max_new_tokens, args.concurrency, meta,
                   args.block_size, args.tolerance, repeats=args.repeats,
                   reload_target=lambda: load_target(args.target, dtype=dtype, device=device))
    ctx = _ctx(args, "bf16" if dtype == torch.bfloat16 else "fp32")
    return ev, ctx


def _base_config(args) -> dict:
    if args.previous:
        return dict(read_json(args.previous)["config"])
    return {"block_size": args.block_size}


def plan(args) -> int:
    """Cost model on the base config, memory transfer, and the choice of directions."""
    log.info("round %d plan for %s on %s: AR and stock references first", args.round, args.deployment, args.gpu)
    ev, ctx = _evaluator(args)
    out = Path(args.out)
    base = _base_config(args)
    transferred = []
    if not args.previous:  # a new deployment starts from the best known entries that apply to it
        best = memory.best_known(args.memory, ctx)
        applicable = {d.name for d in dirs.applicable(ctx)}
        for name, entry in sorted(best.items(), key=lambda kv: -kv[1]["gain"]):
            if name not in applicable:
                continue
            cand = dirs.REGISTRY[name].apply(base, entry["params"])
            res = ev.trial(cand, base, out.parent / f"memory-{name}.jsonl")
            if not res["gate"]["passed"]:
                memory.invalidate(args.memory, entry["id"], f"failed token forcing on {args.deployment}/{args.gpu}")
                log.warning("memory entry %s (%s) failed the gate here: invalidated", entry["id"], name)
            elif res["gain"] >= MIN_GAIN:
                base = cand
                transferred.append({"entry": entry["id"], "direction": name, "params": entry["params"],
                                    "gain": res["gain"]})
    log.info("measuring the round's base config %s", json.dumps(base))
    base_recs, _ = ev.measure(base, base)
    log.info("cost model")
    block = int(base.get("block_size", args.block_size))
    target_cfg = ev.target.config
    drafter_cfg = ev.drafter.config if ev.drafter is not None else None
    ceilings = read_json(args.ceilings)
    dtype_bytes = 2 if ctx["dtype"] == "bf16" else 4
    analysis = analyze(base_recs, target_cfg, drafter_cfg, ceilings, dtype_bytes, block)
    report = report_text(analysis, f"cost model: {args.deployment} on {args.gpu}, round {args.round}")
    gaps = {t["term"]: t["gap_s_per_token"] for t in analysis["terms"]}
    ranked = sorted(dirs.applicable(ctx), key=lambda d: -gaps.get(d.cost_term, 0.0))
    chosen = [d.name for d in ranked if gaps.get(d.cost_term, 0.0) > 0][: args.agents]
    from .trial import geomean

    ar = {r.request_id: r for r in ev.ar}
    stock_speedup = geomean([ar[r.request_id].decode_s / r.decode_s for r in ev.stock])
    base_speedup = geomean([ar[r.request_id].decode_s / r.decode_s for r in base_recs])
    write_json(out.parent / "costmodel.json", analysis)
    (out.parent / "costmodel.txt").write_text(report)
    from ..records import write_records

    write_records(out.parent / "calib-ar.jsonl", ev.ar)
    write_records(out.parent / "calib-stock.jsonl", ev.stock)
    write_json(out, {"round": args.round, "deployment": args.deployment, "gpu": args.gpu, "base_config": base,
                     "directions": chosen, "ranked_terms": [t["term"] for t in analysis["terms"]],
                     "memory_transferred": transferred, "stock_speedup_vs_ar": stock_speedup,
                     "base_speedup_vs_ar": base_speedup, "base_tau": analysis["tau"], "context": ctx})
    print(report, end="")
    print(f"directions for round {args.round}: {', '.join(chosen) or 'none'}")
    return 0


def agent(args) -> int:
    """One direction's agent: policy-driven trials behind the token-forcing gate."""
    p = read_json(args.plan)
    if args.direction not in dirs.REGISTRY:
        raise SpecpilotError(f"unknown direction {args.direction!r}; registered: {', '.join(dirs.REGISTRY)}")
    direction = dirs.REGISTRY[args.direction]
    ev, ctx = _evaluator(args)
    base = p["base_config"]
    out = Path(args.out)
    evid = out.with_suffix("")
    evid.mkdir(parents=True, exist_ok=True)
    half = ev.prompts[::2]
    counter = iter(range(10_000))

    def trial(params: dict, full: bool) -> dict:
        i = next(counter)
        res = ev.trial(direction.apply(base, params), base, evid / f"trial-{i:02d}.jsonl",
                       None if full else half)
        verdict = "rejected by token forcing" if not res["gate"]["passed"] else f"gain {res['gain']:.3f}"
        log.info("trial %d %s: %s (tau %.2f)", i, json.dumps(params), verdict, res["tau"])
        return res

    hints = [e["params"] for e in memory.read(args.memory) if e["direction"] == direction.name
             and e["status"] == "valid"] if Path(args.memory).exists() else []
    context = {"report": (Path(args.plan).parent / "costmodel.txt").read_text()
               if (Path(args.plan).parent / "costmodel.txt").exists() else "",
               "memory": [e for e in memory.read(args.memory)][-20:]}
    policy = make_policy(json.loads(args.llm) if args.llm else None)
    trials = policy.search(direction, base, args.budget, trial, hints, context)
    full = [t for t in trials if t.get("rung") == 1 and t["gain"] is not None]
    best = max(full, key=lambda t: t["gain"], default=None)
    rejected = [{"params": t["params"], "gate": t["gate"], "evidence": t["evidence"]}
                for t in trials if not t["gate"]["passed"]]
    write_json(out, {"direction": direction.name, "cost_term": direction.cost_term, "policy": policy.name,
                     "base_config": base, "trials": trials, "rejected": rejected,
                     "best": best if best and best["gain"] >= MIN_GAIN else None})
    best_txt = "none" if not best else "%s gain %.3f" % (json.dumps(best["params"]), best["gain"])
    print(f"agent {direction.name}: {len(trials)} trials, {len(rejected)} rejected by token forcing, best {best_txt}")
    return 0


def integrate(args) -> int:
    """Merge the agents' winners, re-validate and re-measure, record validated mechanisms."""
    p = read_json(args.plan)
    base = p["base_config"]
    winners = []
    for f in args.agent_files:
        a = read_json(f)
        if a.get("best"):
            winners.append((a["direction"], a["best"]))
    winners.sort(key=lambda w: -w[1]["gain"])
    ev, ctx = _evaluator(args)
    out = Path(args.out)
    chosen, result = base, None
    if winners:
        merged = dict(base)
        for name, w in winners:
            merged = dirs.REGISTRY[name].apply(merged, w["params"])
        res = ev.trial(merged, base, out.parent / "integrated.jsonl")
        best_single = winners[0][1]
        if res["gate"]["passed"] and res["gain"] >= max(MIN_GAIN, 0.98 * best_single["gain"]):
            chosen, result = merged, res
        else:
            single = dirs.REGISTRY[winners[0][0]].apply(base, best_single["params"])
            res = ev.trial(single, base, out.parent / "integrated.jsonl")
            if res["gate"]["passed"] and res["gain"] >= MIN_GAIN:
                chosen, result = single, res
    if result is not None:  # confirm on a fresh, longer measurement before it counts
        ev.repeats = args.repeats + 1
        result = ev.trial(chosen, base, out.parent / "integrated.jsonl")
        if not (result["gate"]["passed"] and result["gain"] >= MIN_GAIN):
            log.info("integrated config %s not confirmed (gain %s): the base stays", chosen, result["gain"])
            chosen, result = base, None
    if result is None:  # nothing validated: the base stays, re-measured for the rounds figure
        result = ev.trial(base, base, out.parent / "integrated.jsonl")
    if not result["gate"]["passed"]:
        raise SpecpilotError(f"round {args.round}: the integrated config failed token forcing: {result['gate']}")
    for name, w in winners:
        if all(chosen.get(k) == v for k, v in w["params"].items()):
            memory.record(args.memory, {
                "direction": name, "params": w["params"], "deployment": args.deployment, "gpu": args.gpu,
                "target": ctx["target"], "drafter": ctx["drafter"], "gain": w["gain"], "round": args.round,
                "evidence": [w["evidence"], str(out.parent / "integrated.jsonl")]})
    write_json(out, {"round": args.round, "config": chosen,
                     "winners": [{"direction": n, "params": w["params"], "gain": w["gain"]} for n, w in winners],
                     "gain_vs_base": result["gain"] if chosen != base else 1.0,
                     "speedup_vs_ar": result["speedup_vs_ar"], "tau": result["tau"], "gate": result["gate"],
                     "stock_speedup_vs_ar": p["stock_speedup_vs_ar"]})
    print(f"round {args.round} integrated: {json.dumps(chosen)} (speedup vs AR {result['speedup_vs_ar']:.2f}, "
          f"tau {result['tau']:.2f})")
    return 0


def final(args) -> int:
    """The specpilot engine config = the last round's integrated config."""
    last = read_json(args.integrated)
    write_json(args.out, {"engine_config": last["config"], "round": last["round"],
                          "speedup_vs_ar_calibration": last["speedup_vs_ar"], "tau_calibration": last["tau"],
                          "validated_by_token_forcing": last["gate"]["passed"]})
    return 0


def kernels(args) -> int:
    """The kernel sub-agent (see :mod:`specpilot.agent.kernel_agent`)."""
    from .kernel_agent import tune

    res = tune(args.target, args.gpu, args.ceilings, str(Path(args.out).parent))
    print(f"kernel sub-agent on {args.gpu}: " + ("nothing applies (" + res["reason"] + ")" if not res["applies"]
                                                  else f"{len(res['configs'])} shapes tuned"))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step", choices=("plan", "agent", "integrate", "final", "kernels"))
    p.add_argument("--out", required=True)
    p.add_argument("--round", type=int, default=1)
    p.add_argument("--plan", help="plan.json of this round (agent, integrate)")
    p.add_argument("--previous", help="integrated.json of the previous round (plan)")
    p.add_argument("--integrated", help="integrated.json of the last round (final)")
    p.add_argument("--agent-files", nargs="*", default=[])
    p.add_argument("--direction")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--target-name")
    p.add_argument("--drafter-name", default="dflash")
    p.add_argument("--deployment", default="custom")
    p.add_argument("--gpu", default="cpu")
    p.add_argument("--prompts", help="calibration prompt file (disjoint from the evaluation prompts)")
    p.add_argument("--ceilings", help="ceilings.json of the device")
    p.add_argument("--memory", default="results/memory.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8, help="the stock block size")
    p.add_argument("--agents", type=int, default=2, help="directions per round")
    p.add_argument("--budget", type=int, default=6, help="trials per agent")
    p.add_argument("--repeats", type=int, default=2, help="alternating timing repeats per trial")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--llm", help="JSON {base_url, model, api_key_env} for the LLM policy")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return {"plan": plan, "agent": agent, "integrate": integrate, "final": final,
            "kernels": kernels}[args.step](args)

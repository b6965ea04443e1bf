"""The kernel sub-agent's CPU section: which step path the target and the drafter run on the CPU.

The candidates are the plain forward (the model as written) and the fused CPU steps
(:class:`~specpilot.fastpath.cpu_target.FusedTarget`, :class:`~specpilot.fastpath.cpu_drafter.FusedDrafter`).
As the GPU section does with its kernels, each candidate is checked before it is timed, on the
deployment's calibration prompts:

- target (``verify_path``): greedy decoding through the fused step gives the plain path's tokens
  exactly, and a verify block of the stock width after each prompt gives logits within the forcing
  tolerance of the plain forward's (max absolute difference);
- drafter (``draft_path``: the draft forward, ``context_path``: the context injection after each
  verify): stock with both through the fused drafter step commits exactly the plain stock's tokens
  in exactly its steps (the same drafts);

both with each matmul kernel the fused steps can use here (:mod:`specpilot.fastpath.cpu_linear`:
aten's ``F.linear``, oneDNN's prepacked linear), of which the fastest that passed is ``matmul``.

Then the steps are timed interleaved in this process (medians of alternating rounds; the target's
verify at the stock width and its one-token decode; the drafter's draft and its context injection
of a verified block). A fused path is chosen when its check passed and its time is below the plain
path's by ``margin``; the choice (``verify_path`` / ``draft_path`` / ``context_path``: ``fused`` or
``plain``) is what the rounds' directions of the same names may try (:mod:`specpilot.agent.directions`), behind the
token-forcing gate, like any mechanism. AR and stock never use it.

torch.compile (inductor) of the same steps was measured and is not a candidate: on the embedded
tiny deployment (2 cores, 2026-12-05) a compiled 12-token verify was no faster than the fused eager
step (1.86 against 1.81 ms warm) and cost 27-36 s to compile per graph (3 s per process from the
cache); see ``specpilot bench cpu-step --compile``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..deployment import load_deployment
from ..engine.config import EngineSpec
from ..engine.proposers import make_proposer
from ..engine.runner import TargetRunner
from ..engine.serve import ServeOptions, serve
from ..fastpath.cpu_drafter import drafter_support, fused_drafter
from ..fastpath.cpu_linear import matmul, onednn_problem, set_matmul
from ..fastpath.cpu_target import FusedTarget, cpu_support

MARGIN = 0.03  # a fused path must be this much faster than the plain one to be chosen


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int = 9, calls: int = 10) -> dict[str, float]:
    """Median milliseconds per call of each function, timed in alternating rounds of ``calls``
    back-to-back calls (so drift of a shared machine hits every candidate alike), after a warm-up."""
    for f in fns.values():
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[k].append((time.perf_counter() - t) / calls * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _serve(dep, spec: EngineSpec, prompts: list[dict], new_tokens: int) -> list:
    meta = {"deployment": "kernel-agent", "target": "target", "drafter": "drafter", "gpu": "cpu"}
    with torch.inference_mode():
        return serve(spec, dep, prompts, new_tokens, 1, meta, ServeOptions(warmup=False, progress=False))


def check_target(dep, prompts: list[dict], width: int, tolerance: float, new_tokens: int) -> dict:
    """The fused target step (with the installed matmul kernel) against the plain forward: greedy
    tokens of every prompt, and the logits of a ``width``-token verify after each prompt (its greedy
    continuation) within ``tolerance``."""
    plain = _serve(dep, EngineSpec("ar"), prompts, new_tokens)
    fused = _serve(dep, EngineSpec("ar", config={"verify_path": "fused"}), prompts, new_tokens)
    same = sum(a.output_ids == b.output_ids for a, b in zip(plain, fused))
    worst = 0.0
    step = dep.backend.fused_step()
    with torch.inference_mode():
        for p, rec in zip(prompts, plain):
            runner = TargetRunner(dep.target, 1, len(p["prompt_ids"]) + width + 1, (), dep.backend)
            runner.prefill([p["prompt_ids"]])
            block = torch.tensor([(rec.output_ids + [0] * width)[:width]])
            want, _ = runner.verify(block)
            got, _ = step.forward(block, runner.length)
            worst = max(worst, float((want - got).abs().max()))
    return {"prompts": len(prompts), "new_tokens": new_tokens, "greedy_equal": f"{same}/{len(prompts)}",
            "verify_width": width, "max_logit_diff": worst, "tolerance": tolerance,
            "passed": same == len(prompts) and worst <= tolerance}


def check_drafter(dep, prompts: list[dict], block: int, new_tokens: int) -> dict:
    """Stock with the fused drafter step (the installed matmul kernel) against plain stock: the same
    tokens in the same steps."""
    plain = _serve(dep, EngineSpec("stock", block), prompts, new_tokens)
    fused = _serve(dep, EngineSpec("stock", block, {"draft_path": "fused", "context_path": "fused"}), prompts,
                   new_tokens)
    same = sum(a.output_ids == b.output_ids and a.committed_per_step == b.committed_per_step
               for a, b in zip(plain, fused))
    return {"prompts": len(prompts), "new_tokens": new_tokens, "same_steps": f"{same}/{len(prompts)}",
            "passed": same == len(prompts)}


def drafter_steps(prop, last: torch.Tensor, ctx: torch.Tensor, at: torch.Tensor, width: int,
                  kernels: list[str]) -> dict[str, Callable[[], object]]:
    """The drafter's timed steps for :func:`interleaved_ms`: ``draft_plain`` / ``context_plain`` (the
    network's own forward) and ``draft_fused_{k}`` / ``context_fused_{k}`` per matmul kernel ``k``
    (:func:`specpilot.fastpath.cpu_drafter.fused_drafter`). ``prop``: a started drafter proposer;
    ``last`` int64 [1] the anchor token; ``ctx`` the target features of the last verify [1, T, F];
    ``at`` int64 [1] the committed length; ``width``: the block in the drafter's counting + 1."""
    net = prop.drafter
    fns = {"draft_plain": (lambda: net.draft(last, at, prop.embed, prop.lm_head, width)) if prop.kind != "dspark"
           else (lambda: net.draft_full(last, at, width - 1)),
           "context_plain": lambda: net.add_context(ctx, at)}
    for k in kernels:
        fused = fused_drafter(net, k)
        fns[f"draft_fused_{k}"] = lambda f=fused: f.draft(last, at, prop.embed, prop.lm_head, width)
        fns[f"context_fused_{k}"] = lambda f=fused: f.add_context(ctx, at)
    return fns


def time_steps(dep, prompt: list[int], block: int, kernels: list[str], target: bool, drafter: bool) -> dict:
    """Interleaved medians [ms] of the plain and the fused steps (one per matmul kernel: ``fused_aten``,
    ``fused_onednn``) after ``prompt``: the target's verify at the stock width and its one-token decode
    (``target``), the drafter's draft and its context injection of a verified block (``drafter``)."""
    prop = make_proposer(dep.drafter, block) if dep.drafter is not None else None
    width = prop.verify_width if prop is not None else block
    capture = prop.capture if prop is not None else ()
    runner = TargetRunner(dep.target, 1, len(prompt) + 2 * width + 2, capture, dep.backend)
    out = {"context_tokens": len(prompt), "verify_width": width}
    with torch.inference_mode():
        logits, feats, _ = runner.prefill([prompt])
        blk, one = torch.randint(4, 64, (1, width)), torch.randint(4, 64, (1, 1))
        fns = {"verify_plain": lambda: runner.verify(blk), "decode_plain": lambda: runner.verify(one)}
        for k in kernels if target else ():
            step = FusedTarget(dep.target, k)
            fns[f"verify_fused_{k}"] = lambda step=step: step.forward(blk, runner.length, capture)
            fns[f"decode_fused_{k}"] = lambda step=step: step.forward(one, runner.length, capture)
        out.update(interleaved_ms(fns))
        if drafter:
            prop.start(runner, [prompt], feats, logits.argmax(-1))
            last, ctx = torch.tensor([int(prompt[-1])]), runner.verify(blk)[1]
            out.update(interleaved_ms(drafter_steps(prop, last, ctx, runner.length, width, kernels)))
    return out


# the engine-config key of each step path -> (the model it runs, the timed steps that decide it)
STEPS = {"verify_path": ("target", ("verify", "decode")), "draft_path": ("drafter", ("draft",)),
         "context_path": ("drafter", ("context",))}


def choose_paths(target_dir: str, drafter_dir: str | None, prompts: list[dict], block: int, tolerance: float,
                 new_tokens: int = 24, margin: float = MARGIN) -> dict:
    """The CPU section of kernel-agent.json: per step the checks, the times and the chosen path.

    The fused steps are checked and timed with each matmul kernel that runs here
    (:data:`specpilot.fastpath.cpu_linear.MATMULS`); ``matmul`` is the kernel whose passing fused
    steps are fastest together. Returns ``{"verify_path", "draft_path"}`` (each ``fused`` or
    ``plain``), ``"matmul"``, ``"target"`` / ``"drafter"`` (``check`` per kernel, or ``reason`` when
    the fused step cannot run the model), ``"times_ms"`` (:func:`time_steps`), and ``"why"``.
    """
    dep = load_deployment(target_dir, drafter_dir, torch.device("cpu"), torch.float32)
    prompts = list(prompts)
    onednn = onednn_problem()
    kernels = ["aten"] + ([] if onednn else ["onednn"])
    res = {**dict.fromkeys(STEPS, "plain"), "matmul": "aten", "margin": margin, "why": []}
    if onednn:
        res["why"].append(f"matmul aten: {onednn}")
    t_why = cpu_support(dep.target)
    d_why = drafter_support(dep.drafter) if dep.drafter is not None else "no drafter"
    width = block + (1 if dep.drafter is not None and dep.drafter.kind == "dspark" else 0)
    res["target"] = {"reason": t_why} if t_why else {"check": {}}
    res["drafter"] = {"reason": d_why} if d_why else {"check": {}}
    before = matmul()
    try:
        for k in kernels:
            set_matmul(k)
            if not t_why:
                res["target"]["check"][k] = check_target(dep, prompts, width, tolerance, new_tokens)
            if not d_why:
                res["drafter"]["check"][k] = check_drafter(dep, prompts, block, new_tokens)
    finally:
        set_matmul(before)
    times = time_steps(dep, prompts[0]["prompt_ids"], block, kernels, not t_why, not d_why)
    res["times_ms"] = times
    _decide(res, times, kernels, len(prompts), margin)
    return res


def _decide(res: dict, times: dict, kernels: list[str], n_prompts: int, margin: float) -> None:
    """Fill ``res``'s ``matmul``, ``verify_path``, ``draft_path`` and ``why`` from the checks and times."""
    def fused_ms(key, k):
        part, steps = STEPS[key]
        info = res[part]
        if "reason" in info or not info["check"][k]["passed"]:
            return None
        return sum(times[f"{s}_fused_{k}"] for s in steps)

    def total(k):
        vals = [fused_ms(key, k) for key in STEPS]
        return sum(v for v in vals if v is not None) if any(v is not None for v in vals) else float("inf")

    res["matmul"] = min(kernels, key=total)
    for key, (part, steps) in STEPS.items():
        info, k = res[part], res["matmul"]
        if "reason" in info:
            res["why"].append(f"{key} plain: {info['reason']}")
            continue
        plain, fused = sum(times[f"{s}_plain"] for s in steps), fused_ms(key, k)
        if fused is None:
            res["why"].append(f"{key} plain: the fused step with matmul {k} failed its check {info['check'][k]}")
        elif fused > plain * (1 - margin):
            res["why"].append(f"{key} plain: fused ({k}) {fused:.3f} ms is not {margin:.0%} below plain {plain:.3f} ms")
        else:
            res[key] = "fused"
            res["why"].append(f"{key} fused with matmul {k}: {plain / fused:.2f}x ({' + '.join(steps)}: {fused:.3f} "
                              f"against {plain:.3f} ms), checked on {n_prompts} calibration prompts")

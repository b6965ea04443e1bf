"""``specpilot bench families``: the hybrid and Muse-Glimmer target families end to end with token
trees (issue 44): per shape and concurrency, AR and stock and static trees, every cell equal to AR
and token-forced, and the teacher-forced pass compared with the engine layer by layer.

For each shape of ``--shapes`` (default ``qwen3.8-27b``: 48 Gated DeltaNet + 16 gated attention
layers, and ``muse-glimmer-30b``: 39 sliding-window (window 2048) + 13 global NoPE layers), random
weights drawn on the device as a lazy random checkpoint's are at load, and a random DFlash drafter
of the shape, in one process (the target loaded once per shape):

1. per concurrency c of ``--concurrency`` (default 1 16; c1 serves the first ``--requests-c1``
   requests): AR, then stock (the replay drafter ``--profile``, block ``--block``) and a static
   tree of N nodes per ``--trees`` (default 31 63; verify width N + 1), each through
   :func:`specpilot.engine.serve.serve` (continuous batching, CUDA graphs, the backend's Triton
   step) and each forced by :func:`specpilot.forcing.force` against AR (the Triton teacher-forced
   pass on the GPU); one line per cell: speedup over AR (geometric mean over requests of AR
   decode_s / engine decode_s), over stock, tau, outputs equal to AR, the forcing verdict;
2. ``teacher`` (``--diagnose``): the teacher-forced pass against the engine, position by position
   and layer by layer. The engine: a runner over the backend's step capturing every layer, the
   prompts prefilled in the runner's pieces, then ``--diag-new`` greedy one-token verify + commit
   steps (bit-equal to its decode and chain verify); the pass: the same prefill, the outputs fed
   ``--diag-width`` positions per step; and the pass with each prompt prefilled whole (the pass
   before issue 44, where a sliding ring did not wrap). Per variant: the first (position, layer)
   whose bits differ from the engine's (layer ``logits`` when only the head differs), the largest
   logit difference, and the largest margin of the engine's tokens under it.

The dry run: tiny shapes on the CPU (the cells eager, the teacher comparison through the Triton
family step under the interpreter, tiny-muse only), a few tokens, trees of 7 and 12 nodes at block 4.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from ..deployment import Deployment
from ..drafters.replay import load_profile
from ..engine.config import EngineSpec
from ..engine.runner import TargetRunner
from ..engine.serve import ServeOptions, serve
from ..forcing import force
from ..forcing.teacher import DEFAULT_TOLERANCE
from ..models.random_checkpoint import build_drafter, build_target
from ..tuning import timing
from . import _engine as E
from ._common import Run, add_common, fmt

META = {"deployment": "bench", "target": "random", "drafter": "replay", "gpu": "bench", "synthetic": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "families")
    p.add_argument("--shapes", nargs="+", default=["qwen3.8-27b", "muse-glimmer-30b"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--requests-c1", type=int, default=3, help="requests of the c = 1 cell")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=256, help="new tokens per request")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--trees", type=int, nargs="*", default=[31, 63], help="static tree sizes (nodes)")
    p.add_argument("--profile", default="study_stock", help="the replay drafter's acceptance profile")
    p.add_argument("--diagnose", choices=("on", "off"), default="on",
                   help="compare the teacher-forced pass with the engine layer by layer per shape")
    p.add_argument("--diag-requests", type=int, default=2)
    p.add_argument("--diag-new", type=int, default=24)
    p.add_argument("--diag-width", type=int, default=16)


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def cells(run: Run, a: argparse.Namespace, dep: Deployment, rows: list[dict]) -> dict:
    """Phase 1 for one shape: {"c{c}": {engine name: cell}} (see the module docstring)."""
    prompts = {r["request_id"]: r["prompt_ids"] for r in rows}
    tol = DEFAULT_TOLERANCE["bf16" if run.cuda else "fp32"]
    prof = load_profile(a.profile)
    out = {}
    for c in a.concurrency:
        part = rows if c > 1 else rows[:a.requests_c1]
        ar = serve(EngineSpec("ar"), dep, part, a.new, c, META, ServeOptions(progress=False))
        refs = {r.request_id: r for r in ar}
        v = force(ar, {}, prompts, dep.backend, tol)
        cell = {"ar": {"n": len(ar), "forcing": _verdict(v), "decode_s": sum(r.decode_s for r in ar)}}
        opts = ServeOptions(progress=False, replay=prof, references={k: r.output_ids for k, r in refs.items()})
        for name, cfg in [("stock", {})] + [(f"tree{n}", {"tree_nodes": n}) for n in a.trees]:
            recs = serve(EngineSpec("stock", a.block, cfg), dep, part, a.new, c, META, opts)
            v = force(recs, {"ar": ar}, prompts, dep.backend, tol)
            steps = [t for r in recs for t in r.committed_per_step]
            cell[name] = {"engine_config": cfg, "n": len(recs), "forcing": _verdict(v),
                          "speedup": _geomean([refs[r.request_id].decode_s / r.decode_s for r in recs if r.decode_s > 0]),
                          "tau": sum(steps) / len(steps) if steps else None,
                          "equal": sum(r.output_ids == refs[r.request_id].output_ids for r in recs),
                          "path": recs[0].engine_config.get("path")}
            timing.log(f"c{c} {name}: {cell[name]}")
        out[f"c{c}"] = cell
    return out


def _verdict(v: dict) -> dict:
    return {k: v.get(k) for k in ("passed", "violations", "near_ties", "tokens_checked", "teacher_forced_path")} | \
        {"first": (v.get("violation_list") or [{}])[0].get("detail")}


# ---- the teacher-forced pass against the engine, layer by layer ----

def _engine_trace(r, prompts: list[list[int]], new: int) -> tuple[torch.Tensor, list, list]:
    """The engine's greedy outputs [B, new], and per output position its logits [B, V] (fp32) and
    every layer's hidden state [B, L*H] (the position that predicts it)."""
    last, feats, lengths = r.prefill(prompts)
    B = len(prompts)
    rows = torch.arange(B, device=last.device)
    logits, hidden = [last.float()], [feats[rows, lengths - 1].clone()]
    tok = [last.argmax(-1)]
    ones = torch.ones(B, dtype=torch.long, device=last.device)
    for _ in range(new - 1):
        lg, f = r.verify(tok[-1][:, None])
        r.commit(ones)
        logits.append(lg[:, 0].float().clone())
        hidden.append(f[:, 0].clone())
        tok.append(lg[:, 0].argmax(-1))
    return torch.stack(tok, 1), logits, hidden


class _WholePrompt(TargetRunner):
    """A runner that prefills each prompt in one piece: the teacher-forced pass before issue 44,
    where a sliding-window ring did not wrap in its own cache (the engine prefilled in pieces)."""

    @property
    def prefill_piece(self) -> None:
        return None


def _teacher_trace(r, prompts, outs: torch.Tensor, width: int) -> tuple[list, list]:
    """The teacher-forced pass over the engine's outputs ``outs`` [B, new] as token forcing runs
    it (the runner's prefill, then verify + commit of ``width`` positions at a time): per output
    position its logits and hidden states."""
    B, new = outs.shape
    lg, f, lengths = r.prefill(prompts)
    rows = torch.arange(B, device=outs.device)
    logits, hidden = [lg.float()], [f[rows, lengths - 1].clone()]
    width = min(width, r.max_block)
    for s in range(0, new - 1, width):
        block = outs[:, s:min(s + width, new - 1)]
        lg, f = r.verify(block)
        r.commit(torch.full((B,), block.shape[1], dtype=torch.long, device=outs.device))
        for j in range(block.shape[1]):
            logits.append(lg[:, j].float().clone())
            hidden.append(f[:, j].clone())
    return logits, hidden


def _compare(eng, ref, outs: torch.Tensor, H: int) -> dict:
    """First (position, layer) where ``ref``'s bits differ from the engine's, largest logit
    difference, largest margin of the engine's tokens under ``ref``."""
    first, worst, margin = None, 0.0, 0.0
    for p, (le, lr, he, hr) in enumerate(zip(eng[0], ref[0], eng[1], ref[1])):
        worst = max(worst, float((le - lr).abs().max()))
        margin = max(margin, float((lr.max(-1).values - lr.gather(1, outs[:, p:p + 1])[:, 0]).max()))
        if first is None and not (torch.equal(le, lr) and torch.equal(he, hr)):
            diff = (he != hr).reshape(he.shape[0], -1, H).any(-1).any(0)  # [L]
            layer = int(diff.nonzero()[0]) if bool(diff.any()) else "logits"
            first = {"position": p, "layer": layer}
    return {"first_difference": first, "max_logit_diff": worst, "max_margin": margin}


def diagnose(run: Run, a: argparse.Namespace, model, prompts: list[list[int]]) -> dict:
    """Phase 2 for one shape (module docstring)."""
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    cap = tuple(range(L))
    S = max(map(len, prompts)) + a.diag_new + max(a.diag_width, 1) + 2
    eng = E.fast_runner(model, len(prompts), S, cap, graphs=run.cuda)
    outs, *trace = _engine_trace(eng, prompts, a.diag_new)
    res = {"path": eng.backend.path, "prefill_piece": eng.prefill_piece}
    for name, whole in (("teacher", False), ("teacher_whole_prompt", True)):
        r = E.fast_runner(model, len(prompts), S, cap, graphs=False)
        if whole:
            if r.model.state.ring is None or r.model.state.ring.R < S:
                res[name] = {"skipped": "no sliding-window ring, or one that wraps (then the former pass chunked too)"}
                continue
            r.__class__ = _WholePrompt
        res[name] = _compare(trace, _teacher_trace(r, prompts, outs, a.diag_width), outs, H)
        timing.log(f"{name}: {res[name]}")
    return res


def measure(run: Run, a: argparse.Namespace, shape: str) -> dict:
    """Both phases for one shape; the target and drafter built on the device once."""
    target = build_target(shape, device=run.device, dtype=run.dtype, seed=a.seed)
    drafter = build_drafter(shape, device=run.device, dtype=run.dtype, seed=a.seed, block_size=a.block)
    dep = Deployment.of(target, drafter)
    rng = random.Random(a.seed)
    V = target.config.vocab_size
    rows = [{"request_id": f"random/{i:04d}", "benchmark": "random",
             "prompt_ids": [rng.randrange(V) for _ in range(a.prompt_len)]} for i in range(a.requests)]
    res = {"backend": dep.backend.path, "cells": cells(run, a, dep, rows)}
    if a.diagnose == "on" and shape in getattr(a, "diagnose_shapes", [shape]):
        res["teacher"] = diagnose(run, a, target, [r["prompt_ids"] for r in rows[:a.diag_requests]])
    return res


def table(R: dict) -> list[str]:
    L = ["shape             cell engine     n  speedup  /stock  tau    = AR   forcing"]
    for shape, res in R.get("shapes", {}).items():
        for c, cell in (res or {}).get("cells", {}).items():
            stock = (cell.get("stock") or {}).get("speedup")
            ar = cell["ar"]["forcing"]
            L.append(f"{shape:<17} {c:<4} {'ar':<9} {cell['ar']['n']:>3}  1.000x   -       1.00   -      "
                     f"{'pass' if ar['passed'] else 'FAIL'} ({ar['violations']} violations, {ar['teacher_forced_path']})")
            for name, v in cell.items():
                if name == "ar":
                    continue
                f = v["forcing"]
                over = v["speedup"] / stock if v["speedup"] and stock else None
                L.append(f"{shape:<17} {c:<4} {name:<9} {v['n']:>3}  {fmt(v['speedup'])}x  {fmt(over)}  "
                         f"{fmt(v['tau'], '{:.2f}')}  {v['equal']}/{v['n']}   {'pass' if f['passed'] else 'FAIL'} "
                         f"({f['violations']} violations, {f['teacher_forced_path']})")
        for name in ("teacher", "teacher_whole_prompt"):
            d = ((res or {}).get("teacher") or {}).get(name)
            if d is None:
                continue
            if "skipped" in d:
                L.append(f"{shape:<17} {name}: skipped ({d['skipped']})")
                continue
            fd = d["first_difference"]
            L.append(f"{shape:<17} {name}: " + ("bit-equal to the engine" if fd is None else
                     f"first differs at position {fd['position']}, layer {fd['layer']}")
                     + f"; max |logit diff| {d['max_logit_diff']:.4g}, max margin {d['max_margin']:.4g}")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        if args.shapes == ["qwen3.8-27b", "muse-glimmer-30b"]:
            args.shapes = ["tiny-hybrid", "tiny-muse"]
        args.requests, args.requests_c1, args.prompt_len, args.new, args.block = 3, 2, 24, 12, 4
        args.trees, args.concurrency = [7, 12], [1, 3]
        args.diag_requests, args.diag_new, args.diag_width = 1, 4, 2
        args.diagnose_shapes = ["tiny-muse"]  # the interpreter is slow: one shape, a sliding-window one
    rn = Run("families", args)
    shapes = rn.R.setdefault("shapes", {})
    for shape in args.shapes:
        shapes[shape] = rn.phase(f"shape {shape}", lambda s=shape: measure(rn, args, s), keep=False)
        rn.save()
    return rn.finish(table(rn.R))

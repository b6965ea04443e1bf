"""``specpilot bench draft``: the DFlash draft step against its byte floor (issue 16: <= 1.3x).

A random drafter of ``--shape`` (default the Qwen3-8B shape: 5 DFlash layers of the target's
width) with a random embedding and LM head of the target's vocabulary; the draft cache holds
``--context`` committed positions. One draft step = the context injection of a verified block of
``--block`` positions (``add_context``, the target's captured features) + the draft of the next
block, as the stock engine runs it. Two implementations of the same step, each captured as CUDA
graphs as the engine captures them, timed in the same run:

- ``triton``: the Triton draft step (:class:`FastDrafter`: the target's layer kernels);
- ``torch``: the eager network (cuBLAS, SDPA), the baseline.

Each part (context injection, draft, the whole step) is the median of CUDA-event times of single
calls issued with the GPU idle (the host's launch of the input copies and graphs inside the time).
Then ``--rounds`` interleaved rounds of the whole step per implementation, two ways: per call as
above, and back to back (device time in a steady stream: :func:`timing.mean_s`). ``--profile``
adds the device time per kernel of the Triton step's two parts, after every timing (the profiler
slows every later call of the process).

Byte floor: the bytes the step must read (the drafter's layers and LM head, the block's hidden
states, the draft cache's K/V, the fc and k/v weights of the context injection and its features)
at the copy bandwidth measured in the same run. Also reported: how often the Triton step's drafts
equal the eager network's (random weights: low margins; drafts are proposals the target checks).

Replaces gpu_bench/bench_draft.py (its context-injection config sweep is gone: the tables are
``DRAFTER_CONTEXT_CONFIGS``; its "Triton linears in the eager network" variant is gone with the
path it measured).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ..tuning import timing
from . import _engine as E
from ._common import Run, add_common, fmt, kernel_profile

IMPLS = ("triton", "torch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "draft")
    p.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape of the drafter (default qwen3-8b)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the whole step's timing (0: none)")
    p.add_argument("--profile", action="store_true", help="device time per kernel of the Triton step (CUDA)")


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Draft:
    """The draft step of one drafter at each batch size (see the module docstring)."""

    def __init__(self, run: Run, a: argparse.Namespace):
        self.run, self.a, self.dev = run, a, run.device
        if run.dry:
            target = E.dry_target(a.shape, seed=a.seed)
            self.drafter = E.dry_drafter(target, a.shape, a.block, seed=a.seed)
            hidden, vocab = target.config.hidden_size, target.config.vocab_size
        else:
            tc = E.target_config(a.shape)
            self.drafter = E.build_drafter(a.shape, self.dev, run.dtype, a.seed, a.block)
            hidden, vocab = tc.hidden_size, tc.vocab_size
        g = torch.Generator(device=self.dev).manual_seed(a.seed + 1)
        self.embed = torch.nn.Embedding(vocab, hidden, device=self.dev, dtype=run.dtype)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, device=self.dev, dtype=run.dtype)
        self.embed.weight.normal_(0, 0.02, generator=g)
        self.head.weight.normal_(0, 0.02, generator=g)
        self.g, self.vocab = g, vocab

    def floor_ms(self, B: int) -> dict:
        c, d, a = self.drafter.config, self.drafter, self.a
        layer_w = [p for n, p in d.named_parameters() if n.startswith(("layers.", "norm."))]
        kv_w = [p for n, p in d.named_parameters() if ".k_proj." in n or ".v_proj." in n]
        F = len(c.target_layer_ids) * c.hidden_size
        esz = self.head.weight.element_size()
        kv_row = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * esz  # bytes per position
        draft = nbytes(layer_w) + nbytes([self.head.weight]) + B * a.block * c.hidden_size * esz \
            + B * (a.context + a.block) * kv_row
        ctx = nbytes([d.fc.weight]) + nbytes(kv_w) + B * a.block * (F * esz + kv_row // 2)
        return {k: v / self.bw * 1e3 for k, v in (("draft", draft), ("add_context", ctx), ("step", draft + ctx))}

    def cell(self, B: int) -> dict:
        a, c, dev = self.a, self.drafter.config, self.dev
        self.drafter.setup_cache(B, a.context + 2 * a.block + 64)
        F = len(c.target_layer_ids) * c.hidden_size
        feats0 = torch.randn(B, a.context, F, device=dev, dtype=self.run.dtype, generator=self.g)
        feats = torch.randn(B, a.block, F, device=dev, dtype=self.run.dtype, generator=self.g)
        start = torch.full((B,), a.context, dtype=torch.long, device=dev)
        anchor = torch.randint(0, self.vocab, (B,), device=dev, generator=self.g)
        cell = {"batch": B, "floor_ms": self.floor_ms(B), "impl": {}}
        steps, drafts = {}, {}
        for impl in IMPLS:
            ctx_fn, draft_fn = E.draft_step(self.drafter, self.embed, self.head, impl, a.block, self.run.cuda)
            with torch.inference_mode():
                self.drafter.add_context(feats0, torch.zeros(B, dtype=torch.long, device=dev))

                def both(ctx_fn=ctx_fn, draft_fn=draft_fn):
                    ctx_fn(feats, start - a.block)
                    return draft_fn(anchor, start)

                t_ctx = self.run.median_s(lambda: ctx_fn(feats, start - a.block), 50, 5) * 1e3
                t_draft = self.run.median_s(lambda: draft_fn(anchor, start), 50, 5) * 1e3
                t_step = self.run.median_s(both, 50, 5) * 1e3
                drafts[impl] = both().clone()
            steps[impl] = (both, ctx_fn, draft_fn)
            cell["impl"][impl] = {"add_context_ms": t_ctx, "draft_ms": t_draft, "step_ms": t_step,
                                  "step_over_floor": t_step / cell["floor_ms"]["step"]}
            timing.log(f"B={B} {impl}: context {t_ctx:.3f} ms, draft {t_draft:.3f} ms, step {t_step:.3f} ms "
                       f"({t_step / cell['floor_ms']['step']:.2f}x floor {cell['floor_ms']['step']:.3f} ms)")
        cell["triton_drafts_equal_eager"] = float((drafts["triton"] == drafts["torch"]).float().mean())
        if a.rounds:
            cell["rounds"] = self.rounds({k: v[0] for k, v in steps.items()}, cell["floor_ms"]["step"])
        if a.profile and self.run.cuda:  # last: once torch.profiler has run, every later call is slower
            _, ctx_fn, draft_fn = steps["triton"]
            with torch.inference_mode():
                cell["profile"] = {"add_context": kernel_profile(lambda: ctx_fn(feats, start - a.block)),
                                   "draft": kernel_profile(lambda: draft_fn(anchor, start))}
        return cell

    def rounds(self, steps: dict, floor: float) -> dict:
        """Each implementation's whole step in interleaved rounds (drift hits all alike): per call
        (GPU idle at issue) and back to back (device time per step in a steady stream)."""
        out = {k: {"call_ms": [], "stream_ms": []} for k in steps}
        n = 1 if self.run.dry else 30
        with torch.inference_mode():
            for _ in range(self.a.rounds):
                for impl, fn in steps.items():
                    out[impl]["call_ms"].append(self.run.median_s(fn, n, 3) * 1e3)
                    out[impl]["stream_ms"].append((timing.mean_s(fn, n) if self.run.cuda
                                                   else self.run.median_s(fn, n, 0)) * 1e3)
        for impl, r in out.items():
            for k in ("call", "stream"):
                r[f"{k}_median_ms"] = statistics.median(r[f"{k}_ms"])
                r[f"{k}_over_floor"] = r[f"{k}_median_ms"] / floor
        return out

    def measure(self) -> dict:
        res = {"shape": self.a.shape, "block": self.a.block, "context": self.a.context, "copy_bw_Bps": self.bw,
               "drafter_params": sum(p.numel() for p in self.drafter.parameters()), "cells": []}
        for B in self.a.batch:
            res["cells"].append(self.cell(B))
            self.run.R["draft"] = res
            self.run.save()
        return res


def table(R: dict) -> list[str]:
    d = R.get("draft", {})
    L = [f"draft step, block {d.get('block')}, context {d.get('context')}: batch impl  context ms  draft ms  "
         f"step ms  x floor (floor ms)  | rounds per call / back to back, x floor"]
    for c in d.get("cells", []):
        for impl, v in c["impl"].items():
            r = c.get("rounds", {}).get(impl, {})
            L.append(f"  {c['batch']:>3} {impl:<7} {fmt(v['add_context_ms']):>8} {fmt(v['draft_ms']):>8} "
                     f"{fmt(v['step_ms']):>8} {fmt(v['step_over_floor'], '{:.2f}'):>6}x ({fmt(c['floor_ms']['step'])})"
                     f"  | {fmt(r.get('call_over_floor'), '{:.3f}')} / {fmt(r.get('stream_over_floor'), '{:.3f}')}")
        L.append(f"      Triton drafts = eager network's on {fmt(c['triton_drafts_equal_eager'] * 100, '{:.1f}')}% of positions")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.shape = "tiny" if args.shape == "qwen3-8b" else args.shape
        args.batch, args.block, args.context, args.rounds = [2], 4, 24, 1
    rn = Run("draft", args)
    b = rn.phase("build", lambda: Draft(rn, args), keep=False)
    if b is not None:
        b.bw = rn.phase("copy_bw_Bps", rn.copy_bandwidth) or float("nan")
        rn.phase("draft", b.measure)
    return rn.finish(table(rn.R))

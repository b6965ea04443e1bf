#!/usr/bin/env python
"""The DFlash draft step on the GPU against its byte floor (issue 16: draft step <= 1.3x its floor).

Random bf16 drafter of the ``--shape`` (default qwen3-8b: 5 DFlash layers of the target's width)
with a random embedding and LM head of the target's vocabulary; the draft cache holds
``--context`` committed positions. One draft step = ``add_context`` of a verified block of
``--block`` positions (the chain's features) + ``draft`` of the next block, as the stock engine
runs it. Three implementations of the same step, each captured as CUDA graphs
(:class:`specpilot.engine.graphs.DrafterGraphs`) and timed in the same run:

- ``torch``: the eager network (cuBLAS, SDPA) captured as is;
- ``triton_linears``: the eager network with its matmuls through the Triton matmul (the path
  before the Triton draft step);
- ``triton``: :class:`specpilot.engine.graphs.FastDrafter` (the target's Triton layer kernels);
- ``triton_tuned`` (``--tune-context``, on by default, for batches of <= 32 rows): ``triton`` with
  the two context-injection matmuls (roles ``ctx_fc``, ``ctx_kv``) on the configs found fastest
  for their shapes in this run, each candidate first checked against cuBLAS (relative error
  < 1e-2) and timed alone in a CUDA graph of 20 calls (each call reads more than the L2 holds).

Then the Triton steps again in ``--rounds`` interleaved rounds (:func:`interleaved_rounds`), per
call with the GPU idle at issue (host launch included) and back to back (device time in a steady
stream); ``--profile`` adds the device time per kernel of ``add_context`` and ``draft`` of ``triton``, after
every timing of the batch size (once torch.profiler has run in a process, CUPTI stays attached and
every later call is ~0.2 ms slower; a later batch size's timings are affected too, so profile one
batch size per process).

Byte floor: the weights the step reads (5 layers, fc, the LM head, the embedding rows) plus the
draft cache's K/V, at the copy bandwidth measured in the run. Also reported: how often the
Triton draft's tokens equal the eager network's (random weights: low margins, so low bits can
flip an argmax; drafts are proposals, checked by the target).

Writes ``draft.json`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specpilot.engine.graphs import DrafterGraphs  # noqa: E402
from specpilot.models.random_checkpoint import build_drafter, target_config  # noqa: E402


def median_ms(fn, n: int = 50, warm: int = 5) -> float:
    """Median time [ms] of ``fn`` over ``n`` runs, each between CUDA events (L2 left warm)."""
    from specpilot.engine.graphs import median_ms as med

    return med(fn, n, warm, flush_l2=False)


def copy_bandwidth() -> float:
    """Device copy bandwidth [B/s] (read + write of a 1 GiB buffer)."""
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), 20, 3)
    return 2 * x.numel() * 2 / (ms / 1e3)


CONTEXT_CANDIDATES = ("bn16-bk512-w4-s3", "bn16-bk256-w4-s4", "bn16-bk1024-w4-s3", "bn32-bk256-w4-s4",
                      "bn32-bk256-w4-s3", "bn32-bk128-w4-s6", "bn32-bk512-w4-s3", "bn32-bk512-w8-s3",
                      "bn32-bk1024-w8-s2", "bn64-bk128-w4-s4", "bn64-bk256-w4-s3", "bn64-bk128-w8-s4",
                      "bn64-bk256-w8-s3", "bn128-bk64-w4-s4", "bn128-bk128-w8-s3")


@torch.inference_mode()
def tune_context(fast, feats: torch.Tensor) -> dict:
    """The fastest checked config per context-injection role for ``feats``' rows, and every candidate's time.

    ``feats`` [B, T, F]; returns {"ctx_fc": {"best": key, "us": {key: us}}, "ctx_kv": ...}. A candidate
    whose output differs from cuBLAS's by a relative error >= 1e-2, or that fails to compile, is skipped
    (its entry says why)."""
    import _timing as TM
    from specpilot.engine import triton_step as K

    B, T, Fd = feats.shape
    M = B * T
    d = fast.model
    x_fc = feats.reshape(M, Fd).contiguous()
    w_kv = fast._context_weights()[0]
    x_kv = torch.randn(M, w_kv.shape[1], device=feats.device, dtype=feats.dtype)
    out = {}
    for role, x, w in (("ctx_fc", x_fc, d.fc.weight.detach()), ("ctx_kv", x_kv, w_kv.detach())):
        ref = (x.float() @ w.float().t())
        y = torch.empty(M, w.shape[0], device=x.device, dtype=x.dtype)
        times = {}
        for key in CONTEXT_CANDIDATES:
            cfg = K.LinearConfig.parse(key)
            try:
                K.linear(x, w, y, cfg=cfg)
                err = TM.rel_err(y, ref)
                if err >= 1e-2:
                    times[key] = f"rel err {err:.2e}"
                    continue
                times[key] = TM.graph_time_us(lambda i, cfg=cfg: K.linear(x, w, y, cfg=cfg), 1, min_calls=20, reps=9)[0]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                times[key] = f"{type(e).__name__}: {str(e)[:120]}"
        cublas = TM.graph_time_us(lambda i: torch.mm(x, w.t(), out=y), 1, min_calls=20, reps=9)[0]
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        out[role] = {"best": best, "us": times, "cublas_us": cublas, "rows": M, "n": w.shape[0], "k": w.shape[1],
                     "weight_bytes": w.numel() * w.element_size()}
        print(f"{role} M={M} N={w.shape[0]} K={w.shape[1]}: best {best} {ok[best]:.1f} us (cuBLAS {cublas:.1f} us); "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(ok.items(), key=lambda kv: kv[1])[:5]), flush=True)
    return out


@torch.inference_mode()
def interleaved_rounds(steps: dict, rounds: int, floor_ms: float, n: int = 30) -> dict:
    """The draft step (``add_context`` + ``draft``) of each implementation in ``steps`` {impl: fn},
    timed in ``rounds`` interleaved rounds (impl A, impl B, A, B, ...; drift hits all alike), two ways:

    - ``call_ms``: median of ``n`` calls, each between CUDA events with a synchronize after it (the
      GPU idle when the call is issued, so the host's launch of the input copies and graphs counts:
      what a step costs when the engine issues it after the acceptance decision);
    - ``stream_ms``: ``n`` calls issued back to back between one pair of events, per call (the
      device time of the step in a steady stream of them).

    Returns {impl: {call_ms: [per round], stream_ms: [...], call_median_ms, stream_median_ms,
    call_over_floor, stream_over_floor}} with medians over the rounds."""
    import statistics

    out = {k: {"call_ms": [], "stream_ms": []} for k in steps}
    for _ in range(rounds):
        for impl, fn in steps.items():
            out[impl]["call_ms"].append(median_ms(fn, n, 3))
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            e1.synchronize()
            out[impl]["stream_ms"].append(e0.elapsed_time(e1) / n)
    for impl, r in out.items():
        for k in ("call", "stream"):
            r[f"{k}_median_ms"] = statistics.median(r[f"{k}_ms"])
            r[f"{k}_over_floor"] = r[f"{k}_median_ms"] / floor_ms
        print(f"rounds {impl:13s} call {r['call_median_ms']:.3f} ms ({r['call_over_floor']:.3f}x floor; "
              f"{min(r['call_ms']):.3f}-{max(r['call_ms']):.3f}), stream {r['stream_median_ms']:.3f} ms "
              f"({r['stream_over_floor']:.3f}x; {min(r['stream_ms']):.3f}-{max(r['stream_ms']):.3f})", flush=True)
    return out


def kernel_profile(fn, n: int = 10) -> dict:
    """Device time per kernel name [us per call of ``fn``] over ``n`` calls (torch.profiler), their
    sum, and the wall time per call between CUDA events around the same calls: the difference is
    what the GPU spends idle or launching (gaps between kernels, graph launch, input copies)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        if getattr(ev, "device_type", None) != DeviceType.CUDA:
            continue
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
        kernels[ev.key[:90]] = {"us": dt / n, "launches": ev.count / n}
    total = sum(v["us"] for v in kernels.values())
    return {"kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])), "kernel_sum_us": total,
            "wall_us": e0.elapsed_time(e1) * 1e3 / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "draft_out"))
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--no-tune-context", dest="tune_context", action="store_false",
                    help="skip the context-injection config sweep (impl triton_tuned)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved repeats of the Triton steps' timing (0: none); see interleaved_rounds")
    ap.add_argument("--profile", action="store_true",
                    help="also a per-kernel device-time profile of the triton step (add_context, draft)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    t0 = time.time()
    tc = target_config(args.shape)
    drafter = build_drafter(args.shape, dev, dt, 0, args.block).eval()
    g = torch.Generator(device=dev).manual_seed(1)
    embed = torch.nn.Embedding(tc.vocab_size, tc.hidden_size, device=dev, dtype=dt)
    head = torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False, device=dev, dtype=dt)
    with torch.no_grad():
        embed.weight.normal_(0, 0.02, generator=g)
        head.weight.normal_(0, 0.02, generator=g)
    bw = copy_bandwidth()
    cfg = drafter.config
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": args.shape, "block": args.block, "context": args.context, "copy_bandwidth_Bps": bw,
           "drafter_params": sum(p.numel() for p in drafter.parameters()), "cells": []}
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    layer_w = [p for n, p in drafter.named_parameters() if n.startswith("layers.") or n.startswith("norm.")]
    kv_w = [p for n, p in drafter.named_parameters() if ".k_proj." in n or ".v_proj." in n]
    F_ = len(cfg.target_layer_ids) * cfg.hidden_size
    for B in args.batch:
        drafter.setup_cache(B, args.context + 2 * args.block + 64)
        kv_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # bytes per position
        draft_bytes = nbytes(layer_w) + nbytes([head.weight]) + B * args.block * cfg.hidden_size * 2 \
            + B * (args.context + args.block) * kv_row
        ctx_bytes = nbytes([drafter.fc.weight]) + nbytes(kv_w) + B * args.block * (F_ + kv_row // 2) * 2
        feats0 = torch.randn(B, args.context, F_, device=dev, dtype=dt, generator=g)
        feats = torch.randn(B, args.block, F_, device=dev, dtype=dt, generator=g)
        start = torch.full((B,), args.context, dtype=torch.long, device=dev)
        anchor = torch.randint(0, tc.vocab_size, (B,), device=dev, generator=g)
        cell = {"batch": B, "floor_ms": {"draft": draft_bytes / bw * 1e3, "add_context": ctx_bytes / bw * 1e3,
                                         "step": (draft_bytes + ctx_bytes) / bw * 1e3}, "impl": {}}
        tokens, steps, parts = {}, {}, {}
        impls = ("torch", "triton_linears", "triton")
        if args.tune_context and B * args.block <= 32:
            impls += ("triton_tuned",)
        for impl in impls:
            dg = DrafterGraphs(drafter, embed, head, "torch" if impl == "torch" else "triton")
            if impl == "triton_linears":
                dg.fast = None
            if impl == "triton_tuned":
                tuned = tune_context(dg.fast, feats)
                cell["context_tuning"] = tuned
                dg.fast.set_configs({r: v["best"] for r, v in tuned.items()})
            with torch.inference_mode():
                drafter.add_context(feats0, torch.zeros(B, dtype=torch.long, device=dev))

                def ctx(dg=dg):
                    dg.add_context(feats, start - args.block)

                def draft(dg=dg):
                    return dg.draft(anchor, start, args.block)

                def both(dg=dg):
                    dg.add_context(feats, start - args.block)
                    return dg.draft(anchor, start, args.block)

                try:
                    t_ctx, t_draft, t_step = median_ms(ctx), median_ms(draft), median_ms(both)
                    tokens[impl] = draft().clone()
                    if impl in ("triton", "triton_tuned"):
                        steps[impl] = both
                    if impl == "triton":
                        parts = {"add_context": ctx, "draft": draft}
                except Exception as e:  # noqa: BLE001 - a failing implementation is reported, not fatal
                    cell["impl"][impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
            cell["impl"][impl] = {"add_context_ms": t_ctx, "draft_ms": t_draft, "step_ms": t_step,
                                  "step_over_floor": t_step / cell["floor_ms"]["step"],
                                  "draft_over_floor": t_draft / cell["floor_ms"]["draft"]}
            print(f"B={B} {impl:15s} add_context {t_ctx:.3f} ms, draft {t_draft:.3f} ms, step {t_step:.3f} ms "
                  f"({t_step / cell['floor_ms']['step']:.2f}x floor {cell['floor_ms']['step']:.3f} ms)", flush=True)
        if steps and args.rounds:
            cell["rounds"] = interleaved_rounds(steps, args.rounds, cell["floor_ms"]["step"])
        if args.profile and parts:  # last: once torch.profiler has run, every later call is ~0.2 ms slower
            with torch.inference_mode():
                cell["profile"] = {k: kernel_profile(fn) for k, fn in parts.items()}
            for part, pr in cell["profile"].items():
                print(f"B={B} profile {part}: kernels {pr['kernel_sum_us']:.1f} us of {pr['wall_us']:.1f} us; "
                      + ", ".join(f"{k[:40]} {v['us']:.1f}x{v['launches']:.0f}"
                                  for k, v in list(pr["kernels"].items())[:8]), flush=True)
        if "torch" in tokens and "triton" in tokens:
            cell["triton_tokens_equal_eager"] = float((tokens["torch"] == tokens["triton"]).float().mean())
        res["cells"].append(cell)
    res["wall_s"] = time.time() - t0
    (out / "draft.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

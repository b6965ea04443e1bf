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
- ``triton``: :class:`specpilot.engine.graphs.FastDrafter` (the target's Triton layer kernels).

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "draft_out"))
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=768)
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
        tokens = {}
        for impl in ("torch", "triton_linears", "triton"):
            dg = DrafterGraphs(drafter, embed, head, "torch" if impl == "torch" else "triton")
            if impl == "triton_linears":
                dg.fast = None
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
                except Exception as e:  # noqa: BLE001 - a failing implementation is reported, not fatal
                    cell["impl"][impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
            cell["impl"][impl] = {"add_context_ms": t_ctx, "draft_ms": t_draft, "step_ms": t_step,
                                  "step_over_floor": t_step / cell["floor_ms"]["step"],
                                  "draft_over_floor": t_draft / cell["floor_ms"]["draft"]}
            print(f"B={B} {impl:15s} add_context {t_ctx:.3f} ms, draft {t_draft:.3f} ms, step {t_step:.3f} ms "
                  f"({t_step / cell['floor_ms']['step']:.2f}x floor {cell['floor_ms']['step']:.3f} ms)", flush=True)
        if "torch" in tokens and "triton" in tokens:
            cell["triton_tokens_equal_eager"] = float((tokens["torch"] == tokens["triton"]).float().mean())
        res["cells"].append(cell)
    res["wall_s"] = time.time() - t0
    (out / "draft.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

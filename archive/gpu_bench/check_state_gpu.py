#!/usr/bin/env python
"""Decode vs verify agreement of the per-layer state paths on the GPU, fp32 and bf16 (issue 14).

For each random-weight shape (dense control ``tiny``; ``tiny-hybrid``; ``tiny-muse``; optionally
the study shapes cut to a few layers), from one 60-token prompt: the logits of 16 tokens decoded
one by one (prefill + decodes, each committed) against one 16-token block verified at the same
position (and the block's commit followed by one more decode), on CUDA in fp32 and in bf16, and
on the CPU in fp32 as the reference. A large fp32 error on the GPU means a GPU-only bug in a state
path; a bf16-only error is rounding (cuBLAS kernels differ with the row count).

    PYTHONUNBUFFERED=1 python3 gpu_bench/check_state_gpu.py --out $OUT/check_state.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src")]

import torch  # noqa: E402

from specpilot.engine.runner import TargetRunner  # noqa: E402
from specpilot.models.random_checkpoint import build_target  # noqa: E402


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def one(shape: str, device: str, dtype, layers: int | None, seed: int = 0) -> dict:
    model = build_target(shape, device=device, dtype=dtype, seed=seed)
    if layers:  # the study shapes cut to their first layers (same layer kinds, fits the check)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        model.config.layer_types = model.config.layer_types[:layers]
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (60,), generator=g).tolist()
    block = torch.randint(0, V, (16,), generator=g)
    S = 128
    r = TargetRunner(model, 1, S, (), graphs=False)
    r.prefill([prompt])
    dec = []
    for t in block.tolist():
        dec.append(r.decode(torch.tensor([t], device=device)).float().cpu())
    dec = torch.cat(dec, 0)
    r2 = TargetRunner(model, 1, S, (), graphs=False)
    r2.prefill([prompt])
    logits, _ = r2.verify(block[None].to(device))
    ver = logits[0].float().cpu()
    r2.commit(torch.tensor([16], device=device))
    after_commit = r2.decode(torch.tensor([block[-1].item()], device=device)).float().cpu()
    r3 = TargetRunner(model, 1, S, (), graphs=False)
    r3.prefill([prompt + block.tolist()])
    after_prefill = r3.decode(torch.tensor([block[-1].item()], device=device)).float().cpu()
    top_agree = float((dec.argmax(-1) == ver.argmax(-1)).float().mean())
    return {"verify_vs_decode_rel": rel(ver, dec), "argmax_agreement": top_agree,
            "commit_then_decode_vs_prefill_rel": rel(after_commit, after_prefill),
            "logit_std": float(dec.std())}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="check_state.json")
    p.add_argument("--shapes", nargs="+", default=["tiny", "tiny-hybrid", "tiny-muse", "qwen3.8-27b:8", "muse-glimmer-30b:8"])
    args = p.parse_args()
    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = {}
    for spec in args.shapes:
        shape, _, n = spec.partition(":")
        for dev in devs:
            for dt in ([torch.float32] if dev == "cpu" else [torch.float32, torch.bfloat16]):
                if dev == "cpu" and n:  # the big shapes only on the GPU
                    continue
                key = f"{spec}/{dev}/{str(dt).split('.')[-1]}"
                try:
                    out[key] = one(shape, dev, dt, int(n) if n else None)
                except Exception as e:  # noqa: BLE001 - record and go on
                    out[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(key, json.dumps(out[key]), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

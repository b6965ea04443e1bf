#!/usr/bin/env python
"""Hardware-counter profile (Nsight Compute) of the kernels behind the missed GPU goals.

Runs each kernel of interest once, between ``cudaProfilerStart`` / ``cudaProfilerStop``, after
warm-up calls outside that window, so that ``ncu --profile-from-start off`` profiles exactly those
launches. The kernels, all on random bf16 weights (std 0.02) of Qwen3-8B shapes:

* 12-bit weights (issue 6), gate/up_proj 12288x4096: the fused w12 kernel with its tuned config at
  M = 1 (``gemv``) and M = 16 (tensor-core kind), and cuBLAS bf16 (``torch.mm``) at the same M;
* the engine's Triton step (issue 7), one layer at M = 1: the q/k/v matmul (norm folded in,
  6144x4096), o_proj (residual, 4096x4096), gate_up (SwiGLU, 2x12288x4096), down_proj (residual,
  4096x12288) with the default configs of ``specpilot.engine.graphs``; and the two attention
  kernels at context 512.

Weights rotate over enough copies that no profiled launch finds its weights in L2. Run on the GPU
machine from the repository root (the report text goes to ``$OUT``)::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        python3 gpu_bench/profile_kernels.py > $OUT/ncu.txt

Without ncu it just runs (and prints each label with its launch order), which checks the script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("w12", "engine", "all"), default="all")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("profile_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    runs: list[tuple[str, object]] = []
    copies = 4  # > 60 MB of L2 for every matrix here, with its neighbours

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(torch.bfloat16)

    if args.only in ("w12", "all"):
        from specpilot.kernels import w12_triton as K
        from specpilot.w12.format import pack

        n, k = 12288, 4096
        ws = [rnd(n, k, std=0.02) for _ in range(copies)]
        packs = []
        for w in ws:
            t = pack(w)
            packs.append((t, K.prepare_escapes(t.escape_idx, t.escape_val, n, k)))
        for m in (1, 16):
            x = rnd(m, k)
            cfg = K.default_config(m, n, k, dev)
            it = iter(range(1 << 30))

            def w12(x=x, cfg=cfg, it=it):
                t, esc = packs[next(it) % copies]
                return K.matmul(x, t.mant, t.codes, t.base, esc, cfg)

            def cublas(x=x, it=iter(range(1 << 30))):
                return torch.mm(x, ws[next(it) % copies].t())

            runs += [(f"w12 gate/up M={m} {cfg.key()}", w12), (f"cuBLAS gate/up M={m}", cublas)]

    if args.only in ("engine", "all"):
        from specpilot.engine import triton_step as T
        from specpilot.engine.graphs import DECODE_CONFIGS as DEFAULT_CONFIGS

        H, I, NQ, NKV, D = 4096, 12288, 32, 8, 128
        roles = {"qkv": ((NQ + 2 * NKV) * D, H, dict(norm=True)), "o": (H, NQ * D, dict(res=True)),
                 "gate_up": (2 * I, H, dict(norm=True, swiglu=True)), "down": (H, I, dict(res=True))}
        for role, (n, k, kind) in roles.items():
            cfg = T.LinearConfig.parse(DEFAULT_CONFIGS[role])
            wts = [rnd(n, k, std=0.02) for _ in range(copies)]
            x = rnd(1, k)
            nw = rnd(k) if kind.get("norm") else None
            n_out = n // 2 if kind.get("swiglu") else n
            out = torch.zeros(1, n_out, dtype=torch.bfloat16, device=dev)
            xn = torch.empty_like(x)

            def lin(cfg=cfg, wts=wts, x=x, nw=nw, out=out, xn=xn, kind=kind, it=iter(range(1 << 30))):
                w = wts[next(it) % copies]
                xx, nn = x, nw
                if cfg.prenorm and nn is not None:
                    xx, nn = T.rmsnorm(x, nw, xn, 1e-6), None
                return T.linear(xx, w, out, cfg=cfg, norm=nn, residual=out if kind.get("res") else None,
                                swiglu=bool(kind.get("swiglu")))

            runs.append((f"engine {role} M=1 {cfg.key()}", lin))
        # attention at context 512 (one layer's cache view), as the step runs it
        S, ctx = 768, 512
        kc = rnd(1, NKV, S, D)
        vc = rnd(1, NKV, S, D)
        q = rnd(1, NQ * D)
        att = torch.empty_like(q)
        start = torch.tensor([ctx], device=dev)
        aws = T.AttnWorkspace(1, 1, NQ, NKV, D, S, dev)
        runs.append(("engine attention ctx=512 (partial + combine)",
                     lambda: T.attention(q, kc, vc, start, 1, NQ, NKV, D, att, aws)))

    for _ in range(3):  # warm-up (compilation, autotuned tables, cuBLAS handles), not profiled
        for _, fn in runs:
            fn()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    for i, (label, fn) in enumerate(runs):
        print(f"profiled launch group {i}: {label}", flush=True)
        cudart.cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel sub-agent: tune launch configs of the kernels furthest from the memory-bandwidth limit.

For each linear shape of the deployment's target (in the 12-bit format, the engine's only
project-owned GEMM kernel today) and each decode/verify row count M, it times the default config,
ranks shapes by achieved weight bandwidth / measured copy bandwidth (lowest first), and for the
``top`` furthest shapes tries every candidate config of
:func:`specpilot.kernels.w12_triton.candidate_configs`. A config counts only after its output matched
the bf16 reference (decoded weights, torch matmul) within bf16 accumulation tolerance. Winners are
the ``configs`` table of ``results/{gpu}/kernels/{deployment}/kernel-agent.json`` (the format of
:func:`specpilot.kernels.w12_triton.set_tuned`), which the engine cells and the round steps read
(:func:`specpilot.kernels_build.use_kernel_outputs`); the manifest written by ``specpilot kernels``
is left untouched so finished steps stay finished. On CPU it records that nothing applies.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..io import read_json, write_json


def _time(fn, iters: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def tune(target_dir: str, gpu: str, ceilings_path: str, out: str | Path, rows: tuple[int, ...] = (1, 16),
         top: int = 3, max_configs: int = 16, manifest: dict | None = None) -> dict:
    """Run the sub-agent; writes ``out`` (kernel-agent.json) and returns its content.

    Fields: ``gpu``, ``applies`` (bool), ``reason`` (when it does not apply), ``configs`` (tuned
    table ``"M_BUCKET,N,K" -> config``; empty when nothing applies), ``ranked`` (shapes by achieved
    fraction of the copy bandwidth), ``trials``.
    """
    if gpu == "cpu" or not torch.cuda.is_available():
        res = {"gpu": gpu, "applies": False, "configs": {}, "reason": "no GPU kernels apply on cpu"
               if gpu == "cpu" else "CUDA not available on this node"}
        write_json(out, res)
        return res
    try:
        from ..kernels import w12_triton as kern
    except ImportError as e:
        res = {"gpu": gpu, "applies": False, "configs": {}, "reason": f"Triton kernels unavailable: {e}"}
        write_json(out, res)
        return res
    from ..models.config import TargetConfig, read_config
    from ..w12 import pack

    cfg = TargetConfig.from_hf_dict(read_config(target_dir))
    bw = read_json(ceilings_path)["memory_bandwidth_bytes_per_s"]
    h, i, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    shapes = sorted({(qd, h), (kvd, h), (h, qd), (i, h), (h, i)})
    dev = torch.device("cuda")
    measured = []
    packed = {}
    for n, k in shapes:
        if k % 8:
            continue
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        p = pack(w.cpu())
        esc = kern.prepare_escapes(p.escape_idx.to(dev), p.escape_val.to(dev), n, k)
        packed[(n, k)] = (w, p.mant.to(dev), p.codes.to(dev), p.base, esc)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            mant, codes, base = packed[(n, k)][1:4]
            t = _time(lambda: kern.matmul(x, mant, codes, base, esc))
            measured.append({"m": m, "n": n, "k": k, "seconds": t, "bw_fraction": n * k * 1.5 / t / bw})
    measured.sort(key=lambda r: r["bw_fraction"])
    table, trials = {}, []
    for r in measured[:top]:
        m, n, k = r["m"], r["n"], r["k"]
        w, mant, codes, base, esc = packed[(n, k)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ w.float().T)
        tol = 2e-2 * ref.abs().max().item() + 1e-3
        best = None
        for c in kern.candidate_configs(m, n, k)[:max_configs]:
            try:
                y = kern.matmul(x, mant, codes, base, esc, config=c)
            except Exception as e:  # a config that does not compile/launch is simply not a candidate
                trials.append({"m": m, "n": n, "k": k, "config": dataclasses.asdict(c), "error": type(e).__name__})
                continue
            err = (y.float() - ref).abs().max().item()
            ok = err <= tol
            t = _time(lambda: kern.matmul(x, mant, codes, base, esc, config=c)) if ok else None
            trials.append({"m": m, "n": n, "k": k, "config": dataclasses.asdict(c), "max_err": err,
                           "correct": ok, "seconds": t})
            if ok and (best is None or t < best[1]):
                best = (c, t)
        if best is not None:
            table[f"{kern.m_bucket(m)},{n},{k}"] = dataclasses.asdict(best[0])
            r["tuned_seconds"] = best[1]
    res = {"gpu": gpu, "applies": True, "kernel": "w12 fused decode+matmul", "ranked": measured,
           "configs": table, "trials": trials}
    write_json(out, res)
    return res

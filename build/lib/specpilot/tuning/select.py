"""Checked cuBLAS: the online choice of a batched verify matmul's implementation.

cuBLAS runs a batched verify's GEMMs (M = 128-384 rows) 25-45 % faster than the fast path's Triton
kernels (H200, BENCHMARKS.md), and on most shapes its rows are bit-equal to the decode kernels' (its
algorithm reduces over K in the same order); on some (split-K) they are not. So the first call of
each (role, M, weight shape) of at least :data:`~specpilot.fastpath.tables.CHECKED_CUBLAS_MIN_ROWS`
rows checks the options on a random probe against the decode config and keeps the fastest bit-equal
one: the table's Triton entry, cuBLAS, and cuBLAS over 16 or 32 rows more
(:class:`~specpilot.fastpath.tables.PaddedCublas`), since cuBLAS picks its algorithm by shape. Row
independence then holds on any GPU and library by check rather than by assumption, and no shape is
faster by being inexact (the batch-invariant kernels' idea, He et al., Thinking Machines 2025,
"Defeating nondeterminism in LLM inference", checked per shape instead of imposed).
"""

from __future__ import annotations

import types
from typing import Callable

import torch

from ..fastpath.tables import CUBLAS, PaddedCublas, config_key

# apply(cfg, x, w, out, ws, norm, residual, swiglu): one matmul call of the step (out = epilogue(norm(x) @ w.T))
Apply = Callable[..., torch.Tensor]
# time(cfg, fn): device milliseconds of one call of option cfg (fn runs it)
Time = Callable[[object, Callable[[], object]], float]


@torch.inference_mode()
def select_checked(apply: Apply, time: Time, key: tuple, table_cfg, base_cfg, w: torch.Tensor,
                   norm: torch.Tensor | None, residual: bool, swiglu: bool) -> tuple[object, dict]:
    """The fastest option of one (role, M, weight shape) matmul whose output is bit-equal, row for
    row, to the decode config's (the config of M <= 16 rows, whose 16-row tiles compute each row
    exactly as a one-row decode does).

    Args:
        apply: the step's matmul (see :data:`Apply`); time: device ms of one option's call.
        key: (role, M, weight shape, norm?, residual?, swiglu?, pads): ``pads`` = row counts
            M + 16 / M + 32 the caller's buffers have room for (:class:`PaddedCublas` options).
        table_cfg: the table's entry for M; base_cfg: the decode config (reference).
        w: the role's real weight [N (x2 for SwiGLU), K]; norm: its RMSNorm weight or None.
        residual, swiglu: the epilogue.
    Returns:
        (the chosen option, a record ``{rows, weight, decode_config, options: {key: {bit_equal, ms}
        or {error}}, chosen}``). Falls back to the decode config when no option is bit-equal; an
        option that raises is recorded with its error and never chosen.
    """
    M, pads = key[1], key[-1]
    dev, dt = w.device, w.dtype
    Kd = w.shape[1]
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    P = max((M,) + tuple(pads))
    g = torch.Generator(device=dev).manual_seed(1234 + M)
    x = torch.randn(P, Kd, generator=g, device=dev, dtype=dt)
    r = torch.randn(P, N, generator=g, device=dev, dtype=dt) if residual else None
    ws = types.SimpleNamespace(xn=torch.empty(P, Kd, dtype=dt, device=dev), gu=None)

    def run(cfg, out=None):
        n = cfg.rows if isinstance(cfg, PaddedCublas) else M
        if out is None:
            out = r[:n].clone() if r is not None else torch.empty(n, N, dtype=dt, device=dev)
        apply(CUBLAS if isinstance(cfg, PaddedCublas) else cfg, x[:n], w, out, ws, norm,
              out if r is not None else None, swiglu)
        return out

    ref = run(base_cfg)
    opts = [c for c in (table_cfg, CUBLAS, *(PaddedCublas(p) for p in pads)) if c != base_cfg]
    rec = {"rows": M, "weight": list(w.shape), "decode_config": config_key(base_cfg), "options": {}}
    best, best_t = base_cfg, None
    for c in opts:
        try:
            ok = bool(torch.equal(run(c)[:M], ref))
            t = time(c, lambda c=c, o=run(c): run(c, o)) if ok else None
        except Exception as e:  # noqa: BLE001 - an option that cannot run is not an option
            rec["options"][config_key(c)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            continue
        rec["options"][config_key(c)] = {"bit_equal": ok, "ms": t}
        if ok and (best_t is None or t < best_t):
            best, best_t = c, t
    rec["chosen"] = config_key(best)
    return best, rec

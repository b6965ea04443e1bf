"""Tuning and checking of the engine's 12-bit (w12) matmul roles on the GPU they run on.

:func:`check_split` checks one K split of the w12 tensor-core kernel before anything of it is timed;
:func:`tune_w12_choice` picks, per matmul role, whether the Triton step runs it in w12 (one split,
a launch per row bucket: see :mod:`specpilot.fastpath.w12`) or in bf16, by timing each role's whole
engine call against the bf16 call the step makes at the deployment's widths (the kernel sub-agent's
``w12_choice``).
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from ..errors import SpecpilotError
from ..fastpath.tables import CUBLAS, PaddedCublas, role_layout
from ..fastpath.w12 import BUCKETS, ROLES, W12Role, role_weights, w12_apply
from ..kernels.w12_mma import SPLITS, TILES, UNROLLS, WARPS, frag_pack, matmul, reference_matmul, valid
from ..w12 import pack
from .timing import graph_us, rel_err


def launches(m: int, k: int, split: int) -> list[tuple[int, int, int]]:
    """The (tiles, warps, unroll) launches the library has for ``m`` rows, K = ``k`` and ``split``."""
    return [(t, w, u) for t in TILES for w in WARPS for u in UNROLLS if valid(m, split, t, w, u, k)]


@torch.inference_mode()
def check_split(f, w: torch.Tensor, split: int, rows: int = 64, seed: int = 7) -> dict:
    """Correctness of one K split of the w12 kernel on weight ``w`` (bf16 [N, K]) packed as ``f``
    (CUDA), before anything of it is timed: output NaN-poisoned first; every launch shape of the
    split bit-equal on ``rows`` rows, and two runs bit-equal; rows 1..``rows`` computed in smaller
    batches (M = 1, 3, 16) and alone bit-equal to the same rows of the full batch (M-invariance);
    relative error against the kernel's own fp32 reference (:func:`~specpilot.kernels.w12_mma.reference_matmul`)
    below 4e-3 and against the true fp32 product at most twice cuBLAS bf16's (+1e-4).

    Returns ``{"ok": bool, "why": [failures], "err_vs_reference", "err_vs_true", "cublas_err_vs_true"}``.
    """
    n, k = f.shape
    g = torch.Generator(device=w.device).manual_seed(seed)
    x = torch.randn(rows, k, device=w.device, generator=g).to(torch.bfloat16)
    why: list[str] = []
    full = {}
    for c in launches(rows, k, split):
        y = torch.full((rows, n), float("nan"), device=w.device, dtype=torch.bfloat16)
        matmul(x, f, split, *c, out=y)
        if not torch.equal(y.view(torch.int16), matmul(x, f, split, *c).view(torch.int16)):
            why.append(f"launch {c}: two runs differ")
        full[c] = y
    if not full:
        return {"ok": False, "why": [f"no launch for split {split} at K = {k}"]}
    c0, base = next(iter(full.items()))
    why += [f"launch {c} differs from {c0}" for c, y in full.items() if not torch.equal(y.view(torch.int16), base.view(torch.int16))]
    for m in (1, 3, 16):
        for c in launches(m, k, split)[:3]:
            for r0 in (0, rows - m):
                y = matmul(x[r0:r0 + m], f, split, *c)
                if not torch.equal(y.view(torch.int16), base[r0:r0 + m].view(torch.int16)):
                    why.append(f"M={m} {c} rows {r0}..: differ from the same rows of M={rows}")
    true = x.float() @ w.float().T
    fin = torch.isfinite(true).all(1)
    e_ref = rel_err(base, reference_matmul(x, f))
    e_true = rel_err(base[fin], true[fin])
    e_cub = rel_err(torch.mm(x, w.t())[fin], true[fin])
    if not (e_ref < 4e-3 and e_true < 2 * e_cub + 1e-4):
        why.append(f"error vs own fp32 reference {e_ref:.2e}, vs true {e_true:.2e} (cuBLAS bf16 {e_cub:.2e})")
    return {"ok": not why, "why": why[:8], "err_vs_reference": e_ref, "err_vs_true": e_true, "cublas_err_vs_true": e_cub}


def bucket(m: int) -> int:
    """The launch-table bucket of ``m`` rows: the smallest of BUCKETS >= min(m, 64)."""
    return next(b for b in BUCKETS if b >= min(m, 64))


def plant_escapes(w: torch.Tensor, seed: int = 0) -> None:
    """Write values the 12-bit format must escape (zeros, subnormals, outliers) into ~0.02 % of
    ``w`` in place (a random-weight copy has none, a real checkpoint some)."""
    n = w.numel()
    g = torch.Generator(device=w.device).manual_seed(seed)
    idx = torch.randint(0, n, (max(8, n // 5000),), device=w.device, generator=g)
    vals = torch.tensor([0.0, -0.0, 1e-30, 300.0, -2e4, 1e-40, 65504.0, -1e-38], device=w.device)
    w.view(-1)[idx] = vals.repeat(idx.numel() // 8 + 1)[: idx.numel()].to(w.dtype)



def _role_copies(layer, role: str, l2: int):
    """The role's weight of the one-layer copy (escapes planted) and enough copies of it, with their
    w12 packs, to exceed the L2 cache (a step streams every weight from device memory)."""
    w0 = role_weights(layer)[role]
    plant_escapes(w0, seed=sum(map(ord, role)))
    n, k = w0.shape
    copies = int(min(8, max(2, math.ceil(4 * l2 / (2 * n * k)))))
    ws_ = [w0] + [w0.roll(i, 0).contiguous() for i in range(1, copies)]
    return w0, ws_, [frag_pack(pack(w)) for w in ws_]


def _split_family(fast, split: int, k: int, widths: tuple, tiers_m: list, fs: list, call_args, timer,
                  trials: list, role: str):
    """The fastest launch per row bucket of one K split: (summed us over ``widths``, its W12Role,
    us per width), or None when some bucket has no launch."""
    xs, outs, scratch, norm, has_res, swiglu, copies = call_args
    tiers, t_w = [], {}
    for b in tiers_m:
        ms_b = [m for m in widths if bucket(m) == b] or [b]
        best = None
        for c in launches(b, k, split):
            rc = W12Role(split, ((64, c),))
            per = {}
            for m in ms_b:
                x = xs[:m]
                per[m] = timer([lambda i=i, x=x, m=m, rc=rc: w12_apply(
                    fast, rc, fs[i], x, outs[i][:m], scratch, norm, outs[i][:m] if has_res else None, swiglu)
                    for i in range(copies)])
                trials.append({"role": role, "split": split, "M": m, "launch": "t{}-w{}-u{}".format(*c), "us": per[m]})
            if best is None or sum(per.values()) < sum(best[1].values()):
                best = (c, per)
        if best is None:
            return None
        tiers.append((b, best[0]))
        t_w.update({m: v for m, v in best[1].items() if m in widths})
    return sum(t_w.values()), W12Role(split, tuple(tiers)), t_w


def _decide(role: str, widths: tuple, bf16_us: dict, totals: dict, min_gain: float, res: dict) -> dict:
    """The role's summary row; records its w12 family in ``res["w12_choice"]`` when it wins."""
    row = {"role": role, "widths": list(widths), "bf16_us": {str(m): v for m, v in bf16_us.items()}}
    if not totals:
        return {**row, "chosen": "bf16", "why": "no split passed its checks"}
    s = min(totals, key=lambda s: totals[s][0])
    tw, rc, t_w = totals[s]
    tb = sum(bf16_us.values())
    row.update(split=s, w12_us={str(m): v for m, v in t_w.items()}, speedup=tb / tw)
    if tw < tb * (1 - min_gain):
        res["w12_choice"][role] = rc.to_dict()
        return {**row, "chosen": "w12", "why": f"{tb / tw:.3f}x bf16 summed over widths {list(widths)}"}
    return {**row, "chosen": "bf16", "why": f"w12 {tb / tw:.3f}x bf16 over widths {list(widths)} "
                                             f"(needs {1 / (1 - min_gain):.3f}x)"}


def _check_tune_args(cfg, widths, device, roles) -> None:
    if device.type != "cuda":
        raise SpecpilotError("w12 choice tuning needs a CUDA device")
    if not cfg.is_dense:
        raise SpecpilotError("w12 choice tuning covers dense targets (the FastTarget step) only")
    if not widths or min(widths) < 1:
        raise SpecpilotError(f"w12 choice widths must be row counts >= 1, got {tuple(widths)}")
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise SpecpilotError(f"w12 choice roles must be among {ROLES}, got {bad}")


@torch.inference_mode()
def tune_w12_choice(cfg, widths: tuple[int, ...] = (16,), device: str | torch.device = "cuda",
                    roles: tuple[str, ...] = ROLES, min_gain: float = 0.02, seed: int = 0,
                    timer: Callable[[list], float] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Per role of a dense target config ``cfg``: does w12 (one split, launch per bucket) beat the
    engine's bf16 step over ``widths`` (the rows per decode / verify matmul the deployment runs,
    e.g. (16,) for one request verifying blocks of 16, (1,) for AR)? CUDA only.

    On a one-layer random copy (:func:`~specpilot.tuning.matmul._one_layer_target`, escapes
    planted), each role's whole call as the engine makes it is timed in CUDA graphs over enough
    weight copies to exceed the L2 cache: bf16 = ``FastTarget._apply`` with the config the step
    picks at that M (table entry, or the checked cuBLAS choice from 64 rows); w12 = RMSNorm, the
    w12 kernel, SwiGLU or the residual add (:func:`~specpilot.fastpath.w12.w12_apply`). Every split
    is checked (:func:`check_split`) before it is timed; per split the fastest launch per bucket;
    the split with the least summed time over ``widths`` is the role's w12 family, chosen when it
    is at least ``min_gain`` faster in sum than bf16.

    Returns ``{"w12_choice": {role: W12Role.to_dict()}, "w12_choice_summary": [per role: role,
    widths, bf16_us {M: us}, w12_us {M: us} of the chosen split, split, speedup, chosen, why],
    "w12_choice_checks": {role: {split: check}}, "w12_choice_trials": [role, split, M, launch, us]}``.

    Raises:
        SpecpilotError: not CUDA, a non-dense config, a width < 1, an unknown role.
    """
    from .matmul import _one_layer_target  # the Triton step: an optional dependency (CUDA only)

    device = torch.device(device)
    _check_tune_args(cfg, widths, device, roles)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    timer = timer or graph_us
    model, fast = _one_layer_target(cfg, device, torch.bfloat16, seed)
    layer = model.model.layers[0]
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    norms = {"qkv": layer.input_layernorm.weight, "gate_up": layer.post_attention_layernorm.weight}
    widths = tuple(sorted(set(int(m) for m in widths)))
    tiers_m = sorted({bucket(m) for m in widths} | {64})  # 64: the launch of chunks beyond
    res = {"w12_choice": {}, "w12_choice_summary": [], "w12_choice_checks": {}, "w12_choice_trials": []}
    for role in roles:
        w0, ws_, fs = _role_copies(layer, role, l2)
        n, k = w0.shape
        has_norm, has_res, swiglu = role_layout(role)
        norm = norms.get(role) if has_norm else None
        checks = {s: check_split(fs[0], w0, s) for s in SPLITS if launches(64, k, s)}
        res["w12_choice_checks"][role] = {str(s): c for s, c in checks.items()}
        for s, c in checks.items():
            if not c["ok"]:
                log(f"w12 choice {role}: split {s} fails its checks: {'; '.join(c['why'][:3])}")
        P = max(widths + (64,))
        g = torch.Generator(device=device).manual_seed(11)
        xs = torch.randn(P, k, generator=g, device=device).to(torch.bfloat16)
        outs = [torch.zeros(P, n // 2 if swiglu else n, device=device, dtype=torch.bfloat16) for _ in ws_]
        scratch = Scratch(P, k, n, device)
        bf16_us = {}
        for m in widths:
            x = xs[:m]
            cfg_m = fast._pick(role, x, w0, norm, outs[0][:m] if has_res else None, swiglu, room=m)
            cfg_m = CUBLAS if isinstance(cfg_m, PaddedCublas) else cfg_m
            bf16_us[m] = timer([lambda i=i, x=x, m=m, c=cfg_m: fast._apply(
                c, x, ws_[i], outs[i][:m], scratch, norm, outs[i][:m] if has_res else None, swiglu)
                for i in range(len(ws_))])
        call_args = (xs, outs, scratch, norm, has_res, swiglu, len(ws_))
        totals = {}
        for s in [s for s, c in checks.items() if c["ok"]]:
            fam = _split_family(fast, s, k, widths, tiers_m, fs, call_args, timer, res["w12_choice_trials"], role)
            if fam is not None:
                totals[s] = fam
        row = _decide(role, widths, bf16_us, totals, min_gain, res)
        log(f"w12 choice {role}: {row['chosen']} ({row['why']})")
        res["w12_choice_summary"].append(row)
        del fs, ws_, outs
    return res


class Scratch:
    """The workspace fields ``FastTarget._apply`` and :func:`~specpilot.fastpath.w12.w12_apply` use
    (norm output, SwiGLU and w12 output buffers) for a tuning call."""

    def __init__(self, rows: int, k: int, n: int, device):
        self.xn = torch.empty(rows, k, dtype=torch.bfloat16, device=device)
        self.gu = None
        self.extra = {"w12y": torch.empty(rows * n, dtype=torch.bfloat16, device=device)}  # flat, as FastTarget's

"""Tuning of the engine's bf16 Triton matmul tables for the GPU they run on (the kernel sub-agent's
``engine_configs``, :mod:`specpilot.agent.kernel_agent`).

The Triton step (:class:`~specpilot.fastpath.dense.FastTarget`) runs five matmul roles per step with
a block config per row bucket (``DEFAULT_CONFIGS``: role -> {max_rows: config key}, tuned on an
H200 for the Qwen3-8B shape). :func:`tune_engine_configs` re-tunes the buckets of up to 256 rows
(16, 32, 64: AR decode, single-request verification, small batches; 128, 256: the batched regime's
verify, 16 requests x a block of 8 or 16, where the GEMMs stop being weight-bound) for the deployment's target
shape on this GPU, through the engine's own call (``FastTarget._apply``, the call
``FastTarget._linear`` makes for a Triton config) on a one-layer random-weight copy of the target
(q/k/v and gate/up fused as the engine fuses them). Per role (weight [N rows, K], fused layout of
:func:`~specpilot.fastpath.dense.fuse_weights`):

- ``qkv``: N = (H + 2 Hkv) D, K = hidden, RMSNorm before (input_layernorm);
- ``o``: N = hidden, K = H D, residual epilogue;
- ``gate_up``: N = 2 intermediate (gate rows, then up rows), K = hidden, RMSNorm before, SwiGLU
  epilogue (output: intermediate columns);
- ``down``: N = hidden, K = intermediate, residual epilogue;
- ``lm_head``: N = vocab, K = hidden, RMSNorm before (the final norm).

A candidate (:func:`candidate_linear_configs`: the default and up to 15 configs of its family) is
timed only after two checks on a seeded probe (x, residual) of the bucket's largest row count and of
the smallest row count that falls in the bucket (e.g. 17 and 32): (a) every output row is bit-equal
to the same row computed alone (M = 1) by the role's current decode config (the 16-row entry), the
engine's batch invariance (a token's logits do not depend on the batch or the block it is verified
in); (b) its relative L2 error against an fp32 torch reference is at most
:data:`FP32_REL_TOL` (or 1.5x the decode config's own). The decode config is the reference of every
bucket, so a new 16-row entry (the decode config itself) is taken only when it is bit-equal to the
current one: the numerics of decoding never change. Times are device microseconds per call from
CUDA-graph replays over enough weight copies to exceed the L2 cache (a step streams every weight
from device memory). A bucket's winner replaces the default only when a re-timing that alternates
the two confirms it faster by ``min_gain`` (or when the default failed its own checks).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import SpecpilotError
from ..fastpath.dense import FastTarget
from ..fastpath.support import dense_support
from ..fastpath.tables import DEFAULT_CONFIGS, DEFAULT_TUNE_ROWS, LINEAR_ROLES, TUNE_ROWS, LinearConfig, role_layout, row_tile
from ..models.config import TargetConfig
from ..models.qwen3 import Transformer
from ..models.target import Transformer as FamilyTransformer
from .timing import graph_us, rel_err

FP32_REL_TOL = 2e-2  # relative L2 error against the fp32 reference a config may have at most
# (bn, bk, warps, stages) of the candidates (in this order after the default): the blocks of the
# default tables up to 64 rows, fastpath.tables.CANDIDATES and the verify benchmark's small family
BLOCKS = ((32, 128, 4, 6), (32, 256, 4, 4), (32, 256, 4, 3), (32, 512, 4, 3), (16, 512, 4, 3),
          (64, 128, 4, 4), (64, 256, 4, 3), (64, 128, 4, 3), (64, 128, 8, 4), (64, 64, 4, 6),
          (128, 64, 4, 4), (128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 4, 3), (128, 128, 8, 3))
# the candidates of the buckets above 64 rows (compute-bound tiles: wide N, 8 warps, deeper pipelines;
# the blocks of the default tables at 128 / 256 rows first), each with two row tiles (see
# candidate_linear_configs)
BIG_BLOCKS = ((128, 64, 8, 5), (128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 4, 3), (64, 64, 4, 6),
              (128, 128, 8, 3), (64, 128, 8, 4), (128, 64, 4, 4), (64, 256, 4, 3), (256, 64, 8, 3),
              (64, 64, 8, 4), (64, 64, 8, 6), (32, 128, 4, 4), (32, 64, 4, 6))  # the last four: SwiGLU's tiles
SMEM_LIMIT = 200 * 1024  # pipeline shared memory a candidate may use (bytes; the H100/H200 allow 227 KiB)


def role_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Weight shape (N rows, K columns) of each matmul role for a target config (a
    :class:`~specpilot.models.config.TargetConfig` of a dense target), in the fused layout."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (cfg.vocab_size, h)}


def family_role_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Per matmul role the weight shape (N rows, K columns) a family target's step (Gated DeltaNet
    hybrid, Muse-Glimmer: :class:`~specpilot.fastpath.family.FastFamilyTarget`) runs the role on for
    the most weight bytes, in its fused layout: ``qkv`` the attention ``fused_qkv`` (q | k | v [|
    gate]) or the GDN ``fused_in`` (qkv | z | b | a), ``o`` the attention ``o_proj`` or the GDN
    ``out_proj``, ``gate_up`` / ``down`` the MLP's, ``lm_head``. Shapes read from the model built
    on the meta device (no memory), fused as the family step fuses it."""
    from ..fastpath.family import fuse_family_weights  # the family step (Triton: imported when asked)

    with torch.device("meta"):
        model = FamilyTransformer(cfg)
    fuse_family_weights(model)
    weight: dict[str, dict[tuple[int, int], int]] = {}
    for layer in model.model.layers:
        gdn = layer.kind == "linear_attention"
        roles = {"qkv": layer.fused_in if gdn else layer.fused_qkv,
                 "o": layer.linear_attn.out_proj.weight if gdn else layer.self_attn.o_proj.weight,
                 "gate_up": layer.fused_gate_up, "down": layer.mlp.down_proj.weight}
        for role, w in roles.items():
            by = weight.setdefault(role, {})
            by[tuple(w.shape)] = by.get(tuple(w.shape), 0) + w.numel()
    out = {role: max(by, key=by.get) for role, by in weight.items()}
    out["lm_head"] = tuple(model.lm_head.weight.shape)
    return out


def _dense_stand_in(cfg):
    """A dense config of a family target's hidden size, MLP, attention heads and vocabulary: the
    one-layer target whose step (:class:`FastTarget`) makes the matmul calls the family step makes
    (FastFamilyTarget inherits them) on the family's role weights (:func:`family_role_shapes`)."""
    return TargetConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        rms_norm_eps=cfg.rms_norm_eps)


def drafter_stand_in(dcfg, vocab_size: int):
    """The dense target config whose layer has a DFlash-family drafter's layer shapes (``dcfg``: a
    :class:`~specpilot.models.dflash.DrafterConfig`) and whose LM head is the target's (``vocab_size``
    rows; the drafter drafts through the target's head): :func:`tune_engine_configs` of it tunes the
    draft step's tables (:class:`~specpilot.fastpath.drafter.FastDrafter` makes the same matmul calls)."""
    return TargetConfig(vocab_size=vocab_size, hidden_size=dcfg.hidden_size, intermediate_size=dcfg.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=dcfg.num_attention_heads,
                        num_key_value_heads=dcfg.num_key_value_heads, head_dim=dcfg.head_dim,
                        rms_norm_eps=dcfg.rms_norm_eps)


def bucket_of(role: str, rows: int) -> int:
    """The ``max_rows`` of DEFAULT_CONFIGS[role] whose entry a matmul of ``rows`` rows uses (the
    smallest >= rows, else the largest)."""
    keys = sorted(int(k) for k in DEFAULT_CONFIGS[role])
    return next((k for k in keys if k >= rows), keys[-1])


def fits(c, swiglu: bool) -> bool:
    """Whether a LinearConfig's tile plausibly fits one SM: fp32 accumulator registers per thread
    <= 128 (two accumulators with SwiGLU) and pipeline shared memory <= :data:`SMEM_LIMIT`."""
    n = 2 if swiglu else 1
    acc = c.bn * c.bm * n / (32 * c.warps)
    smem = c.stages * (c.bn * c.bk * n + c.bm * c.bk) * 2
    return acc <= 128 and smem <= SMEM_LIMIT


def candidate_linear_configs(role: str, rows: int, limit: int = 16) -> list[str]:
    """LinearConfig keys to try for a matmul of ``role`` at ``rows`` rows: the default entry of the
    row bucket first, then the :data:`BLOCKS` family in the default's conventions.

    Every key keeps the role's norm placement (``-p``: qkv, gate_up and lm_head run their RMSNorm
    as a separate kernel; a fused-norm prologue would round differently, so its rows could never
    be bit-equal to the decode config's) and takes the row tile of the bucket (``-mXX`` = the
    smallest of 16 / 32 / 64 rows covering ``rows``; no suffix for 16), as the defaults do. Above
    64 rows the :data:`BIG_BLOCKS` family, each block with the default's row tile and the smallest
    of 128 / 256 covering ``rows`` and half that (one program per column block, or two along M:
    more programs, each re-reading the weight tile from L2), interleaved. Keys whose tile does not fit
    (:func:`fits`) are left out. At most ``limit`` keys, no repeats.

    Raises:
        SpecpilotError: an unknown role, ``rows`` outside 1 .. 256, ``limit`` < 1.
    """
    swiglu = role_layout(role)[2]
    if not 1 <= int(rows) <= max(TUNE_ROWS):
        raise SpecpilotError(f"matmul tuning covers 1 .. {max(TUNE_ROWS)} rows, got {rows}")
    if limit < 1:
        raise SpecpilotError(f"limit must be >= 1, got {limit}")
    default = DEFAULT_CONFIGS[role][str(bucket_of(role, rows))]
    base = LinearConfig.parse(default)
    bm = row_tile(int(rows), max(TUNE_ROWS))
    blocks, tiles = (BLOCKS, (bm,)) if int(rows) <= 64 else (BIG_BLOCKS, tuple(dict.fromkeys((base.bm, bm, bm // 2))))
    out = [default]
    for bn, bk, w, s in blocks:
        for tile in tiles:
            c = LinearConfig(bn, bk, w, s, base.prenorm, tile)
            if fits(c, swiglu) and c.key() not in out:
                out.append(c.key())
    return out[:limit]


def pick_config(default: str, trials: list[dict], min_gain: float,
                confirm: Callable[[str, str], tuple[float, float]] | None = None) -> tuple[str, str]:
    """The config a row bucket keeps, and why.

    ``trials``: one dict per candidate with ``config`` (key), ``passed`` (both checks) and ``us``
    (microseconds per call, None when not timed). The fastest passing candidate replaces
    ``default`` when the default failed its checks, or when ``confirm(default, best)`` (a
    re-timing: (default us, best us); default the trials' own times) finds it faster by the
    fraction ``min_gain``. Nothing that did not pass is ever returned but ``default`` itself.
    """
    ok = [t for t in trials if t.get("passed") and t.get("us") is not None]
    if not ok:
        return default, "no candidate passed the checks"
    best = min(ok, key=lambda t: t["us"])
    d = next((t for t in trials if t["config"] == default), None)
    if d is None or not d.get("passed") or d.get("us") is None:
        return best["config"], "the default failed its checks"
    if best["config"] == default:
        return default, "the default is the fastest"
    td, tb = confirm(default, best["config"]) if confirm is not None else (d["us"], best["us"])
    if tb < td * (1.0 - min_gain):
        return best["config"], f"{td / tb:.3f}x the default's speed (re-timed {tb:.2f} vs {td:.2f} us)"
    return default, f"not {min_gain:.0%} faster when re-timed ({tb:.2f} vs {td:.2f} us)"


def _one_layer_target(cfg, device, dtype, seed: int):
    """A random one-layer copy of a dense target config on ``device`` (matrices N(0, 0.02), norm
    weights 1 + N(0, 0.1)), and its FastTarget (which fuses q/k/v and gate/up as the engine does).

    Raises SpecpilotError when the dense step cannot run the shape."""
    one = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=[], layer_rope=[])
    with torch.device("meta"):
        model = Transformer(one)
    model = model.to(dtype).to_empty(device=device).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device))
    why = dense_support(model)
    if why is not None:
        raise SpecpilotError(f"the engine's Triton step does not run this target: {why}")
    return model, FastTarget(model)


@dataclass
class _RoleProbe:
    """One role's seeded probe: inputs, the engine's call, each row computed alone by the decode
    config (the batch-invariance reference) and the fp32 reference."""

    role: str
    call: Callable
    fresh: Callable
    x: torch.Tensor
    w: torch.Tensor
    alone: torch.Tensor
    ref: torch.Tensor
    decode: object
    base_err: float


def _probe(fast, model, role: str, Mmax: int, g, device, dtype, shape: tuple[int, int] | None = None) -> _RoleProbe:
    """The probe of ``role`` on the one-layer target (see :class:`_RoleProbe`); ``shape``: a weight
    of that shape instead (a family target's, :func:`family_role_shapes`; N(0, 0.02) from ``g``)."""
    L = model.model.layers[0]
    weights = {"qkv": (L.fused_qkv, L.input_layernorm.weight), "o": (L.self_attn.o_proj.weight, None),
               "gate_up": (L.fused_gate_up, L.post_attention_layernorm.weight),
               "down": (L.mlp.down_proj.weight, None), "lm_head": (model.lm_head.weight, model.model.norm.weight)}
    w, norm = weights[role]
    if shape is not None and tuple(w.shape) != tuple(shape):  # the norms (K = hidden) stay the stand-in's
        w = (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype)
    _, res, sw = role_layout(role)
    Kd = w.shape[1]
    N = w.shape[0] // 2 if sw else w.shape[0]
    x = torch.randn(Mmax, Kd, generator=g, device=device).to(dtype)
    r = torch.randn(Mmax, N, generator=g, device=device).to(dtype) if res else None
    ws = types.SimpleNamespace(xn=torch.empty(Mmax, Kd, dtype=dtype, device=device), gu=None, extra={})

    def call(c, xm, wm, out):
        # the engine's call of a Triton config (FastTarget._linear -> _apply); out holds the residual
        return fast._apply(c, xm, wm, out, ws, norm, out if res else None, sw)

    def fresh(lo, hi):
        return r[lo:hi].clone() if r is not None else torch.full((hi - lo, N), float("nan"), dtype=dtype, device=device)

    decode = fast.config_for(role, 1)
    alone = torch.empty(Mmax, N, dtype=dtype, device=device)  # each row by the decode config at M = 1
    for i in range(Mmax):
        alone[i:i + 1] = call(decode, x[i:i + 1], w, fresh(i, i + 1))
    xf = x.float()
    if norm is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * norm.float()
    ref = xf @ w.float().t()
    if sw:
        ref = torch.nn.functional.silu(ref[:, :N]) * ref[:, N:]
    if res:
        ref = ref + r.float()
    return _RoleProbe(role, call, fresh, x, w, alone, ref, decode, rel_err(alone, ref))


def _trial(pr: _RoleProbe, M: int, key: str, checks: list[int], tol: float, timed, wbytes: int,
           bandwidth: float | None) -> dict:
    """Check one candidate config (bit-equal rows, fp32 error) and time it when it passes."""
    t = {"role": pr.role, "rows": M, "config": key, "checked_rows": checks}
    try:
        c = LinearConfig.parse(key)
        eq, err = True, 0.0
        for m in checks:
            o = pr.call(c, pr.x[:m], pr.w, pr.fresh(0, m))
            eq &= bool(torch.equal(o, pr.alone[:m]))
            err = max(err, rel_err(o, pr.ref[:m]))
        t.update(bit_equal=eq, rel_err=err, passed=eq and err <= tol, us=None)
        if t["passed"]:
            t["us"] = float(timed(key))
            if bandwidth:
                t["bw_fraction"] = wbytes / (t["us"] * 1e-6) / bandwidth
    except Exception as e:  # noqa: BLE001 - a config that does not compile / launch is no candidate
        t.update(passed=False, us=None, error=f"{type(e).__name__}: {str(e)[:160]}")
    return t


def _tune_bucket(pr: _RoleProbe, M: int, lo: int, copies: list, tol: float, timer, opts: dict, log) -> tuple[dict, list]:
    """One (role, row bucket): the candidates checked and timed, the winner confirmed by a
    re-timing that alternates it with the default. Returns (summary row, trials)."""
    role, default = pr.role, DEFAULT_CONFIGS[pr.role][str(M)]
    checks = sorted({lo, M})
    out_t = pr.fresh(0, M)
    wbytes = pr.w.numel() * pr.w.element_size()

    def timed(key):
        c = LinearConfig.parse(key)
        return timer(key, [lambda c=c, wc=wc: pr.call(c, pr.x[:M], wc, out_t) for wc in copies])

    bucket = [_trial(pr, M, key, checks, tol, timed, wbytes, opts["bandwidth"])
              for key in candidate_linear_configs(role, M, opts["max_configs"])]

    def confirm(a, b):
        ta, tb = [], []
        try:
            for _ in range(opts["confirm_repeats"]):
                ta.append(float(timed(a)))
                tb.append(float(timed(b)))
        except Exception as e:  # noqa: BLE001 - an unconfirmed winner is no winner
            log(f"engine {role} M<={M}: re-timing failed ({type(e).__name__}: {e}); default kept")
            return 1.0, 1.0
        return statistics.median(ta), statistics.median(tb)

    chosen, why = pick_config(default, bucket, opts["min_gain"], confirm)
    d = next(t for t in bucket if t["config"] == default)
    ok = [t for t in bucket if t.get("passed") and t.get("us") is not None]
    best = min(ok, key=lambda t: t["us"]) if ok else None
    log(f"engine {role} M<={M}: default {default} {d.get('us') or float('nan'):.2f} us, "
        f"{len(ok)}/{len(bucket)} passed, chosen {chosen} ({why})")
    row = {"role": role, "rows": M, "default": default, "default_us": d.get("us"), "default_passed": d.get("passed"),
           "best": best and best["config"], "best_us": best and best["us"], "chosen": chosen, "why": why,
           "candidates": len(bucket), "passed": len(ok)}
    return row, bucket


def tune_engine_configs(cfg, device: torch.device | str = "cuda", rows: tuple[int, ...] = DEFAULT_TUNE_ROWS,
                        roles: tuple[str, ...] = LINEAR_ROLES, max_configs: int = 16, min_gain: float = 0.02,
                        dtype: torch.dtype = torch.bfloat16, seed: int = 0, bandwidth: float | None = None,
                        timer: Callable[[str, list], float] | None = None, confirm_repeats: int = 3,
                        log: Callable[[str], None] | None = None) -> dict:
    """Tune the engine's matmul tables of ``rows`` (a subset of :data:`TUNE_ROWS`) for ``roles`` of a
    target config ``cfg`` on this GPU (see the module docstring). A family target (Gated DeltaNet
    hybrid, Muse-Glimmer) is probed on its own role weights (:func:`family_role_shapes`, the shape
    with the most bytes per role) through the same matmul call, on a dense one-layer stand-in of its
    hidden size (:func:`_dense_stand_in`): its step's tables.

    ``max_configs``: candidates per (role, bucket), the default included. ``min_gain``: fraction by
    which a candidate must beat the default on the confirming re-timing (``confirm_repeats``
    alternating timings of each, medians). ``bandwidth``: the device's copy bandwidth in bytes/s
    (ceilings.json) to report each timing's fraction of. ``timer(key, fns) -> microseconds per
    call`` times the launches ``fns`` (one per weight copy) of config ``key``; default
    :func:`~specpilot.tuning.timing.graph_us` (CUDA). ``dtype``: bf16 on the GPU (fp32 for the CPU
    interpreter in tests).

    Returns:
        ``{"engine_configs": {role: {max_rows (str): key}} (only the entries that differ from
        DEFAULT_CONFIGS), "engine_summary": [per (role, bucket): role, rows, default, default_us,
        best, best_us, chosen, why], "engine_trials": [per candidate: role, rows, config,
        checked_rows, bit_equal, rel_err, passed, us (device microseconds per call), bw_fraction,
        error], "engine_shapes": {role: [N, K] of the weight probed}}``. A role whose decode
        config is itself off the fp32 reference is left at its defaults (a summary row with ``why``).

    Raises:
        SpecpilotError: the Triton step does not run the (stand-in) target, ``rows`` outside
            :data:`TUNE_ROWS`, an unknown role.
    """
    bad = [r for r in rows if r not in TUNE_ROWS]
    if bad or not rows:
        raise SpecpilotError(f"engine matmul tuning rows must be among {TUNE_ROWS}, got {tuple(rows)}")
    for role in roles:
        role_layout(role)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    device = torch.device(device)
    timer = timer or (lambda key, fns: graph_us(fns))
    opts = {"bandwidth": bandwidth, "max_configs": max_configs, "min_gain": min_gain, "confirm_repeats": confirm_repeats}
    rows = tuple(sorted(rows))
    shapes = role_shapes(cfg) if cfg.is_dense else family_role_shapes(cfg)
    model, fast = _one_layer_target(cfg if cfg.is_dense else _dense_stand_in(cfg), device, dtype, seed)
    l2 = (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)) \
        if device.type == "cuda" else 0
    table: dict[str, dict[str, str]] = {}
    summary, trials = [], []
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for role in roles:
            pr = _probe(fast, model, role, max(rows), g, device, dtype, None if cfg.is_dense else shapes[role])
            if not pr.base_err <= FP32_REL_TOL:
                summary.append({"role": role, "rows": None, "default": pr.decode.key(), "chosen": None,
                                "why": f"the decode config is off the fp32 reference (rel err {pr.base_err:.3g}); "
                                       "defaults kept"})
                log(f"engine {role}: decode config {pr.decode.key()} rel err {pr.base_err:.3g}: skipped")
                continue
            tol = max(FP32_REL_TOL, 1.5 * pr.base_err)
            wbytes = pr.w.numel() * pr.w.element_size()
            copies = [pr.w] + [pr.w.clone() for _ in range(max(1, min(8, -(-2 * l2 // wbytes))) - 1)] if l2 else [pr.w]
            lo = 1
            for M in rows:
                row, bucket = _tune_bucket(pr, M, lo, copies, tol, timer, opts, log)
                summary.append(row)
                trials += bucket
                if row["chosen"] != row["default"]:
                    table.setdefault(role, {})[str(M)] = row["chosen"]
                lo = M + 1
            del copies, pr
    del fast, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"engine_configs": table, "engine_summary": summary, "engine_trials": trials,
            "engine_shapes": {role: list(shapes[role]) for role in roles}}


def tune_drafter_configs(dcfg, vocab_size: int, target_configs: dict, rows: tuple[int, ...] = DEFAULT_TUNE_ROWS,
                         roles: tuple[str, ...] | None = None, **kw) -> dict:
    """The DFlash draft step's tables (issue 62): its layer roles of ``roles`` (default all but the LM
    head) tuned by :func:`tune_engine_configs` on the drafter's layer shapes (:func:`drafter_stand_in`;
    ``dcfg`` a :class:`~specpilot.models.dflash.DrafterConfig`), the LM head's entries the target's
    (``target_configs``: the target's ``engine_configs``; the draft step runs the same head weight).
    ``kw``: :func:`tune_engine_configs`'s options.

    Returns ``{"drafter_engine_configs", "drafter_engine_summary", "drafter_engine_shapes"}``."""
    layer_roles = tuple(r for r in (roles or LINEAR_ROLES) if r != "lm_head")
    t = tune_engine_configs(drafter_stand_in(dcfg, vocab_size), rows=rows, roles=layer_roles, **kw)
    table = dict(t["engine_configs"])
    if target_configs.get("lm_head"):
        table["lm_head"] = target_configs["lm_head"]
    return {"drafter_engine_configs": table, "drafter_engine_summary": t["engine_summary"],
            "drafter_engine_shapes": t["engine_shapes"]}

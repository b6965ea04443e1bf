"""12-bit weights inside the engine's CUDA-graph fast path: per matmul role, the fragment-ordered
tensor-core kernel (:mod:`specpilot.kernels.w12_mma`) or the bf16 step, as tuned on this GPU.

**One choice per role, not per M.** AR decodes one row, a verify step 16 (one request) or more;
the same prefix must give the same logits in either, or speculative outputs drift from AR's. The
w12 kernel's reduction order depends only on its K split, never on M (its launch shape, tiles per
warp x warps x unroll, may change with M; more than 64 rows run in chunks of 64); the bf16 step's
rows are M-invariant by its own construction. So a role chosen for w12 runs w12 with one split at
every M of a decode or verify step, and a role not chosen runs bf16 at every M; the choice is made
from the summed time over the widths the deployment runs (``widths``). Prefill matmuls (``last_only``
forwards) stay bf16: a prompt is prefilled by the same calls in every engine and in token forcing.
A w12 role sums the same exact products as bf16 in another order, so an engine with w12 roles is
compared to the bf16 weights by token forcing (near-tie classification), not bit for bit.

**Choice format** (``w12_choice`` of a kernel-agent.json): ``{role: {"split": s, "launch":
{max_rows: "t{tiles}-w{warps}-u{unroll}"}}}`` for the roles that run w12 (qkv, o, gate_up, down;
absent roles run bf16). An M uses the launch of the smallest ``max_rows`` >= min(M, 64), the largest
entry beyond them all.

:func:`tune_w12_choice` measures it per role on a one-layer random copy of the target (checks
before timing: :func:`check_split`); :func:`install_w12_choice` puts a choice into a target's step.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..errors import SpecpilotError

ROLES = ("qkv", "o", "gate_up", "down")  # matmul roles that may run w12 (lm_head stays bf16)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # launch-table rows tuned per split


@dataclass(frozen=True)
class W12Role:
    """How one role runs w12: the K ``split`` (fixes the bits) and launch shapes by row bucket.

    ``tiers``: ((max_rows, (tiles, warps, unroll)), ...) sorted by max_rows."""

    split: int
    tiers: tuple[tuple[int, tuple[int, int, int]], ...]

    def launch(self, rows: int) -> tuple[int, int, int]:
        """(tiles, warps, unroll) for a matmul of ``rows`` rows (chunks of 64 beyond 64)."""
        m = min(rows, 64)
        for max_rows, launch in self.tiers:
            if m <= max_rows:
                return launch
        return self.tiers[-1][1]

    def to_dict(self) -> dict:
        return {"split": self.split, "launch": {str(m): "t{}-w{}-u{}".format(*c) for m, c in self.tiers}}


def _launch_key(key: str, where: str) -> tuple[int, int, int]:
    try:
        t, w, u = key.split("-")
        if t[0] != "t" or w[0] != "w" or u[0] != "u":
            raise ValueError
        return int(t[1:]), int(w[1:]), int(u[1:])
    except (ValueError, IndexError, AttributeError):
        raise SpecpilotError(f"{where}: launch {key!r} is not 't<tiles>-w<warps>-u<unroll>'") from None


def parse_choice(choice, where: str = "w12_choice") -> dict[str, W12Role]:
    """Validate a ``w12_choice`` object (module docstring) into ``{role: W12Role}``.

    Raises:
        SpecpilotError: naming ``where`` and the unknown role, bad split, row count or launch.
    """
    from ..kernels.w12_mma import SPLITS, TILES, UNROLLS, WARPS

    if choice is None:
        return {}
    if not isinstance(choice, dict):
        raise SpecpilotError(f"{where} must be an object {{role: {{split, launch}}}}, got {type(choice).__name__}")
    out = {}
    for role, spec in choice.items():
        if role not in ROLES:
            raise SpecpilotError(f"{where} names role {role!r}; w12 roles: {', '.join(ROLES)}")
        if not isinstance(spec, dict) or not isinstance(spec.get("launch"), dict) or not spec["launch"]:
            raise SpecpilotError(f"{where}[{role!r}] must be {{'split': int, 'launch': {{max_rows: key}}}}, got {spec!r}")
        split = spec.get("split")
        if split not in SPLITS:
            raise SpecpilotError(f"{where}[{role!r}]: split {split!r} not among {SPLITS}")
        tiers = []
        for rows, key in spec["launch"].items():
            try:
                n = int(rows)
            except (TypeError, ValueError):
                n = 0
            if n < 1 or str(rows).strip() != str(n):
                raise SpecpilotError(f"{where}[{role!r}]: row count {rows!r} must be an integer >= 1")
            t, w, u = _launch_key(key, f"{where}[{role!r}][{rows!r}]")
            if t not in TILES or w not in WARPS or u not in UNROLLS:
                raise SpecpilotError(f"{where}[{role!r}][{rows!r}]: launch {key!r} outside tiles {TILES}, "
                                     f"warps {WARPS}, unroll {UNROLLS}")
            tiers.append((n, (t, w, u)))
        out[role] = W12Role(int(split), tuple(sorted(tiers)))
    return out


def role_weights(layer) -> dict[str, torch.Tensor]:
    """The engine's weight of each w12 role in one fused decoder layer (see ``fuse_weights``)."""
    return {"qkv": layer.fused_qkv, "o": layer.self_attn.o_proj.weight, "gate_up": layer.fused_gate_up,
            "down": layer.mlp.down_proj.weight}


def to_plain_linears(model: nn.Module) -> int:
    """Replace every :class:`~specpilot.w12.W12Linear` of ``model`` by an ``nn.Linear`` holding its
    exact bf16 weight (lossless: the format decodes bit for bit); returns how many it replaced.
    The fast path then packs the roles it runs in w12 from those weights again."""
    from ..w12 import W12Linear

    names = [n for n, m in model.named_modules() if isinstance(m, W12Linear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        m = getattr(owner, child)
        lin = nn.Linear(m.in_features, m.out_features, bias=False, device=m.w12_mant.device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(m.weight_bf16())
        setattr(owner, child, lin)
    return len(names)


def install_w12_choice(model, choice: dict[str, W12Role]) -> dict | None:
    """Run ``choice``'s roles in w12 inside ``model``'s Triton step (CUDA); returns what to record
    (``{role: split}``), or None when the model does not run the dense Triton step or the choice is
    empty. A model loaded with ``weight_format: w12`` (W12Linear modules) is first turned back into
    plain linears (:func:`to_plain_linears`); the fast step keeps both the bf16 weights (the roles
    and M it runs in bf16, the prefill) and the fragment-ordered w12 copies of the chosen roles.

    Raises:
        SpecpilotError: the w12 kernel library cannot be built or loaded, or the converted target
            still does not run the Triton step.
    """
    if not choice:
        return None
    from ..kernels_build import _runs_triton_step
    from .graphs import resolve_kernels

    w = model.lm_head.weight
    hd = model.config.head_dim
    if (w.device.type != "cuda" or not model.config.is_dense or hd & (hd - 1)
            or not set(model.config.layer_types) <= {"full_attention"}
            or resolve_kernels("auto", w.device, torch.bfloat16) != "triton"):
        return None  # checked before the conversion: a target the step cannot run stays in w12
    to_plain_linears(model)
    if not _runs_triton_step(model):
        raise SpecpilotError("w12 fast path: the target converted to plain linears still does not run the Triton step")
    from ..kernels import w12_mma
    from . import graphs

    w12_mma.load()
    sg = graphs.step_graphs(model, "triton")
    sg.fast.use_w12(choice)
    sg.cache.entries.clear()
    return {role: rc.split for role, rc in choice.items()}


# ----------------------------------------------------------------------------------------------
# checks and tuning (CUDA)

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def launches(m: int, k: int, split: int) -> list[tuple[int, int, int]]:
    """The (tiles, warps, unroll) launches the library has for ``m`` rows, K = ``k`` and ``split``."""
    from ..kernels.w12_mma import TILES, UNROLLS, WARPS, valid

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
    from ..kernels.w12_mma import matmul, reference_matmul

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
    e_ref = _rel(base, reference_matmul(x, f))
    e_true = _rel(base[fin], true[fin])
    e_cub = _rel(torch.mm(x, w.t())[fin], true[fin])
    if not (e_ref < 4e-3 and e_true < 2 * e_cub + 1e-4):
        why.append(f"error vs own fp32 reference {e_ref:.2e}, vs true {e_true:.2e} (cuBLAS bf16 {e_cub:.2e})")
    return {"ok": not why, "why": why[:8], "err_vs_reference": e_ref, "err_vs_true": e_true, "cublas_err_vs_true": e_cub}


def _bucket(m: int) -> int:
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


@torch.inference_mode()
def tune_w12_choice(cfg, widths: tuple[int, ...] = (16,), device: str | torch.device = "cuda",
                    roles: tuple[str, ...] = ROLES, min_gain: float = 0.02, seed: int = 0,
                    timer: Callable[[list], float] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Per role of a dense target config ``cfg``: does w12 (one split, launch per bucket) beat the
    engine's bf16 step over ``widths`` (the rows per decode / verify matmul the deployment runs,
    e.g. (16,) for one request verifying blocks of 16, (1,) for AR)? CUDA only.

    On a one-layer random copy (:func:`~specpilot.engine.matmul_tune._one_layer_target`, escapes
    planted), each role's whole call as the engine makes it is timed in CUDA graphs over enough
    weight copies to exceed the L2 cache: bf16 = ``FastTarget._apply`` with the config the step
    picks at that M (table entry, or the checked cuBLAS choice from 64 rows); w12 = RMSNorm, the
    w12 kernel, SwiGLU or the residual add (``FastTarget._w12_apply``). Every split is checked
    (:func:`check_split`) before it is timed; per split the fastest launch per bucket; the split
    with the least summed time over ``widths`` is the role's w12 family, chosen when it is at least
    ``min_gain`` faster in sum than bf16.

    Returns ``{"w12_choice": {role: W12Role.to_dict()}, "w12_choice_summary": [per role: role,
    widths, bf16_us {M: us}, w12_us {M: us} of the chosen split, split, speedup, chosen, why],
    "w12_choice_checks": {role: {split: check}}, "w12_choice_trials": [role, split, M, launch, us]}``.

    Raises:
        SpecpilotError: not CUDA, a non-dense config, a width < 1, an unknown role.
    """
    from ..kernels.w12_mma import SPLITS, frag_pack
    from ..w12 import pack
    from .graphs import CUBLAS, PaddedCublas
    from .matmul_tune import _one_layer_target, graph_us, role_layout

    device = torch.device(device)
    if device.type != "cuda":
        raise SpecpilotError("w12 choice tuning needs a CUDA device")
    if not cfg.is_dense:
        raise SpecpilotError("w12 choice tuning covers dense targets (the FastTarget step) only")
    if not widths or min(widths) < 1:
        raise SpecpilotError(f"w12 choice widths must be row counts >= 1, got {tuple(widths)}")
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise SpecpilotError(f"w12 choice roles must be among {ROLES}, got {bad}")
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    timer = timer or graph_us
    model, fast = _one_layer_target(cfg, device, torch.bfloat16, seed)
    layer = model.model.layers[0]
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    norms = {"qkv": layer.input_layernorm.weight, "gate_up": layer.post_attention_layernorm.weight}
    widths = tuple(sorted(set(int(m) for m in widths)))
    tiers_m = sorted({_bucket(m) for m in widths} | {64})  # 64: the launch of chunks beyond
    res = {"w12_choice": {}, "w12_choice_summary": [], "w12_choice_checks": {}, "w12_choice_trials": []}
    for role in roles:
        w0 = role_weights(layer)[role]
        plant_escapes(w0, seed=sum(map(ord, role)))
        n, k = w0.shape
        copies = int(min(8, max(2, math.ceil(4 * l2 / (2 * n * k)))))
        ws_ = [w0] + [w0.roll(i, 0).contiguous() for i in range(1, copies)]
        fs = [frag_pack(pack(w)) for w in ws_]
        has_norm, has_res, swiglu = role_layout(role)
        norm = norms.get(role) if has_norm else None
        nout = n // 2 if swiglu else n
        checks = {s: check_split(fs[0], w0, s) for s in SPLITS if launches(64, k, s)}
        res["w12_choice_checks"][role] = {str(s): c for s, c in checks.items()}
        for s, c in checks.items():
            if not c["ok"]:
                log(f"w12 choice {role}: split {s} fails its checks: {'; '.join(c['why'][:3])}")
        P = max(widths + (64,))
        g = torch.Generator(device=device).manual_seed(11)
        xs = torch.randn(P, k, generator=g, device=device).to(torch.bfloat16)
        outs = [torch.zeros(P, nout, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        scratch = _Scratch(P, k, n, device)
        bf16_us = {}
        for m in widths:
            x = xs[:m]
            cfg_m = fast._pick(role, x, w0, norm, outs[0][:m] if has_res else None, swiglu, room=m)
            cfg_m = CUBLAS if isinstance(cfg_m, PaddedCublas) else cfg_m
            bf16_us[m] = timer([lambda i=i, x=x, m=m, c=cfg_m: fast._apply(
                c, x, ws_[i], outs[i][:m], scratch, norm, outs[i][:m] if has_res else None, swiglu)
                for i in range(copies)])
        totals = {}
        for s in [s for s, c in checks.items() if c["ok"]]:
            tiers, t_w = [], {}
            for b in tiers_m:
                ms_b = [m for m in widths if _bucket(m) == b] or [b]
                best = None
                for c in launches(b, k, s):
                    rc = W12Role(s, ((64, c),))
                    per = {}
                    for m in ms_b:
                        x = xs[:m]
                        per[m] = timer([lambda i=i, x=x, m=m, rc=rc: fast._w12_apply(
                            rc, fs[i], x, outs[i][:m], scratch, norm, outs[i][:m] if has_res else None, swiglu)
                            for i in range(copies)])
                        res["w12_choice_trials"].append({"role": role, "split": s, "M": m,
                                                         "launch": "t{}-w{}-u{}".format(*c), "us": per[m]})
                    if best is None or sum(per.values()) < sum(best[1].values()):
                        best = (c, per)
                if best is None:
                    break
                tiers.append((b, best[0]))
                t_w.update({m: v for m, v in best[1].items() if m in widths})
            if len(tiers) == len(tiers_m):
                totals[s] = (sum(t_w.values()), W12Role(s, tuple(tiers)), t_w)
        row = {"role": role, "widths": list(widths), "bf16_us": {str(m): v for m, v in bf16_us.items()}}
        if not totals:
            row.update(chosen="bf16", why="no split passed its checks")
        else:
            s = min(totals, key=lambda s: totals[s][0])
            tw, rc, t_w = totals[s]
            tb = sum(bf16_us.values())
            row.update(split=s, w12_us={str(m): v for m, v in t_w.items()}, speedup=tb / tw)
            if tw < tb * (1 - min_gain):
                res["w12_choice"][role] = rc.to_dict()
                row.update(chosen="w12", why=f"{tb / tw:.3f}x bf16 summed over widths {list(widths)}")
            else:
                row.update(chosen="bf16", why=f"w12 {tb / tw:.3f}x bf16 over widths {list(widths)} "
                                              f"(needs {1 / (1 - min_gain):.3f}x)")
        log(f"w12 choice {role}: {row['chosen']} ({row['why']})")
        res["w12_choice_summary"].append(row)
        del fs, ws_, outs
    return res


class _Scratch:
    """The workspace fields ``FastTarget._apply`` / ``_w12_apply`` use (norm output, SwiGLU and w12
    output buffers) for a tuning call."""

    def __init__(self, rows: int, k: int, n: int, device):
        self.xn = torch.empty(rows, k, dtype=torch.bfloat16, device=device)
        self.gu = None
        self.w12y = torch.empty(rows * n, dtype=torch.bfloat16, device=device)  # flat, as FastTarget's

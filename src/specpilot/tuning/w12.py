"""The fast path's 12-bit roles, chosen per matmul role and row count on the GPU they run on (the
kernel sub-agent's ``w12_choice``, :mod:`specpilot.fastpath.w12`).

Both loaders of the step's Triton matmul give the same bits, so the choice is about speed only.
:func:`tune_w12_choice` takes the target's real (fused) role shapes (every layer kind of a dense,
hybrid or sliding-window target: :func:`role_shapes`), and for each role and row count M of
``widths``:

1. the bf16 call the step makes at M: the role's table config (``DEFAULT_CONFIGS`` or the
   installed engine tables; a ``cublas`` entry keeps the role bf16 at M);
2. candidate 12-bit configs: the same config, then the bucket's other candidates of
   :func:`specpilot.tuning.matmul.candidate_linear_configs` (same norm placement); each is
   checked before it is timed: its output bit-equal to the bf16 call's on a probe of M rows and on
   the bucket's smallest row count (the K sum of every config of this kernel is the same MMA k16
   steps in the same order, so only a wrong loader, or hardware that sums otherwise, fails);
3. times in CUDA graphs over weight copies beyond the L2 cache (a step streams every weight), summed
   over the role's shapes weighted by their layer counts; the role runs w12 at M (with the fastest
   passing config) when that sum beats bf16's by ``min_gain``.

A role w12 at every M keeps no bf16 copy in the engine (1.5 bytes per weight instead of 2); the
summary says which.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable

import torch

from ..errors import SpecpilotError
from ..fastpath.tables import CUBLAS, DEFAULT_CONFIGS, LinearConfig, config_tiers, role_layout, tier_for
from ..fastpath.w12 import ROLES, role_groups
from ..models.qwen3 import Transformer
from ..w12.planes import planes_of
from .timing import graph_us


@torch.no_grad()
def plant_escapes(w: torch.Tensor, seed: int = 0) -> None:
    """Write values the 12-bit format must escape (zeros, subnormals, outliers) into ~0.02 % of
    ``w`` in place (a random-weight copy has few, a real checkpoint some)."""
    n = w.numel()
    g = torch.Generator(device=w.device).manual_seed(seed)
    idx = torch.randint(0, n, (max(8, n // 5000),), device=w.device, generator=g)
    vals = torch.tensor([0.0, -0.0, 1e-30, 300.0, -2e4, 1e-40, 65504.0, -1e-38], device=w.device)
    w.view(-1)[idx] = vals.repeat(idx.numel() // 8 + 1)[: idx.numel()].to(w.dtype)


def role_shapes(cfg) -> dict[str, list[tuple[int, int, int]]]:
    """The fast path's fused weight shapes of each w12 role of a target config (any family): ``{role:
    [(N rows, K columns, layers with that shape), ...]}``, from one layer of each kind built on the
    meta device (grouped as :func:`specpilot.fastpath.w12.prepare` groups them)."""
    kinds = list(dict.fromkeys(cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers))
    counts = {k: (cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers).count(k) for k in kinds}
    out: dict[str, dict[tuple[int, int], int]] = {r: {} for r in ROLES}
    for kind in kinds:
        idx = (cfg.layer_types or []).index(kind) if cfg.layer_types else 0
        one = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=[kind] if cfg.layer_types else [],
                                  layer_rope=[cfg.layer_rope[idx]] if cfg.layer_rope else [])
        with torch.device("meta"):
            layer = Transformer(one).model.layers[0]
        for role, _, owner, names in role_groups(layer):
            mods = [getattr(owner, n) for n in names]
            shape = (sum(m.out_features for m in mods), mods[0].in_features)
            out[role][shape] = out[role].get(shape, 0) + counts[kind]
    return {r: [(n, k, c) for (n, k), c in v.items()] for r, v in out.items()}


class _Probe:
    """One (role, shape): weight copies beyond the L2 cache and their tile planes, the step's
    epilogue arguments, a seeded input and the bf16 call at each checked row count."""

    def __init__(self, role: str, n: int, k: int, device, l2: int, seed: int):
        self.role = role
        norm_before, self.res, self.swiglu = role_layout(role)
        g = torch.Generator(device=device).manual_seed(seed)
        w0 = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
        plant_escapes(w0, seed=seed)
        copies = int(min(8, max(2, math.ceil(4 * l2 / (2 * n * k))))) if l2 else 1
        self.ws = [w0] + [w0.roll(i, 0).contiguous() for i in range(1, copies)]
        self.ps = [planes_of(w) for w in self.ws]
        self.norm = (1.0 + 0.1 * torch.randn(k, device=device, generator=g)).to(torch.bfloat16) if norm_before else None
        self.n_out = n // 2 if self.swiglu else n
        self.x = torch.randn(64, k, device=device, generator=g).to(torch.bfloat16)
        self.r = torch.randn(64, self.n_out, device=device, generator=g).to(torch.bfloat16)
        self.outs = [torch.zeros(64, self.n_out, device=device, dtype=torch.bfloat16) for _ in self.ws]

    def call(self, K, cfg: LinearConfig, m: int, i: int = 0, w12: bool = False, out=None):
        """The step's call of a Triton config on ``m`` rows (prenorm as the step runs it)."""
        x, norm = self.x[:m], self.norm
        if cfg.prenorm and norm is not None:
            x, norm = K.rmsnorm(x, norm, torch.empty_like(x), 1e-6), None
        if out is None:
            out = self.r[:m].clone() if self.res else torch.empty(m, self.n_out, device=x.device, dtype=x.dtype)
        w = self.ps[i] if w12 else self.ws[i]
        return K.linear(x, w, out, cfg=cfg, norm=norm, eps=1e-6, residual=out if self.res else None,
                        swiglu=self.swiglu)

    def timed(self, K, cfg: LinearConfig, m: int, w12: bool, timer) -> float:
        return timer([lambda i=i: self.call(K, cfg, m, i, w12, self.outs[i][:m]) for i in range(len(self.ws))])


def _candidates(role: str, m: int, table_cfg: LinearConfig, limit: int) -> list[LinearConfig]:
    from .matmul import candidate_linear_configs  # the Triton step: an optional dependency

    keys = [table_cfg.key()] + [k for k in candidate_linear_configs(role, min(m, 64), limit) if k != table_cfg.key()]
    out = []
    for key in keys[:limit]:
        c = LinearConfig.parse(key)
        if c.prenorm == table_cfg.prenorm:
            out.append(c)
    return out


def _bucket(role: str, m: int, probes: list[tuple[_Probe, int]], table_cfg, K, timer, min_gain: float,
            limit: int, lo: int, trials: list) -> dict:
    """One (role, row count): the bf16 call and the 12-bit candidates checked and timed (module
    docstring). Returns the summary row with ``value`` ("bf16" / "w12" / "w12:<key>")."""
    row = {"role": role, "rows": m, "table_config": table_cfg.key()}
    bf = sum(c * p.timed(K, table_cfg, m, False, timer) for p, c in probes)
    row["bf16_us"] = bf
    best = None
    for cand in _candidates(role, m, table_cfg, limit):
        t = {"role": role, "rows": m, "config": cand.key()}
        try:
            ok = all(torch.equal(p.call(K, cand, r, w12=True).view(torch.int16),
                                 p.call(K, table_cfg, r).view(torch.int16)) for p, _ in probes for r in sorted({lo, m}))
            t["bit_equal"] = ok
            if ok:
                t["us"] = sum(c * p.timed(K, cand, m, True, timer) for p, c in probes)
                if best is None or t["us"] < best[1]:
                    best = (cand, t["us"])
        except Exception as e:  # noqa: BLE001 - a config that does not compile / launch is no candidate
            t.update(bit_equal=False, error=f"{type(e).__name__}: {str(e)[:160]}")
        trials.append(t)
    if best is None:
        return {**row, "value": "bf16", "why": "no 12-bit config was bit-equal to the bf16 call"}
    cand, w = best
    row.update(w12_us=w, w12_config=cand.key(), speedup=bf / w)
    if w < bf * (1 - min_gain):
        value = "w12" if cand == table_cfg else f"w12:{cand.key()}"
        return {**row, "value": value, "why": f"{bf / w:.3f}x bf16"}
    return {**row, "value": "bf16", "why": f"w12 {bf / w:.3f}x bf16 (needs {1 / (1 - min_gain):.3f}x)"}


@torch.inference_mode()
def tune_w12_choice(cfg, widths: tuple[int, ...] = (1, 4, 16, 64), device: str | torch.device = "cuda",
                    roles: tuple[str, ...] = ROLES, tables: dict | None = None, min_gain: float = 0.02,
                    max_configs: int = 6, seed: int = 0, timer: Callable[[list], float] | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """Per role of target config ``cfg`` and row count of ``widths`` (the rows per decode / verify
    matmul the deployment runs), whether the step runs the 12-bit loader, and with which config
    (module docstring). CUDA (the CPU interpreter only with a ``timer``, for tests).

    ``tables``: the engine's matmul tables (``{role: key or {max_rows: key}}``; default
    ``DEFAULT_CONFIGS``). ``max_configs``: 12-bit configs tried per (role, M), the table's first.

    Returns ``{"w12_choice": {role: {max_rows: value}} (roles with a w12 entry), "w12_choice_summary":
    [per (role, M): role, rows, table_config, bf16_us, w12_us, w12_config, speedup, value, why;
    microseconds summed over the role's layers], "w12_choice_lean": [roles w12 at every M],
    "w12_choice_trials": [per candidate: role, rows, config, bit_equal, us, error]}``.

    Raises:
        SpecpilotError: no CUDA (and no timer), a width outside 1 .. 256, an unknown role.
    """
    device = torch.device(device)
    if device.type != "cuda" and timer is None:
        raise SpecpilotError("w12 choice tuning needs a CUDA device")
    if not widths or min(widths) < 1 or max(widths) > 256:
        raise SpecpilotError(f"w12 choice widths must be row counts in 1 .. 256, got {tuple(widths)}")
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise SpecpilotError(f"w12 choice roles must be among {ROLES}, got {bad}")
    from ..kernels import step as K  # the Triton step: an optional dependency

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    timer = timer or graph_us
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    tiers = {r: config_tiers((tables or {}).get(r, DEFAULT_CONFIGS[r])) for r in roles}
    shapes = role_shapes(cfg)
    widths = tuple(sorted(set(int(m) for m in widths)))
    res = {"w12_choice": {}, "w12_choice_summary": [], "w12_choice_lean": [], "w12_choice_trials": []}
    for role in roles:
        probes = [(_Probe(role, n, k, device, l2, seed + i), c) for i, (n, k, c) in enumerate(shapes[role])]
        entries, lo = {}, 1
        for m in widths:
            table_cfg = tier_for(tiers[role], m)
            if table_cfg == CUBLAS:
                row = {"role": role, "rows": m, "table_config": CUBLAS, "value": "bf16", "why": "a cuBLAS table entry"}
            else:
                row = _bucket(role, m, probes, table_cfg, K, timer, min_gain, max_configs, lo,
                              res["w12_choice_trials"])
            lo = m + 1
            entries[str(m)] = row["value"]
            res["w12_choice_summary"].append(row)
            log(f"w12 choice {role} M={m}: {row['value']} ({row['why']})")
        if any(v != "bf16" for v in entries.values()):
            res["w12_choice"][role] = entries
            if all(v != "bf16" for v in entries.values()):
                res["w12_choice_lean"].append(role)
        del probes
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res

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

:func:`specpilot.tuning.w12.tune_w12_choice` measures it per role on a one-layer random copy of the
target; the backend (:func:`specpilot.engine.backend.choose_backend`) puts a choice into a
target's step through :class:`W12Roles`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import SpecpilotError
from ..kernels import w12_mma
from ..kernels.w12_mma import SPLITS, TILES, UNROLLS, WARPS
from ..w12 import W12Linear, pack

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



class W12Roles:
    """The roles of one fast step that run the 12-bit kernel: the choice and the fragment-packed
    weights (lossless copies of the bf16 weights the step keeps for prefill and other roles).

    Args:
        layers: the target's decoder layers (fused: ``fused_qkv``, ``fused_gate_up``).
        choice: ``{role: W12Role}`` (:func:`parse_choice`); CUDA only (the kernel library is loaded).
    Raises:
        SpecpilotError: a role outside :data:`ROLES`, or a launch the library lacks for a weight's K
            (:func:`specpilot.kernels.w12_mma.valid`).
    """

    def __init__(self, layers, choice: dict[str, W12Role]):
        bad = [r for r in choice if r not in ROLES]
        if bad:
            raise SpecpilotError(f"w12 roles must be among {ROLES}, got {bad}")
        for role, w in role_weights(layers[0]).items():
            rc = choice.get(role)
            # each launch at its bucket's rows (valid there: valid at fewer), the last also at 64
            # (it runs every 64-row chunk beyond the table)
            checks = [(min(r, 64), c) for r, c in rc.tiers] + [(64, rc.tiers[-1][1])] if rc is not None else []
            for m, (tn, warps, unroll) in checks:
                if not w12_mma.valid(m, rc.split, tn, warps, unroll, w.shape[1]):
                    raise SpecpilotError(f"w12 role {role}: no kernel for split {rc.split}, tiles {tn}, warps "
                                         f"{warps}, unroll {unroll} at {m} rows (K = {w.shape[1]}); see w12_mma.valid")
        self.choice = dict(choice)
        self.packed = {}  # weight data_ptr -> FragW12
        for layer in layers:
            for role, w in role_weights(layer).items():
                if role in choice:
                    self.packed[w.data_ptr()] = w12_mma.frag_pack(pack(w.detach()))

    def splits(self) -> dict[str, int]:
        """``{role: split}`` (what the records show)."""
        return {role: rc.split for role, rc in self.choice.items()}

    def apply(self, step, role: str, x, w, out, ws, norm=None, residual=None, swiglu=False):
        """``out = epilogue(norm(x) @ W.T)`` with ``w`` in w12 when ``role`` runs w12 and ``w`` was
        packed (:func:`w12_apply`); returns ``out``, or None when this call stays bf16."""
        rc = self.choice.get(role)
        f = self.packed.get(w.data_ptr()) if rc is not None else None
        if f is None:
            return None
        return w12_apply(step, rc, f, x, out, ws, norm, residual, swiglu)


def w12_apply(step, rc: W12Role, f, x: torch.Tensor, out: torch.Tensor, ws, norm=None, residual=None,
              swiglu: bool = False) -> torch.Tensor:
    """``out = epilogue(norm(x) @ W.T)`` with W in w12 (``f``, a FragW12) through launch family ``rc``:
    the RMSNorm and SwiGLU kernels of the bf16 cuBLAS variant of ``step`` (a FastTarget), the w12
    tensor-core matmul into the workspace buffer ``ws.extra["w12y"]``, then SwiGLU or ``out += y``
    (``residual`` is ``out``). x [M, K] bf16; out [M, N]. Returns ``out``."""
    K = step.k
    M = x.shape[0]
    if norm is not None:
        x = K.rmsnorm(x, norm, ws.xn[:M], step.model.config.rms_norm_eps)
    launch = rc.launch(M)
    if residual is None and not swiglu:
        return w12_mma.matmul(x, f, rc.split, *launch, out=out)
    need = M * f.shape[0]
    buf = ws.extra.get("w12y")  # flat: the kernel writes rows of exactly N columns
    if buf is None or buf.numel() < need:
        buf = ws.extra["w12y"] = torch.empty(need, dtype=x.dtype, device=x.device)
    y = buf[:need].view(M, f.shape[0])
    w12_mma.matmul(x, f, rc.split, *launch, out=y)
    if swiglu:
        return K.silu_mul(y, out)
    return out.add_(y)

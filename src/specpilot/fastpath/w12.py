"""12-bit weights in the engine's fast path: matmul roles whose weight is held as lossless 12-bit
tile planes and multiplied by the bf16 Triton kernel with the 12-bit loader.

**Same kernel, another loader.** A 12-bit role runs :func:`specpilot.kernels.step.linear` with
the same config (tiles, K order, no split, prologue, epilogues) the bf16 step runs at that row
count; only the weight tile is decoded in registers from the planes instead of loaded
(:mod:`specpilot.w12.planes`). The decoded values are the bf16 weights' bits, so the step's logits
are the bf16 step's bit for bit at every M, and a w12 engine is token-forced against the bf16
teacher-forced pass with margins exactly 0. Prefill matmuls that run cuBLAS on the bf16 weights
(>= 64 rows on a GPU) run the same cuBLAS call on the weight decoded into a scratch buffer.

**Choice** (``w12_choice``, tuned per GPU and shape by :func:`specpilot.tuning.w12.tune_w12_choice`):
``{role: value | {max_rows: value}}`` over :data:`ROLES`, a value being ``"bf16"``, ``"w12"``
(the 12-bit loader with the step's table config at that M) or ``"w12:<config key>"`` (with
another :class:`~specpilot.fastpath.tables.LinearConfig`: the tuner takes one only after every
output row was bit-equal to the bf16 step's on the GPU: the configs of this kernel differ in
tiles, not in the order of the K sum, which is the MMA's k16 steps ascending into one fp32
accumulator); a role's matmul of M rows uses the entry with the smallest ``max_rows`` >= M (the
largest beyond them all). Since both give the same bits, the choice per role and M is only about
speed. A role that is w12 at every M
keeps no bf16 copy (:func:`prepare` frees it: 1.5 bytes per weight instead of 2); a role that is
bf16 at some M keeps both.

:func:`prepare` converts a loaded target (dense or hybrid / sliding-window family, or a DFlash
drafter's layers) in place, layer by layer (peak memory: the bf16 model plus one layer's planes):
the role's fused weight (``fused_qkv``, ``fused_in``, ``fused_gate_up``) becomes a
:class:`W12Weight`, and its linear modules :class:`PlanesLinear` views, whose eager forward decodes
exactly (so the eager forward, token forcing's eager pass and trees that run eagerly keep working
and give the bf16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..w12 import W12Linear, pack
from ..w12.planes import TilePlanes, decode_planes, tile_planes
from .tables import LinearConfig

ROLES = ("qkv", "o", "gate_up", "down")  # the target's matmul roles that may run w12 (lm_head stays bf16)
CHOICES = ("w12", "bf16")
ALL = 1 << 30  # max_rows of a one-entry table


@dataclass
class W12Weight:
    """A matmul role's weight ``[N, K]`` as 12-bit tile planes, with its bf16 copy when kept.

    Attributes:
        planes: :class:`~specpilot.w12.planes.TilePlanes`; dense: the bf16 weight or None.
    """

    planes: TilePlanes
    dense: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.planes.shape)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.planes.device

    def numel(self) -> int:
        return self.planes.shape[0] * self.planes.shape[1]

    def rows(self, lo: int, hi: int) -> "W12Weight":
        """Rows ``lo .. hi-1`` (views)."""
        return W12Weight(self.planes.rows(lo, hi), self.dense[lo:hi] if self.dense is not None else None)

    def bf16(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exact bf16 weight: the kept copy, else decoded into ``out`` (or a new tensor) by the
        matmul kernel's decode on CUDA, by the PyTorch reference elsewhere."""
        if self.dense is not None:
            return self.dense
        if self.device.type == "cuda":
            from ..kernels import step  # Triton: an optional dependency

            return step.decode(self.planes, out)
        d = decode_planes(self.planes)
        return out.copy_(d) if out is not None else d

    def nbytes(self) -> int:
        """Bytes held: the planes, plus the bf16 copy when kept."""
        return self.planes.nbytes() + (self.dense.numel() * 2 if self.dense is not None else 0)


class PlanesLinear(nn.Module):
    """A bias-free linear layer whose weight is a :class:`W12Weight` (a role prepared for the fast
    path): ``.weight`` is that object; the eager forward is ``F.linear(x, weight.bf16())``, exact
    (the kept bf16 copy, or the weight decoded for the call)."""

    def __init__(self, w: W12Weight):
        super().__init__()
        self.w12 = w
        self.out_features, self.in_features = w.shape
        self.bias = None

    @property
    def weight(self) -> W12Weight:
        return self.w12

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise SpecpilotError(f"w12: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        w = self.w12.bf16()
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w12, " \
               f"bf16 kept={self.w12.dense is not None}"


def _value(v, where: str) -> tuple[str, LinearConfig | None]:
    if v in CHOICES:
        return v, None
    if isinstance(v, str) and v.startswith("w12:"):
        try:
            return "w12", LinearConfig.parse(v[4:])
        except ValueError as e:
            raise SpecpilotError(f"{where}: {v!r}: {e}") from None
    raise SpecpilotError(f"{where}: {v!r} is not 'w12', 'bf16' or 'w12:<config key>'")


def parse_choice(choice, where: str = "w12_choice") -> dict[str, tuple]:
    """Validate a ``w12_choice`` (module docstring) into ``{role: ((max_rows, "w12" | "bf16",
    LinearConfig or None), ...)}`` sorted by max_rows (roles absent or all-bf16 left out). None or
    ``{}``: no w12 role.

    Raises:
        SpecpilotError: naming ``where`` and the unknown role, bad row count or value.
    """
    if choice is None:
        return {}
    if not isinstance(choice, dict):
        raise SpecpilotError(f"{where} must be an object {{role: 'w12' | 'bf16' | {{max_rows: ...}}}}, "
                             f"got {type(choice).__name__}")
    out = {}
    for role, spec in choice.items():
        if role not in ROLES:
            raise SpecpilotError(f"{where} names role {role!r}; w12 roles: {', '.join(ROLES)}")
        table = spec if isinstance(spec, dict) else {str(ALL): spec}
        if not table:
            raise SpecpilotError(f"{where}[{role!r}] is an empty table")
        tiers = []
        for rows, v in table.items():
            try:
                n = int(rows)
            except (TypeError, ValueError):
                n = 0
            if n < 1 or str(rows).strip() != str(n):
                raise SpecpilotError(f"{where}[{role!r}]: row count {rows!r} must be an integer >= 1")
            tiers.append((n, *_value(v, f"{where}[{role!r}][{rows!r}]")))
        tiers = tuple(sorted(tiers, key=lambda t: t[0]))
        if any(v == "w12" for _, v, _ in tiers):
            out[role] = tiers
    return out


def every_role() -> dict[str, tuple]:
    """The parsed choice with every role in w12 at every row count (no bf16 copy kept)."""
    return {role: ((ALL, "w12", None),) for role in ROLES}


def _json_value(v: str, cfg: LinearConfig | None) -> str:
    return f"w12:{cfg.key()}" if cfg is not None else v


def choice_json(parsed: dict[str, tuple]) -> dict:
    """The JSON form of a parsed choice (inverse of :func:`parse_choice`)."""
    return {role: (_json_value(t[0][1], t[0][2]) if len(t) == 1 and t[0][0] == ALL
                   else {str(m): _json_value(v, c) for m, v, c in t})
            for role, t in parsed.items()}


def tier(tiers: tuple, rows: int) -> tuple[str, LinearConfig | None]:
    """``("w12" | "bf16", config or None)`` of a role with ``tiers`` for a matmul of ``rows`` rows."""
    for max_rows, v, cfg in tiers:
        if rows <= max_rows:
            return v, cfg
    return tiers[-1][1], tiers[-1][2]


def runs_w12(tiers: tuple, rows: int) -> bool:
    """Whether a role with ``tiers`` runs w12 for a matmul of ``rows`` rows."""
    return tier(tiers, rows)[0] == "w12"


def lean(tiers: tuple) -> bool:
    """True when the role runs w12 at every row count (its bf16 copy is not kept)."""
    return all(v == "w12" for _, v, _ in tiers)


def role_groups(layer) -> list[tuple[str, str | None, nn.Module, list[str]]]:
    """The matmul roles of one decoder layer (a dense, hybrid GDN or sliding-window target's, or a
    DFlash drafter's) as the fast path fuses them: ``(role, attribute of the fused weight or None
    for a one-module role, owner module, member linear names in fused order)``."""
    kind = getattr(layer, "kind", "full_attention")
    if kind == "linear_attention":
        g = layer.linear_attn
        out = [("qkv", "fused_in", g, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]),
               ("o", None, g, ["out_proj"])]
    else:
        a = layer.self_attn
        extra = ["gate_proj"] if getattr(a, "gate", None) == "proj" else []
        out = [("qkv", "fused_qkv", a, ["q_proj", "k_proj", "v_proj"] + extra), ("o", None, a, ["o_proj"])]
    return out + [("gate_up", "fused_gate_up", layer.mlp, ["gate_proj", "up_proj"]),
                  ("down", None, layer.mlp, ["down_proj"])]


def _bf16_weight(mod: nn.Module) -> torch.Tensor:
    """The exact bf16 weight of a linear module (plain, checkpoint-format 12-bit, or prepared)."""
    if isinstance(mod, W12Linear):
        return mod.weight_bf16()
    if isinstance(mod, PlanesLinear):
        return mod.w12.bf16()
    if type(mod) is nn.Linear and mod.bias is None:
        return mod.weight.detach()
    raise SpecpilotError(f"w12 fast path: cannot read the weight of a {type(mod).__name__}")


def _bf16_values(w: torch.Tensor) -> torch.Tensor:
    """``w`` as bf16, exactly: a bf16 weight, or an fp32 one that holds bf16 values (the CPU
    interpreter's models, whose kernels compute in fp32). Raises SpecpilotError otherwise."""
    if w.dtype == torch.bfloat16:
        return w.contiguous()
    b = w.to(torch.bfloat16)
    if w.dtype != torch.float32 or not torch.equal(b.to(w.dtype), w):
        raise SpecpilotError(f"w12 roles need bf16 weights (or fp32 holding bf16 values), got {w.dtype} values "
                             "that bf16 does not hold")
    return b.contiguous()


def _plain(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


@torch.no_grad()
def _prepare_group(layer, attr: str | None, owner: nn.Module, names: list[str], tiers) -> int:
    """One fused group of one layer (see :func:`prepare`); returns the bf16 bytes freed."""
    mods = [getattr(owner, n) for n in names]
    fused = getattr(layer, attr, None) if attr else None
    if isinstance(fused, W12Weight) or (attr is None and isinstance(mods[0], PlanesLinear)):
        return 0  # prepared before
    if isinstance(fused, torch.Tensor):
        w = fused  # fused before (the members are views of it)
    elif attr is None:
        w = _bf16_weight(mods[0])
        if type(mods[0]) is not nn.Linear:
            setattr(owner, names[0], _plain(w))
    else:  # fuse: the members become views of one tensor, as fastpath.dense.fuse_linears does
        w = torch.cat([_bf16_weight(m) for m in mods], 0)
        o = 0
        for n, m in zip(names, mods):
            setattr(owner, n, _plain(w[o:o + m.out_features]))
            o += m.out_features
    if not tiers:  # a bf16 role: its fused tensor, as the bf16 step keeps it
        if attr is not None:
            setattr(layer, attr, w)
        return 0
    keep = not lean(tiers)
    ww = W12Weight(tile_planes(pack(_bf16_values(w))), w if keep else None)
    o = 0
    for n in names:
        rows = getattr(owner, n).out_features
        setattr(owner, n, PlanesLinear(ww if len(names) == 1 else ww.rows(o, o + rows)))
        o += rows
    if attr is not None:
        setattr(layer, attr, ww)
    return 0 if keep else w.numel() * 2


@torch.no_grad()
def prepare_layers(layers, choice: dict[str, tuple]) -> dict:
    """:func:`prepare` over decoder layers (a target's, or a DFlash drafter's), in place."""
    freed = packed = 0
    for layer in layers:
        for role, attr, owner, names in role_groups(layer):
            tiers = choice.get(role)
            freed += _prepare_group(layer, attr, owner, names, tiers)
            packed += bool(tiers)
    return {"roles": sorted(choice), "weights_converted": packed, "bf16_bytes_freed": freed}


@torch.no_grad()
def prepare(model, choice: dict[str, tuple]) -> dict:
    """Convert a loaded target's matmul roles in place for the fast path (module docstring): every
    layer's groups fused, the roles of ``choice`` (:func:`parse_choice`) held as :class:`W12Weight`
    (without their bf16 copy where they run w12 at every M). Linear modules in the checkpoint's
    12-bit format (:class:`~specpilot.w12.W12Linear`) are decoded layer by layer first. The step
    built afterwards (:class:`~specpilot.fastpath.dense.FastTarget` or its family subclass) finds
    the layers fused and the weights converted.

    Returns:
        ``{"roles", "weights_converted", "bf16_bytes_freed"}``.
    Raises:
        SpecpilotError: a projection the fast path cannot read (a bias, another module type).
    """
    stats = prepare_layers(model.model.layers, choice)
    if model.config.is_dense:
        model._fused_weights = True
    else:
        model._fused_family = True
    if isinstance(model.lm_head, W12Linear):
        lin = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False,
                        device=model.lm_head.w12_mant.device, dtype=torch.bfloat16)
        lin.weight = nn.Parameter(model.lm_head.weight_bf16(), requires_grad=False)
        model.lm_head = lin
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats


def w12_bytes(model) -> int:
    """Bytes of the 12-bit planes held by a prepared model's roles (each weight once)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, PlanesLinear):
            p = m.w12.planes
            key = (p.mant.data_ptr(), p.codes.data_ptr())
            if key not in seen:
                seen.add(key)
                total += p.nbytes()
    return total

"""The tile planes of a 12-bit weight: the layout the engine's matmul kernel decodes in registers.

:class:`TilePlanes` is the in-memory layout :func:`specpilot.kernels.step.linear` reads when its
weight is 12-bit (the bf16 kernel with another loader, ``W12`` in ``_linear_kernel``). It holds the
same 12 bits per weight as the checkpoint format (:mod:`specpilot.w12.format`: one sign+mantissa
byte and one 4-bit exponent code, ``exponent = base + code``), viewed as words, plus one change
for the escapes:

* ``mant`` uint8 ``[N, K]``: the sign+mantissa bytes in natural order (the format stores the
  middle bytes of each 4 swapped, for its own reference decoder);
* ``codes`` int32 ``[N, K/8]``: the format's 4 code bytes of each group of 8 weights as one word
  (nibbles of elements 0, 4, 1, 5 in ``C & 0x0F0F0F0F``, of 2, 6, 3, 7 in ``(C >> 4) & 0x0F0F0F0F``);
* **escape groups**: a group with any escaped weight (zero, subnormal, or an exponent outside
  ``base + 1 .. base + 15``: about 1.5e-4 of N(0, 0.02) weights) has its code word set to 0 (no
  other group has one: every code of a plain group is 1..15) and its first 4 ``mant`` bytes set
  to the byte offset ``16 e`` of its entry in ``side`` (little-endian int32), which holds its 8
  exact bf16 values in natural order
  (``side`` int32 ``[4 E]``: 4 words per escape group). The kernel decodes every group, then
  loads 16 bytes from ``side`` only for the groups whose code word is 0 (a predicated load: no
  memory traffic for the others) and takes them instead.

Bytes a kernel moves per weight: 1 (``mant``) + 0.5 (``codes``) + 16 / 8 per weight of an escape
group (``nbytes``). Escapes after Turbo-Lossless (cenconq25/Turbo-Lossless: a code reserved for
escapes, exact values on the side); the per-group patch before the product, instead of a
correction after it, is what keeps the product bit-identical to the bf16 kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecpilotError
from .format import GROUP, W12Tensor, _check_w12, natural_fields, pack


@dataclass
class TilePlanes:
    """One bf16 matrix ``[N, K]`` in the kernel's tile layout (module docstring).

    Attributes:
        mant: uint8 ``[N, K]``; codes: int32 ``[N, K/8]``; side: int32 ``[max(4, 4 E)]``;
        base: int in 0..239; shape: ``(N, K)``; escape_groups: E.
    """

    mant: torch.Tensor
    codes: torch.Tensor
    side: torch.Tensor
    base: int
    shape: tuple[int, int]
    escape_groups: int

    @property
    def device(self) -> torch.device:
        return self.mant.device

    def nbytes(self) -> int:
        """Bytes the planes occupy (and a product of one row tile reads): 1.5 per weight + 16 per
        escape group."""
        return self.mant.numel() + self.codes.numel() * 4 + 16 * self.escape_groups

    def base2(self) -> int:
        """The base exponent at bits 7-14 and 23-30 of an int32 (signed), as the kernel adds it."""
        return _i32(int(self.base) * 0x00800080)

    def rows(self, lo: int, hi: int) -> "TilePlanes":
        """The planes of rows ``lo .. hi-1`` (views; the escape groups keep their side entries)."""
        return TilePlanes(self.mant[lo:hi], self.codes[lo:hi], self.side, self.base, (hi - lo, self.shape[1]),
                          self.escape_groups)


def tile_planes(t: W12Tensor) -> TilePlanes:
    """The tile planes of a packed matrix (same bytes; escape groups moved to ``side``).

    Args:
        t: a :class:`~specpilot.w12.format.W12Tensor` ``[N, K]`` (K a multiple of 8).
    Returns:
        :class:`TilePlanes` on ``t``'s device.
    Raises:
        SpecpilotError: an inconsistent ``t`` (:func:`~specpilot.w12.format.unpack`'s checks), or
            more escape groups than an int32 word index addresses.
    """
    n, k = _check_w12(t)
    dev = t.mant.device
    sm, code = natural_fields(t)
    mant = sm.to(torch.uint8).contiguous()
    codes = t.codes.contiguous().view(torch.int32).view(n, k // GROUP).clone()
    flat = t.escape_idx.to(device=dev, dtype=torch.int64)
    groups = torch.unique(flat // GROUP) if flat.numel() else flat
    e = int(groups.numel())
    if 4 * e >= 2 ** 31:
        raise SpecpilotError(f"w12: {e} escape groups exceed the planes' int32 side index")
    side = torch.zeros(max(4, 4 * e), dtype=torch.int32, device=dev)
    if e:
        bits = ((sm & 0x80) << 8) | ((code + int(t.base)) << 7) | (sm & 0x7F)
        vals = bits.reshape(-1, GROUP)[groups]  # natural order, escapes still wrong
        pos = flat - groups[torch.searchsorted(groups, flat // GROUP)] * GROUP
        row = torch.searchsorted(groups, flat // GROUP)
        vals[row, pos] = t.escape_val.to(dev).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        words = vals[:, 0::2] | (vals[:, 1::2] << 16)  # pair word p: elements 2p (low), 2p + 1 (high)
        side[:4 * e] = (words - ((words >> 31) << 32)).to(torch.int32).reshape(-1)
        off = 16 * torch.arange(e, device=dev)
        mant.view(-1, GROUP)[groups] = torch.stack([(off >> s) & 0xFF for s in (0, 8, 16, 24)]
                                                   + [torch.zeros_like(off)] * 4, 1).to(torch.uint8)
        codes.view(-1)[groups] = 0
    return TilePlanes(mant, codes, side, int(t.base), (n, k), e)


def _i32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def planes_of(w: torch.Tensor) -> TilePlanes:
    """:func:`tile_planes` of :func:`~specpilot.w12.format.pack` (w): a bf16 ``[N, K]`` matrix,
    K a multiple of 8 (raises SpecpilotError otherwise)."""
    return tile_planes(pack(w))


def decode_planes(p: TilePlanes) -> torch.Tensor:
    """The bf16 matrix ``[N, K]`` of tile planes (PyTorch reference of the kernel's decode; any
    device): bit-identical to the packed matrix."""
    n, k = p.shape
    byte = p.mant.view(n, k // GROUP, GROUP).to(torch.int64)
    c = p.codes.view(n, k // GROUP).to(torch.int64) & 0xFFFFFFFF
    code = torch.stack([(c >> (4 * (i // 2 + 4 * (i % 2)))) & 0xF for i in range(GROUP)], -1)
    bits = ((byte & 0x80) << 8) | ((code + int(p.base)) << 7) | (byte & 0x7F)
    esc = c == 0
    if p.escape_groups:
        b = byte[esc]
        idx = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)) // 16
        words = p.side.view(-1, 4)[idx].to(torch.int64) & 0xFFFFFFFF
        bits[esc] = torch.stack([words & 0xFFFF, words >> 16], -1).reshape(-1, GROUP)
    bits = bits - ((bits & 0x8000) << 1)
    return bits.to(torch.int16).view(torch.bfloat16).reshape(n, k)

"""The lossless 12-bit weight format ("w12"): pack / unpack bf16 matrices, bit for bit.

Idea (after Turbo-Lossless, cenconq25/Turbo-Lossless docs/TECHNICAL.md, and NyoomFloat12,
openreview.net/forum?id=yYFj1E1mSZ; see section 8 of the project's anchors notes): almost every bf16
weight of a trained (or randomly initialised) matrix has its 8-bit exponent inside about 15
consecutive binades. So each weight is stored as

* one **sign+mantissa byte** ``s m6 m5 m4 m3 m2 m1 m0`` (bf16 bit 15, then bits 6..0), and
* one **4-bit exponent code** ``c``: ``c`` in 1..15 means ``exponent = base + c`` (one integer add),
  ``c = 0`` is an **escape**: the weight's exact bf16 value is stored on the side
  (``escape_idx``, ``escape_val``) and patched in after the bulk decode.

That is exactly 12 bits per weight plus the escapes. Zeros, subnormals, inf/nan and outliers are
escapes, so :func:`unpack` reproduces every bit (test by comparing ``.view(torch.int16)``).

``base`` is chosen **per tensor** (one int per matrix) so that the window of exponents
``base+1 .. base+15`` holds the most weights (the 15 most-populated consecutive binades; ties go to
the smallest base). ``base`` lies in 0..239 so the window never includes exponent 0 (zero /
subnormal) or 255 (inf / nan).

Bit layout (K must be a multiple of 8; elements ``k = 8g + i``, ``i = 0..7``, of row ``n``):

* ``mant`` uint8 ``[N, K]``: within each group of 4 consecutive elements the two middle bytes are
  swapped, i.e. byte order ``(e0, e2, e1, e3)``. Read as a little-endian uint32 word ``A``,
  ``A & 0x00FF00FF`` holds the bytes of elements 0 and 1 in its two 16-bit lanes and
  ``(A >> 8) & 0x00FF00FF`` those of elements 2 and 3, ready for a two-lanes-at-once decode.
  Escaped elements store the byte 0.
* ``codes`` uint8 ``[N, K/2]``: 4 bytes per group of 8 elements, i.e. one little-endian uint32
  word ``C`` per group whose nibble ``p`` (bits ``4p..4p+3``) is the code of element ``2p`` and
  nibble ``p + 4`` (bits ``16+4p..19+4p``) the code of element ``2p + 1`` (``p = 0..3``). Byte by
  byte: ``c0|c2<<4, c4|c6<<4, c1|c3<<4, c5|c7<<4``. So ``(C >> 4p) & 0x000F000F`` holds the codes
  of the pair ``(2p, 2p+1)`` in its two 16-bit lanes.

A kernel reading a K-tile of ``8*G`` elements of one row therefore reads ``8*G`` contiguous
mantissa bytes and ``4*G`` contiguous code bytes, and decodes a pair of weights into one bf16x2
word with ``R = (T & 0x00800080) * 255 + T + X * 128 + base * 128 * 0x00010001`` (``T`` the two
sign+mantissa bytes, ``X`` the two codes, one per 16-bit lane; no carry crosses a lane).
An escape decodes in bulk to ``+2**(base-127)`` (bits ``base << 7``) before it is patched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecpilotError

GROUP = 8  # elements per code word; K must be a multiple of this
N_CODES = 15  # binades covered by codes 1..15
MAX_BASE = 254 - N_CODES  # 239: base + 15 <= 254 keeps inf/nan (255) outside the window

# within a group of 4 sign+mantissa bytes, stored byte j holds element _MANT_PERM[j]
_MANT_PERM = (0, 2, 1, 3)
# within a group of 8 codes: stored byte j = code[_CODE_LO[j]] | code[_CODE_HI[j]] << 4
_CODE_LO = (0, 4, 1, 5)
_CODE_HI = (2, 6, 3, 7)


@dataclass
class W12Tensor:
    """One bf16 matrix ``[N, K]`` in the 12-bit format (see the module docstring for the layout).

    Attributes:
        mant: uint8 ``[N, K]``, sign+mantissa bytes, middle bytes of each 4-group swapped.
        codes: uint8 ``[N, K // 2]``, 4-bit exponent codes, nibble order as documented above.
        base: int in 0..239; code ``c`` in 1..15 decodes to exponent ``base + c``.
        escape_idx: int64 ``[E]``, sorted flat row-major indices ``n * K + k`` of the escapes.
        escape_val: bfloat16 ``[E]``, their exact values.
        shape: ``(N, K)``.
    """

    mant: torch.Tensor
    codes: torch.Tensor
    base: int
    escape_idx: torch.Tensor
    escape_val: torch.Tensor
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        """Number of weights ``N * K``."""
        return self.shape[0] * self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.mant.device

    def to(self, device: torch.device | str) -> "W12Tensor":
        """A copy with every tensor on ``device``."""
        return W12Tensor(self.mant.to(device), self.codes.to(device), self.base,
                         self.escape_idx.to(device), self.escape_val.to(device), self.shape)


def _check_matrix(w: torch.Tensor, what: str = "weight") -> tuple[int, int]:
    if not isinstance(w, torch.Tensor):
        raise SpecpilotError(f"w12: {what} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype != torch.bfloat16:
        raise SpecpilotError(f"w12: {what} must be bfloat16, got {w.dtype} (shape {tuple(w.shape)})")
    if w.dim() != 2:
        raise SpecpilotError(f"w12: {what} must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % GROUP != 0 or k == 0 or n == 0:
        raise SpecpilotError(f"w12: {what} needs K (columns) a positive multiple of {GROUP}, "
                             f"got shape {tuple(w.shape)}")
    return n, k


def choose_base(exponents: torch.Tensor) -> int:
    """The base exponent that puts the most weights inside the window ``base+1 .. base+15``.

    Args:
        exponents: integer tensor of biased bf16 exponents (0..255), any shape.

    Returns:
        int in 0..239; ties go to the smallest base.
    """
    hist = torch.bincount(exponents.reshape(-1).to(torch.int64), minlength=256).to(torch.int64)
    csum = torch.cat([hist.new_zeros(1), hist.cumsum(0)])
    bases = torch.arange(0, MAX_BASE + 1, device=hist.device)
    covered = csum[bases + 1 + N_CODES] - csum[bases + 1]  # weights with exponent in base+1..base+15
    return int(torch.argmax(covered).item())  # argmax returns the first maximum


def pack(w: torch.Tensor) -> W12Tensor:
    """Pack a bf16 matrix into the 12-bit format; exact for every bf16 value.

    Args:
        w: bfloat16 ``[N, K]`` (any device), K a multiple of 8.

    Returns:
        :class:`W12Tensor` on the same device as ``w``.

    Raises:
        SpecpilotError: ``w`` is not bf16, not 2-D, or K is not a positive multiple of 8.
    """
    n, k = _check_matrix(w)
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    base = choose_base(exp)
    code = exp - base
    inside = (code >= 1) & (code <= N_CODES)
    code = torch.where(inside, code, torch.zeros_like(code))
    sm = torch.where(inside, ((bits >> 8) & 0x80) | (bits & 0x7F), torch.zeros_like(bits))

    mant = sm.to(torch.uint8).view(n, k // 4, 4)[:, :, list(_MANT_PERM)].reshape(n, k).contiguous()
    c = code.view(n, k // GROUP, GROUP)
    lo = c[:, :, list(_CODE_LO)]
    hi = c[:, :, list(_CODE_HI)]
    codes = (lo | (hi << 4)).to(torch.uint8).reshape(n, k // 2).contiguous()

    escape_idx = torch.nonzero(~inside.reshape(-1)).reshape(-1).to(torch.int64)
    escape_val = w.reshape(-1)[escape_idx].clone()
    return W12Tensor(mant, codes, base, escape_idx, escape_val, (n, k))


def _check_w12(t: W12Tensor) -> tuple[int, int]:
    if not isinstance(t, W12Tensor):
        raise SpecpilotError(f"w12: expected a W12Tensor, got {type(t).__name__}")
    n, k = t.shape
    if k % GROUP or tuple(t.mant.shape) != (n, k) or tuple(t.codes.shape) != (n, k // 2):
        raise SpecpilotError(f"w12: inconsistent W12Tensor: shape {t.shape}, mant {tuple(t.mant.shape)}, "
                             f"codes {tuple(t.codes.shape)}")
    if t.mant.dtype != torch.uint8 or t.codes.dtype != torch.uint8:
        raise SpecpilotError(f"w12: mant/codes must be uint8, got {t.mant.dtype}/{t.codes.dtype}")
    if not 0 <= int(t.base) <= MAX_BASE:
        raise SpecpilotError(f"w12: base must be in 0..{MAX_BASE}, got {t.base}")
    if t.escape_idx.numel() != t.escape_val.numel() or t.escape_val.dtype != torch.bfloat16:
        raise SpecpilotError(f"w12: {t.escape_idx.numel()} escape indices but {t.escape_val.numel()} "
                             f"values of dtype {t.escape_val.dtype} (bf16 needed)")
    return n, k


def natural_fields(t: W12Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sign+mantissa bytes and the codes of ``t`` in natural element order.

    Returns:
        ``(sm, code)``: both int32 ``[N, K]``; ``sm`` is 0 and ``code`` 0 at escapes.
    """
    n, k = _check_w12(t)
    inv = [_MANT_PERM.index(j) for j in range(4)]
    sm = t.mant.view(n, k // 4, 4)[:, :, inv].reshape(n, k).to(torch.int32)
    cb = t.codes.view(n, k // GROUP, 4).to(torch.int32)
    code = torch.empty(n, k // GROUP, GROUP, dtype=torch.int32, device=t.mant.device)
    code[:, :, list(_CODE_LO)] = cb & 0xF
    code[:, :, list(_CODE_HI)] = cb >> 4
    return sm, code.reshape(n, k)


def unpack(t: W12Tensor) -> torch.Tensor:
    """Decode to the exact original bf16 matrix (PyTorch reference; runs on any device).

    Args:
        t: a :class:`W12Tensor` from :func:`pack` (or loaded from a w12 checkpoint).

    Returns:
        bfloat16 ``[N, K]`` on ``t``'s device, bit-identical to the packed matrix.

    Raises:
        SpecpilotError: ``t`` is inconsistent (shapes, dtypes, base out of range, escape counts),
            or an escape index is out of range.
    """
    n, k = _check_w12(t)
    sm, code = natural_fields(t)
    bits = ((sm & 0x80) << 8) | ((code + int(t.base)) << 7) | (sm & 0x7F)
    bits = bits - ((bits & 0x8000) << 1)  # to the signed int16 range, no wrap-around needed
    out = bits.to(torch.int16).view(torch.bfloat16).reshape(-1)
    if t.escape_idx.numel():
        idx = t.escape_idx.to(device=out.device, dtype=torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= n * k:
            raise SpecpilotError(f"w12: escape index out of range 0..{n * k - 1}: "
                                 f"{int(idx.min())}..{int(idx.max())}")
        out[idx] = t.escape_val.to(out.device)
    return out.view(n, k)


def escape_rate(t: W12Tensor) -> float:
    """Fraction of the weights of ``t`` stored as escapes (0.0 .. 1.0)."""
    return t.escape_idx.numel() / max(1, t.numel)


def nbytes(t: W12Tensor, index_bytes: int = 8) -> int:
    """Bytes of ``t`` in memory: mantissas + codes + escapes (index + 2-byte value each).

    Args:
        index_bytes: bytes counted per escape index (8 for the stored int64; 4 for the int32 column
            index a kernel reads).
    """
    return t.mant.numel() + t.codes.numel() + t.escape_idx.numel() * (index_bytes + 2)


def exponent_window(t: W12Tensor) -> tuple[int, int]:
    """The biased exponents ``(base + 1, base + 15)`` that codes 1..15 cover."""
    return int(t.base) + 1, int(t.base) + N_CODES


def escape_csr(t: W12Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The escapes of ``t`` by row, as the fused kernels read them.

    Returns:
        ``(rowptr, row, col, val)``: int32 ``[N+1]`` (escapes of row n are ``rowptr[n]:rowptr[n+1]``),
        int32 ``[E]``, int32 ``[E]``, bf16 ``[E]``, sorted by flat index, on ``t``'s device. With no
        escapes ``row``, ``col`` and ``val`` hold one unused zero (kernels need a valid pointer).
    """
    n, k = _check_w12(t)
    dev = t.escape_idx.device
    idx, order = torch.sort(t.escape_idx.to(torch.int64))
    val = t.escape_val[order]
    row = idx // k
    col = idx - row * k
    rowptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    if idx.numel():
        rowptr[1:] = torch.bincount(row, minlength=n).cumsum(0).to(torch.int32)
        return rowptr, row.to(torch.int32), col.to(torch.int32), val.to(torch.bfloat16)
    z = torch.zeros(1, dtype=torch.int32, device=dev)
    return rowptr, z, z.clone(), torch.zeros(1, dtype=torch.bfloat16, device=dev)

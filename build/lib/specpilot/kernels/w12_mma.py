"""Tensor-core matmul for 12-bit weights at verify widths: fragment-ordered storage, CUDA C++.

The Triton w12 kernels (:mod:`specpilot.kernels.w12_triton`) beat bf16 at one row but lose at 4-64
rows (0.55-0.89x on the H200): their decoded tile goes through a shared-memory layout change before
the tensor cores see it. This kernel (``w12_mma.cu`` beside this file, built with
``torch.utils.cpp_extension`` on the GPU machine) stores the 12-bit weights in the order of the
``mma.sync.m16n8k16`` A fragments, so each lane loads exactly its fragments' bytes and decodes them
in registers, after the idea of a fragment-ordered layout decoded straight into MMA registers
(Marlin, IST-DASLab/marlin, does this for 4-bit integers; Turbo-Lossless, cenconq25/Turbo-Lossless,
and NyoomFloat12, openreview.net/forum?id=yYFj1E1mSZ, for 12-bit floats). No code is taken from them.

**Fragment layout** (:func:`frag_pack`). W ``[N, K]`` is cut into 16-row tiles ``T`` and 32-column
chunks ``i`` (K a multiple of 32, N of 16). Inside a chunk, element ``k = 8*tig + 4*j + 2*qq + ql``
(``tig`` 0..3, k-step ``j`` 0..1, ``qq`` and ``ql`` 0..1) goes to lane ``4*g + tig`` (``g`` the row
within the tile mod 8, ``h`` = row // 8):

* ``fm`` uint8 ``[N/16, K/32, 32, 16]``: the lane's 16 sign+mantissa bytes as four 32-bit words
  ``2*j + qq``, each holding bytes ``(h, ql) = (0,0), (0,1), (1,0), (1,1)``;
* ``fc`` uint8 ``[N/16, K/32, 32, 8]``: two 32-bit code words (one per k-step ``j``), the code of
  ``(h, qq, ql)`` at bits ``16*ql + 4*(h + 2*qq)``.

A lane's register ``r = h + 2*qq`` of k-step ``j`` (the m16n8k16 A-fragment register: rows ``g`` /
``g+8``, slots ``2*tig + {0,1}`` / ``+8``) is then one byte permute with sign replication of word
``2*j + qq`` (PTX ``prmt`` selectors 0x9180 / 0xB3A2), the code word shifted by ``7 - 4*r``, and two
masks: ``(p & 0x807F807F) | (c & 0x07800780) | 0x38003800``, a raw bf16 pair with exponent field
``112 + code`` (4 integer ops per pair). The same permutation of k inside a chunk is applied to x:
the lane's 8 x values of a chunk are contiguous (one 16-byte load gives its two k-steps' B
fragments). Escapes (code 0, byte 0) decode to the raw value ``2**-15``.

**Numerics.** Products of bf16 values are exact; the fp32 accumulator of the raw weights is scaled
by ``2**(base - 112)`` once (exact, a power of two), then each escape ``(n, k, val)`` adds
``x*val - x*v0`` in fp32 (``v0 = 2**(base - 127)``, what the escape decoded to), then the sum is
rounded to bf16: the fp32 sum of the same exact products as a bf16 matmul, in another order. The
reduction order depends only on ``split`` (see the .cu file), never on M: a row of ``y`` is
bit-identical whatever the other rows are, for M = 1..64 (the engine's batch invariance).

CPU: :func:`frag_decode_reference` and :func:`reference_matmul` emulate the kernel's decode and
arithmetic with integer and fp32 torch ops (tests/test_w12_mma.py checks them against
:func:`specpilot.w12.unpack` bit for bit). CUDA: :func:`build` compiles the kernel with nvcc into a
plain shared library (no PyTorch ABI: built once per GPU architecture, by the workflow's
``kernels`` rule or on first use), :func:`load` opens it through ctypes, :func:`matmul` runs it on
PyTorch's current stream (CUDA-graph capture works as for any kernel on that stream).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpecpilotError
from ..w12.format import W12Tensor, escape_csr, natural_fields

SOURCE = Path(__file__).with_name("w12_mma.cu")
MAX_M = 64  # rows per launch (8 m16n8k16 B tiles); matmul() runs more rows in chunks of 64
SPLITS = (1, 2, 4, 8)  # K slices = blocks of one thread-block cluster (8: the portable cluster size)
TILES = (1, 2)  # 16-row W tiles per warp
WARPS = (2, 4)
UNROLLS = (2, 4, 8)  # 8: only when tiles per warp x ceil(M / 8) <= 2


def valid(m: int, split: int, tn: int, warps: int, unroll: int, k: int) -> bool:
    """True when the extension has a kernel for this launch (and K has enough 32-column chunks)."""
    nt = (min(m, MAX_M) + 7) // 8
    nt = 1 if nt <= 1 else 2 if nt <= 2 else 4 if nt <= 4 else 8
    return (split in SPLITS and tn in TILES and warps in WARPS and unroll in UNROLLS
            and not (unroll == 8 and nt * tn > 2) and split * unroll <= k // 32)


@dataclass
class FragW12:
    """A w12 matrix in the fragment order of :mod:`w12_mma` (see the module docstring).

    Attributes:
        fm: uint8 ``[N/16, K/32, 32, 16]`` sign+mantissa bytes.
        fc: uint8 ``[N/16, K/32, 32, 8]`` exponent codes.
        base: the format's base exponent (0..239).
        rowptr, col, val: the escapes by row (int32 ``[N+1]``, int32 ``[E]``, bf16 ``[E]``; one
            unused zero when E = 0).
        shape: ``(N, K)``.
    """

    fm: torch.Tensor
    fc: torch.Tensor
    base: int
    rowptr: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for the weights: 1.5 per weight plus 6 per escape (col + value)."""
        return self.fm.numel() + self.fc.numel() + 6 * int(self.rowptr[-1])

    def to(self, device) -> "FragW12":
        """A copy with every tensor on ``device``."""
        return FragW12(self.fm.to(device), self.fc.to(device), self.base, self.rowptr.to(device),
                       self.col.to(device), self.val.to(device), self.shape)


def frag_pack(t: W12Tensor) -> FragW12:
    """Reorder a :class:`~specpilot.w12.W12Tensor` into the fragment layout (same bytes, same escapes).

    Args:
        t: a packed ``[N, K]`` matrix, N a multiple of 16 and K of 32 (every Qwen3 / Llama shape).
    Returns:
        :class:`FragW12` on ``t``'s device.
    Raises:
        SpecpilotError: N or K not a multiple of 16 / 32.
    """
    n, k = t.shape
    if n % 16 or k % 32:
        raise SpecpilotError(f"w12 mma: the fragment layout needs N a multiple of 16 and K of 32, got {n} x {k}")
    sm, code = natural_fields(t)  # int32 [N, K]
    T, KI = n // 16, k // 32
    # (T, h, g, KI, tig, j, qq, ql): row = 8h + g, k = 32 i + 8 tig + 4 j + 2 qq + ql
    sm8 = sm.view(T, 2, 8, KI, 4, 2, 2, 2)
    fm = sm8.permute(0, 3, 2, 4, 5, 6, 1, 7).reshape(T, KI, 32, 16).to(torch.uint8).contiguous()
    c8 = code.view(T, 2, 8, KI, 4, 2, 2, 2)
    cb = c8[:, 0] | (c8[:, 1] << 4)  # (T, g, KI, tig, j, qq, ql): h = 0 low nibble, h = 1 high
    fc = cb.permute(0, 2, 1, 3, 4, 6, 5).reshape(T, KI, 32, 8).to(torch.uint8).contiguous()
    rowptr, _, col, val = escape_csr(t)
    return FragW12(fm, fc, int(t.base), rowptr, col, val, (n, k))


def _words(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4w] -> int64 [..., w] little-endian 32-bit words."""
    b = b.to(torch.int64).view(*b.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _prmt_sext(w: torch.Tensor, hi_pair: bool) -> torch.Tensor:
    """PTX ``prmt.b32 d, w, w, 0x9180`` (bytes 0, 1) or ``0xB3A2`` (bytes 2, 3): each byte into a
    16-bit lane, its sign replicated into the lane's high byte."""
    lo, hi = ((w >> 16) & 0xFF, (w >> 24) & 0xFF) if hi_pair else (w & 0xFF, (w >> 8) & 0xFF)
    sext = lambda b: b | (torch.where(b >= 0x80, 0xFF, 0) << 8)  # noqa: E731
    return sext(lo) | (sext(hi) << 16)


def raw_pairs(f: FragW12) -> torch.Tensor:
    """The kernel's decode, emulated: raw bf16 bits int64 ``[N/16, K/32, 32, 2 (j), 4 (r), 2 (lane)]``
    (exponent field 112 + code), as the kernel's registers hold them."""
    mw, cw = _words(f.fm), _words(f.fc)  # [T, KI, 32, 4], [T, KI, 32, 2]
    out = []
    for j in range(2):
        regs = []
        for r in range(4):
            h, qq = r % 2, r // 2
            p = _prmt_sext(mw[..., 2 * j + qq], hi_pair=bool(h))
            sh = 7 - 4 * r
            c = (cw[..., j] << sh) if sh >= 0 else (cw[..., j] >> -sh)
            R = (p & 0x807F807F) | (c & 0x07800780) | 0x38003800
            regs.append(torch.stack([R & 0xFFFF, (R >> 16) & 0xFFFF], -1))
        out.append(torch.stack(regs, -2))
    return torch.stack(out, -3)


def _natural(pairs: torch.Tensor) -> torch.Tensor:
    """Register-ordered values [T, KI, 32 (g, tig), 2 (j), 4 (r = h + 2 qq), 2 (ql)] -> [N, K]."""
    T, KI = pairs.shape[:2]
    v = pairs.reshape(T, KI, 8, 4, 2, 2, 2, 2)  # (T, KI, g, tig, j, qq, h, ql)
    return v.permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(T * 16, KI * 32)


def _escape_rows(f: FragW12) -> torch.Tensor:
    """The row index of each escape, int64 [E] (the CSR ``rowptr`` expanded)."""
    return torch.repeat_interleave(torch.arange(f.shape[0], device=f.rowptr.device),
                                   (f.rowptr[1:] - f.rowptr[:-1]).to(torch.int64))


def frag_decode_reference(f: FragW12) -> torch.Tensor:
    """Decode a :class:`FragW12` to bf16 ``[N, K]`` exactly as the kernel does (emulated on any
    device), escapes patched in: bit-identical to :func:`specpilot.w12.unpack` of the source."""
    raw = _natural(raw_pairs(f))
    bits = raw + ((f.base - 112) << 7)  # the true exponent base + code (never past 254)
    bits = bits - ((bits & 0x8000) << 1)
    out = bits.to(torch.int16).view(torch.bfloat16).clone()
    e = int(f.rowptr[-1])
    if e:
        out[_escape_rows(f), f.col[:e].to(torch.int64)] = f.val[:e]
    return out


def reference_matmul(x: torch.Tensor, f: FragW12) -> torch.Tensor:
    """The kernel's arithmetic in fp32 (any device, any summation order): ``scale * (x @ Wraw.T)``
    plus ``x*val - x*v0`` per escape, rounded to bf16. x [M, K] -> bf16 [M, N]."""
    raw = _natural(raw_pairs(f))
    raw = raw - ((raw & 0x8000) << 1)
    wr = raw.to(torch.int16).view(torch.bfloat16).float()
    xf = x.float()
    y = (xf @ wr.T) * (2.0 ** (f.base - 112))
    e = int(f.rowptr[-1])
    if e:
        xe = xf[:, f.col[:e].to(torch.int64)]  # [M, E]
        corr = xe * f.val[:e].float() - xe * (2.0 ** (f.base - 127))
        y.index_add_(1, _escape_rows(f), corr)
    return y.to(torch.bfloat16)


_LIB = None
ENV_LIB = "SPECPILOT_W12_MMA_LIB"  # a built library to use instead of building one


def default_build_dir() -> Path:
    """Where :func:`build` puts the library when no folder is given: ``$XDG_CACHE_HOME/specpilot``
    (default ``~/.cache/specpilot``)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specpilot" / "kernels"


def library_name(arch: str) -> str:
    """File name of the built library for a compute capability such as ``"90"``."""
    return f"libw12mma_sm{arch}.so"


def build(arch: str, out_dir: str | os.PathLike, nvcc: str = "nvcc", pipe: int | None = None) -> Path:
    """Compile ``w12_mma.cu`` with nvcc into ``out_dir/libw12mma_sm{arch}.so`` (atomically).

    A plain shared library (static CUDA runtime, no PyTorch ABI), so it needs no PyTorch headers
    and runs under any PyTorch of the same CUDA driver. About one minute on one core.
    ``pipe`` selects the main loop (``-DW12_PIPE``, see the .cu file: 0 loads then math per group
    of chunks, the default, 1 register double buffering, 2 cp.async through shared memory); a
    non-default one is built as ``libw12mma_sm{arch}_pipe{pipe}.so``.

    Raises:
        SpecpilotError: nvcc missing or the compile failing (its output included).
    """
    if pipe not in (None, 0, 1, 2):
        raise SpecpilotError(f"w12 mma: pipe must be 0, 1 or 2, got {pipe!r}")
    if shutil.which(nvcc) is None:
        raise SpecpilotError(f"w12 mma: {nvcc!r} not found: the CUDA compiler is needed to build {SOURCE.name}")
    name = library_name(arch) if pipe is None else library_name(arch).replace(".so", f"_pipe{pipe}.so")
    out = Path(out_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
    cmd = [nvcc, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo",
           "-Xcompiler", "-fPIC", "-shared", "-o", str(tmp), str(SOURCE)]
    if pipe is not None:
        cmd.insert(1, f"-DW12_PIPE={pipe}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SpecpilotError(f"w12 mma: {' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def load(build_dir: str | os.PathLike | None = None):
    """The compiled library for this GPU, as a ctypes handle (loaded once per process).

    Order: ``$SPECPILOT_W12_MMA_LIB`` if set; else ``build_dir`` (default :func:`default_build_dir`)
    holding ``libw12mma_sm{arch}.so``; else :func:`build` into that folder first.

    Raises:
        SpecpilotError: no CUDA device, a build failure, or a library that does not load.
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    if not torch.cuda.is_available():
        raise SpecpilotError("w12 mma: the kernel needs a CUDA device")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    path = os.environ.get(ENV_LIB)
    if not path:
        folder = Path(build_dir) if build_dir is not None else default_build_dir()
        path = folder / library_name(arch)
        if not path.is_file():
            path = build(arch, folder)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise SpecpilotError(f"w12 mma: cannot load {path}: {e}") from e
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.w12_mma_launch.argtypes = [p, i, i, p, p, i, i, p, p, p, i, p, i, i, i, i, p]
    lib.w12_mma_launch.restype = i
    _LIB = lib
    return lib


def matmul(x: torch.Tensor, f: FragW12, split: int = 1, tn: int = 1, warps: int = 4, unroll: int = 2,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W.T`` on tensor cores from the fragment layout (CUDA).

    Args:
        x: bf16 ``[M, K]`` on the GPU, rows 16-byte aligned (row stride a multiple of 8).
        f: :class:`FragW12` on the same device.
        split: K slices (SPLITS): the blocks of one thread-block cluster, summed in order by
            its first block through distributed shared memory;
            tn: 16-row W tiles per warp (TILES; they share the warp's x fragments); warps: warps
            per block (WARPS; each its own tiles, the same K slice); unroll: 32-column chunks
            whose loads a warp issues before their math (UNROLLS); see :func:`valid`. The
            reduction order, so the bits of a row, depend on ``split`` only.
        out: optional bf16 ``[M, N]`` output.
    Returns:
        bf16 ``[M, N]``. More than 64 rows run in chunks of 64 (each re-reads W).
    Raises:
        SpecpilotError: bad dtypes, shapes, devices or launch options.
    """
    n, k = f.shape
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise SpecpilotError(f"w12 mma: x must be bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if x.device != f.fm.device or x.device.type != "cuda":
        raise SpecpilotError(f"w12 mma: x on {x.device}, weights on {f.fm.device} (both must be on one GPU)")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    M = x.shape[0]
    if not valid(M, split, tn, warps, unroll, k):
        raise SpecpilotError(f"w12 mma: no kernel for M={M}, split {split}, tiles {tn}, warps {warps}, "
                             f"unroll {unroll} (K = {k}); see w12_mma.valid")
    y = out if out is not None else torch.empty(M, n, dtype=torch.bfloat16, device=x.device)
    lib = load()
    for m0 in range(0, M, MAX_M):
        m1 = min(M, m0 + MAX_M)
        xs = x[m0:m1]
        rc = lib.w12_mma_launch(xs.data_ptr(), m1 - m0, xs.stride(0), f.fm.data_ptr(), f.fc.data_ptr(), k, n,
                                f.rowptr.data_ptr(), f.col.data_ptr(), f.val.data_ptr(), f.base,
                                y[m0:m1].data_ptr(), split, tn, warps, unroll,
                                torch.cuda.current_stream(x.device).cuda_stream)
        if rc != 0:
            raise SpecpilotError(f"w12 mma: launch failed (code {rc}) for M={m1 - m0}, N={n}, K={k}, "
                                 f"split {split}, tiles {tn}, warps {warps}, unroll {unroll}")
    return y

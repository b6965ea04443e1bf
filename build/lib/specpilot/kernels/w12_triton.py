"""Triton kernels for the lossless 12-bit weight format (``specpilot.w12.format``).

Three kernels, all reading the packed format directly (layout in ``specpilot/w12/format.py``):

* :func:`decode`: w12 -> bf16 ``[N, K]`` (bulk decode, then the escapes are patched with one
  index-put), bit-exact.
* :func:`matmul` with a ``gemv`` config: ``y = x @ W.T`` for few rows (decode shapes, M <= 8):
  CUDA-core FMA in fp32, each program owns ``BN`` rows of W and (with split-K) a slice of K.
* :func:`matmul` with a tensor-core config, for more rows (verify shapes, M up to 256):
  ``mm`` / ``mmr`` put the decoded W tile on the left (``W @ x.T``, so the wide N fills the MMA's
  M side and a 16-row x still fits its N side; ``mm`` lets Triton pipeline the loads, ``mmr``
  prefetches the next tile into registers), ``mmx`` puts x on the left (``x @ W.T``).

Which config runs: :func:`default_config` (the tuned table for (M bucket, N, K), loaded on first
use from ``src/specpilot/kernels/tuned/w12_<gpu>.json`` when present, else a heuristic). On the H200 the fused
kernels beat cuBLAS bf16 at M = 1 (1.23-1.47x per shape, 1.33x over a 36-layer step) but not at
M >= 4 (0.73-0.89x): see BENCHMARKS.md, section "12-bit weights (issue 6)".

Decode: a program loads per group of 8 weights one 64-bit word of sign+mantissa bytes (split into
two 32-bit words in registers) and one 32-bit word of codes, and builds each pair of bf16 values
in one 32-bit word, the fixed-width split layout of Turbo-Lossless (cenconq25/Turbo-Lossless, docs/TECHNICAL.md) with a
two-lanes-at-once decode in the spirit of NyoomFloat12's short SIMT decode
(openreview.net/forum?id=yYFj1E1mSZ). No code is taken from either. The decodes
(``Config.decode``):

* ``"raw"`` (default) builds a *raw* bf16 whose exponent field is ``112 + c`` (``0111cccc``),
  independent of the tensor's base: ``R = sign | mantissa | ((C << k) & 0x07800780) | 0x38003800``
  (sign and mantissa moved into place with two masks and one shift; about 5 integer ops per pair,
  4 with the ``"prmt"`` variant, one PTX byte permute with sign replication instead of the shift
  and sign mask). The true weight is ``w = w_raw * 2**(base - 112)``, a power of two, so the
  kernels multiply the fp32 accumulator by ``scale = 2**(base - 112)`` once, before the escapes
  are added. This is bit-identical to accumulating the true weights in the same order: each product
  ``x * w_raw`` is exact in fp32 (8-bit x 8-bit significands), and IEEE rounding commutes with
  scaling by a power of two, so every partial sum (FMA or add, any order) of the raw products is
  exactly ``2**(112 - base)`` times the one of the true products; the final multiply is exact.
  The one assumption: no product or partial sum is subnormal (or overflows) in one scaling but
  not the other; that needs |x| below about 2**-100 or sums near 2**127, never the case for a
  model's activations and weights. Tensor cores: their products are exact and their
  alignment/truncation is relative to the largest exponent in the sum, so they should commute
  with the scaling as well; the interpreter checks only the IEEE fp32 case, so
  specpilot bench w12 also compares "raw" with "base" bit for bit on the GPU (all 162 pairs
  equal on the H200, 2026-11-30, tensor-core kinds included). The
  tensor-core kinds turn the raw pair words into the bf16 tile by truncation to int16 lanes and
  a bitcast (no fp32 round trip, no F2FP).
* ``"base"``: the true bf16 bits, ``R = (T & 0x00800080) * 255 + T + X * 128 + base *
  0x00800080`` (about 8 integer ops per pair; the tensor-core tile built through fp32), kept to
  compare against.

The :func:`decode` kernel (true bf16 out, bit-exact) uses the raw formula with the base added:
``((C << k) & 0x07800780) + base * 0x00800080`` is ``(base + c) << 7`` per lane.

Escapes (code 0) decode in bulk to ``v0 = 2**(base-127)`` (their stored byte is 0; raw: ``2**-15``,
times the scale the same ``v0``); the fused
kernels then add ``x[m, k] * val - x[m, k] * v0`` for each escape ``(n, k, val)`` of their rows,
from a CSR list, in fp32 before rounding. The result is the fp32 sum of the same exact products
``x * w`` as a bf16 matmul, in another order: equal to cuBLAS within bf16 accumulation tolerance,
not bit-identical (no two GEMM kernels are).

Split-K is deterministic: each K-slice writes an fp32 partial; the last program of a tile to
finish (an atomic counter per tile) sums the partials in slice order and writes ``y``, then resets
the counter. The workspace and counters are cached per device and shared by all calls, so calls
must not run concurrently on different streams.

Triton is imported by this module; ``specpilot`` imports this module only on CUDA.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------
# device code
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_pairs(A, B, C, base2):
    """Four bf16x2 words (pairs 0-1, 2-3, 4-5, 6-7 of a group) from 2 mantissa words + 1 code word.

    The "base" decode (true bf16 bits, exponent base + c): about 8 integer ops per pair."""
    T0 = A & 0x00FF00FF
    T1 = (A >> 8) & 0x00FF00FF
    T2 = B & 0x00FF00FF
    T3 = (B >> 8) & 0x00FF00FF
    R0 = (T0 & 0x00800080) * 255 + T0 + (C & 0x000F000F) * 128 + base2
    R1 = (T1 & 0x00800080) * 255 + T1 + ((C >> 4) & 0x000F000F) * 128 + base2
    R2 = (T2 & 0x00800080) * 255 + T2 + ((C >> 8) & 0x000F000F) * 128 + base2
    R3 = (T3 & 0x00800080) * 255 + T3 + ((C >> 12) & 0x000F000F) * 128 + base2
    return R0, R1, R2, R3



@triton.jit
def _prmt_a280(A):
    """prmt.b32 selector 0xA280: lanes (byte 0, sign of byte 0 x8 | byte 2, sign of byte 2 x8)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0xA280;", "=r,r", [A], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _prmt_b391(A):
    """prmt.b32 selector 0xB391: lanes (byte 1, sign of byte 1 x8 | byte 3, sign of byte 3 x8)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0xB391;", "=r,r", [A], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _bitsel(M: tl.constexpr, NOT_M: tl.constexpr, a, b):
    """Bits of ``a`` where M is set, of ``b`` elsewhere (one LOP3)."""
    return (a & M) | (b & NOT_M)


@triton.jit
def _assemble_pairs(A, B, L, H, PRMT: tl.constexpr):
    """The four pair words from the mantissa words A, B and the exponent-byte words L, H.

    Exponent bytes of L at bytes 0/2 (pair 0) go to bits 7-14 / 23-30 with ``<< 7``, those at
    bytes 1/3 (pair 2) with ``>> 1`` (likewise H for pairs 1 and 3). Sign and mantissa: one bit
    select (sign bits 15/31 from one source, the rest from another), then one bit select of the
    exponent field (0x7F807F80); with PRMT the sign move is one byte permute with sign
    replication (bits 7-14 hold sign copies, overwritten by the exponent)."""
    # 0x80008000 / 0x7FFF7FFF: sign bits; 0x7F807F80 / 0x807F807F (int32: -0x7F807F81): exponent
    if PRMT:
        R0 = _bitsel(0x7F807F80, -0x7F807F81, L << 7, _prmt_a280(A))
        R1 = _bitsel(0x7F807F80, -0x7F807F81, H << 7, _prmt_b391(A))
        R2 = _bitsel(0x7F807F80, -0x7F807F81, L >> 1, _prmt_a280(B))
        R3 = _bitsel(0x7F807F80, -0x7F807F81, H >> 1, _prmt_b391(B))
    else:
        R0 = _bitsel(0x7F807F80, -0x7F807F81, L << 7, _bitsel(-0x7FFF8000, 0x7FFF7FFF, A << 8, A))
        R1 = _bitsel(0x7F807F80, -0x7F807F81, H << 7, _bitsel(-0x7FFF8000, 0x7FFF7FFF, A, A >> 8))
        R2 = _bitsel(0x7F807F80, -0x7F807F81, L >> 1, _bitsel(-0x7FFF8000, 0x7FFF7FFF, B << 8, B))
        R3 = _bitsel(0x7F807F80, -0x7F807F81, H >> 1, _bitsel(-0x7FFF8000, 0x7FFF7FFF, B, B >> 8))
    return R0, R1, R2, R3


@triton.jit
def _decode_pairs_raw(A, B, C, PRMT: tl.constexpr):
    """The four pair words of a group in the "raw" decode: exponent field 112 + c (0x70 | c), no base.

    Raw bits ``s << 15 | (0x70 + c) << 7 | m``; the true weight is raw * 2**(base - 112) (the
    caller scales its fp32 accumulator). The codes become exponent bytes ``0x70 | c`` four at a
    time (2 ops per 4 codes), then :func:`_assemble_pairs`: about 4.5 integer ops per pair of
    weights (3.5 with PRMT), against about 6 for the "base" formula as compiled (sm_90 SASS).
    Arithmetic shifts of negative words only pull copies of bit 31 into bits the masks clear.
    """
    # exponent bytes 0111cccc: L holds those of elements 0, 4, 1, 5 and H of 2, 6, 3, 7 (bytes 0..3)
    L = (C & 0x0F0F0F0F) | 0x70707070
    H = ((C >> 4) & 0x0F0F0F0F) | 0x70707070
    R0, R1, R2, R3 = _assemble_pairs(A, B, L, H, PRMT)
    return R0, R1, R2, R3


@triton.jit
def _decode_pairs_true(A, B, C, base4):
    """True bf16 bits with the raw formula, the base added to the exponent bytes (decode kernel).

    ``base4 = base * 0x01010101``; each byte ``base + c <= 254``, so no carry crosses a byte.
    """
    L = (C & 0x0F0F0F0F) + base4
    H = ((C >> 4) & 0x0F0F0F0F) + base4
    R0, R1, R2, R3 = _assemble_pairs(A, B, L, H, False)
    return R0, R1, R2, R3


@triton.jit
def _decode_any(A, B, C, base2, DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Pair words per DECODE: 0 "base" (true bits), 1 "raw", 2 "prmt" (raw via PRMT; plain raw when
    interpreting, the CPU interpreter has no inline PTX)."""
    if DECODE == 0:
        R0, R1, R2, R3 = _decode_pairs(A, B, C, base2)
    elif INTERPRET:
        R0, R1, R2, R3 = _decode_pairs_raw(A, B, C, False)
    else:
        R0, R1, R2, R3 = _decode_pairs_raw(A, B, C, DECODE == 2)
    return R0, R1, R2, R3


@triton.jit
def _lo_f32(R):
    """The low bf16 lane of an int32 word as fp32."""
    return (R << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi_f32(R):
    """The high bf16 lane of an int32 word as fp32."""
    return (R & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _finish(out, y_ptrs, ws_ptrs, ws_stride, mask, lock_ptr, tile, pid_k, SPLIT_K: tl.constexpr):
    """Write the bf16 result, or (split-K) the fp32 partial and let the last slice reduce."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, out.to(tl.bfloat16), mask=mask)
    else:
        tl.store(ws_ptrs + pid_k * ws_stride, out, mask=mask)
        tl.debug_barrier()
        cnt = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if cnt == SPLIT_K - 1:
            tot = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                tot += tl.load(ws_ptrs + s * ws_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(tl.bfloat16), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit
def _w12_decode_kernel(m32_ptr, c32_ptr, out32_ptr, n_groups, base4, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    w2 = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    mw = tl.load(m32_ptr + w2, mask=w2 < 2 * n_groups, other=0)
    A, B = tl.split(tl.reshape(mw, (BLOCK, 2)))
    g = pid * BLOCK + tl.arange(0, BLOCK)
    C = tl.load(c32_ptr + g, mask=g < n_groups, other=0)
    R0, R1, R2, R3 = _decode_pairs_true(A, B, C, base4)
    R = tl.reshape(tl.join(tl.join(R0, R2), tl.join(R1, R3)), (4 * BLOCK,))
    w4 = pid * (4 * BLOCK) + tl.arange(0, 4 * BLOCK)
    tl.store(out32_ptr + w4, R, mask=w4 < 4 * n_groups)


@triton.jit
def _split64(w):
    """(low, high) int32 halves of int64 words (two packed 32-bit words, no data movement)."""
    return w.to(tl.int32), (w >> 32).to(tl.int32)


@triton.jit
def _row_fma(acc, R0, R1, R2, R3, x64_row, g, mg, EVEN: tl.constexpr):
    """acc[BN, BG] += the 8 products of each group with one row of x (bf16 pairs: int64 words 2g, 2g+1)."""
    if EVEN:
        X01 = tl.load(x64_row + 2 * g)[None, :]
        X23 = tl.load(x64_row + 2 * g + 1)[None, :]
    else:
        X01 = tl.load(x64_row + 2 * g, mask=mg, other=0)[None, :]
        X23 = tl.load(x64_row + 2 * g + 1, mask=mg, other=0)[None, :]
    X0, X1 = _split64(X01)
    X2, X3 = _split64(X23)
    acc += _lo_f32(R0) * _lo_f32(X0)
    acc += _hi_f32(R0) * _hi_f32(X0)
    acc += _lo_f32(R1) * _lo_f32(X1)
    acc += _hi_f32(R1) * _hi_f32(X1)
    acc += _lo_f32(R2) * _lo_f32(X2)
    acc += _hi_f32(R2) * _hi_f32(X2)
    acc += _lo_f32(R3) * _lo_f32(X3)
    acc += _hi_f32(R3) * _hi_f32(X3)
    return acc


@triton.jit
def _load_tile(ptrs, g0, g_hi, offs_g, mask_n, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """One [BN, BG] tile of packed words (zeros outside the matrix / the K slice)."""
    if EVEN_K and EVEN_N:
        t = tl.load(ptrs, eviction_policy="evict_first")
    elif EVEN_K:
        t = tl.load(ptrs, mask=mask_n[:, None], other=0, eviction_policy="evict_first")
    else:
        t = tl.load(ptrs, mask=mask_n[:, None] & (g0 + offs_g < g_hi)[None, :], other=0,
                    eviction_policy="evict_first")
    return t


@triton.jit
def _gemv_step(a0, a1, a2, a3, a4, a5, a6, a7, mw, C, x64_ptr, g0, g_hi, offs_g, G, M, base2,
               BM: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Decode one [BN, BG] tile of groups and accumulate its products with the BM rows of x."""
    A, B = _split64(mw)
    g = g0 + offs_g
    mg = g < g_hi
    R0, R1, R2, R3 = _decode_any(A, B, C, base2, DECODE, INTERPRET)
    a0 = _row_fma(a0, R0, R1, R2, R3, x64_ptr, g, mg, EVEN_K)
    if BM > 1:
        a1 = _row_fma(a1, R0, R1, R2, R3, x64_ptr + 2 * G, g, mg & (1 < M), False)
    if BM > 2:
        a2 = _row_fma(a2, R0, R1, R2, R3, x64_ptr + 4 * G, g, mg & (2 < M), False)
        a3 = _row_fma(a3, R0, R1, R2, R3, x64_ptr + 6 * G, g, mg & (3 < M), False)
    if BM > 4:
        a4 = _row_fma(a4, R0, R1, R2, R3, x64_ptr + 8 * G, g, mg & (4 < M), False)
        a5 = _row_fma(a5, R0, R1, R2, R3, x64_ptr + 10 * G, g, mg & (5 < M), False)
        a6 = _row_fma(a6, R0, R1, R2, R3, x64_ptr + 12 * G, g, mg & (6 < M), False)
        a7 = _row_fma(a7, R0, R1, R2, R3, x64_ptr + 14 * G, g, mg & (7 < M), False)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _esc_chunk(rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr, x_ptr, offs_m, mask_m, K, e0, e_hi, n0, ok,
               ESC_B: tl.constexpr):
    """Load up to ESC_B escapes from index e0 (row - n0, value) and x[m, col] for rows offs_m."""
    e = e0 + tl.arange(0, ESC_B)
    me = (e < e_hi) & ok
    r = tl.load(erow_ptr + e, mask=me, other=-1) - n0
    c = tl.load(ecol_ptr + e, mask=me, other=0)
    v = tl.load(eval_ptr + e, mask=me, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + offs_m[:, None] * K + c[None, :], mask=mask_m[:, None] & me[None, :], other=0.0)
    return r, v, xv


@triton.jit
def _esc_apply(out, r, v, xv, v0, BN: tl.constexpr):
    """out[BM, BN] += x[m, k] * val - x[m, k] * v0 for the loaded escapes (fp32, exact products)."""
    xf = xv.to(tl.float32)
    d = xf * v[None, :] - xf * v0  # [BM, E]
    hit = r[:, None] == tl.arange(0, BN)[None, :]  # [E, BN]
    return out + tl.sum(tl.where(hit[None, :, :], d[:, :, None], 0.0), axis=1)


@triton.jit
def _tile_prologue(pid_n, pid_k, N, K, BN: tl.constexpr, BG: tl.constexpr, SPLIT_K: tl.constexpr):
    """The program's K slice in groups of 8 (``G``, ``g_lo``, ``g_hi``; SPLIT_K equal runs of whole
    BG-group tiles) and its rows of W (``n0``, ``offs_n`` [BN], ``mask_n``)."""
    G = K // 8
    g_per = tl.cdiv(tl.cdiv(G, SPLIT_K), BG) * BG
    g_lo = pid_k * g_per
    g_hi = tl.minimum(G, g_lo + g_per)
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    return G, g_lo, g_hi, n0, offs_n, offs_n < N


@triton.jit(do_not_specialize=["M"])
def _w12_gemv_kernel(x_ptr, x64_ptr, m64_ptr, c32_ptr, y_ptr, ws_ptr, lock_ptr,
                     rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr,
                     M, N, K, base2, v0, scale,
                     BM: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
                     SPLIT_K: tl.constexpr, ESC_B: tl.constexpr, DECODE: tl.constexpr, INTERPRET: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """CUDA-core product for M <= 8 rows. Each group of 8 weights is one int64 word of sign+mantissa
    bytes (split into its two 32-bit words in registers) and one int32 code word. EVEN_K: every K
    slice is whole tiles (no K masks); EVEN_N: N % BN == 0 (no row masks)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    G, g_lo, g_hi, n0, offs_n, mask_n = _tile_prologue(pid_n, pid_k, N, K, BN, BG, SPLIT_K)
    offs_g = tl.arange(0, BG)

    # one [BN, BG] accumulator per row of x (BM <= 8); unused ones are compiled away
    a0 = tl.zeros((BN, BG), dtype=tl.float32)
    a1 = tl.zeros((BN, BG), dtype=tl.float32)
    a2 = tl.zeros((BN, BG), dtype=tl.float32)
    a3 = tl.zeros((BN, BG), dtype=tl.float32)
    a4 = tl.zeros((BN, BG), dtype=tl.float32)
    a5 = tl.zeros((BN, BG), dtype=tl.float32)
    a6 = tl.zeros((BN, BG), dtype=tl.float32)
    a7 = tl.zeros((BN, BG), dtype=tl.float32)
    # software pipelining by hand (Triton pipelines only loads that feed tl.dot): the weights of
    # step i+1 are requested before step i is decoded; the last step is peeled off (no request
    # past the slice). The first tile is requested before anything else.
    m_row = m64_ptr + offs_n[:, None] * G + offs_g[None, :]
    c_row = c32_ptr + offs_n[:, None] * G + offs_g[None, :]
    g_last = g_lo + tl.maximum(g_hi - g_lo - 1, 0) // BG * BG
    mw = _load_tile(m_row + g_lo, g_lo, g_hi, offs_g, mask_n, EVEN_K, EVEN_N)
    C = _load_tile(c_row + g_lo, g_lo, g_hi, offs_g, mask_n, EVEN_K, EVEN_N)
    # escapes of these rows (split 0 only): the first ESC_B are requested now, used after the loop,
    # so their dependent loads (row pointer -> escape list -> x) hide behind the weight stream
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    e_lo = tl.load(rowptr_ptr + n0)
    e_hi = tl.load(rowptr_ptr + tl.minimum(n0 + BN, N))
    er, ev, exv = _esc_chunk(rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr, x_ptr, offs_m, mask_m, K, e_lo, e_hi,
                             n0, pid_k == 0, ESC_B)
    for g0 in range(g_lo, g_last, BG):
        g1 = g0 + BG
        mw_next = _load_tile(m_row + g1, g1, g_hi, offs_g, mask_n, EVEN_K, EVEN_N)
        C_next = _load_tile(c_row + g1, g1, g_hi, offs_g, mask_n, EVEN_K, EVEN_N)
        a0, a1, a2, a3, a4, a5, a6, a7 = _gemv_step(a0, a1, a2, a3, a4, a5, a6, a7, mw, C, x64_ptr, g0, g_hi,
                                                    offs_g, G, M, base2, BM, EVEN_K, DECODE, INTERPRET)
        mw = mw_next
        C = C_next
    if g_hi > g_lo:
        a0, a1, a2, a3, a4, a5, a6, a7 = _gemv_step(a0, a1, a2, a3, a4, a5, a6, a7, mw, C, x64_ptr, g_last, g_hi,
                                                    offs_g, G, M, base2, BM, EVEN_K, DECODE, INTERPRET)

    o0 = tl.sum(a0, axis=1)
    o1 = tl.sum(a1, axis=1)
    o2 = tl.sum(a2, axis=1)
    o3 = tl.sum(a3, axis=1)
    o4 = tl.sum(a4, axis=1)
    o5 = tl.sum(a5, axis=1)
    o6 = tl.sum(a6, axis=1)
    o7 = tl.sum(a7, axis=1)
    out = tl.where(offs_m[:, None] == 0, o0[None, :], 0.0)
    if BM > 1:
        out = tl.where(offs_m[:, None] == 1, o1[None, :], out)
    if BM > 2:
        out = tl.where(offs_m[:, None] == 2, o2[None, :], out)
        out = tl.where(offs_m[:, None] == 3, o3[None, :], out)
    if BM > 4:
        out = tl.where(offs_m[:, None] == 4, o4[None, :], out)
        out = tl.where(offs_m[:, None] == 5, o5[None, :], out)
        out = tl.where(offs_m[:, None] == 6, o6[None, :], out)
        out = tl.where(offs_m[:, None] == 7, o7[None, :], out)
    if DECODE != 0:  # raw weights: w = w_raw * 2**(base - 112), exact (see the module docstring)
        out = out * scale
    out = _esc_apply(out, er, ev, exv, v0, BN)
    if pid_k == 0:  # rows with more than ESC_B escapes (rare)
        for e0 in range(e_lo + ESC_B, e_hi, ESC_B):
            er, ev, exv = _esc_chunk(rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr, x_ptr, offs_m, mask_m, K, e0, e_hi,
                                     n0, True, ESC_B)
            out = _esc_apply(out, er, ev, exv, v0, BN)
    mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    _finish(out, y_ptrs, ws_ptrs, M * N, mask, lock_ptr, pid_n, pid_k, SPLIT_K)


@triton.jit
def _decode_tile_bf16(mw, C, base2, BN: tl.constexpr, BG: tl.constexpr, DECODE: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """The bf16 tile [BN, 8*BG] (natural k order) of BN rows x BG groups (mw: int64 mantissa words).

    DECODE 0 ("base"): true bf16 values, each lane widened to fp32 and converted back (F2FP).
    Else raw values: each pair word is split into its two 16-bit lanes by truncation (int32 ->
    int16) and bitcast to bf16, no float conversion."""
    A, B = _split64(mw)
    R0, R1, R2, R3 = _decode_any(A, B, C, base2, DECODE, INTERPRET)
    if DECODE == 0:
        E0 = _lo_f32(R0).to(tl.bfloat16)
        E1 = _lo_f32(R1).to(tl.bfloat16)
        E2 = _lo_f32(R2).to(tl.bfloat16)
        E3 = _lo_f32(R3).to(tl.bfloat16)
        O0 = _hi_f32(R0).to(tl.bfloat16)
        O1 = _hi_f32(R1).to(tl.bfloat16)
        O2 = _hi_f32(R2).to(tl.bfloat16)
        O3 = _hi_f32(R3).to(tl.bfloat16)
        ev = tl.join(tl.join(E0, E2), tl.join(E1, E3))  # [BN, BG, s, t]: pair 2s + t
        od = tl.join(tl.join(O0, O2), tl.join(O1, O3))
        w = tl.reshape(tl.join(ev, od), (BN, 8 * BG))  # element 4s + 2t + l: natural order
    else:
        P = tl.join(tl.join(R0, R2), tl.join(R1, R3))  # [BN, BG, s, t]: pair 2s + t
        lanes = tl.join(P.to(tl.int16), (P >> 16).to(tl.int16))  # [..., l]: element 4s + 2t + l
        w = tl.reshape(lanes.to(tl.bfloat16, bitcast=True), (BN, 8 * BG))
    return w


@triton.jit(do_not_specialize=["M"])
def _w12_mm_kernel(x_ptr, m64_ptr, c32_ptr, y_ptr, ws_ptr, lock_ptr,
                   rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr,
                   M, N, K, base2, v0, scale,
                   BM: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
                   SPLIT_K: tl.constexpr, ESC_B: tl.constexpr, INTERPRET: tl.constexpr,
                   REG_PF: tl.constexpr, X_LEFT: tl.constexpr, DECODE: tl.constexpr):
    """Tensor-core product. X_LEFT=False: acc[BN, BM] = W @ x.T (W the left operand, swap-AB);
    X_LEFT=True: acc[BM, BN] = x @ W.T. REG_PF: weights of step i+1 requested before step i is
    decoded (register prefetch, for num_stages=1); else Triton's own pipelining (num_stages).
    DECODE: 0 "base" (true weights), 1 "raw", 2 "prmt" (raw weights; acc scaled by ``scale`` at the end)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    G, g_lo, g_hi, n0, offs_n, mask_n = _tile_prologue(pid_n, pid_k, N, K, BN, BG, SPLIT_K)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_g = tl.arange(0, BG)
    offs_k = tl.arange(0, 8 * BG)
    m_row = m64_ptr + offs_n[:, None] * G + offs_g[None, :]
    c_row = c32_ptr + offs_n[:, None] * G + offs_g[None, :]

    if X_LEFT:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    if REG_PF:  # the first tile first; the escapes' row range next (its latency hides in the loop)
        mw = tl.load(m_row + g_lo, mask=mask_n[:, None] & (g_lo + offs_g[None, :] < g_hi), other=0,
                     eviction_policy="evict_first")
        C = tl.load(c_row + g_lo, mask=mask_n[:, None] & (g_lo + offs_g[None, :] < g_hi), other=0,
                    eviction_policy="evict_first")
    e_lo = tl.load(rowptr_ptr + n0)
    e_hi = tl.load(rowptr_ptr + tl.minimum(n0 + BN, N))
    for g0 in range(g_lo, g_hi, BG):
        if REG_PF:
            g1 = g0 + BG
            mw_next = tl.load(m_row + g1, mask=mask_n[:, None] & (g1 + offs_g[None, :] < g_hi),
                              other=0, eviction_policy="evict_first")
            C_next = tl.load(c_row + g1, mask=mask_n[:, None] & (g1 + offs_g[None, :] < g_hi), other=0,
                             eviction_policy="evict_first")
        else:
            mw = tl.load(m_row + g0, mask=mask_n[:, None] & (g0 + offs_g[None, :] < g_hi), other=0)
            C = tl.load(c_row + g0, mask=mask_n[:, None] & (g0 + offs_g[None, :] < g_hi), other=0)
        w = _decode_tile_bf16(mw, C, base2, BN, BG, DECODE, INTERPRET)
        k = 8 * g0 + offs_k
        if X_LEFT:
            xa = tl.load(x_ptr + offs_m[:, None] * K + k[None, :],
                         mask=mask_m[:, None] & (k[None, :] < 8 * g_hi), other=0.0)  # [BM, 8BG]
            if INTERPRET:  # the CPU interpreter mis-multiplies bf16 dots (triton 3.6); exact fp32 instead
                acc = tl.dot(xa.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xa, tl.trans(w), acc)
        else:
            xt = tl.load(x_ptr + offs_m[None, :] * K + k[:, None],
                         mask=mask_m[None, :] & (k[:, None] < 8 * g_hi), other=0.0)  # [8BG, BM]
            if INTERPRET:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        if REG_PF:
            mw = mw_next
            C = C_next

    if DECODE != 0:  # raw weights: w = w_raw * 2**(base - 112), exact (see the module docstring)
        acc = acc * scale
    if pid_k == 0:  # escapes of these rows: + x*val - x*v0, exact products, fp32 sum
        offs_e = tl.arange(0, ESC_B)
        for e0 in range(e_lo, e_hi, ESC_B):
            e = e0 + offs_e
            me = e < e_hi
            r = tl.load(erow_ptr + e, mask=me, other=-1) - n0
            c = tl.load(ecol_ptr + e, mask=me, other=0)
            v = tl.load(eval_ptr + e, mask=me, other=0.0).to(tl.float32)
            if X_LEFT:
                xv = tl.load(x_ptr + offs_m[:, None] * K + c[None, :],
                             mask=mask_m[:, None] & me[None, :], other=0.0).to(tl.float32)  # [BM, E]
                d = xv * v[None, :] - xv * v0
                hit = (r[:, None] == tl.arange(0, BN)[None, :]).to(tl.float32)  # [E, BN]
                acc = tl.dot(d, hit, acc, input_precision="ieee")
            else:
                xv = tl.load(x_ptr + offs_m[None, :] * K + c[:, None],
                             mask=mask_m[None, :] & me[:, None], other=0.0).to(tl.float32)  # [E, BM]
                d = xv * v[:, None] - xv * v0
                hit = (tl.arange(0, BN)[:, None] == r[None, :]).to(tl.float32)  # [BN, E]
                acc = tl.dot(hit, d, acc, input_precision="ieee")

    tile = pid_m * tl.num_programs(0) + pid_n
    if X_LEFT:
        y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
    else:
        y_ptrs = y_ptr + offs_m[None, :] * N + offs_n[:, None]
        ws_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        mask = mask_m[None, :] & mask_n[:, None]
    _finish(acc, y_ptrs, ws_ptrs, M * N, mask, lock_ptr, tile, pid_k, SPLIT_K)


# --------------------------------------------------------------------------------------------
# host code
# --------------------------------------------------------------------------------------------


class EscapeCSR(NamedTuple):
    """Escapes of one matrix by row: ``rowptr`` int32 [N+1], ``row``/``col`` int32 [E], ``val`` bf16 [E].

    Each array has at least one element (kernels need a valid pointer even when E = 0).
    """

    rowptr: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor


def prepare_escapes(escape_idx: torch.Tensor, escape_val: torch.Tensor, n: int, k: int) -> EscapeCSR:
    """Row-sorted escape lists for the fused kernels, from the format's flat escape indices.

    Args:
        escape_idx: int64 [E] flat indices ``row * k + col`` (any order).
        escape_val: bf16 [E] exact values.
        n, k: the matrix shape.
    """
    dev = escape_idx.device
    idx = escape_idx.to(torch.int64)
    order = torch.argsort(idx)
    idx = idx[order]
    val = escape_val[order].to(torch.bfloat16)
    row = idx // k
    col = idx - row * k
    counts = torch.bincount(row, minlength=n) if idx.numel() else torch.zeros(n, dtype=torch.int64, device=dev)
    rowptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    rowptr[1:] = counts.cumsum(0).to(torch.int32)
    pad = lambda t, dt: t.to(dt) if t.numel() else torch.zeros(1, dtype=dt, device=dev)  # noqa: E731
    return EscapeCSR(rowptr, pad(row, torch.int32), pad(col, torch.int32), pad(val, torch.bfloat16))


@dataclass(frozen=True)
class Config:
    """One launch configuration of :func:`matmul`.

    kind: ``"gemv"`` (CUDA cores, M <= 8) or a tensor-core kind (any M): ``"mm"`` (W the left
    operand, Triton's pipelining), ``"mmr"`` (W left, register prefetch), ``"mmx"`` (x left, register
    prefetch); block_n: rows of W per
    program; block_g: groups of 8 weights per K step (K tile = 8 * block_g); split_k: K slices;
    num_warps, num_stages: Triton launch options.

    decode: how the fused kernel decodes weights. ``"raw"`` (default): to raw bf16 with exponent
    field 112 + c, independent of the base (about 5 integer ops per pair of weights, and the
    tensor-core kinds split the pair words into bf16 lanes by truncation, without fp32
    conversions), the fp32 accumulator then scaled by 2**(base - 112); bit-identical to ``"base"``
    (see the module docstring). ``"base"``: the true bf16 bits (exponent base + c, about 8 ops per
    pair; the tensor-core tile built through fp32), kept for comparison. ``"prmt"``: ``"raw"`` with
    the sign move done by one PTX ``prmt`` per pair (4 ops per pair; CUDA only, the interpreter
    runs the plain raw formula). ``key()`` names the decode only when it is not ``"raw"``, so keys
    and tuned tables written before this field existed keep their meaning (then: the raw decode).
    """

    kind: str
    block_n: int
    block_g: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    decode: str = "raw"

    def key(self) -> str:
        k = f"{self.kind}-n{self.block_n}-g{self.block_g}-s{self.split_k}-w{self.num_warps}-st{self.num_stages}"
        return k if self.decode == "raw" else f"{k}-d{self.decode}"

    @classmethod
    def from_key(cls, key: str) -> Config:
        """The config a :meth:`key` string names (inverse of :meth:`key`)."""
        kind, *parts = key.split("-")
        vals: dict = {}
        for tag, field in (("st", "num_stages"), ("n", "block_n"), ("g", "block_g"), ("s", "split_k"),
                           ("w", "num_warps")):
            for p in parts:
                if p.startswith(tag) and p[len(tag):].isdigit() and field not in vals:
                    vals[field] = int(p[len(tag):])
                    parts.remove(p)
                    break
        for p in parts:
            if p.startswith("d") and p[1:] in DECODES:
                vals["decode"] = p[1:]
                parts.remove(p)
                break
        if parts or kind not in ("gemv",) + MM_KINDS or len(vals) < 5:
            raise ValueError(f"w12: not a config key: {key!r}")
        return cls(kind, **vals)


DECODES = {"base": 0, "raw": 1, "prmt": 2}  # Config.decode -> the kernels' DECODE constexpr
GEMV_MAX_M = 8
MM_MAX_BM = 64
MM_KINDS = ("mm", "mmr", "mmx")  # W left + Triton pipelining; W left + register prefetch; x left + prefetch

# tuned table: "M_BUCKET,N,K" -> Config (set by load_tuned / set_tuned; written by the benchmark).
# On first use without a table, src/specpilot/kernels/tuned/w12_<gpu>.json (gpu as in specpilot.device, e.g. h200)
# is loaded when present.
_TUNED: dict[str, Config] = {}
_TUNED_TRIED = False
TUNED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def m_bucket(m: int) -> int:
    """The power of two >= m used as the row block and the tuning key (1, 2, 4, ..., 256)."""
    return 1 << max(0, (int(m) - 1).bit_length())


def block_m(config: Config, m: int) -> int:
    """The row block (compile-time BM) a config uses for M rows."""
    if config.kind == "gemv":
        return m_bucket(m)
    return min(max(16, m_bucket(m)), MM_MAX_BM)


def set_tuned(table: dict[str, dict]) -> None:
    """Install tuned configs: ``{"M_BUCKET,N,K": {Config fields}}`` (as written by the benchmark)."""
    global _TUNED_TRIED
    _TUNED_TRIED = True
    _TUNED.clear()
    fields = set(Config.__dataclass_fields__)
    for key, cfg in table.items():
        _TUNED[key] = Config(**{f: v for f, v in cfg.items() if f in fields})


def load_tuned(path: str | os.PathLike) -> None:
    """Read a tuned-config JSON file (``{"configs": {...}}`` or a bare table) into :func:`set_tuned`."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    set_tuned(obj.get("configs", obj))


def tuned_table() -> dict[str, dict]:
    """The installed tuned configs as JSON-ready dicts."""
    return {k: asdict(c) for k, c in _TUNED.items()}


def _load_default_tuned(device: torch.device) -> None:
    name = torch.cuda.get_device_name(device).lower()
    for gpu in ("gh200", "h200", "h100"):
        if gpu in name.split() or f" {gpu} " in f" {name} ":
            path = os.path.join(TUNED_DIR, f"w12_{gpu}.json")
            if os.path.isfile(path):
                load_tuned(path)
            return


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_for(tiles: int, groups: int, block_g: int, sms: int, target: float = 2.0) -> int:
    split = 1
    while tiles * split < target * sms and split < 16 and groups // (block_g * split * 2) >= 1:
        split *= 2
    return split


def default_config(m: int, n: int, k: int, device: torch.device | None = None) -> Config:
    """The config :func:`matmul` uses: the tuned one for (M bucket, N, K) if installed, else a heuristic."""
    global _TUNED_TRIED
    if not _TUNED_TRIED and device is not None and device.type == "cuda":
        _TUNED_TRIED = True
        _load_default_tuned(device)
    mb = m_bucket(m)
    for b in (mb, 2 * mb, 4 * mb, 8 * mb):  # the tuned M bucket, else the nearest larger one tuned
        cfg = _TUNED.get(f"{b},{n},{k}")
        if cfg is not None and (cfg.kind != "gemv" or mb <= GEMV_MAX_M):
            return cfg
    sms = _sm_count(device) if device is not None and device.type == "cuda" else 132
    g = k // 8
    if mb <= GEMV_MAX_M:
        bn, bg = 8, 64
        return Config("gemv", bn, bg, _split_for(triton.cdiv(n, bn), g, bg, sms), 4, 1)
    bm = min(mb, MM_MAX_BM)
    bn, bg = 64, 16
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    return Config("mm", bn, bg, _split_for(tiles, g, bg, sms), 4, 2)


_GEMV_SHAPES = ((2, 128, 4), (4, 64, 4), (8, 64, 4), (16, 32, 4), (16, 64, 4), (32, 32, 4), (8, 128, 8),
                (16, 64, 8), (4, 128, 4))  # (block_n, block_g, num_warps), num_stages 1
_MM_SHAPES = (("mm", 64, 16, 4, 3), ("mm", 64, 16, 4, 2), ("mm", 16, 32, 4, 2), ("mm", 64, 32, 4, 2),
              ("mmr", 64, 16, 4, 1), ("mmr", 64, 32, 4, 1), ("mmr", 128, 16, 8, 1), ("mmr", 32, 32, 4, 1),
              ("mmx", 64, 16, 4, 1), ("mmx", 128, 16, 4, 1), ("mmx", 64, 32, 4, 1), ("mmx", 256, 16, 8, 1))
# the H200's frequent winners (src/specpilot/kernels/tuned/w12_h200.json): the quick subset, and the shapes also
# tried with the "base" and "prmt" decodes, side by side with "raw"
_GEMV_QUICK = ((2, 128, 4), (16, 32, 4), (16, 64, 4), (32, 32, 4), (8, 128, 8))
_MM_QUICK = (("mm", 16, 32, 4, 2), ("mmr", 32, 32, 4, 1), ("mmx", 64, 16, 4, 1), ("mmx", 64, 32, 4, 1))
_GEMV_TWINS = ((2, 128, 4), (8, 128, 8))
_MM_TWINS = (("mmx", 64, 16, 4, 1),)


def candidate_configs(m: int, n: int, k: int, quick: bool = False,
                      decodes: tuple[str, ...] = ("base", "prmt")) -> list[Config]:
    """The configs the benchmark tries for one (M, N, K) (split-K chosen to fill 132 SMs).

    Every shape with the default "raw" decode first; then, for comparison, a few shapes
    (``_GEMV_TWINS``, ``_MM_TWINS``) again with each decode of ``decodes``. ``quick``: only the
    shapes that won most often on the H200.
    """
    mb = m_bucket(m)
    g = k // 8
    out: list[Config] = []

    def gemv(shapes, decode):
        for bn, bg, w in shapes:
            tiles = triton.cdiv(n, bn)
            for split in sorted({1, _split_for(tiles, g, bg, 132, 1.0), _split_for(tiles, g, bg, 132, 3.0)}):
                out.append(Config("gemv", bn, bg, split, w, 1, decode))

    def mm(shapes, decode):
        bm = min(max(16, mb), MM_MAX_BM)
        for kind, bn, bg, w, st in shapes:
            tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
            for split in sorted({1, _split_for(tiles, g, bg, 132, 1.0), _split_for(tiles, g, bg, 132, 3.0)}):
                out.append(Config(kind, bn, bg, split, w, st, decode))

    if mb <= GEMV_MAX_M:
        gemv(_GEMV_QUICK if quick else _GEMV_SHAPES, "raw")
    mm(_MM_QUICK if quick else _MM_SHAPES, "raw")
    for dec in decodes:
        if mb <= GEMV_MAX_M:
            gemv(_GEMV_TWINS, dec)
        mm(_MM_TWINS, dec)
    return out


_SCRATCH: dict[tuple, torch.Tensor] = {}
_KEEP: list[torch.Tensor] = []  # outgrown scratch stays alive: captured CUDA graphs may point at it


def _scratch(device: torch.device, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    key = (device.index, name)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _KEEP.append(buf)
        buf = torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf


def _check_operands(x: torch.Tensor, mant: torch.Tensor, codes: torch.Tensor) -> tuple[int, int, int]:
    n, k = mant.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"w12 matmul: x must be bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if k % 8 or codes.shape != (n, k // 2) or mant.dtype != torch.uint8 or codes.dtype != torch.uint8:
        raise ValueError(f"w12 matmul: bad packed weight: mant {tuple(mant.shape)}, codes {tuple(codes.shape)}")
    if n * k >= 2**31:
        raise ValueError(f"w12 matmul: N*K = {n * k} exceeds int32 indexing")
    for name, t in (("x", x), ("mant", mant), ("codes", codes)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"w12 matmul: {name} must be contiguous and 16-byte aligned (the kernels read "
                             f"it as 64-bit words), got strides {t.stride()} at address {t.data_ptr():#x}")
    return x.shape[0], n, k


def decode(mant: torch.Tensor, codes: torch.Tensor, base: int, escape_idx: torch.Tensor,
           escape_val: torch.Tensor, out: torch.Tensor | None = None, block: int = 512) -> torch.Tensor:
    """Decode a packed matrix to bf16 on the GPU, bit-exact.

    Args:
        mant: uint8 [N, K] contiguous; codes: uint8 [N, K/2] contiguous; base: the tensor's base.
        escape_idx: int64 [E] flat indices; escape_val: bf16 [E].
        out: optional bf16 [N, K] contiguous destination.

    Returns:
        bf16 [N, K] (``out`` if given).
    """
    n, k = mant.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16, device=mant.device)
    n_groups = n * k // 8
    grid = (triton.cdiv(n_groups, block),)
    _w12_decode_kernel[grid](mant.view(torch.int32), codes.view(torch.int32), out.view(torch.int32),
                             n_groups, int(base) * 0x01010101, BLOCK=block, num_warps=4)
    if escape_idx.numel():
        out.view(-1)[escape_idx] = escape_val
    return out


def matmul(x: torch.Tensor, mant: torch.Tensor, codes: torch.Tensor, base: int, esc: EscapeCSR,
           config: Config | None = None, out: torch.Tensor | None = None, esc_block: int = 32) -> torch.Tensor:
    """``y = x @ W.T`` with W in the 12-bit format, decoded on the fly (fp32 accumulation).

    Args:
        x: bf16 [M, K] contiguous (rows of activations).
        mant, codes, base: the packed W [N, K] (see ``specpilot.w12.format``).
        esc: :func:`prepare_escapes` of W's escapes.
        config: launch config; default :func:`default_config`. A ``gemv`` config needs M <= 8.
        out: optional bf16 [M, N] contiguous destination.

    Returns:
        bf16 [M, N].

    Raises:
        ValueError: shapes/dtypes do not match, or a gemv config with M > 8.
    """
    m, n, k = _check_operands(x, mant, codes)
    if config is None:
        config = default_config(m, n, k, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    base2 = int(base) * 0x00800080
    v0 = 2.0 ** (int(base) - 127)
    scale = 2.0 ** (int(base) - 112)  # raw decode: w = w_raw * scale (exact power of two in fp32)
    dec = DECODES.get(config.decode)
    if dec is None:
        raise ValueError(f"w12 matmul: unknown decode {config.decode!r} (one of {sorted(DECODES)})")
    s = config.split_k
    ws = _scratch(x.device, "ws", s * m * n if s > 1 else 1, torch.float32)
    if config.kind == "gemv":
        bm = m_bucket(m)
        if bm > GEMV_MAX_M:
            raise ValueError(f"w12 matmul: gemv config needs M <= {GEMV_MAX_M}, got {m}")
        tiles = triton.cdiv(n, config.block_n)
        lock = _scratch(x.device, "lock", tiles, torch.int32)
        grid = (tiles, s)
        g = k // 8
        _w12_gemv_kernel[grid](x, x.view(torch.int64), mant.view(torch.int64), codes.view(torch.int32), out, ws,
                               lock, esc.rowptr, esc.row, esc.col, esc.val, m, n, k, base2, v0, scale,
                               BM=bm, BN=config.block_n, BG=config.block_g, SPLIT_K=s, ESC_B=esc_block,
                               DECODE=dec, INTERPRET=_interpreting(),
                               EVEN_K=g % (config.block_g * s) == 0, EVEN_N=n % config.block_n == 0,
                               num_warps=config.num_warps, num_stages=config.num_stages)
    elif config.kind in MM_KINDS:
        bm = min(max(16, m_bucket(m)), MM_MAX_BM)
        tiles_n = triton.cdiv(n, config.block_n)
        tiles_m = triton.cdiv(m, bm)
        lock = _scratch(x.device, "lock", tiles_n * tiles_m, torch.int32)
        grid = (tiles_n, tiles_m, s)
        _w12_mm_kernel[grid](x, mant.view(torch.int64), codes.view(torch.int32), out, ws, lock,
                             esc.rowptr, esc.row, esc.col, esc.val, m, n, k, base2, v0, scale,
                             BM=bm, BN=config.block_n, BG=config.block_g, SPLIT_K=s, ESC_B=max(16, esc_block),
                             INTERPRET=_interpreting(), REG_PF=config.kind != "mm", X_LEFT=config.kind == "mmx",
                             DECODE=dec,
                             num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        raise ValueError(f"w12 matmul: unknown config kind {config.kind!r}")
    return out

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
use from ``kernels/tuned/w12_<gpu>.json`` when present, else a heuristic). On the H200 the fused
kernels beat cuBLAS bf16 at M = 1 (1.14-1.29x per shape) but not at M >= 4 (0.7-0.9x): see
BENCHMARKS.md, section "12-bit weights (issue 6)".

Decode: a program loads per group of 8 weights two uint32 words of sign+mantissa bytes and one
uint32 word of codes, and builds each pair of bf16 values in one 32-bit word
(``R = (T & 0x00800080) * 255 + T + X * 128 + base * 0x00800080``; about 4 integer ops per
weight), the fixed-width split layout of Turbo-Lossless (cenconq25/Turbo-Lossless,
docs/TECHNICAL.md) with a two-lanes-at-once decode in the spirit of NyoomFloat12's short SIMT
decode (openreview.net/forum?id=yYFj1E1mSZ). No code is taken from either.

Escapes (code 0) decode in bulk to ``v0 = 2**(base-127)`` (their stored byte is 0); the fused
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
    """Four bf16x2 words (pairs 0-1, 2-3, 4-5, 6-7 of a group) from 2 mantissa words + 1 code word."""
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
def _w12_decode_kernel(m32_ptr, c32_ptr, out32_ptr, n_groups, base2, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    w2 = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    mw = tl.load(m32_ptr + w2, mask=w2 < 2 * n_groups, other=0)
    A, B = tl.split(tl.reshape(mw, (BLOCK, 2)))
    g = pid * BLOCK + tl.arange(0, BLOCK)
    C = tl.load(c32_ptr + g, mask=g < n_groups, other=0)
    R0, R1, R2, R3 = _decode_pairs(A, B, C, base2)
    R = tl.reshape(tl.join(tl.join(R0, R2), tl.join(R1, R3)), (4 * BLOCK,))
    w4 = pid * (4 * BLOCK) + tl.arange(0, 4 * BLOCK)
    tl.store(out32_ptr + w4, R, mask=w4 < 4 * n_groups)


@triton.jit
def _row_fma(acc, R0, R1, R2, R3, x32_row, g, mg):
    """acc[BN, BG] += the 8 products of each group with one row of x (bf16 pairs at word 4g + p)."""
    X0 = tl.load(x32_row + 4 * g + 0, mask=mg, other=0)[None, :]
    X1 = tl.load(x32_row + 4 * g + 1, mask=mg, other=0)[None, :]
    X2 = tl.load(x32_row + 4 * g + 2, mask=mg, other=0)[None, :]
    X3 = tl.load(x32_row + 4 * g + 3, mask=mg, other=0)[None, :]
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


@triton.jit(do_not_specialize=["M"])
def _w12_gemv_kernel(x_ptr, x32_ptr, m32_ptr, c32_ptr, y_ptr, ws_ptr, lock_ptr,
                     rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr,
                     M, N, K, base2, v0,
                     BM: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
                     SPLIT_K: tl.constexpr, ESC_B: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    G = K // 8
    g_per = tl.cdiv(tl.cdiv(G, SPLIT_K), BG) * BG
    g_lo = pid_k * g_per
    g_hi = tl.minimum(G, g_lo + g_per)

    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_w = tl.arange(0, 2 * BG)
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
    # escapes of these rows (split 0 only): the first ESC_B are requested now, used after the loop,
    # so their dependent loads (row pointer -> escape list -> x) hide behind the weight stream
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    e_lo = tl.load(rowptr_ptr + n0)
    e_hi = tl.load(rowptr_ptr + tl.minimum(n0 + BN, N))
    er, ev, exv = _esc_chunk(rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr, x_ptr, offs_m, mask_m, K, e_lo, e_hi,
                             n0, pid_k == 0, ESC_B)

    # software pipelining by hand (Triton pipelines only loads that feed tl.dot): the weights of
    # step i+1 are requested before step i is decoded.
    m_row = m32_ptr + offs_n[:, None] * (2 * G) + offs_w[None, :]
    c_row = c32_ptr + offs_n[:, None] * G + offs_g[None, :]
    mw = tl.load(m_row + 2 * g_lo, mask=mask_n[:, None] & (2 * g_lo + offs_w[None, :] < 2 * g_hi), other=0,
                 eviction_policy="evict_first")
    C = tl.load(c_row + g_lo, mask=mask_n[:, None] & (g_lo + offs_g[None, :] < g_hi), other=0,
                eviction_policy="evict_first")
    for g0 in range(g_lo, g_hi, BG):
        g1 = g0 + BG
        mw_next = tl.load(m_row + 2 * g1, mask=mask_n[:, None] & (2 * g1 + offs_w[None, :] < 2 * g_hi), other=0,
                          eviction_policy="evict_first")
        C_next = tl.load(c_row + g1, mask=mask_n[:, None] & (g1 + offs_g[None, :] < g_hi), other=0,
                         eviction_policy="evict_first")
        A, B = tl.split(tl.reshape(mw, (BN, BG, 2)))
        g = g0 + offs_g
        mg = g < g_hi
        R0, R1, R2, R3 = _decode_pairs(A, B, C, base2)
        a0 = _row_fma(a0, R0, R1, R2, R3, x32_ptr, g, mg)
        if BM > 1:
            a1 = _row_fma(a1, R0, R1, R2, R3, x32_ptr + 4 * G, g, mg & (1 < M))
        if BM > 2:
            a2 = _row_fma(a2, R0, R1, R2, R3, x32_ptr + 8 * G, g, mg & (2 < M))
            a3 = _row_fma(a3, R0, R1, R2, R3, x32_ptr + 12 * G, g, mg & (3 < M))
        if BM > 4:
            a4 = _row_fma(a4, R0, R1, R2, R3, x32_ptr + 16 * G, g, mg & (4 < M))
            a5 = _row_fma(a5, R0, R1, R2, R3, x32_ptr + 20 * G, g, mg & (5 < M))
            a6 = _row_fma(a6, R0, R1, R2, R3, x32_ptr + 24 * G, g, mg & (6 < M))
            a7 = _row_fma(a7, R0, R1, R2, R3, x32_ptr + 28 * G, g, mg & (7 < M))
        mw = mw_next
        C = C_next

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
def _decode_tile_bf16(mw, C, base2, BN: tl.constexpr, BG: tl.constexpr):
    """The bf16 tile [BN, 8*BG] (natural k order) of BN rows x BG groups of packed words."""
    A, B = tl.split(tl.reshape(mw, (BN, BG, 2)))
    R0, R1, R2, R3 = _decode_pairs(A, B, C, base2)
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
    return tl.reshape(tl.join(ev, od), (BN, 8 * BG))  # element 4s + 2t + l: natural order


@triton.jit(do_not_specialize=["M"])
def _w12_mm_kernel(x_ptr, m32_ptr, c32_ptr, y_ptr, ws_ptr, lock_ptr,
                   rowptr_ptr, erow_ptr, ecol_ptr, eval_ptr,
                   M, N, K, base2, v0,
                   BM: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr,
                   SPLIT_K: tl.constexpr, ESC_B: tl.constexpr, INTERPRET: tl.constexpr,
                   REG_PF: tl.constexpr, X_LEFT: tl.constexpr):
    """Tensor-core product. X_LEFT=False: acc[BN, BM] = W @ x.T (W the left operand, swap-AB);
    X_LEFT=True: acc[BM, BN] = x @ W.T. REG_PF: weights of step i+1 requested before step i is
    decoded (register prefetch, for num_stages=1); else Triton's own pipelining (num_stages)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    G = K // 8
    g_per = tl.cdiv(tl.cdiv(G, SPLIT_K), BG) * BG
    g_lo = pid_k * g_per
    g_hi = tl.minimum(G, g_lo + g_per)

    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_w = tl.arange(0, 2 * BG)
    offs_g = tl.arange(0, BG)
    offs_k = tl.arange(0, 8 * BG)
    m_row = m32_ptr + offs_n[:, None] * (2 * G) + offs_w[None, :]
    c_row = c32_ptr + offs_n[:, None] * G + offs_g[None, :]

    if X_LEFT:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    if REG_PF:
        mw = tl.load(m_row + 2 * g_lo, mask=mask_n[:, None] & (2 * g_lo + offs_w[None, :] < 2 * g_hi), other=0,
                     eviction_policy="evict_first")
        C = tl.load(c_row + g_lo, mask=mask_n[:, None] & (g_lo + offs_g[None, :] < g_hi), other=0,
                    eviction_policy="evict_first")
    for g0 in range(g_lo, g_hi, BG):
        if REG_PF:
            g1 = g0 + BG
            mw_next = tl.load(m_row + 2 * g1, mask=mask_n[:, None] & (2 * g1 + offs_w[None, :] < 2 * g_hi),
                              other=0, eviction_policy="evict_first")
            C_next = tl.load(c_row + g1, mask=mask_n[:, None] & (g1 + offs_g[None, :] < g_hi), other=0,
                             eviction_policy="evict_first")
        else:
            mw = tl.load(m_row + 2 * g0, mask=mask_n[:, None] & (2 * g0 + offs_w[None, :] < 2 * g_hi), other=0)
            C = tl.load(c_row + g0, mask=mask_n[:, None] & (g0 + offs_g[None, :] < g_hi), other=0)
        w = _decode_tile_bf16(mw, C, base2, BN, BG)
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

    if pid_k == 0:  # escapes of these rows: + x*val - x*v0, exact products, fp32 sum
        e_lo = tl.load(rowptr_ptr + n0)
        e_hi = tl.load(rowptr_ptr + tl.minimum(n0 + BN, N))
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
    """

    kind: str
    block_n: int
    block_g: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def key(self) -> str:
        return f"{self.kind}-n{self.block_n}-g{self.block_g}-s{self.split_k}-w{self.num_warps}-st{self.num_stages}"


GEMV_MAX_M = 8
MM_MAX_BM = 64
MM_KINDS = ("mm", "mmr", "mmx")  # W left + Triton pipelining; W left + register prefetch; x left + prefetch

# tuned table: "M_BUCKET,N,K" -> Config (set by load_tuned / set_tuned; written by the benchmark).
# On first use without a table, kernels/tuned/w12_<gpu>.json (gpu as in specpilot.device, e.g. h200)
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


def candidate_configs(m: int, n: int, k: int) -> list[Config]:
    """The configs the benchmark tries for one (M, N, K) (split-K chosen to fill 132 SMs)."""
    mb = m_bucket(m)
    g = k // 8
    out = []
    if mb <= GEMV_MAX_M:
        for bn, bg, w in ((2, 128, 4), (4, 64, 4), (8, 64, 4), (16, 32, 4), (16, 64, 4), (32, 32, 4),
                          (8, 128, 8), (16, 64, 8), (4, 128, 4)):
            tiles = triton.cdiv(n, bn)
            for split in sorted({1, _split_for(tiles, g, bg, 132, 1.0), _split_for(tiles, g, bg, 132, 3.0)}):
                out.append(Config("gemv", bn, bg, split, w, 1))
    bm = min(max(16, mb), MM_MAX_BM)
    mm_shapes = (("mm", 64, 16, 4, 3), ("mm", 64, 16, 4, 2), ("mm", 16, 32, 4, 2), ("mm", 64, 32, 4, 2),
                 ("mmr", 64, 16, 4, 1), ("mmr", 64, 32, 4, 1), ("mmr", 128, 16, 8, 1), ("mmr", 32, 32, 4, 1),
                 ("mmx", 64, 16, 4, 1), ("mmx", 128, 16, 4, 1), ("mmx", 64, 32, 4, 1), ("mmx", 256, 16, 8, 1))
    for kind, bn, bg, w, st in mm_shapes:
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        for split in sorted({1, _split_for(tiles, g, bg, 132, 1.0), _split_for(tiles, g, bg, 132, 3.0)}):
            out.append(Config(kind, bn, bg, split, w, st))
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
                             n_groups, int(base) * 0x00800080, BLOCK=block, num_warps=4)
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
    s = config.split_k
    ws = _scratch(x.device, "ws", s * m * n if s > 1 else 1, torch.float32)
    if config.kind == "gemv":
        bm = m_bucket(m)
        if bm > GEMV_MAX_M:
            raise ValueError(f"w12 matmul: gemv config needs M <= {GEMV_MAX_M}, got {m}")
        tiles = triton.cdiv(n, config.block_n)
        lock = _scratch(x.device, "lock", tiles, torch.int32)
        grid = (tiles, s)
        _w12_gemv_kernel[grid](x, x.view(torch.int32), mant.view(torch.int32), codes.view(torch.int32), out, ws,
                               lock, esc.rowptr, esc.row, esc.col, esc.val, m, n, k, base2, v0,
                               BM=bm, BN=config.block_n, BG=config.block_g, SPLIT_K=s, ESC_B=esc_block,
                               num_warps=config.num_warps, num_stages=config.num_stages)
    elif config.kind in MM_KINDS:
        bm = min(max(16, m_bucket(m)), MM_MAX_BM)
        tiles_n = triton.cdiv(n, config.block_n)
        tiles_m = triton.cdiv(m, bm)
        lock = _scratch(x.device, "lock", tiles_n * tiles_m, torch.int32)
        grid = (tiles_n, tiles_m, s)
        _w12_mm_kernel[grid](x, mant.view(torch.int32), codes.view(torch.int32), out, ws, lock,
                             esc.rowptr, esc.row, esc.col, esc.val, m, n, k, base2, v0,
                             BM=bm, BN=config.block_n, BG=config.block_g, SPLIT_K=s, ESC_B=max(16, esc_block),
                             INTERPRET=_interpreting(), REG_PF=config.kind != "mm", X_LEFT=config.kind == "mmx",
                             num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        raise ValueError(f"w12 matmul: unknown config kind {config.kind!r}")
    return out

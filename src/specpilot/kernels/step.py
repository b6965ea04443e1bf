"""Triton kernels of the CUDA fast path: one decode / verify step of a Qwen3 / Llama target.

A step of T tokens per row (T = 1 for AR decode, the block size for verification) is memory-bound:
it streams every weight once. Per layer it runs 7 kernels:

1. ``linear`` with an RMSNorm prologue: ``qkv = norm(x) @ Wqkv.T`` (q, k, v weights fused);
2. ``qk_rope_cache``: q/k RMSNorm (Qwen3), RoPE, K/V written into the static cache;
3. ``attn_partial`` + ``attn_combine``: split-KV attention over the committed prefix plus the
   block's own chain (flash-decoding style; chunks past ``start + T`` are skipped, so the KV bytes
   read are those of the actual context, not of the static cache);
4. ``linear`` with a residual epilogue: ``x = x + attn @ Wo.T``;
5. ``linear`` with norm prologue and SwiGLU epilogue: ``h = silu(norm(x) @ Wg.T) * (norm(x) @ Wu.T)``;
6. ``linear`` with residual epilogue: ``x = x + h @ Wd.T``.

Rows per tile (M-aware): a matmul over M rows runs row tiles of ``BM`` = the smallest of 16, 32,
64, 128, 256 that covers M, capped by the config's ``bm``; so a verify of 64 or 256 rows streams
each weight tile once per 64 / ``bm`` rows instead of once per 16 rows (which made a 256-row verify
cost 6.4x a 16-row one on the H200).

Row independence ("batch invariance"): every kernel computes each output row with the same
arithmetic whatever the number of rows M: the reduction over K runs in the same order (K steps of
``bk``, ascending, accumulated in fp32 by the tensor cores; no split-K), the row tile only changes
how many rows share a weight tile, never a row's sum, and the KV chunks of attention depend on the
cache size only. So the logits of a token are bit-identical whether it is decoded alone (AR) or
verified inside a block or a batch. That a tile of more rows (or another column / K tiling of the
tensor-core product) leaves each row's bits unchanged is a property of the hardware's MMA, not of
the language: ``specpilot bench verify`` checks it on the GPU for every config and M it uses,
and ``tests/test_gpu_path.py`` under the interpreter.

The RMSNorm prologue folds the norm into the matmul: ``y = rstd * ((x * w_norm) @ W.T)``, the
row's sum of squares accumulated from the same x loads, so the norm costs no extra kernel.

Two loaders, one kernel: the matmul reads its weight tile either as bf16 or from lossless 12-bit
tile planes (:mod:`specpilot.w12.planes`, ``W12``), decoded in registers (inline PTX, 17 integer
instructions per 8 weights plus the escape test) into the same bf16 values before the same
``tl.dot``; tiles, K order, prologue and epilogues are shared, so the outputs are the same bits
(issue 48; a decode kept elementwise, so the dot operand layout stays the bf16 kernel's:
:mod:`specpilot.kernels.inspect` reads it from the machine code).

``TRITON_INTERPRET=1`` runs the kernels on the CPU (tests); the interpreter of triton 3.6
mis-multiplies bf16 ``tl.dot``, so the kernels take an exact fp32 dot when interpreting.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..fastpath.tables import BM, CANDIDATES, ROW_TILES, LinearConfig, row_tile  # noqa: F401 (re-used names)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BR = 16  # query rows per attention tile (default; AttnWorkspace(rows=0) picks by block length)
COMBINE_ROWS = 16  # rows per program of the attention combine kernel


@triton.jit
def _interp_dot(a, b):
    """a [M, K] @ b [K, N] in fp32 for the CPU interpreter only: every element summed over k in the
    same order whatever its row or column (numpy's matmul, behind the interpreter's tl.dot, may
    sum a row differently by its position in the tile, so bit-exact comparisons of rows at other
    tile positions would fail for the interpreter's sake alone; on the GPU the MMA order is fixed)."""
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


# One group of 8 weights -> 8 bf16 (4 registers of 2), per instance of the inline PTX below
# (tl.inline_asm_elementwise, pack=8). Operands: $0..$3 the pairs (elements 0-1, 2-3, 4-5, 6-7),
# $4 / $5 the group's sign+mantissa bytes (elements 0-3 / 4-7), $6 its code word (see
# specpilot.w12.planes: the low nibbles of its bytes are the codes of elements 0, 4, 1, 5, the high
# nibbles of 2, 6, 3, 7), $14 the side table's address (64-bit), $22 the base exponent in bits 7-14
# and 23-30 (the other operands repeat these: one per element of the pack).
# Exponents: with l = C & 0x0F0F0F0F and h = C & 0xF0F0F0F0, the codes of a pair move to bits 7-10
# and 23-30 of a word and the base is added in one integer multiply-add each: l * 128 (elements
# 0, 1), h * 8 (2, 3), hi(l * 2^31) = l >> 1 (4, 5), hi(h * 2^27) = h >> 5 (6, 7), + base (no
# carry leaves a field: base + 15 <= 254; what lands outside bits 7-14 / 23-30 is masked).
# Sign and mantissa: a byte permute with sign replication (prmt, modes 0x9180 / 0xB3A2) puts each
# byte's mantissa at bits 0-6 of its lane and its sign at bit 15. One bit select (lop3) merges
# them. An escape group (code word 0) holds in its first mantissa word the byte offset of its 16
# exact bytes in the side table, loaded predicated (no traffic for the others).
_W12_DECODE_ASM = tl.constexpr(
    "{ .reg .b32 l, h, e, s; .reg .b64 a; .reg .pred p;\n"
    "and.b32 l, $6, 0x0F0F0F0F; and.b32 h, $6, 0xF0F0F0F0;\n"
    "prmt.b32 s, $4, $4, 0x9180; mad.lo.u32 e, l, 128, $22; lop3.b32 $0, e, s, 0x7F807F80, 0xE4;\n"
    "prmt.b32 s, $4, $4, 0xB3A2; mad.lo.u32 e, h, 8, $22; lop3.b32 $1, e, s, 0x7F807F80, 0xE4;\n"
    "prmt.b32 s, $5, $5, 0x9180; mad.hi.u32 e, l, 0x80000000, $22; lop3.b32 $2, e, s, 0x7F807F80, 0xE4;\n"
    "prmt.b32 s, $5, $5, 0xB3A2; mad.hi.u32 e, h, 0x08000000, $22; lop3.b32 $3, e, s, 0x7F807F80, 0xE4;\n"
    "setp.eq.u32 p, $6, 0; mad.wide.u32 a, $4, 1, $14;\n"
    "@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [a]; }")
_W12_DECODE_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 2 + ["r"] * 8 + ["l"] * 8 + ["r"] * 8))


@triton.jit
def _w12_weight_tile(m_rows, c_rows, side_ptr, side_addr, kk, g, wmask, gmask, base2, BN: tl.constexpr,
                     BK: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr):
    """The bf16 weight tile [BN, BK] (natural k order) decoded in registers from the tile planes
    of :func:`specpilot.w12.planes.tile_planes` (``m_rows``: uint8 sign+mantissa bytes of the
    tile's rows, natural order; ``c_rows``: int32 code words, one per group of 8): exponent = base
    + code, and a group whose code word is 0 is an escape group, its 8 exact values read from the
    side table (16 bytes at ``side + 16 * index``, index = the group's first mantissa word). The
    values are the weights' bf16 bits exactly, so the tile feeds the same ``tl.dot`` as the bf16
    load would: an elementwise result (no join / reshape before the dot), so the compiler keeps
    the bf16 kernel's dot operand layout (a K order within each MMA identical to the bf16
    kernel's). GPU: :data:`_W12_DECODE_ASM` per group; the interpreter: the same arithmetic
    element by element."""
    BG: tl.constexpr = BK // 8
    if MASKED:
        mant = tl.load(m_rows + kk[None, :], mask=wmask, other=0, eviction_policy="evict_first")  # uint8 [BN, BK]
        C = tl.load(c_rows + g[None, :], mask=gmask, other=1, eviction_policy="evict_first")  # int32 [BN, BG]
    else:
        mant = tl.load(m_rows + kk[None, :], eviction_policy="evict_first")
        C = tl.load(c_rows + g[None, :], eviction_policy="evict_first")
    Cb = tl.reshape(tl.broadcast_to(C[:, :, None], (BN, BG, 8)), (BN, BK))  # each weight: its group's word
    if INTERP:
        i = kk % 8  # element of the group; its code is nibble i // 2 + 4 (i % 2) of the code word
        code = (Cb >> ((i // 2 + 4 * (i % 2)) * 4)[None, :]) & 0xF
        b = mant.to(tl.int32)
        bits = ((b & 0x80) << 8) | ((code + ((base2 >> 7) & 0xFF)) << 7) | (b & 0x7F)
        off = tl.load(m_rows.to(tl.pointer_type(tl.int32)) + ((kk // 8) * 2)[None, :], mask=wmask, other=0)
        side16 = side_ptr.to(tl.pointer_type(tl.int16))
        ev = tl.load(side16 + off // 2 + i[None, :], mask=wmask & (Cb == 0), other=0).to(tl.int32) & 0xFFFF
        bits = tl.where(Cb == 0, ev, bits)
        w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w = tl.inline_asm_elementwise(
            _W12_DECODE_ASM, _W12_DECODE_CONSTRAINTS,
            [mant, Cb, tl.full((BN, BK), side_addr, tl.int64), tl.full((BN, BK), base2, tl.int32)],
            dtype=tl.bfloat16, is_pure=False, pack=8)
    return w


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, r_ptr, nw_ptr,
                   M, N, K, stride_xm, stride_ym, stride_rm, eps,
                   m_ptr, c_ptr, side_ptr, side_addr, base2,
                   NORM: tl.constexpr, RES: tl.constexpr, SWIGLU: tl.constexpr,
                   BM_: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   INTERP: tl.constexpr, W12: tl.constexpr = False, EVEN_N: tl.constexpr = False):
    """y[M, N] = epilogue(prologue(x)[M, K] @ W[N, K].T); SWIGLU: W is [2N, K] (gate rows, then up rows).

    W12: the weight comes from the 12-bit tile planes (``m_ptr`` uint8 [N, K] sign+mantissa
    bytes, ``c_ptr`` int32 [N, K/8] code words, ``side_ptr`` int32 escape words at the address
    ``side_addr``, ``base2`` the base exponent at bits 7-14 and 23-30 of an int32; ``w_ptr``
    unused), decoded to the same bf16 values in registers
    (:func:`_w12_weight_tile`); everything else (tiles, K order, dot, prologue, epilogues) is the
    bf16 kernel's, so the output is the bf16 kernel's bit for bit."""
    pid_m = tl.program_id(0)  # fastest: the row tiles that share a weight tile run side by side
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM_ + tl.arange(0, BM_)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if W12:
        G = K // 8
        offs_g = tl.arange(0, BK // 8)
        m_rows = m_ptr + offs_n[:, None].to(tl.int64) * K
        c_rows = c_ptr + offs_n[:, None].to(tl.int64) * G
    else:
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros((BN, BM_), dtype=tl.float32)
    acc2 = tl.zeros((BN, BM_), dtype=tl.float32)
    ss = tl.zeros((BM_,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        if EVEN_K:  # K % BK == 0: no K mask (the same values, wider loads)
            xmask = mask_m[:, None]
            wmask = mask_n[:, None]
        else:
            mk = kk < K
            xmask = mask_m[:, None] & mk[None, :]
            wmask = mask_n[:, None] & mk[None, :]
        x = tl.load(x_rows + kk[None, :], mask=xmask, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            if EVEN_K:
                nw = tl.load(nw_ptr + kk).to(tl.float32)
            else:
                nw = tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(x_ptr.dtype.element_ty)
        if W12:
            g = k0 // 8 + offs_g
            if EVEN_K:
                gmask = mask_n[:, None]
            else:
                gmask = mask_n[:, None] & (g < G)[None, :]
            w = _w12_weight_tile(m_rows, c_rows, side_ptr, side_addr, kk, g, wmask, gmask, base2, BN, BK, INTERP,
                                 not (EVEN_K and EVEN_N))
        else:
            w = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        if INTERP:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        if SWIGLU:
            if W12:
                w2 = _w12_weight_tile(m_rows + N * K, c_rows + N * G, side_ptr, side_addr, kk, g, wmask, gmask, base2,
                                      BN, BK, INTERP, not (EVEN_K and EVEN_N))
            else:
                w2 = tl.load(w_rows + N * K + kk[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
            if INTERP:
                acc2 = tl.dot(w2.to(tl.float32), tl.trans(x.to(tl.float32)), acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(w2, tl.trans(x), acc2)
    dt = y_ptr.dtype.element_ty
    if NORM:
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * rstd[None, :]
        acc2 = acc2 * rstd[None, :]
    if SWIGLU:
        g = acc.to(dt).to(tl.float32)
        u = acc2.to(dt).to(tl.float32)
        out = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
    else:
        out = acc
    mask = mask_n[:, None] & mask_m[None, :]
    if RES:
        r = tl.load(r_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0)
        out = r.to(tl.float32) + out.to(dt).to(tl.float32)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], out.to(dt), mask=mask)


def linear(x: torch.Tensor, w, out: torch.Tensor | None = None, *, cfg: LinearConfig = LinearConfig(),
           norm: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
           swiglu: bool = False) -> torch.Tensor:
    """``out = epilogue(prologue(x) @ w.T)`` for x [M, K] (row stride free, unit column stride).

    ``w``: the bf16 weight [N, K] (contiguous), or its lossless 12-bit tile planes
    (:class:`specpilot.w12.planes.TilePlanes`, same shape): the same kernel, tiles, K order and
    epilogues, the weight tile decoded in registers instead of loaded, so the output is
    bit-identical to the bf16 weight's.

    Rows run in tiles of :func:`row_tile` (M, ``cfg.bm``) rows; each weight tile is read once per
    row tile.

    norm: RMSNorm weight [K] applied to x first. residual: [M, N] added to the product (may be
    ``out`` itself: each program reads its tile before writing it). swiglu: ``w`` is [2N, K]
    (gate rows then up rows) and the result is ``silu(gate) * up``.
    """
    M, K = x.shape
    planes = None if isinstance(w, torch.Tensor) else w
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1 and (planes is not None or w.is_contiguous())
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm = row_tile(M, cfg.bm)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, cfg.bn))
    r = residual if residual is not None else out
    if planes is not None:
        assert K % 8 == 0 and cfg.bk % 8 == 0
        if cfg.bn * cfg.bk < 256 * cfg.warps:  # each thread decodes whole groups of 8 contiguous weights
            raise ValueError(f"w12: tile {cfg.bn} x {cfg.bk} gives a thread fewer than 8 weights with "
                             f"{cfg.warps} warps")
        wp, mp, cp, sp, sa, b2 = x, planes.mant, planes.codes, planes.side, planes.side.data_ptr(), planes.base2()
    else:
        wp, mp, cp, sp, sa, b2 = w, w, w, w, 0, 0
    _linear_kernel[grid](x, wp, out, r, norm if norm is not None else wp,
                         M, N, K, x.stride(0), out.stride(0), r.stride(0), eps, mp, cp, sp, sa, b2,
                         NORM=norm is not None, RES=residual is not None, SWIGLU=swiglu,
                         BM_=bm, BN=cfg.bn, BK=cfg.bk, EVEN_K=K % cfg.bk == 0, INTERP=INTERPRET,
                         W12=planes is not None, EVEN_N=planes is not None and N % cfg.bn == 0, num_warps=cfg.warps,
                         num_stages=cfg.stages)
    return out


@triton.jit
def _w12_decode_kernel(m_ptr, c_ptr, side_ptr, side_addr, base2, out_ptr, N, K,
                       BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
    """out[N, K] (bf16) = the tile planes decoded (:func:`_w12_weight_tile`), one [BN, BK] tile per program."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    g = tl.program_id(1) * (BK // 8) + tl.arange(0, BK // 8)
    mask_n = offs_n < N
    wmask = mask_n[:, None] & (kk < K)[None, :]
    gmask = mask_n[:, None] & (g < K // 8)[None, :]
    w = _w12_weight_tile(m_ptr + offs_n[:, None].to(tl.int64) * K, c_ptr + offs_n[:, None].to(tl.int64) * (K // 8),
                         side_ptr, side_addr, kk, g, wmask, gmask, base2, BN, BK, INTERP, True)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + kk[None, :], w, mask=wmask)


def decode(planes, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 matrix ``[N, K]`` of 12-bit tile planes (:class:`specpilot.w12.planes.TilePlanes`),
    decoded by the matmul kernel's own decode (bit-identical to the packed matrix) into ``out``
    (a contiguous bf16 ``[N, K]`` buffer, or a new one). For prefill matmuls that run cuBLAS on a
    12-bit weight, and the eager forward of a 12-bit role."""
    n, k = planes.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16, device=planes.device)
    assert out.is_contiguous() and tuple(out.shape) == (n, k) and out.dtype == torch.bfloat16
    bn, bk = 32, 128
    _w12_decode_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        planes.mant, planes.codes, planes.side, planes.side.data_ptr(), planes.base2(), out, n, k, BN=bn, BK=bk,
        INTERP=INTERPRET,
        num_warps=4)
    return out


@triton.jit(do_not_specialize=["T"])
def _qk_rope_cache_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, start_ptr, depth_ptr,
                          T, HQ, HKV, stride_qkv, stride_cb, stride_ch, stride_cs, eps, KN_GROUP,
                          QK_NORM: tl.constexpr, TREE: tl.constexpr, D: tl.constexpr):
    """Per (row m = b*T + t, head h): q heads -> norm, RoPE -> q[m, h]; k heads -> norm, RoPE -> cache; v -> cache."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    b = m // T
    t = m % T
    slot = tl.load(start_ptr + b).to(tl.int32) + t  # block slot t is cache slot start + t
    if TREE:  # RoPE position = start + the node's depth
        pos = slot - t + tl.load(depth_ptr + m).to(tl.int32)
    else:  # chain: RoPE position = cache slot
        pos = slot
    offs = tl.arange(0, D // 2)
    row = qkv_ptr + m.to(tl.int64) * stride_qkv
    dt = q_ptr.dtype.element_ty
    x1 = tl.load(row + h * D + offs).to(tl.float32)
    x2 = tl.load(row + h * D + D // 2 + offs).to(tl.float32)
    is_q = h < HQ
    if QK_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        kn = kn_ptr + (tl.maximum(h - HQ, 0) // KN_GROUP) * D  # the k norm of this k head's group
        w1 = tl.where(is_q, tl.load(qn_ptr + offs), tl.load(kn + offs)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + D // 2 + offs), tl.load(kn + D // 2 + offs)).to(tl.float32)
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + pos * D + offs)
    s = tl.load(sin_ptr + pos * D + offs)
    o1 = (x1 * c - x2 * s).to(dt)
    o2 = (x2 * c + x1 * s).to(dt)
    if is_q:
        dst = q_ptr + (m.to(tl.int64) * HQ + h) * D
        tl.store(dst + offs, o1)
        tl.store(dst + D // 2 + offs, o2)
    else:
        kh = h - HQ
        base = b.to(tl.int64) * stride_cb + kh * stride_ch + slot.to(tl.int64) * stride_cs
        tl.store(kc_ptr + base + offs, o1)
        tl.store(kc_ptr + base + D // 2 + offs, o2)
        offs_d = tl.arange(0, D)
        v = tl.load(row + (HQ + HKV) * D + kh * D + offs_d)
        tl.store(vc_ptr + base + offs_d, v)


def qk_rope_cache(qkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  start: torch.Tensor, T: int, n_heads: int, n_kv: int, head_dim: int, eps: float,
                  depth: torch.Tensor | None = None, k_norm_group: int | None = None) -> None:
    """Split ``qkv`` [B*T, (Hq + 2 Hkv) * D]: q -> ``q_out`` [B*T, Hq*D]; k, v -> cache slots start..start+T-1.

    ``depth`` int32 [B, T] (tree blocks): RoPE position of node t = start + depth[b, t]
    (default: start + t, a chain); its K/V still go to slot start + t.

    ``k_norm_group``: k heads per row of ``k_norm`` (default all: one [D] weight). With
    ``k_norm`` [Hkv / g, D], k head h is normed by row h // g: several layers' K/V written in
    one launch, their heads laid out layer after layer in the cache's head axis (the DFlash
    drafter's context injection, :class:`specpilot.fastpath.drafter.FastDrafter`).

    ``k_cache``/``v_cache`` are one layer's views (B, Hkv, S, D) of the static cache (unit last stride).
    """
    M = qkv.shape[0]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and qkv.stride(1) == 1
    qk = q_norm is not None
    _qk_rope_cache_kernel[(M, n_heads + n_kv)](
        qkv, q_out, k_cache, v_cache, q_norm if qk else qkv, k_norm if qk else qkv, cos, sin, start,
        depth if depth is not None else start,
        T, n_heads, n_kv, qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        k_norm_group or n_kv, QK_NORM=qk, TREE=depth is not None, D=head_dim, num_warps=1)


@triton.jit(do_not_specialize=["T"])
def _attn_partial_kernel(q_ptr, kc_ptr, vc_ptr, start_ptr, anc_ptr, o_ws, m_ws, l_ws,
                         T, HQ, HKV, G, stride_cb, stride_ch, stride_cs, n_chunks, R_pad, scale, WIN, RING,
                         path_ptr, depth_ptr,
                         CHUNK: tl.constexpr, BS: tl.constexpr, BR_: tl.constexpr, D: tl.constexpr,
                         TREE: tl.constexpr, WINDOWED: tl.constexpr, INTERP: tl.constexpr,
                         PATH: tl.constexpr = False, PREFIX: tl.constexpr = False, TAIL: tl.constexpr = False):
    """Program (b*Hkv + kv head, row tile, chunk): the rows (query head, block token) of one KV head
    against cache slots [chunk*CHUNK, min(+CHUNK, start+T)); writes unnormalized out, max, sum.
    A row's own key (slot start + t) is left out here and folded in last by the combine kernel, so
    the keys summed in these tiles are exactly the ones a one-token decode at the row's position
    sums, in the same slots and tiles, also for a tree node (whose own key sits at block slot
    start + t, not at start + depth as in the decode; its ancestors on the spine sit where the
    decode has them).
    WINDOWED (chains and PATH trees): positions are read from slot position mod RING and a row at
    position P sees positions P-WIN+1 .. P (a sliding-window layer's KV ring); a PATH tree node
    sits at position start + depth[t], its ancestors at block slots start + path[t, d] mod RING.
    PATH (token trees of the target): one program per block token t (its G query heads); the keys
    are read in the order of positions, not of block slots: the virtual slot start + d (d <
    depth[t]) is the block slot start + path[t, d] of t's ancestor at depth d, so a tree node sums
    its prefix and its ancestors in exactly the tiles a one-token decode at position start +
    depth[t] sums them in (whatever the node order of the tree; ``anc_ptr`` unused).
    A wide tree's prefix is read once per row tile, not once per node, in two launches (issues 47,
    63): PREFIX (chain rows): every key tile (BS keys) wholly below the tile holding ``start``,
    whose keys every node sees, in row tiles of many nodes' rows (the sums a decode makes there:
    each row's bits do not depend on its tile); the state (max, sum, out) of each chunk is written,
    empty for the chunks past start's tile. With WINDOWED each row masks the keys outside the
    window of its node (position start + depth[t]; ``depth_ptr`` read per row). TAIL (with PATH):
    the chunk holding ``start`` and the next one (program axis 2 counts from start // CHUNK; a tree
    is at most 64 deep), per node: it loads the PREFIX state of its chunk and goes on from start's
    tile with the same recurrence, over the virtual slots up to start + depth[t] only (the tiles
    past them would be all masked: a tile whose keys are all masked leaves the state unchanged,
    bit for bit). So a node's sums run over the same tiles in the same order as a decode's at its
    position; only the tile holding start (prefix keys and the node's ancestors) and those of its
    deeper ancestors are read per node."""
    bh = tl.program_id(0)
    rt = tl.program_id(1)
    c = tl.program_id(2)
    b = bh // HKV
    kh = bh % HKV
    start = tl.load(start_ptr + b).to(tl.int32)
    if TAIL:
        c = start // CHUNK + c
    if PATH:  # node rt's G rows, in the row tile (and at the tile positions) a chain verify gives them;
        # when G does not divide the tile (the 27B hybrid's 24 / 4 = 6 heads) and the node's rows
        # cross a tile boundary, the tile ends at its last row instead (every row is still computed;
        # a row's bits do not depend on its position in the tile)
        r0 = ((rt * G) // BR_) * BR_
        r0 = tl.where(rt * G + G > r0 + BR_, rt * G + G - BR_, r0)
        r = r0 + tl.arange(0, BR_)
        rmask = (r >= rt * G) & (r < rt * G + G)
        t = rt + tl.arange(0, BR_) * 0
        dep = tl.load(depth_ptr + b * T + rt).to(tl.int32)
    else:
        r = rt * BR_ + tl.arange(0, BR_)
        rmask = r < G * T
        t = r // G
    h = kh * G + r % G
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + ((b * T + t).to(tl.int64) * HQ + h)[:, None] * D + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    last = start + t  # last visible slot of each row: the prefix and the block's chain up to itself
    if PREFIX and WINDOWED:  # a tree node sits at position start + depth[t]: its window ends there
        last = start + tl.load(depth_ptr + b * T + t, mask=rmask, other=0).to(tl.int32)
    if TREE:  # bit j of anc[b, t]: block node j is t itself or an ancestor of t
        anc = tl.load(anc_ptr + b * T + t, mask=rmask, other=0)
    kbase = kc_ptr + b.to(tl.int64) * stride_cb + kh * stride_ch
    vbase = vc_ptr + b.to(tl.int64) * stride_cb + kh * stride_ch
    ws = (bh * n_chunks + c).to(tl.int64) * R_pad + r
    if TAIL:  # the chunk after the last one of the cache does not exist
        rmask = rmask & (c < n_chunks)
        # the PREFIX launch's state after the chunk's key tiles below start's tile (empty if none):
        # this program goes on from there with the same online-softmax recurrence (fp32, exact)
        m_i = tl.load(m_ws + ws, mask=rmask, other=float("-inf"))
        l_i = tl.load(l_ws + ws, mask=rmask, other=0.0)
        acc = tl.load(o_ws + ws[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
    else:
        m_i = tl.full((BR_,), float("-inf"), tl.float32)
        l_i = tl.zeros((BR_,), dtype=tl.float32)
        acc = tl.zeros((BR_, D), dtype=tl.float32)
    ones = tl.full((BS, 16), 1.0, dtype=vc_ptr.dtype.element_ty)
    s_lo = c * CHUNK
    if PATH:  # the virtual slots past start + depth[t] hold no ancestor: their tiles would be all masked
        s_hi = tl.minimum(s_lo + CHUNK, start + dep)
    else:
        s_hi = tl.minimum(s_lo + CHUNK, start + T)
    if PREFIX:  # the key tiles wholly below start's tile (every node sees them); the rest is TAIL's
        s_hi = tl.minimum(s_lo + CHUNK, (start // BS) * BS)
    if TAIL:
        s_lo = tl.maximum(s_lo, (start // BS) * BS)
    if WINDOWED:  # skip the key tiles below the first row's window; tiles stay BS-aligned (as in a
        # decode of any row), so every row sums its keys in the same tiles whatever the block
        s_lo = tl.maximum(s_lo, (tl.maximum(start - WIN + 1, 0) // BS) * BS)
    for s0 in range(s_lo, s_hi, BS):
        offs_s = s0 + tl.arange(0, BS)
        smask = offs_s < s_hi
        if PATH:
            jv = offs_s - start  # the ancestor at depth jv, for 0 <= jv < depth[t]
            onpath = (jv >= 0) & (jv < dep)
            pj = tl.load(path_ptr + (b * T + rt).to(tl.int64) * 64 + tl.where(onpath, jv, 0), mask=onpath, other=0)
            smask = smask & ((jv < 0) | onpath)
            src = tl.where(jv >= 0, start + pj, offs_s)
            if WINDOWED:  # a sliding layer's ring: position p (or block slot start + j) in slot mod RING
                src = src % RING
            kv_off = src[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
        elif WINDOWED:
            kv_off = (offs_s % RING)[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
        else:
            kv_off = offs_s[:, None].to(tl.int64) * stride_cs + offs_d[None, :]
        k = tl.load(kbase + kv_off, mask=smask[:, None], other=0.0)
        if INTERP:
            sc = _interp_dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = sc * scale
        if PATH:
            vis = smask[None, :] & rmask[:, None]
            if WINDOWED:  # the node sits at position start + depth[t]: it sees the WIN positions up to it
                vis = vis & (offs_s[None, :] > start + dep - WIN)
        elif TREE:
            j = (offs_s - start).to(tl.int64)
            inblk = (j >= 0) & (j < T)
            bit = (anc[:, None] >> tl.where(inblk, j, 0)[None, :]) & 1
            notself = j[None, :] != t[:, None].to(tl.int64)
            vis = ((j < 0)[None, :] | (inblk[None, :] & (bit != 0) & notself)) & smask[None, :]
        else:
            vis = (offs_s[None, :] < last[:, None]) & smask[None, :]
            if WINDOWED:
                vis = vis & (offs_s[None, :] > last[:, None] - WIN)
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        v = tl.load(vbase + kv_off, mask=smask[:, None], other=0.0)
        if INTERP:
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = _interp_dot(p, v.to(tl.float32))
        else:
            pb = p.to(v.dtype)
            # row sums through the tensor cores, like p @ v: a fixed order per row whatever the
            # tile's rows (a tl.sum reduces in a layout that depends on the tile); read back with a
            # max over 16 equal columns (exact)
            l_i = l_i * alpha + tl.max(tl.dot(pb, ones), axis=1)
            pv = tl.dot(pb, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    tl.store(o_ws + ws[:, None] * D + offs_d[None, :], acc, mask=rmask[:, None])
    tl.store(m_ws + ws, m_i, mask=rmask)
    tl.store(l_ws + ws, l_i, mask=rmask)


@triton.jit(do_not_specialize=["T"])
def _attn_combine_kernel(o_ws, m_ws, l_ws, out_ptr, start_ptr, q_ptr, kc_ptr, vc_ptr, T, HQ, HKV, G, n_chunks,
                         R_pad, stride_cb, stride_ch, stride_cs, scale, RING,
                         CHUNK: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, WINDOWED: tl.constexpr,
                         INTERP: tl.constexpr):
    """Program (b*Hkv + kv head, tile of RB rows): merge the chunks' partial results into
    out[b*T + t, h], then fold in the row's own key (slot start + t; ring slot mod RING when
    WINDOWED), last. Chunks are merged one after the other (element-wise per row), and the own
    key's score is the diagonal of a tensor-core product (a fixed reduction order per element), so
    a row's result does not depend on the tile it sits in."""
    bh = tl.program_id(0)
    rt = tl.program_id(1)
    b = bh // HKV
    kh = bh % HKV
    start = tl.load(start_ptr + b).to(tl.int32)
    n_valid = (start + T + CHUNK - 1) // CHUNK
    r = rt * RB + tl.arange(0, RB)
    rmask = r < G * T
    t = r // G
    h = kh * G + r % G
    offs_d = tl.arange(0, D)
    # the own key's score: q_r . k_r on the diagonal of q @ k.T
    q = tl.load(q_ptr + ((b * T + t).to(tl.int64) * HQ + h)[:, None] * D + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    pos = start + t
    slot = pos % RING if WINDOWED else pos
    kv_self = b.to(tl.int64) * stride_cb + kh * stride_ch + slot.to(tl.int64)[:, None] * stride_cs + offs_d[None, :]
    k = tl.load(kc_ptr + kv_self, mask=rmask[:, None], other=0.0)
    if INTERP:
        qk = _interp_dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.dot(q, tl.trans(k))
    eye = tl.arange(0, RB)[:, None] == tl.arange(0, RB)[None, :]
    s_self = tl.sum(tl.where(eye, qk, 0.0), axis=1) * scale  # one non-zero term per row: exact
    base = (bh * n_chunks).to(tl.int64) * R_pad + r
    mx = s_self
    for c in range(0, n_valid):
        mx = tl.maximum(mx, tl.load(m_ws + base + c * R_pad, mask=rmask, other=float("-inf")))
    mx = tl.where(rmask, mx, 0.0)  # rows past the block: no -inf - -inf
    lsum = tl.zeros((RB,), dtype=tl.float32)
    acc = tl.zeros((RB, D), dtype=tl.float32)
    for c in range(0, n_valid):
        ws = base + c * R_pad
        w = tl.exp(tl.load(m_ws + ws, mask=rmask, other=float("-inf")) - mx)
        lsum += w * tl.load(l_ws + ws, mask=rmask, other=0.0)
        acc += w[:, None] * tl.load(o_ws + ws[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
    p_self = tl.where(rmask, tl.exp(s_self - mx), 0.0)
    v = tl.load(vc_ptr + kv_self, mask=rmask[:, None], other=0.0).to(tl.float32)
    lsum += p_self
    acc += p_self[:, None] * v
    lsum = tl.where(rmask, lsum, 1.0)
    out = acc / lsum[:, None]
    dst = out_ptr + ((b * T + t).to(tl.int64) * HQ + h)[:, None] * D + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


# KV slots per attention program. Fixed, so a request's partial sums never depend on the cache
# size or the batch it is served in (row independence).
ATTN_CHUNK = 128
# trees of more nodes than this read their prefix once per row tile (PREFIX + TAIL launches); smaller
# ones one program per node over every chunk (fewer launches)
PREFIX_ONCE_NODES = 16


class AttnWorkspace:
    """fp32 partial results of :func:`attention` for one (batch, block length, cache size)."""

    def __init__(self, B: int, T: int, n_heads: int, n_kv: int, head_dim: int, max_seq: int, device,
                 rows: int = BR):
        """``rows``: query rows (query head x block token of one KV head) per attention program; a
        power of two >= 16, or 0: 16 when the block's rows (G x T) fit in 16, else 64. The row
        sums run through the tensor cores like the products, so a row's bits do not depend on the
        tile (checked on the GPU by specpilot bench verify)."""
        G = n_heads // n_kv
        if rows == 0:
            rows = 16 if G * T <= 16 else 64
        if rows < 16 or rows & (rows - 1):
            raise ValueError(f"attention rows per tile must be a power of two >= 16 (or 0), got {rows}")
        self.br = rows
        self.chunk = ATTN_CHUNK
        self.n_chunks = triton.cdiv(max_seq, self.chunk)
        self.row_tiles = triton.cdiv(G * T, rows)
        self.r_pad = self.row_tiles * rows
        n = B * n_kv * self.n_chunks * self.r_pad
        self.o = torch.empty(n * head_dim, dtype=torch.float32, device=device)
        self.m = torch.empty(n, dtype=torch.float32, device=device)
        self.l = torch.empty(n, dtype=torch.float32, device=device)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, T: int,
              n_heads: int, n_kv: int, head_dim: int, out: torch.Tensor, ws: AttnWorkspace,
              anc_bits: torch.Tensor | None = None, window: int = 0, ring: int = 0,
              path: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> torch.Tensor:
    """Block attention: q [B*T, Hq*D] (RoPE applied) against one layer's cache (B, Hkv, S, D).

    Chain (``anc_bits`` and ``path`` None): row t of block b sees cache slots 0 .. start[b] + t
    (the committed prefix and the block's chain up to itself, whose K/V were just written). Tree
    by ancestor bits (``anc_bits`` int64 [B, T], T <= 64; :func:`tree_bits`; the drafter's
    non-causal block): row t sees the prefix and the block slots j whose bit j is set (itself and
    its ancestors). Tree by paths (``path`` int32 [B, T, 64] and ``depth`` int32 [B, T] from
    :func:`tree_paths`; a target's token tree): node t sees the prefix and its ancestors, read in
    the order of their positions, so its sums are bit-equal to a decode at position start +
    depth[t] (see ``_attn_partial_kernel``; any node count, depth <= 64). ``window`` W > 0 with
    ``ring`` R (a sliding-window layer's ring, slot = position mod R): a row at position P sees
    positions P-W+1 .. P (chains and trees by paths; not trees by ancestor bits). Writes ``out``
    [B*T, Hq*D].
    """
    if window > 0 and anc_bits is not None and path is None:
        raise ValueError("a windowed (ring) attention of a tree needs the tree's paths (tree_paths)")
    B = start.shape[0]
    G = n_heads // n_kv
    scale = head_dim ** -0.5
    if path is not None:
        if depth is None:
            raise ValueError("tree attention by paths needs the nodes' depths")
        # one program per node, its G heads in a tile of rows: 16 on the GPU (the decode's tile; a
        # row's bits do not depend on the tile there), the workspace's under the interpreter (the
        # tile shape and row positions of a chain verify of the same width, since the
        # interpreter's matmul may sum other shapes differently)
        rows = ws.br if INTERPRET else max(16, triton.next_power_of_2(G))
        if G > rows:
            raise ValueError(f"tree attention by paths needs the {G} query heads of a KV head in one tile of {rows} rows")
        grid = (B * n_kv, T, ws.n_chunks)
    else:
        grid, rows = (B * n_kv, ws.row_tiles, ws.n_chunks), ws.br
    split = path is not None and T > PREFIX_ONCE_NODES  # the prefix once per row tile
    args = (q, k_cache, v_cache, start, anc_bits if anc_bits is not None else start, ws.o, ws.m, ws.l, T, n_heads,
            n_kv, G, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ws.n_chunks, ws.r_pad, scale, window,
            max(ring, 1), path if path is not None else start, depth if depth is not None else start)
    if split:
        _attn_partial_kernel[(B * n_kv, ws.row_tiles, ws.n_chunks)](
            *args, CHUNK=ws.chunk, BS=64, BR_=ws.br, D=head_dim, TREE=False, WINDOWED=window > 0, INTERP=INTERPRET,
            PATH=False, PREFIX=True, num_warps=4, num_stages=2)
        grid = (B * n_kv, T, 2)
    _attn_partial_kernel[grid](
        *args, CHUNK=ws.chunk, BS=64, BR_=rows, D=head_dim, TREE=anc_bits is not None and path is None,
        WINDOWED=window > 0, INTERP=INTERPRET, PATH=path is not None, TAIL=split,
        num_warps=4, num_stages=2)
    _attn_combine_kernel[(B * n_kv, triton.cdiv(G * T, COMBINE_ROWS))](
        ws.o, ws.m, ws.l, out, start, q, k_cache, v_cache, T, n_heads, n_kv, G, ws.n_chunks, ws.r_pad,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale, max(ring, 1),
        CHUNK=ws.chunk, RB=COMBINE_ROWS, D=head_dim, WINDOWED=window > 0, INTERP=INTERPRET, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# helpers of the cuBLAS variant (matmuls through torch.mm, norms and SwiGLU as separate kernels)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    """y[m] = bf16(x[m] * rstd) * w, as the eager RMSNorm rounds."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + m.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    dt = y_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dt).to(tl.float32) * w
    tl.store(y_ptr + m.to(tl.int64) * stride_y + offs, y.to(dt), mask=mask)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm of x [M, H] into ``out`` (one program per row)."""
    M, H = x.shape
    _rmsnorm_kernel[(M,)](x, w, out, H, x.stride(0), out.stride(0), eps, BLOCK=triton.next_power_of_2(H),
                          num_warps=8)
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, h_ptr, N, stride_gu, stride_h, BLOCK: tl.constexpr):
    """h[m, n] = silu(gu[m, n]) * gu[m, N + n] (gate columns, then up columns), eager rounding."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = gu_ptr + m.to(tl.int64) * stride_gu
    g = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + N + offs, mask=mask, other=0.0).to(tl.float32)
    dt = h_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(h_ptr + m.to(tl.int64) * stride_h + offs, (s * u).to(dt), mask=mask)


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up product gu [M, 2N] into ``out`` [M, N]."""
    M, N = out.shape
    BLOCK = 1024
    _silu_mul_kernel[(M, triton.cdiv(N, BLOCK))](gu, out, N, gu.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out

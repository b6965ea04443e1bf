"""Triton kernels of the fast path for the hybrid (Qwen3.5 / 3.8) and Muse-Glimmer targets.

The matmuls, the split-KV attention and the row-wise RMSNorm are those of
:mod:`specpilot.kernels.step` (the attention with a sliding window over a KV ring); this
module adds what the two families need around them:

- :func:`attn_prep`: q / k norm (weighted ``1 + w``, or weightless with the query scaled by
  ``qk_scale_factor``), RoPE on the first ``rot`` dims (partial RoPE, Qwen3.5) or none (NoPE,
  Muse-Glimmer's global layers), K/V written to a linear cache or to a ring (slot = position
  mod R); the query heads may sit ``2 * head_dim`` apart (Qwen3.5's q_proj interleaves query and
  output gate per head);
- :func:`gate_mul`: the attention output times ``sigmoid(gate)`` (both families' output gate);
- :func:`add_rmsnorm`: ``x += norm(y)`` (Muse-Glimmer's sandwich norms after each sub-layer);
- Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464; the math of
  :mod:`specpilot.models.gdn`): :func:`gdn_conv` (causal depthwise conv + SiLU over the committed
  conv window and the block), :func:`gdn_recurrent` (the gated delta rule token by token from the
  committed state, one program per (row, value head, value block); with ``write`` it stores the
  state after ``counts[b]`` tokens: a decode / prefill, or the replay of the accepted tokens at
  commit, which is how rejected drafts never reach the state: checkpoint + replay, as z-lab's
  dflash ``_GDNStateCapture``), :func:`gdn_conv_commit` (the conv window after ``counts[b]``
  tokens) and :func:`gated_rmsnorm` (``w * norm(o) * silu(z)``).

Every kernel computes an output row with the same arithmetic whatever the number of rows (no
reduction across rows), so the fast path stays row-independent like the dense one. Rounding
follows the eager modules' (bf16 after each op where they round), not bit for bit.
``TRITON_INTERPRET=1`` runs them on the CPU (tests/test_family_fast.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NORM_NONE, NORM_WEIGHTED, NORM_SCALELESS = 0, 1, 2
_PLACEHOLDERS: dict = {}


def _placeholder(device, dtype) -> torch.Tensor:
    """A one-element tensor standing in for an absent index argument (a chain's depth / path, a
    commit's counts): the same pointer dtype as the real one, since the dtype is part of the
    compiled binary's key and chains and trees must run one binary."""
    key = (str(device), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


@triton.jit(do_not_specialize=["T", "TREE"])
def _attn_prep_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, start_ptr, depth_ptr,
                      T, HQ, HKV, stride_qkv, Q_STRIDE, K_OFF, V_OFF, stride_cb, stride_ch, stride_cs,
                      RING, eps, qscale, TREE,
                      NORM: tl.constexpr, ROT: tl.constexpr, D: tl.constexpr):
    """Program (row m = b*T + t, head h < HQ + HKV): q head -> q[m, h]; k head -> cache; v -> cache.

    RoPE at position start + t (a chain) or start + depth[m] (``TREE`` != 0: a token tree's node);
    K/V always to block slot start + t. ``TREE`` is a runtime flag, not a constexpr: chains and
    trees run one compiled binary, so a node's q / k are bit-equal to a decode's at its position."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    b = m // T
    t = m % T
    first = tl.load(start_ptr + b).to(tl.int32)
    dep = tl.load(depth_ptr + m, mask=TREE != 0, other=0).to(tl.int32)
    pos = first + tl.where(TREE != 0, dep, t)  # RoPE position
    offs = tl.arange(0, D)
    row = qkv_ptr + m.to(tl.int64) * stride_qkv
    is_q = h < HQ
    kh = tl.maximum(h - HQ, 0)
    col = tl.where(is_q, h * Q_STRIDE, K_OFF + kh * D)
    dt = q_ptr.dtype.element_ty
    half = ROT // 2
    if ROT > 0:
        partner = tl.where(offs < half, offs + half, tl.where(offs < ROT, offs - half, offs))
    else:
        partner = offs
    x = tl.load(row + col + offs).to(tl.float32)
    xp = tl.load(row + col + partner).to(tl.float32)
    if NORM != 0:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        if NORM == 1:
            w = tl.where(is_q, tl.load(qn_ptr + offs), tl.load(kn_ptr + offs)).to(tl.float32)
            wp = tl.where(is_q, tl.load(qn_ptr + partner), tl.load(kn_ptr + partner)).to(tl.float32)
            x = (x * rstd * w).to(dt).to(tl.float32)
            xp = (xp * rstd * wp).to(dt).to(tl.float32)
        else:
            x = (x * rstd).to(dt).to(tl.float32)
            xp = (xp * rstd).to(dt).to(tl.float32)
            sq = tl.where(is_q, qscale, 1.0)
            x = (x * sq).to(dt).to(tl.float32)
            xp = (xp * sq).to(dt).to(tl.float32)
    if ROT > 0:
        rmask = offs < ROT
        c = tl.load(cos_ptr + pos * ROT + offs, mask=rmask, other=1.0).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * ROT + offs, mask=rmask, other=0.0).to(dt).to(tl.float32)
        sign = tl.where(offs < half, -1.0, 1.0)
        rot = (x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32)
        x = tl.where(rmask, rot, x)
    if is_q:
        tl.store(q_ptr + (m.to(tl.int64) * HQ + h) * D + offs, x.to(dt))
    else:
        slot = first + t  # the block slot
        if RING > 0:
            slot = slot % RING
        base = b.to(tl.int64) * stride_cb + kh * stride_ch + slot.to(tl.int64) * stride_cs
        tl.store(kc_ptr + base + offs, x.to(dt))
        v = tl.load(row + V_OFF + kh * D + offs)
        tl.store(vc_ptr + base + offs, v)


def attn_prep(qkv: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              start: torch.Tensor, T: int, n_heads: int, n_kv: int, head_dim: int, *, q_stride: int,
              k_off: int, v_off: int, norm: int = NORM_NONE, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, qscale: float = 1.0, eps: float = 1e-6,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, rot: int = 0,
              ring: int = 0, depth: torch.Tensor | None = None) -> None:
    """Split the fused projection ``qkv`` [B*T, cols] of a chain block (or a token tree: ``depth``
    int32 [B, T], RoPE at start + depth) at ``start`` int64 [B].

    Query head h starts at column ``h * q_stride``, key / value head g at ``k_off + g * head_dim`` /
    ``v_off + g * head_dim``. ``norm``: :data:`NORM_NONE`, :data:`NORM_WEIGHTED` (``q_norm`` /
    ``k_norm`` [head_dim], the effective scale, fp32) or :data:`NORM_SCALELESS` (the query then
    times ``qscale``). RoPE on the first ``rot`` dims with tables ``cos``/``sin`` [S, rot]
    (HF rotate-half layout; ``rot`` 0 = NoPE). Queries go to ``q_out`` [B*T, Hq*D], keys and values
    to one layer's cache view (B, Hkv, S, D) at slot ``start + t`` (``ring`` R > 0: slot
    ``(start + t) mod R``), for a tree too (its block slots; compact the accepted path after).
    """
    M = qkv.shape[0]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and qkv.stride(1) == 1
    dummy = qkv
    _attn_prep_kernel[(M, n_heads + n_kv)](
        qkv, q_out, k_cache, v_cache, q_norm if q_norm is not None else dummy,
        k_norm if k_norm is not None else dummy, cos if cos is not None else dummy,
        sin if sin is not None else dummy, start, depth if depth is not None else _placeholder(qkv.device, torch.int32),
        T, n_heads, n_kv,
        qkv.stride(0), q_stride, k_off, v_off,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ring, eps, qscale, int(depth is not None),
        NORM=norm, ROT=rot, D=head_dim, num_warps=1)


@triton.jit
def _gate_mul_kernel(y_ptr, g_ptr, stride_y, stride_g, G_STRIDE, G_OFF, D: tl.constexpr):
    """Program (row m, head h): y[m, h*D:] *= sigmoid(g[m, G_OFF + h*G_STRIDE:])."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, D)
    dt = y_ptr.dtype.element_ty
    yp = y_ptr + m.to(tl.int64) * stride_y + h * D + offs
    g = tl.load(g_ptr + m.to(tl.int64) * stride_g + G_OFF + h * G_STRIDE + offs).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(yp, (tl.load(yp).to(tl.float32) * sg).to(dt))


def gate_mul(y: torch.Tensor, gate_src: torch.Tensor, n_heads: int, head_dim: int, g_stride: int, g_off: int) -> None:
    """``y`` [M, H*D] *= sigmoid(gate): head h's gate at columns ``g_off + h * g_stride`` of ``gate_src``."""
    M = y.shape[0]
    _gate_mul_kernel[(M, n_heads)](y, gate_src, y.stride(0), gate_src.stride(0), g_stride, g_off, D=head_dim,
                                   num_warps=1)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    """x[m] = x[m] + bf16(norm(y[m]) * w)."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    dt = x_ptr.dtype.element_ty
    y = tl.load(y_ptr + m.to(tl.int64) * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n = (y * rstd * w).to(dt).to(tl.float32)
    xp = x_ptr + m.to(tl.int64) * stride_x + offs
    tl.store(xp, (tl.load(xp, mask=mask, other=0.0).to(tl.float32) + n).to(dt), mask=mask)


def add_rmsnorm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` [M, H] += RMSNorm(``y`` [M, H]) * ``w`` [H] (fp32 effective scale), in place."""
    M, H = y.shape
    _add_rmsnorm_kernel[(M,)](x, y, w, H, x.stride(0), y.stride(0), eps, BLOCK=triton.next_power_of_2(H),
                              num_warps=8)
    return x


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "TREE"])
def _gdn_conv_kernel(p_ptr, conv_ptr, w_ptr, out_ptr, depth_ptr, path_ptr, T, C, stride_p, stride_cb, stride_cc,
                     stride_o, TREE, K: tl.constexpr, BC: tl.constexpr):
    """Program (row m = b*T + t, channel block): out[m, c] = silu(sum_i w[c, i] * seq[d + i]) where
    seq = (conv window [K-1 columns], the pre-conv inputs of the row's path p[b*T + .]) and d = t
    (a chain: the path is the block's tokens 0..t) or depth[m] (``TREE`` != 0, a runtime flag: the
    path is the node's ancestors by depth, ``path`` [B*T, 64], then the node itself)."""
    m = tl.program_id(0)
    cb = tl.program_id(1)
    b = m // T
    t = m % T
    offs = cb * BC + tl.arange(0, BC)
    mask = offs < C
    dt = out_ptr.dtype.element_ty
    z = offs * 0
    dep = tl.sum(tl.load(depth_ptr + m + z, mask=(offs == cb * BC) & (TREE != 0), other=0), axis=0).to(tl.int32)
    d0 = tl.where(TREE != 0, dep, t)  # the row's depth along its path
    acc = tl.zeros((BC,), dtype=tl.float32)
    for i in tl.static_range(K):
        j = d0 + i  # index into seq
        inw = j < K - 1
        d = j - (K - 1)  # depth of the path entry read (d == d0: the row itself)
        onp = (TREE != 0) & (d >= 0) & (d < dep)
        anc = tl.sum(tl.load(path_ptr + m.to(tl.int64) * 64 + tl.minimum(tl.maximum(d, 0), 63) + z,
                             mask=(offs == cb * BC) & onp, other=0), axis=0).to(tl.int32)
        node = tl.where(TREE != 0, tl.where(d < dep, anc, t), tl.maximum(d, 0))
        vw = tl.load(conv_ptr + b.to(tl.int64) * stride_cb + offs * stride_cc + tl.minimum(j, K - 2),
                     mask=mask & inw, other=0.0)
        vp = tl.load(p_ptr + (b * T + node).to(tl.int64) * stride_p + offs,
                     mask=mask & (j >= K - 1), other=0.0)
        val = tl.where(inw, vw, vp)
        wi = tl.load(w_ptr + offs * K + i, mask=mask, other=0.0).to(tl.float32)
        acc += val.to(tl.float32) * wi
    a = acc.to(dt).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_o + offs, (a / (1.0 + tl.exp(-a))).to(dt), mask=mask)


def gdn_conv(pre: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, T: int,
             depth: torch.Tensor | None = None, path: torch.Tensor | None = None) -> None:
    """Causal depthwise conv + SiLU of a chain block: ``pre`` [B*T, >= C] (pre-conv columns first),
    ``conv_state`` (B, C, K-1) the committed window, ``weight`` [C, K] contiguous, ``out`` [B*T, C].
    A token tree: ``depth`` int32 [B, T] and ``path`` int32 [B, T, 64] (:func:`tree_paths`): each
    node convolves its ancestors' inputs and its own, as a chain along its path would."""
    M = pre.shape[0]
    C, K = weight.shape
    BC = 256
    tree = depth is not None
    if tree and path is None:
        raise ValueError("a tree's conv needs its paths")
    ph = _placeholder(pre.device, torch.int32)
    _gdn_conv_kernel[(M, triton.cdiv(C, BC))](pre, conv_state, weight, out, depth if tree else ph,
                                              path if tree else ph, T, C, pre.stride(0),
                                              conv_state.stride(0), conv_state.stride(1), out.stride(0), int(tree),
                                              K=K, BC=BC, num_warps=4)


@triton.jit(do_not_specialize=["T", "HV", "R", "A_OFF", "B_OFF", "stride_ml", "stride_m", "stride_pl", "stride_p",
                               "stride_sb", "stride_sl", "stride_sh", "stride_o", "WRITE", "OUT", "COUNTED", "TREE",
                               "INDEXED", "stride_ix"])
def _gdn_recurrent_kernel(mix_ptr, p_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, cnt_ptr, dep_ptr, path_ptr, ix_ptr,
                          T, HV, R, A_OFF, B_OFF, stride_ml, stride_m, stride_pl, stride_p,
                          stride_sb, stride_sl, stride_sh, stride_o, eps, qscale, WRITE, OUT, COUNTED, TREE,
                          INDEXED, stride_ix, DK: tl.constexpr, BV: tl.constexpr, DV: tl.constexpr):
    """Program (row b, layer l * HV + value head, value block): the delta rule over the row's tokens.

    ``TREE`` (a token tree's verify): program (b * T + node, ...) runs the delta rule along the
    node's path (its ancestors by depth, ``path`` [B*T, 64], then itself) from the committed state
    and writes the node's output only, so a node's output is a decode's at its position.
    ``INDEXED`` (the commit of a tree's accepted path): token i of row b is block token
    ``ix[b, i]`` instead of i.

    WRITE / OUT / COUNTED / TREE / INDEXED are runtime flags, not constexprs, and no integer
    argument is specialized (Triton would otherwise compile a variant per divisibility of the
    strides, whose layouts, and so reduction orders, may differ): decode, verify (chain or tree)
    and the commit replay run one compiled binary, so a token's state update is bit-identical on
    every path (a random-weight model amplifies one rounding difference into other tokens)."""
    pid = tl.program_id(0)
    b = tl.where(TREE != 0, pid // T, pid)
    node = pid % T
    lh = tl.program_id(1)
    vb = tl.program_id(2)
    l = lh // HV
    hv = lh % HV
    kh = hv // R
    H = HV // R
    offs_k = tl.arange(0, DK)
    offs_v = vb * BV + tl.arange(0, BV)
    sp = s_ptr + b.to(tl.int64) * stride_sb + l.to(tl.int64) * stride_sl + hv.to(tl.int64) * stride_sh
    S = tl.load(sp + offs_k[:, None] * DV + offs_v[None, :])
    a_log = tl.load(alog_ptr + l * HV + hv).to(tl.float32)
    dtb = tl.load(dtb_ptr + l * HV + hv).to(tl.float32)
    n = tl.load(cnt_ptr + b + offs_k * 0, mask=(offs_k == 0) & (COUNTED != 0), other=0).to(tl.int32)
    n = tl.where(COUNTED != 0, tl.sum(n, axis=0), T)
    dep = tl.sum(tl.load(dep_ptr + pid + offs_k * 0, mask=(offs_k == 0) & (TREE != 0), other=0), axis=0).to(tl.int32)
    n = tl.where(TREE != 0, dep + 1, n)
    mix = mix_ptr + l.to(tl.int64) * stride_ml
    pp = p_ptr + l.to(tl.int64) * stride_pl
    for i in range(0, n):
        anc = tl.sum(tl.load(path_ptr + pid.to(tl.int64) * 64 + tl.minimum(i, 63) + offs_k * 0,
                             mask=(offs_k == 0) & (TREE != 0) & (i < dep), other=0), axis=0).to(tl.int32)
        ixi = tl.sum(tl.load(ix_ptr + b.to(tl.int64) * stride_ix + i + offs_k * 0,
                             mask=(offs_k == 0) & (INDEXED != 0), other=0), axis=0).to(tl.int32)
        t = tl.where(TREE != 0, tl.where(i < dep, anc, node), tl.where(INDEXED != 0, ixi, i))
        m = (b * T + t).to(tl.int64)
        row = mix + m * stride_m
        q = tl.load(row + kh * DK + offs_k).to(tl.float32)
        k = tl.load(row + H * DK + kh * DK + offs_k).to(tl.float32)
        v = tl.load(row + 2 * H * DK + hv * DV + offs_v).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * qscale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        a = tl.load(pp + m * stride_p + A_OFF + hv).to(tl.float32)
        bb = tl.load(pp + m * stride_p + B_OFF + hv).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-bb))
        x = a + dtb
        sp_ = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus (torch threshold 20)
        g = -tl.exp(a_log) * sp_
        S = S * tl.exp(g)
        u = (v - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        last = (TREE == 0) | (i == n - 1)  # a tree node writes its own output only
        tl.store(o_ptr + m * stride_o + hv * DV + offs_v, o.to(o_ptr.dtype.element_ty),
                 mask=(offs_v >= 0) & (OUT != 0) & last)
    tl.store(sp + offs_k[:, None] * DV + offs_v[None, :], S, mask=(offs_k[:, None] >= 0) & (WRITE != 0))


def gdn_recurrent(mixed: torch.Tensor, proj: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  state: torch.Tensor, out: torch.Tensor | None, T: int, *, n_key_heads: int, a_off: int,
                  b_off: int, write: bool, counts: torch.Tensor | None = None, depth: torch.Tensor | None = None,
                  path: torch.Tensor | None = None, index: torch.Tensor | None = None) -> None:
    """Gated delta rule of chain blocks over L GDN layers at once (L = 1 for one layer).

    Args:
        mixed: [L, B*T, C] post-conv q | k | v columns (model dtype; C = 2 H Dk + HV Dv).
        proj: [L, B*T, >= b_off + HV] the fused input projection (a at ``a_off``, b at ``b_off``).
        a_log, dt_bias: [L, HV] fp32. state: fp32 view (B, L, HV, Dk, Dv) of the recurrent state.
        out: [B*T, HV*Dv] outputs (L must be 1), or None (a commit replay writes no outputs).
        T: block length; ``counts`` int [B]: tokens of each row to apply (None: all T).
        write: store the state after those tokens (decode, prefill, commit); else leave it.
        depth, path: a token tree's node depths int32 [B, T] and ancestors by depth int32
            [B, T, 64] (:func:`~specpilot.engine.verify.tree_paths`): each node's output is the
            delta rule along its path from the committed state (a verify: ``write`` False).
        index: int64 [B, P] block indices of each row's tokens in order (a tree's accepted path,
            with ``counts``; None: tokens 0, 1, ...).
    """
    L, M, C = mixed.shape
    B, _, HV, DK, DV = state.shape
    assert state.stride(4) == 1 and state.stride(3) == DV and mixed.stride(2) == 1 and proj.stride(2) == 1
    tree = depth is not None
    if tree and (path is None or write):
        raise ValueError("a tree's delta rule needs its paths, and a tree verify writes no state")
    BV = min(32, DV)
    # placeholders of the real dtypes: a pointer's dtype is part of the compiled binary's key
    counts_arg = _placeholder(mixed.device, torch.int64) if counts is None else counts.long()
    ph32 = _placeholder(mixed.device, torch.int32)
    ix = _placeholder(mixed.device, torch.int64) if index is None else index.long()
    _gdn_recurrent_kernel[(B * T if tree else B, L * HV, triton.cdiv(DV, BV))](
        mixed, proj, a_log, dt_bias, state, out if out is not None else mixed, counts_arg,
        depth if tree else ph32, path if tree else ph32, ix, T, HV, HV // n_key_heads, a_off, b_off,
        mixed.stride(0), mixed.stride(1), proj.stride(0), proj.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0) if out is not None else 0, 1e-6, DK ** -0.5,
        int(write), int(out is not None), int(counts is not None), int(tree), int(index is not None),
        ix.stride(0) if index is not None else 0, DK=DK, BV=BV, DV=DV, num_warps=4)


@triton.jit(do_not_specialize=["T"])
def _gdn_conv_commit_kernel(p_ptr, conv_ptr, cnt_ptr, ix_ptr, T, C, stride_pl, stride_p, stride_cb, stride_cl, stride_cc,
                            stride_ix, BC: tl.constexpr, COUNTED: tl.constexpr, INDEXED: tl.constexpr):
    """Program (row b, layer l, channel block): the conv window (K = 4) after the row's first n tokens
    (``INDEXED``: token i of the row is block token ix[b, i], a tree's accepted path). Copies only."""
    b = tl.program_id(0)
    l = tl.program_id(1)
    cb = tl.program_id(2)
    offs = cb * BC + tl.arange(0, BC)
    mask = offs < C
    n = T
    if COUNTED:
        n = tl.load(cnt_ptr + b).to(tl.int32)
    cp = conv_ptr + b.to(tl.int64) * stride_cb + l.to(tl.int64) * stride_cl + offs * stride_cc
    pp = p_ptr + l.to(tl.int64) * stride_pl
    # seq = (window[0..2], p[b*T + 0 ..]); the new window is seq[n .. n+2] (K = 4)
    w0 = tl.load(cp + 0, mask=mask, other=0.0)
    w1 = tl.load(cp + 1, mask=mask, other=0.0)
    w2 = tl.load(cp + 2, mask=mask, other=0.0)
    i0 = n
    i1 = n + 1
    i2 = n + 2
    j0, j1, j2 = i0 - 3, i1 - 3, i2 - 3  # the row's token index
    if INDEXED:
        ib = ix_ptr + b.to(tl.int64) * stride_ix
        j0 = tl.load(ib + tl.maximum(j0, 0), mask=j0 >= 0, other=0).to(tl.int32)
        j1 = tl.load(ib + tl.maximum(j1, 0), mask=j1 >= 0, other=0).to(tl.int32)
        j2 = tl.load(ib + tl.maximum(j2, 0), mask=j2 >= 0, other=0).to(tl.int32)
    p0 = tl.load(pp + (b * T + j0).to(tl.int64) * stride_p + offs, mask=mask & (i0 >= 3), other=0.0)
    p1 = tl.load(pp + (b * T + j1).to(tl.int64) * stride_p + offs, mask=mask & (i1 >= 3), other=0.0)
    p2 = tl.load(pp + (b * T + j2).to(tl.int64) * stride_p + offs, mask=mask & (i2 >= 3), other=0.0)
    v0 = tl.where(i0 < 3, tl.where(i0 == 0, w0, tl.where(i0 == 1, w1, w2)), p0)
    v1 = tl.where(i1 < 3, tl.where(i1 == 1, w1, w2), p1)
    v2 = tl.where(i2 < 3, w2, p2)
    tl.store(cp + 0, v0, mask=mask)
    tl.store(cp + 1, v1, mask=mask)
    tl.store(cp + 2, v2, mask=mask)


def gdn_conv_commit(proj: torch.Tensor, conv: torch.Tensor, T: int, counts: torch.Tensor | None = None,
                    index: torch.Tensor | None = None) -> None:
    """Advance the conv windows ``conv`` (B, L, C, K-1) by each row's first ``counts[b]`` (None: T)
    pre-conv inputs of ``proj`` [L, B*T, >= C] (columns 0..C-1). K = 4 (the Qwen3.5 conv).
    ``index`` int [B, P]: the row's tokens are block tokens index[b, 0], index[b, 1], ... (a tree's
    accepted path, with ``counts``)."""
    B, L, C, Km1 = conv.shape
    if Km1 != 3:
        raise ValueError(f"the fast GDN conv commit handles conv kernel 4, got {Km1 + 1}")
    BC = 512
    _gdn_conv_commit_kernel[(B, L, triton.cdiv(C, BC))](
        proj, conv, counts if counts is not None else conv, index if index is not None else conv, T, C,
        proj.stride(0), proj.stride(1), conv.stride(0), conv.stride(1), conv.stride(2),
        index.stride(0) if index is not None else 0, BC=BC, COUNTED=counts is not None,
        INDEXED=index is not None, num_warps=4)


@triton.jit
def _gated_rmsnorm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, stride_o, stride_z, Z_OFF, stride_y, eps, D: tl.constexpr):
    """Program (row m, value head h): y = bf16(w * bf16(norm(o))) * silu(z)."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, D)
    dt = y_ptr.dtype.element_ty
    o = tl.load(o_ptr + m.to(tl.int64) * stride_o + h * D + offs).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)
    w = tl.load(w_ptr + offs).to(tl.float32)
    y = (w * (o * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    z = tl.load(z_ptr + m.to(tl.int64) * stride_z + Z_OFF + h * D + offs).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_y + h * D + offs, (y * (z / (1.0 + tl.exp(-z)))).to(dt))


def gated_rmsnorm(o: torch.Tensor, z_src: torch.Tensor, z_off: int, w: torch.Tensor, out: torch.Tensor,
                  n_heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """GDN output norm per value head: ``out`` [M, HV*Dv] = w * norm(o) * silu(z); z at columns
    ``z_off + h * Dv`` of ``z_src``."""
    M = o.shape[0]
    _gated_rmsnorm_kernel[(M, n_heads)](o, z_src, w, out, o.stride(0), z_src.stride(0), z_off, out.stride(0), eps,
                                        D=head_dim, num_warps=1)
    return out

"""Attention layers by type: full (Qwen3 / Llama / Qwen3.5 gated), sliding window, global NoPE.

One :class:`Attention` covers every variant a config asks for:

- q/k norm: weighted per-head RMSNorm (Qwen3; ``1 + w`` in Qwen3.5) or scale-less with the query
  multiplied by ``qk_scale_factor`` (Muse-Glimmer); scores scaled by 1/sqrt(head_dim) in all cases;
- RoPE on the first ``rotary_dim`` dims (partial RoPE, Qwen3.5: 0.25 of head_dim; HF
  "rotate_half" layout), or none on NoPE layers (Muse-Glimmer's global layers);
- output gate ``sigmoid(gate)`` per channel: interleaved in q_proj (Qwen3.5 emits
  [query | gate] per head, so q_proj is twice as wide) or a separate ``gate_proj`` (Muse-Glimmer);
- full attention reads/writes the static :class:`state.KVCache`; sliding attention the
  :class:`state.RingKV` (window W: a query sees W keys including itself).

Tensor names follow the transformers classes so checkpoints load by name.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import TargetConfig
from .layers import block_mask
from .norms import ScalelessRMSNorm, make_norm


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [B, H, T, D] by tables [B, T, rotary_dim]."""
    r = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    xr, xp = x[..., :r], x[..., r:]
    half = r // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    out = xr * cos + rot * sin
    return out if xp.shape[-1] == 0 else torch.cat([out, xp], -1)


class Attention(nn.Module):
    """Grouped-query attention of one layer (full or sliding), reading/writing its state slot.

    ``slot`` indexes the layer in the KV cache (full) or in the ring (sliding).
    """

    def __init__(self, cfg: TargetConfig, layer: int, slot: int):
        super().__init__()
        self.layer, self.slot = layer, slot
        self.kind = cfg.layer_types[layer]
        self.window = cfg.sliding_window if self.kind == "sliding_attention" else None
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gate = cfg.attn_gate
        self.rope = cfg.layer_rope[layer]
        qmul = 2 if self.gate == "interleaved" else 1
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim * qmul, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if self.gate == "proj":
            self.gate_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.q_norm = self.k_norm = self.qk_norm = None
        self.qk_scale = 1.0
        if cfg.qk_norm:
            self.q_norm = make_norm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = make_norm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        elif cfg.qk_scaleless:
            self.qk_norm = ScalelessRMSNorm(cfg.rms_norm_eps)
            self.qk_scale = cfg.qk_scale_factor

    def _project(self, x, cos, sin):
        B, T, _ = x.shape
        hd = self.head_dim
        gate = None
        if self.gate == "interleaved":
            qg = self.q_proj(x).view(B, T, self.n_heads, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, -1)
        else:
            q = self.q_proj(x).view(B, T, self.n_heads, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm is not None:
            q, k = self.qk_norm(q) * self.qk_scale, self.qk_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope:
            q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if self.gate == "proj":
            gate = self.gate_proj(x)
        return q, k, v, gate

    def _out(self, y, gate, B, T):
        y = y.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y)

    def forward_causal(self, x, cos, sin):
        """Cache-free causal forward over whole sequences (training, teacher forcing)."""
        B, T, _ = x.shape
        q, k, v, gate = self._project(x, cos, sin)
        gqa = self.n_kv != self.n_heads
        if self.window is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            i = torch.arange(T, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self._out(y, gate, B, T)

    def forward(self, x, cos, sin, ctx, slots, mask):
        """Block forward against the cache. ``slots`` [B, T] and ``mask`` [B, 1, T, S] serve full attention."""
        B, T, _ = x.shape
        q, k, v, gate = self._project(x, cos, sin)
        gqa = self.n_kv != self.n_heads
        if self.window is None:
            kc, vc = ctx.state.kv.write(self.slot, slots, k, v)
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=gqa)
        else:
            ring = ctx.state.ring
            keys, vals, rmask = ring.keys(self.slot, ctx, k, v)
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=rmask, enable_gqa=gqa)
            ring.write(self.slot, ctx, k, v)
        return self._out(y, gate, B, T)

    def forward_ragged(self, x, cos, sin, ctx):
        """Packed segments [1, S, hidden] of a ragged forward (:mod:`specpilot.models.ragged`):
        projections over all S tokens at once; per group of equal-width segments their K/V
        written into their cache rows and their queries attended against those rows under the
        segments' masks, one batched call. Full attention only."""
        _, S, _ = x.shape
        q, k, v, gate = self._project(x, cos, sin)  # [1, heads, S, D]
        kc, vc = ctx.state.kv.k[:, self.slot], ctx.state.kv.v[:, self.slot]  # [B, kv_heads, max_seq, D]
        gqa = self.n_kv != self.n_heads
        ys = []
        for rows, slots, o, t, mask in ctx.groups:
            R = rows.shape[0]

            def split(z):  # [1, H, R * t, D] -> [R, H, t, D]
                return z[0, :, o:o + R * t].unflatten(1, (R, t)).transpose(0, 1)

            qg, kg, vg = split(q), split(k), split(v)
            at = rows[:, None].expand(R, t)
            kc[at, :, slots] = kg.transpose(1, 2)
            vc[at, :, slots] = vg.transpose(1, 2)
            y = F.scaled_dot_product_attention(qg, kc[rows], vc[rows], attn_mask=mask, enable_gqa=gqa)
            ys.append(y.transpose(0, 1).flatten(1, 2))  # [H, R * t, D]
        return self._out(torch.cat(ys, 1)[None], gate, 1, S)

__all__ = ["Attention", "apply_partial_rope", "block_mask"]

"""The CPU step path of a dense target: the verify / decode forward in fewer, larger operations.

On a CPU a small target's step is bound by per-operation overhead, not by bytes or FLOPs (the
embedded tiny target: ~200 operations of a few microseconds each per 12-token verify). This step
computes exactly the plain forward (:meth:`specpilot.models.target.Transformer.forward`) with fewer
operations; every weight and state is the plain model's, read in place:

- one matmul for the q/k/v projections of a layer and one for its gate/up projections (the weights
  concatenated once, at construction: ``[q; k; v]``, ``[gate; up]``); the split outputs are views;
  every matmul through the kernel the kernel sub-agent chose (:mod:`.cpu_linear`: aten's or
  oneDNN's prepacked);
- the K/V of the block written as one slice copy per layer when the batch is one row (a static
  cache row, slots ``start .. start + T - 1``), and attention over the slots in use only
  (``max(start) + T`` of ``max_seq``), its mask built once per step and shared by every layer (none
  at all for a one-token step);
- the q and k heads normed and rotated together (one norm, their weights after it; RoPE as
  :func:`rotate`), the norms and SwiGLU as the plain model computes them, in the
  ``[B, T, heads, head_dim]`` layout the projection produced (no transposes before the cache write).

Outputs equal the plain forward's up to the rounding of a different matmul blocking (fp32: ~1e-7
of a logit); :func:`specpilot.agent.kernel_agent` checks that before anything uses the path, and
token forcing checks every output against the plain forward. Covers dense targets (Qwen3 / Llama:
full attention with RoPE on every layer, plain RMSNorms, no attention gate); other families are
refused by :func:`cpu_support` with the reason.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..models.layers import RMSNorm
from .cpu_linear import Linear, matmul


def cpu_support(model) -> str | None:
    """None when :class:`FusedTarget` runs ``model`` (a loaded :class:`~specpilot.models.target.Transformer`),
    else why not: a dense target (full attention, RoPE on every layer over the whole head, no
    attention gate, weighted or no q/k norms of the plain kind, plain linear projections)."""
    c = model.config
    if not c.is_dense:
        return f"a {c.family} target with layers {sorted(set(c.layer_types))} (the fused CPU step covers dense targets)"
    if c.attn_gate != "none" or c.sandwich_norm or c.qk_scaleless or c.norm_offset:
        return "attention gates, sandwich or offset norms (the fused CPU step covers plain Qwen3 / Llama layers)"
    if c.rotary_dim != c.head_dim or not all(c.layer_rope):
        return "partial or missing RoPE (the fused CPU step rotates whole heads on every layer)"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not all(type(x) is nn.Linear for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                   m.down_proj)):
            return "projections that are not plain linear layers (another weight format)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm) + ((a.q_norm, a.k_norm) if c.qk_norm else ())
        if not all(type(n) is RMSNorm for n in norms):
            return "norms that are not plain RMSNorms"
    if type(model.model.norm) is not RMSNorm or type(model.lm_head) is not nn.Linear:
        return "a final norm or LM head of another kind"
    return None


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [..., D] with its first half negated: what :func:`rotate` multiplies the rolled input by."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [..., D] (HF "rotate_half") by ``cos`` and ``ssin`` = :func:`signed_sin` of the sine
    table, broadcast to x: ``x * cos + roll(x, D/2) * ssin``, bit-equal to
    :func:`specpilot.models.layers.apply_rope`'s ``x * cos + cat(-x2, x1) * sin`` (a product's sign
    moves exactly), in two operations fewer."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * ssin


class _Layer:
    """One decoder layer's weights for the fused step (the q/k/v and gate/up weights concatenated),
    its matmuls through ``kernel`` (:class:`~specpilot.fastpath.cpu_linear.Linear`)."""

    def __init__(self, layer, qk_norm: bool, kernel: str):
        a, m = layer.self_attn, layer.mlp
        self.w_in, self.w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv = Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).contiguous(), kernel)
        self.o = Linear(a.o_proj.weight, kernel)
        self.gu = Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight], 0).contiguous(), kernel)
        self.down = Linear(m.down_proj.weight, kernel)
        nh, nkv = a.n_heads, a.n_kv
        # the q and k norms as one norm over the q and k heads, then their weights (bit-equal: RMSNorm
        # multiplies by its weight last); None without q/k norms
        self.qk_norm = torch.cat([a.q_norm.weight.expand(nh, -1), a.k_norm.weight.expand(nkv, -1)]).contiguous() \
            if qk_norm else None


class FusedTarget:
    """The fused CPU step of a dense target (see the module docstring).

    Built once per loaded target (:meth:`specpilot.engine.backend.Backend.fused_step`); the runner
    calls :meth:`forward` for verify and decode steps. The concatenated weights are copies (made at
    construction: a target whose weights change afterwards needs a new step).

    Raises:
        SpecpilotError: a target :func:`cpu_support` refuses (the reason named).
    """

    def __init__(self, model, kernel: str | None = None):
        why = cpu_support(model)
        if why is not None:
            raise SpecpilotError(f"the fused CPU step cannot run this target: {why}")
        c = model.config
        self.model, self.kernel = model, kernel or matmul()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.hidden, self.inter, self.eps = c.hidden_size, c.intermediate_size, c.rms_norm_eps
        self.gqa = self.nh != self.nkv
        with torch.no_grad():
            self.layers = [_Layer(layer, c.qk_norm, self.kernel) for layer in model.model.layers]
            self.head = Linear(model.lm_head.weight, self.kernel)

    def _mask(self, start: torch.Tensor, lo: int, T: int, hi: int, ancestors: torch.Tensor | None):
        """bool [B, 1, T, hi] visibility of cache slots 0..hi-1 (committed slots, then the block's
        own ancestors: a chain's lower triangle without ``ancestors``), or None when every query sees
        every slot (one row, one token)."""
        B = start.shape[0]
        if ancestors is None and T == 1 and B == 1:
            return None
        slots = torch.arange(hi)
        if ancestors is None:  # chain: slot s is visible to block query q when s <= start + q
            if B == 1:
                return (slots[None, :] <= torch.arange(lo, lo + T)[:, None])[None, None]
            return (slots[None, None, :] <= (start[:, None] + torch.arange(T))[:, :, None])[:, None]
        rel = slots[None, :] - start[:, None]  # [B, hi]
        inside = (rel >= 0) & (rel < T)
        idx = rel.clamp(0, T - 1)[:, None, :].expand(B, T, hi)
        return ((torch.gather(ancestors, 2, idx) & inside[:, None, :]) | (rel < 0)[:, None, :])[:, None]

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, capture: tuple[int, ...] = (),
                ancestors: torch.Tensor | None = None, depth: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block of tokens against the target's KV cache (verify, decode): the plain forward's
        result, its K/V written at slots ``start + j``.

        Args:
            tokens: int64 [B, T]; start: int64 [B] committed length per row (CPU tensor).
            capture: target layers whose outputs to return (as the plain forward).
            ancestors: bool [B, T, T] of a tree (None: a chain); depth: int64 [B, T] of a tree's
                nodes (RoPE position start + depth).
        Returns:
            logits [B, T, vocab] and the captured features [B, T, len(capture) * hidden] or None.
        """
        m = self.model
        B, T = tokens.shape
        lo, top = int(start.min()), int(start.max())
        hi = top + T
        cache = m.cache
        if hi > cache.max_seq:
            raise SpecpilotError(f"a verify block to slot {hi} exceeds the KV cache of {cache.max_seq} slots")
        if depth is None and B == 1:
            cos, sin = m.cos[lo:hi][None, :, None], m.sin[lo:hi][None, :, None]
        else:
            pos = start[:, None] + (torch.arange(T) if depth is None else depth)
            cos, sin = m.cos[pos][:, :, None], m.sin[pos][:, :, None]
        sin = signed_sin(sin)  # once per step, for every layer's RoPE
        mask = self._mask(start, lo, T, hi, ancestors)
        rows = slots = None
        if B > 1:
            slots = start[:, None] + torch.arange(T)
            rows = torch.arange(B)[:, None].expand(B, T)
        nh, nkv, hd, eps = self.nh, self.nkv, self.hd, self.eps
        x = m.model.embed(tokens)
        feats = {}
        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (self.hidden,), L.w_in, eps)
            qkv = L.qkv(h).view(B, T, nh + 2 * nkv, hd)
            qk, v = qkv[:, :, :nh + nkv], qkv[:, :, nh + nkv:]
            if L.qk_norm is not None:
                qk = F.rms_norm(qk, (hd,), None, eps) * L.qk_norm
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :, :nh], qk[:, :, nh:]
            kc, vc = cache.k[:, i], cache.v[:, i]  # [B, Hkv, S, D]
            if B == 1:
                kc[:, :, lo:hi] = k.transpose(1, 2)
                vc[:, :, lo:hi] = v.transpose(1, 2)
            else:
                kc[rows, :, slots] = k
                vc[rows, :, slots] = v
            y = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :, :hi], vc[:, :, :hi], attn_mask=mask,
                                               enable_gqa=self.gqa)
            x = x + L.o(y.transpose(1, 2).reshape(B, T, nh * hd))
            g, u = L.gu(F.rms_norm(x, (self.hidden,), L.w_post, eps)).split(self.inter, -1)
            x = x + L.down(F.silu(g) * u)
            if i in capture:
                feats[i] = x
        logits = self.head(m.model.norm(x))  # a dense target: no output multiplier, no softcap
        return logits, (torch.cat([feats[i] for i in capture], -1) if capture else None)

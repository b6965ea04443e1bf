"""The target model, built layer by layer from its config: full attention, Qwen3.5 gated attention,
Gated DeltaNet, sliding-window and global NoPE attention (see :mod:`specpilot.models.config`).

In the spirit of gpt-fast's model.py (pytorch-labs/gpt-fast): static shapes, one forward that
serves prefill, decode and verify over preallocated per-layer state (:mod:`specpilot.models.state`).
Tensor names match the transformers classes (``model.layers.{i}.self_attn.q_proj.weight``,
``model.layers.{i}.linear_attn.in_proj_qkv.weight``, ...), so checkpoints load by name.

A forward over a block of T tokens lets each block token see the committed prefix plus its
ancestors inside the block (a chain for prefill/decode/linear verify, any tree for tree
verification). Verify leaves every committed state as it was (attention writes land past the
committed length; GDN records a tape); :meth:`Transformer.commit` keeps the accepted path and
rolls back the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SpecpilotError
from .attention import Attention
from .config import TargetConfig
from .gdn import GatedDeltaNet
from .layers import MLP, block_mask, rope_tables
from .norms import ScalelessRMSNorm, WeightedRMSNorm, make_norm
from .state import GDNState, KVCache, RingKV, StepContext, TargetState

DEFAULT_VERIFY_WIDTH = 64  # the smallest reserve of a sliding-window ring: also its prefill piece width


def ring_reserve(verify_width: int) -> int:
    """Slots a sliding-window ring keeps beyond the window for an engine that verifies blocks of
    up to ``verify_width`` tokens: that width, but never fewer than :data:`DEFAULT_VERIFY_WIDTH`
    (prompts prefill in pieces of that many tokens, :data:`PREFILL_PIECE`, whatever the engine).

    Raises:
        SpecpilotError: a width below 1.
    """
    if int(verify_width) < 1:
        raise SpecpilotError(f"verify width must be >= 1, got {verify_width}")
    return max(DEFAULT_VERIFY_WIDTH, int(verify_width))


# Tokens per prefill call of a target with sliding-window layers, on every path and at every cache
# size: the engine at any concurrency and token forcing's teacher pass prefill a prompt in the same
# pieces, so on a GPU (where a prefill matmul's bits depend on its rows: cuBLAS picks its algorithm
# by shape) a prompt's K/V and first-token logits are the same bits in both. At most a ring's
# reserve, so a piece never evicts a live ring entry.
PREFILL_PIECE = DEFAULT_VERIFY_WIDTH


def layer_slots(cfg: TargetConfig) -> list[int]:
    """Each layer's index within its state kind (KV cache, ring, or GDN state)."""
    seen: dict[str, int] = {}
    out = []
    for t in cfg.layer_types:
        out.append(seen.get(t, 0))
        seen[t] = out[-1] + 1
    return out


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + mixer(norm(x)), then + mlp(norm(x)); sandwich norms (Muse-Glimmer)
    normalise each sub-layer's output before the residual add."""

    def __init__(self, cfg: TargetConfig, layer: int, slot: int):
        super().__init__()
        self.kind = cfg.layer_types[layer]
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = make_norm(cfg.hidden_size, eps, off)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer, slot)
        else:
            self.self_attn = Attention(cfg, layer, slot)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.post_attention_layernorm = make_norm(cfg.hidden_size, cfg.post_norm_eps, off)
            self.pre_feedforward_layernorm = make_norm(cfg.hidden_size, eps, off)
            self.post_feedforward_layernorm = make_norm(cfg.hidden_size, cfg.post_norm_eps, off)
        else:
            self.post_attention_layernorm = make_norm(cfg.hidden_size, eps, off)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def _mix(self, h, cos, sin, ctx, slots, mask):
        if self.kind == "linear_attention":
            return self.linear_attn.forward_causal(h) if ctx is None else self.linear_attn(h, ctx)
        if ctx is None:
            return self.self_attn.forward_causal(h, cos, sin)
        if getattr(ctx, "ragged", False):  # packed rows of a mixed step (models.ragged)
            return self.self_attn.forward_ragged(h, cos, sin, ctx)
        return self.self_attn(h, cos, sin, ctx, slots, mask)

    def forward(self, x, cos, sin, ctx=None, slots=None, mask=None):
        h = self._mix(self.input_layernorm(x), cos, sin, ctx, slots, mask)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Holds ``embed_tokens``, ``layers`` and ``norm`` under the HF name ``model``."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        slots = layer_slots(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, slots[i]) for i in range(cfg.num_hidden_layers))
        if cfg.final_norm_offset or not cfg.norm_offset:
            self.norm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.final_norm_offset)
        else:
            self.norm = WeightedRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=False)
        # weightless, so not in the checkpoint; the drafter embeds with embed_tokens alone
        self.embed_norm = ScalelessRMSNorm(cfg.rms_norm_eps) if cfg.embed_norm else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        return self.embed_norm(x) if self.embed_norm is not None else x


class Transformer(nn.Module):
    """Causal LM of any supported family with static per-layer state.

    Call :meth:`setup_cache` once, then :meth:`forward` for prefill, decode and verify, and
    :meth:`commit` after a verify. ``cache`` is the full-attention :class:`KVCache` (the whole
    state of a dense target, as the GPU step of fastpath/dense.py expects); ``state`` holds it
    together with the sliding rings and the GDN state.
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cache: KVCache | None = None
        self.state: TargetState | None = None
        self.cos = self.sin = None

    # ------------------------------------------------------------------ state
    def setup_cache(self, batch: int, max_seq: int, dtype: torch.dtype | None = None,
                    verify_width: int = DEFAULT_VERIFY_WIDTH) -> None:
        """Allocate the per-layer state and RoPE tables.

        Full attention: KV cache (batch, full layers, kv_heads, max_seq, head_dim); sliding:
        rings of window + ``verify_width`` slots (the widest block a verify may hold: pass
        :func:`ring_reserve` of the engine's verify width); GDN: conv (batch, layers, conv_dim, K-1) and
        fp32 recurrent (batch, layers, HV, Dk, Dv) states. A state of the same shapes, dtype and
        device is kept rather than reallocated, so its addresses stay fixed across requests and
        captured CUDA graphs stay valid.
        """
        cfg = self.config
        device = self.lm_head.weight.device
        dtype = dtype or self.lm_head.weight.dtype
        key = (batch, max_seq, dtype, str(device), verify_width)
        if self.state is not None and getattr(self, "_state_key", None) == key:
            return
        n = {t: cfg.layer_types.count(t) for t in ("full_attention", "sliding_attention", "linear_attention")}
        kv = KVCache(batch, n["full_attention"], cfg.num_key_value_heads, max_seq, cfg.head_dim, dtype, device) \
            if n["full_attention"] else None
        ring = RingKV(batch, n["sliding_attention"], cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window,
                      verify_width, max_seq, dtype, device) if n["sliding_attention"] else None
        gdn = None
        if n["linear_attention"]:
            h, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                             cfg.linear_value_head_dim)
            gdn = GDNState(batch, n["linear_attention"], 2 * h * dk + hv * dv, cfg.linear_conv_kernel_dim, hv, h,
                           dk, dv, dtype, device)
        self.state = TargetState(kv, ring, gdn)
        self.cache = kv
        self._state_key = key
        cos, sin = rope_tables(cfg.rotary_dim, max_seq, cfg.rope_theta)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def commit(self, start: torch.Tensor, counts: torch.Tensor, path_slots: torch.Tensor | None = None) -> None:
        """Keep ``counts[b]`` entries of the last verify (along ``path_slots`` [B, P] for a tree)."""
        self.state.commit(start, counts, path_slots)

    def state_bytes_per_row(self) -> dict:
        """Bytes of state per request by kind ({'kv', 'ring', 'gdn'}), as allocated by setup_cache."""
        return self.state.nbytes_per_row()

    # ---------------------------------------------------------------- forward
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(x))
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            T = cfg.final_logit_softcapping
            logits = torch.tanh(logits / T) * T
        return logits

    def forward_causal(self, tokens: torch.Tensor, capture: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache-free causal forward over whole sequences [B, T] (training, teacher forcing).

        Returns logits [B, T, vocab] and captured features [B, T, len(capture) * hidden] or None.
        """
        B, T = tokens.shape
        cfg = self.config
        if self.cos is None or self.cos.shape[0] < T:
            cos, sin = rope_tables(cfg.rotary_dim, max(T, 64), cfg.rope_theta)
            self.cos, self.sin = cos.to(tokens.device), sin.to(tokens.device)
        cos, sin = self.cos[:T][None].expand(B, T, -1), self.sin[:T][None].expand(B, T, -1)
        x = self.model.embed(tokens)
        feats = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin)
            if i in capture:
                feats[i] = x
        return self._logits(x), (torch.cat([feats[i] for i in capture], -1) if capture else None)

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, ancestors: torch.Tensor,
                depth: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                parents: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                write: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a block of tokens against the state.

        Args:
            tokens: int64 [B, T] block tokens (prompt, one decode token, or a draft block/tree).
            start: int64 [B] committed length per row; block entry j is position start + j
                (RoPE position start + depth[j]).
            ancestors: bool [B, T, T] block-internal visibility (chain = lower triangle).
            depth: int64 [B, T] depth of each node; None = chain.
            capture: target layer ids whose outputs to return (DFlash convention: layer i's output
                is HF ``hidden_states[i + 1]``).
            parents: int64 [B, T] parent block index per node (-1 root); needed for trees on
                recurrent (GDN) targets, None = chain.
            lengths: int64 [B] valid tokens per row (right-padded prefill); None = all T.
            write: commit the whole valid block into recurrent state (prefill, decode) instead of
                recording it for :meth:`commit` (verify). Attention writes are the same either way.
        Returns:
            logits float [B, T, vocab] (model dtype) and the captured hidden states concatenated on
            the feature axis [B, T, len(capture) * hidden] (None if capture is empty).
        """
        B, T = tokens.shape
        steps = torch.arange(T, device=tokens.device)[None, :]
        slots = start[:, None] + steps
        pos = start[:, None] + (steps if depth is None else depth)
        cos, sin = self.cos[pos], self.sin[pos]
        if parents is None and depth is not None and self.config.is_recurrent:
            raise ValueError("tree verification on a recurrent target needs parents")
        ctx = StepContext(self.state, start, ancestors, depth, parents, lengths, write)
        mask = block_mask(start, ancestors, self.cache.max_seq) if self.cache is not None else None
        x = self.model.embed(tokens)
        feats = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, ctx, slots, mask)
            if i in capture:
                feats[i] = x
        logits = self._logits(x)
        hidden = torch.cat([feats[i] for i in capture], -1) if capture else None
        return logits, hidden

"""The target model: a compact Qwen3 / Llama decoder with a preallocated static KV cache.

In the spirit of gpt-fast's model.py (pytorch-labs/gpt-fast): static shapes, one forward that
serves prefill, decode and verify. Tensor names match Hugging Face ``Qwen3ForCausalLM`` /
``LlamaForCausalLM`` (``model.layers.{i}.self_attn.q_proj.weight``, ...), so HF checkpoints load
by name.

One forward handles every case: it writes the K/V of a block of T tokens into cache slots
``start .. start+T-1`` of each row and lets each block token attend to the committed prefix plus
its ancestors inside the block (a chain for prefill/decode/linear verify, any tree for tree
verification). Rolling back after a rejected draft is bookkeeping only: stale slots past the
committed length are never visible (see :func:`layers.block_mask`) and are overwritten later.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import TargetConfig
from .layers import MLP, RMSNorm, apply_rope, block_mask, rope_tables


class KVCache(nn.Module):
    """Static KV cache, k and v each shaped (batch, layers, kv_heads, max_seq, head_dim)."""

    def __init__(self, batch: int, layers: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        shape = (batch, layers, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, H, T, D] at slots int64 [B, T]; return this layer's full k, v [B, H, S, D]."""
        B = slots.shape[0]
        rows = torch.arange(B, device=slots.device)[:, None].expand_as(slots)
        kc, vc = self.k[:, layer], self.v[:, layer]
        kc[rows, :, slots] = k.transpose(1, 2)
        vc[rows, :, slots] = v.transpose(1, 2)
        return kc, vc

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to ``dst`` (int64 [N] each) of ``rows`` [N].

        Used to compact the accepted path of a tree into contiguous slots.
        """
        self.k[rows, :, :, dst] = self.k[rows, :, :, src]
        self.v[rows, :, :, dst] = self.v[rows, :, :, src]


class Attention(nn.Module):
    """Grouped-query attention with optional Qwen3 q/k RMSNorm, reading/writing the static cache."""

    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: KVCache, slots, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        gqa = self.n_kv != self.n_heads
        if cache is None:  # training / teacher forcing over a whole sequence: plain causal attention
            y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=gqa)
        else:
            kc, vc = cache.write(self.layer, slots, k, v.transpose(1, 2))
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Holds ``embed_tokens``, ``layers`` and ``norm`` under the HF name ``model``."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Qwen3 / Llama causal LM with a static KV cache.

    Call :meth:`setup_cache` once, then :meth:`forward` for prefill, decode and verify.
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.cache: KVCache | None = None
        self.cos = self.sin = None

    def setup_cache(self, batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """Allocate the static KV cache (batch, layers, kv_heads, max_seq, head_dim) and RoPE tables.

        A cache of the same shape, dtype and device is kept rather than reallocated (its stale
        slots are invisible, see :func:`layers.block_mask`), so its address stays fixed across
        requests and captured CUDA graphs stay valid.
        """
        cfg = self.config
        device = self.lm_head.weight.device
        dtype = dtype or self.lm_head.weight.dtype
        shape = (batch, cfg.num_hidden_layers, cfg.num_key_value_heads, max_seq, cfg.head_dim)
        old = self.cache
        if old is not None and tuple(old.k.shape) == shape and old.k.dtype == dtype and old.k.device == device \
                and self.cos is not None and self.cos.shape[0] == max_seq:
            return
        self.cache = KVCache(batch, cfg.num_hidden_layers, cfg.num_key_value_heads, max_seq,
                             cfg.head_dim, dtype, device)
        cos, sin = rope_tables(cfg.head_dim, max_seq, cfg.rope_theta)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward_causal(self, tokens: torch.Tensor, capture: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache-free causal forward over whole sequences [B, T] (training, teacher forcing).

        Returns logits [B, T, vocab] and captured features [B, T, len(capture) * hidden] or None.
        """
        B, T = tokens.shape
        if self.cos is None or self.cos.shape[0] < T:
            cos, sin = rope_tables(self.config.head_dim, max(T, 64), self.config.rope_theta)
            self.cos, self.sin = cos.to(tokens.device), sin.to(tokens.device)
        cos, sin = self.cos[:T][None].expand(B, T, -1), self.sin[:T][None].expand(B, T, -1)
        x = self.model.embed_tokens(tokens)
        feats = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None, None, None)
            if i in capture:
                feats[i] = x
        logits = self.lm_head(self.model.norm(x))
        return logits, (torch.cat([feats[i] for i in capture], -1) if capture else None)

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, ancestors: torch.Tensor,
                depth: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a block of tokens against the cache.

        Args:
            tokens: int64 [B, T] block tokens (prompt, one decode token, or a draft block/tree).
            start: int64 [B] committed length per row; block slot j is cache slot start + j.
            ancestors: bool [B, T, T] block-internal visibility (chain = lower triangle).
            depth: int64 [B, T] depth of each node (RoPE position = start + depth); None = chain.
            capture: target layer ids whose outputs to return (DFlash convention: layer i's output
                is HF ``hidden_states[i + 1]``).
        Returns:
            logits float [B, T, vocab] (model dtype) and the captured hidden states concatenated on
            the feature axis [B, T, len(capture) * hidden] (None if capture is empty).
        """
        B, T = tokens.shape
        steps = torch.arange(T, device=tokens.device)[None, :]
        slots = start[:, None] + steps
        pos = start[:, None] + (steps if depth is None else depth)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = block_mask(start, ancestors, self.cache.max_seq)
        x = self.model.embed_tokens(tokens)
        feats = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, self.cache, slots, mask)
            if i in capture:
                feats[i] = x
        logits = self.lm_head(self.model.norm(x))
        hidden = torch.cat([feats[i] for i in capture], -1) if capture else None
        return logits, hidden

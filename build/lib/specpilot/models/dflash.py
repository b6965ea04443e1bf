"""DFlash block drafter (Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036; public release github.com/z-lab/dflash, dflash/model.py).

Design, as in the release:
- a few Qwen3-style decoder layers; no embedding or LM head of its own: the block is embedded with
  the target's ``embed_tokens`` and drafts are read with the target's ``lm_head`` after the
  drafter's final ``norm``;
- context: the target's hidden states at ``target_layer_ids`` (spread evenly from layer 1 to L-3,
  :func:`build_target_layer_ids`) concatenated on the feature axis, projected by a bias-free
  ``fc`` and ``hidden_norm`` (RMSNorm); in every drafter layer the context gives keys/values
  through that layer's own ``k_proj``/``v_proj`` (KV injection), kept in a draft KV cache;
- the block is the last committed token followed by ``mask_token_id``; attention is
  bidirectional inside the block and sees all committed context; one forward drafts
  ``block_size - 1`` tokens (slots 1..B-1, argmax).

Checkpoint compatibility: config.json is a Qwen3 config (hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta)
plus ``dflash_config: {target_layer_ids, mask_token_id, block_size}`` (top-level ``block_size``
and ``num_target_layers`` also read), ``architectures: ["DFlashDraftModel"]``; tensor names
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``norm.weight``, ``fc.weight``, ``hidden_norm.weight``. Optional ``input_embedding_scale`` and
``output_multiplier`` / ``final_logit_softcapping`` are honoured as in the release.

Attention per layer follows the reference package ``dflash`` 0.1.0 (which wins where our reading
of the paper differs): ``layer_types`` entries ``full_attention`` / ``sliding_attention``; a
sliding layer sees keys within ``sliding_window`` positions (both directions when non-causal);
a layer is causal inside the block when ``is_causal`` is true, or when ``is_causal`` is unset and
the layer is sliding (the reference's rule); ``sliding_window`` counts only with
``use_sliding_window: true`` (transformers' Qwen3Config, on which the reference builds, drops it
otherwise). Parity: tests/test_dflash_parity.py. Unsupported (one SpecpilotError naming it):
other layer types, attention_bias, non-default RoPE, activations other than silu.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from .config import DecoderShape
from .layers import MLP, RMSNorm, apply_rope, rope_tables


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers the drafter reads: spread evenly from layer 1 to L-3 (DFlash rule).

    Example: 36 target layers, 5 draft layers -> [1, 9, 17, 25, 33].
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise SpecpilotError(f"a target of {num_target_layers} layers is too shallow for a DFlash drafter")
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig(DecoderShape):
    """Shape (:class:`DecoderShape`) and DFlash fields of a block drafter."""

    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    num_target_layers: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    architecture: str = "DFlashDraftModel"
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise SpecpilotError(f"drafter config: layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise SpecpilotError(f"drafter config: unsupported layer type(s) {bad}; supported: full_attention, "
                                 f"sliding_attention")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise SpecpilotError(f"drafter config: sliding_window must be >= 1, got {self.sliding_window}")

    def layer_causal(self, i: int) -> bool:
        """Causal inside the block? The reference (z-lab ``dflash/model.py``) makes a layer causal when
        ``is_causal`` is unset and the layer is sliding; ``is_causal`` in the config overrides it."""
        if self.is_causal is None:
            return self.layer_types[i] == "sliding_attention"
        return bool(self.is_causal)

    def layer_window(self, i: int) -> int | None:
        """Sliding window (positions) of layer i, None for full attention (or no window set:
        transformers' Qwen3Config, which the reference builds on, drops ``sliding_window`` unless
        ``use_sliding_window`` is true; we read config.json the same way)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "drafter config.json") -> "DrafterConfig":
        """Read a DFlash release config (``dflash_config`` sub-dict or top-level keys).

        Raises:
            SpecpilotError: a missing key, or no target_layer_ids / mask_token_id.
        """
        sub = d.get("dflash_config") or {}

        def get(name, default=None):
            return sub.get(name, d.get(name, default))

        if get("target_layer_ids") is None and d.get("num_target_layers"):
            sub = {**sub, "target_layer_ids": build_target_layer_ids(int(d["num_target_layers"]),
                                                                     int(d["num_hidden_layers"]))}
        if get("target_layer_ids") is None:
            raise SpecpilotError(f"{where}: drafter config must define dflash_config.target_layer_ids")
        if d.get("attention_bias"):
            raise SpecpilotError(f"{where}: attention_bias=true drafters are not supported")
        rope_type = (d.get("rope_parameters") or d.get("rope_scaling") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise SpecpilotError(f"{where}: rope_type {rope_type!r} is not supported (only default RoPE)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise SpecpilotError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        if get("mask_token_id") is None:
            raise SpecpilotError(f"{where}: drafter config must define dflash_config.mask_token_id")
        try:
            heads = d["num_attention_heads"]
            rope = d.get("rope_parameters") or {}
            return cls(
                hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                vocab_size=d["vocab_size"], target_layer_ids=list(get("target_layer_ids")),
                mask_token_id=int(get("mask_token_id")), block_size=int(get("block_size", 16)),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 1e6))),
                num_target_layers=int(get("num_target_layers", 0) or 0),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=get("final_logit_softcapping"),
                layer_types=list(d.get("layer_types") or []),
                sliding_window=d.get("sliding_window") if d.get("use_sliding_window") else None,
                is_causal=d.get("is_causal"),
                architecture=(d.get("architectures") or ["DFlashDraftModel"])[0],
                extra=dict(sub),
            )
        except KeyError as e:
            raise SpecpilotError(f"{where}: missing key {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict:
        """config.json content in the DFlash release layout."""
        dflash = {**self.extra, "target_layer_ids": self.target_layer_ids, "mask_token_id": self.mask_token_id,
                  "block_size": self.block_size}
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", None)):
            if getattr(self, name) != default:
                dflash[name] = getattr(self, name)
        out = {
            "architectures": [self.architecture], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "max_position_embeddings": 40960, "attention_dropout": 0.0,
            "layer_types": self.layer_types, "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "dflash_config": dflash,
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out


class DraftAttention(nn.Module):
    """Block queries attend to injected context K/V plus the whole block (no causal mask)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, Hkv, T, D] of inputs x [B, T, hidden]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DraftLayer(nn.Module):
    """Pre-norm drafter layer. DFlash2 sets ``attention_conv`` / ``mlp_conv`` (grouped dynamic
    causal convolutions around each sublayer, :mod:`specpilot.drafters.dflash2`); DFlash leaves them None."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.attention_conv = None
        self.mlp_conv = None

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask, block_len: int | None = None):
        x = self.input_layernorm(h)
        if self.attention_conv is not None:
            x, dyn = self.attention_conv.prepare(x, block_len)
        y = self.self_attn(x, cos, sin, ctx_k, ctx_v, mask)
        if self.attention_conv is not None:
            y = self.attention_conv.finish(y, dyn, block_len)
        h = h + y
        x = self.post_attention_layernorm(h)
        if self.mlp_conv is not None:
            x, dyn = self.mlp_conv.prepare(x, block_len)
        y = self.mlp(x)
        if self.mlp_conv is not None:
            y = self.mlp_conv.finish(y, dyn, block_len)
        return h + y


def _visible(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Reference visibility rule between query and key positions (z-lab ``_attention_mask``):
    causal -> key <= query; a window w -> query - key < w and, when not causal, key - query < w."""
    d = qpos[..., :, None] - kpos[..., None, :]
    vis = torch.ones_like(d, dtype=torch.bool)
    if causal:
        vis &= d >= 0
    if window is not None:
        vis &= d < window
        if not causal:
            vis &= -d < window
    return vis


class DFlashDrafter(nn.Module):
    """DFlash drafter with a static draft KV cache of injected context.

    Inference: :meth:`setup_cache`, then per step :meth:`add_context` (target features of newly
    committed positions) and :meth:`draft`. Training: :meth:`train_logits`.
    """

    kind = "dflash"

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ctx_k = self.ctx_v = self.cos = self.sin = None

    # -- cache ------------------------------------------------------------------------------
    def setup_cache(self, batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """Allocate the context K/V cache: (layers, batch, kv_heads, max_seq, head_dim) each (views of
        batch-major storage)."""
        cfg = self.config
        device = self.fc.weight.device
        dtype = dtype or self.fc.weight.dtype
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_seq, cfg.head_dim)
        if self.ctx_k is not None and tuple(self.ctx_k.shape) == shape and self.ctx_k.dtype == dtype \
                and self.ctx_k.device == device:
            return  # same shape: keep the buffers (and the CUDA graphs captured on them)
        # stored (batch, layers, kv_heads, max_seq, head_dim), as the target's cache: one request's
        # context of every layer is one block, so the Triton context injection writes all layers'
        # K/V in one launch (fastpath.drafter.FastDrafter); ctx_k[i] stays one layer's (B, Hkv, S, D)
        lead = (batch, cfg.num_hidden_layers, cfg.num_key_value_heads, max_seq, cfg.head_dim)
        self.ctx_k = torch.zeros(lead, dtype=dtype, device=device).transpose(0, 1)
        self.ctx_v = torch.zeros(lead, dtype=dtype, device=device).transpose(0, 1)
        cos, sin = rope_tables(cfg.head_dim, max_seq + cfg.block_size + 64, cfg.rope_theta)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Fuse target features [..., n_layers * hidden] into the context [..., hidden]."""
        return self.hidden_norm(self.fc(features))

    def add_context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        """Write the injected K/V of newly committed positions into the draft cache.

        Args:
            features: [B, T, n_layers * hidden] target hidden states of positions start..start+T-1.
            start: int64 [B] first position per row. Entries past a row's committed length are
                harmless: :meth:`draft` only reads slots below its ``start``.
        """
        B, T, _ = features.shape
        pos = start[:, None] + torch.arange(T, device=start.device)[None, :]
        cos, sin = self.cos[pos], self.sin[pos]
        ctx = self.context(features)
        rows = torch.arange(B, device=start.device)[:, None].expand_as(pos)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            self.ctx_k[i][rows, :, pos] = k.transpose(1, 2)
            self.ctx_v[i][rows, :, pos] = v.transpose(1, 2)

    def block_hidden(self, block: torch.Tensor, start: torch.Tensor, embed: nn.Embedding,
                     ctx_len: torch.Tensor | None = None) -> torch.Tensor:
        """Drafter output states [B, T, hidden] for a block [B, T] whose slot 0 sits at ``start``.

        ``ctx_len`` int64 [B]: context slots the block sees (default ``start``: all injected ones).
        Smaller for a block placed beyond not-yet-verified positions (two-level drafting), whose
        context slots hold nothing valid.
        """
        B, T = block.shape
        pos = start[:, None] + torch.arange(T, device=block.device)[None, :]
        cos, sin = self.cos[pos], self.sin[pos]
        S = self.ctx_k.shape[3]
        cfg = self.config
        slots = torch.arange(S, device=block.device)
        visible_ctx = slots[None, :] < (start if ctx_len is None else ctx_len)[:, None]  # [B, S]
        masks = {}
        for i in range(cfg.num_hidden_layers):
            key = (cfg.layer_causal(i), cfg.layer_window(i))
            if key in masks:
                continue
            if key == (False, None):  # the DFlash default: the whole committed context + the block
                masks[key] = torch.cat([visible_ctx, visible_ctx.new_ones(B, T)], 1)[:, None, None, :]
                continue
            ctx = visible_ctx[:, None, :] & _visible(pos, slots[None, :].expand(B, -1), *key)
            own = _visible(pos, pos, *key)
            masks[key] = torch.cat([ctx, own], 2)[:, None]
        h = self.embed_block(block, embed)
        for i, layer in enumerate(self.layers):
            mask = masks[(cfg.layer_causal(i), cfg.layer_window(i))]
            h = layer(h, cos, sin, self.ctx_k[i], self.ctx_v[i], mask, T)
        return self.norm(h)

    def embed_block(self, block: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """Block input embeddings [B, T, hidden] (the target's ``embed_tokens`` x input scale)."""
        return embed(block) * self.config.input_embedding_scale

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits through the target's LM head (with the release's optional scaling)."""
        out = lm_head(hidden) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def draft(self, anchor: torch.Tensor, start: torch.Tensor, embed: nn.Embedding, lm_head: nn.Module,
              block_size: int, ctx_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft ``block_size - 1`` tokens after ``anchor`` in one forward.

        Args:
            anchor: int64 [B] last committed token (not yet seen by the target), at position ``start``.
            start: int64 [B] its position = number of context positions already in the draft cache.
            ctx_len: int64 [B] context slots visible (default ``start``; see :meth:`block_hidden`).
        Returns:
            tokens int64 [B, block_size - 1] (argmax) and their logits [B, block_size - 1, vocab].
        """
        B = anchor.shape[0]
        block = torch.full((B, block_size), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        logits = self.logits(self.block_hidden(block, start, embed, ctx_len)[:, 1:], lm_head)
        return logits.argmax(-1), logits

    # -- training ---------------------------------------------------------------------------
    def train_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                     embed: nn.Embedding, lm_head: nn.Module, block_size: int,
                     return_hidden: bool = False, drop_anchor: bool = True):
        """Draft logits for many blocks of each sequence in one pass (DFlash-style training).

        Block a of row b starts at anchor position p = anchors[b, a]: slot 0 holds tokens[b, p],
        the rest the mask token; it sees context positions < p and its own block.

        Args:
            features: [B, T, n_layers * hidden] target features of the whole sequence.
            tokens: int64 [B, T]; anchors: int64 [B, A] with p + block_size <= T.
        Returns:
            logits [B, A, block_size - 1, vocab]; slot j predicts tokens[b, p + j] (with
            ``drop_anchor=False`` all block_size slots are returned). ``return_hidden`` adds the
            drafter's normed output states [B, A, slots, hidden].
        """
        B, T, _ = features.shape
        A = anchors.shape[1]
        dev = tokens.device
        cos_t, sin_t = self.cos[:T][None].expand(B, T, -1), self.sin[:T][None].expand(B, T, -1)
        ctx = self.context(features)
        offs = torch.arange(block_size, device=dev)
        pos = (anchors[:, :, None] + offs).reshape(B, A * block_size)
        cos_b, sin_b = self.cos[pos], self.sin[pos]
        block = torch.full((B, A, block_size), self.config.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = tokens.gather(1, anchors)
        h = self.embed_block(block.view(B, A * block_size), embed)
        blk_id = torch.arange(A, device=dev).repeat_interleave(block_size)
        ctx_vis = torch.arange(T, device=dev)[None, None, :] < pos[:, :, None].sub(
            offs.repeat(A)[None, :, None])  # [B, A*bs, T]: context positions < anchor
        own = (blk_id[:, None] == blk_id[None, :])[None].expand(B, -1, -1)
        cfg = self.config
        tpos = torch.arange(T, device=dev)[None].expand(B, -1)
        masks = {}
        for i in range(cfg.num_hidden_layers):
            key = (cfg.layer_causal(i), cfg.layer_window(i))
            if key not in masks:
                masks[key] = torch.cat([ctx_vis & _visible(pos, tpos, *key), own & _visible(pos, pos, *key)],
                                       2)[:, None]
        for i, layer in enumerate(self.layers):
            ck, cv = layer.self_attn.kv(ctx, cos_t, sin_t)
            h = layer(h, cos_b, sin_b, ck, cv, masks[(cfg.layer_causal(i), cfg.layer_window(i))], block_size)
        h = self.norm(h).view(B, A, block_size, -1)
        if drop_anchor:
            h = h[:, :, 1:]
        logits = self.logits(h, lm_head)
        return (logits, h) if return_hidden else logits

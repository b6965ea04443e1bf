"""Tiny target builders by kind, for ``specpilot build-tiny --target-kind``.

- ``dense``: today's tiny Qwen3 target (full attention, q/k norm, tied embeddings);
- ``hybrid``: a tiny Qwen3.5-style hybrid: Gated DeltaNet layers with one gated full-attention
  layer in every four (transformers' ``full_attention_interval`` rule), partial RoPE 0.25,
  ``1 + w`` norms, the interleaved attention output gate;
- ``muse``: a tiny Muse-Glimmer-style target: sliding-window RoPE layers (window 64, so prompts
  and answers wrap the ring) with a global NoPE layer every fourth counted back from the last,
  scale-less q/k norm x 3.87, sigmoid ``gate_proj`` output gate, sandwich norms, a weightless
  embedding norm and a softcapped head (cap 20, multiplier 1/sqrt(hidden/256) as in the release).

Every kind shares the recipe's width, depth and head count, so training cost stays comparable.
"""

from __future__ import annotations

import math

import torch

from ..errors import SpecpilotError
from ..models.config import TargetConfig

TARGET_KINDS = ("dense", "hybrid", "muse")
MUSE_WINDOW = 64


def tiny_target_config(kind: str, recipe, vocab: int) -> TargetConfig:
    """The :class:`TargetConfig` of a tiny target of ``kind`` for a :class:`tiny.build.TinyRecipe`.

    Raises:
        SpecpilotError: unknown kind (named).
    """
    n, heads = recipe.layers, recipe.heads
    base = dict(vocab_size=vocab, hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
                num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=recipe.kv_heads,
                head_dim=recipe.hidden // heads, rope_theta=10000.0, tie_word_embeddings=True,
                max_position_embeddings=4096)
    if kind == "dense":
        return TargetConfig(**base)
    if kind == "hybrid":
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        hd = recipe.hidden // heads
        return TargetConfig(**base, family="qwen3_5", architecture="Qwen3_5ForCausalLM", layer_types=types,
                            norm_offset=True, final_norm_offset=True, attn_gate="interleaved",
                            partial_rotary_factor=0.25, linear_num_key_heads=max(1, heads // 2),
                            linear_num_value_heads=heads, linear_key_head_dim=hd, linear_value_head_dim=hd,
                            linear_conv_kernel_dim=4)
    if kind == "muse":
        glob = [(n - 1 - i) % 4 == 0 for i in range(n)]
        return TargetConfig(**{**base, "rms_norm_eps": 1e-5}, family="muse_glimmer",
                            architecture="MuseGlimmerForCausalLM", qk_norm=False,
                            layer_types=["full_attention" if g else "sliding_attention" for g in glob],
                            layer_rope=[not g for g in glob], sliding_window=MUSE_WINDOW, norm_offset=True,
                            attn_gate="proj", qk_scaleless=True, qk_scale_factor=3.87, sandwich_norm=True,
                            post_norm_eps=1e-8, embed_norm=True, final_logit_softcapping=20.0,
                            output_multiplier=1.0 / math.sqrt(recipe.hidden / 256))
    raise SpecpilotError(f"unknown tiny target kind {kind!r}; choose from {', '.join(TARGET_KINDS)}")


@torch.no_grad()
def init_family_params(model) -> None:
    """Family-specific inits on top of the recipe's N(0, std) linear init: GDN decay
    ``A_log = log U(1, 16)`` and ``dt_bias = 1`` (transformers' Qwen3.5 init); norms keep their
    neutral values (1, or 0 where stored as ``1 + w``)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)

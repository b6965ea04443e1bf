"""The named shapes of random checkpoints (``specpilot random-checkpoint --shape``), torch-free.

Each shape is the keyword arguments of a :class:`~specpilot.models.config.TargetConfig` plus three
drafter keys (``draft_layers``, ``mask_token_id``, ``draft_heads``); the shapes themselves and their
sources are described in :mod:`specpilot.models.random_checkpoint`. Kept apart from the checkpoint
writer so the workflow's planning (:mod:`specpilot.validate`, resources of a job) reads them without
importing torch.
"""

from __future__ import annotations

from ..errors import SpecpilotError

DRAFTER_KEYS = ("draft_layers", "mask_token_id", "draft_heads")


def _hybrid(groups: int, **sizes) -> dict:
    """A Qwen3.5 hybrid shape: [3 Gated DeltaNet, 1 gated full attention] x ``groups``, ``1 + w``
    norms, the interleaved output gate and partial RoPE 0.25, plus the shape's ``sizes``."""
    return dict(family="qwen3_5", architecture="Qwen3_5ForCausalLM",
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * groups, norm_offset=True,
                final_norm_offset=True, attn_gate="interleaved", partial_rotary_factor=0.25, **sizes)


def _muse(groups: int, **sizes) -> dict:
    """A Muse-Glimmer shape: [3 sliding RoPE, 1 global NoPE] x ``groups``, scale-less q/k norm x 3.87,
    the ``gate_proj`` output gate, sandwich and embedding norms, softcap 20, plus the shape's ``sizes``."""
    return dict(family="muse_glimmer", architecture="MuseGlimmerForCausalLM", qk_norm=False,
                layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * groups,
                layer_rope=([True] * 3 + [False]) * groups, norm_offset=True, attn_gate="proj", qk_scaleless=True,
                qk_scale_factor=3.87, sandwich_norm=True, post_norm_eps=1e-8, embed_norm=True,
                final_logit_softcapping=20.0, **sizes)


SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                     max_position_embeddings=40960, draft_layers=5, mask_token_id=151669),
    "qwen3-27b-dense": dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                            num_attention_heads=40, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                            max_position_embeddings=40960, draft_layers=5, mask_token_id=151669),
    "qwen3.8-27b": _hybrid(16, vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                           num_attention_heads=24, num_key_value_heads=4, head_dim=256, rope_theta=10_000_000.0,
                           max_position_embeddings=262144, linear_num_key_heads=16, linear_num_value_heads=48,
                           linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                           draft_layers=5, mask_token_id=248319, draft_heads=(32, 8, 128)),
    "muse-glimmer-30b": _muse(13, vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_hidden_layers=52,
                              num_attention_heads=32, num_key_value_heads=2, head_dim=128, rope_theta=500_000.0,
                              rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=2048,
                              output_multiplier=0.19611613513818404, draft_layers=5, mask_token_id=202047,
                              draft_heads=(32, 8, 128)),
    "tiny-hybrid": _hybrid(2, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
                           max_position_embeddings=4096, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=32, linear_value_head_dim=32, draft_layers=2, mask_token_id=1023),
    "tiny-muse": _muse(2, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
                       max_position_embeddings=4096, sliding_window=64, output_multiplier=0.5, draft_layers=2,
                       mask_token_id=1023),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
                 max_position_embeddings=4096, draft_layers=2, mask_token_id=1023),
}


def shape_spec(name: str) -> dict:
    """The spec of a named shape (see :data:`SHAPES`).

    Raises:
        SpecpilotError: an unknown name (the known ones listed)."""
    if name not in SHAPES:
        raise SpecpilotError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    return SHAPES[name]


def target_params_b(name: str) -> float:
    """Parameters [billions] of a named shape's target, counted from its sizes: embedding and LM head
    (untied), attention projections of every attention layer, Gated DeltaNet projections of every
    linear-attention layer (q, k, v, z, a, b, out; hybrid shapes), the MLP of every layer. Norms and
    small vectors are left out (< 0.1 % at the study's shapes; ~1 % at the tiny ones).

    Raises:
        SpecpilotError: an unknown name."""
    s = shape_spec(name)
    h, i, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    types = s.get("layer_types") or ["full_attention"] * n
    attn = h * s["head_dim"] * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    if s.get("attn_gate") in ("interleaved", "proj"):  # the output gate doubles q (interleaved) or adds a gate proj
        attn += h * s["head_dim"] * s["num_attention_heads"]
    kd = s.get("linear_num_key_heads", 0) * s.get("linear_key_head_dim", 0)
    vd = s.get("linear_num_value_heads", 0) * s.get("linear_value_head_dim", 0)
    gdn = h * (2 * kd + 2 * vd + 2 * s.get("linear_num_value_heads", 0)) + vd * h
    layers = sum(gdn if t == "linear_attention" else attn for t in types) + n * 3 * h * i
    return (layers + 2 * h * v) / 1e9

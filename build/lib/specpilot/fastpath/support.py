"""What the Triton fast path can run: one answer per kind of model, as a reason (None = it can).

These are the only capability checks of the fast path; :func:`specpilot.engine.backend.choose_backend`
asks them once per model and everything else reads its decision. Nothing here imports Triton.
"""

from __future__ import annotations

from torch import nn

from ..models.dflash import DFlashDrafter

DENSE_LAYERS = {"full_attention"}
FAMILY_LAYERS = {"full_attention", "sliding_attention", "linear_attention"}


def triton_available() -> bool:
    """True when the optional dependency Triton imports (CUDA kernels, or their CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Triton path
        return False
    return True


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _plain_linears(mods) -> bool:
    return all(type(m) is nn.Linear for m in mods)


def dense_support(model) -> str | None:
    """None when the dense step (:class:`~specpilot.fastpath.dense.FastTarget`) can run the target
    ``model``, else why not: every projection a plain ``nn.Linear`` (not a w12 module), all layers
    full attention, a power-of-two head_dim (the attention and RoPE kernels tile by it)."""
    c = model.config
    if not _pow2(c.head_dim):
        return f"head_dim {c.head_dim} is not a power of two"
    if set(c.layer_types) - DENSE_LAYERS:
        return f"layer types {sorted(set(c.layer_types))} (the dense step has full attention only)"
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not _plain_linears((a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)):
            return "projections that are not plain linear layers (another weight format)"
    if type(model.lm_head) is not nn.Linear:
        return "the LM head is not a plain linear layer"
    return None


def family_support(model) -> str | None:
    """None when the family step (:class:`~specpilot.fastpath.family.FastFamilyTarget`) can run
    the hybrid / sliding-window target ``model``, else why not: plain ``nn.Linear`` projections,
    power-of-two head dims (attention, GDN key and value), an even rotary dim, a GDN conv kernel
    of 4 and no layer type beyond full / sliding / linear attention."""
    c = model.config
    if not _pow2(c.head_dim):
        return f"head_dim {c.head_dim} is not a power of two"
    if set(c.layer_types) - FAMILY_LAYERS:
        return f"layer types {sorted(set(c.layer_types))}"
    if c.is_recurrent:
        if not (_pow2(c.linear_key_head_dim) and _pow2(c.linear_value_head_dim)):
            return "GDN head dims must be powers of two"
        if c.linear_conv_kernel_dim != 4:
            return f"GDN conv kernel {c.linear_conv_kernel_dim} (the fast path has 4)"
    if c.rotary_dim % 2:
        return f"odd rotary dim {c.rotary_dim}"
    for layer in model.model.layers:
        for mod in layer.modules():
            if mod is not layer and isinstance(mod, nn.Module) and mod.__class__.__name__.startswith("W12"):
                return "12-bit weights"
    if type(model.lm_head) is not nn.Linear:
        return "the LM head is not a plain linear layer"
    return None


def target_support(model) -> str | None:
    """:func:`dense_support` for a dense target, :func:`family_support` for the others."""
    return dense_support(model) if model.config.is_dense else family_support(model)


def drafter_support(drafter) -> str | None:
    """None when the Triton draft step (:class:`~specpilot.fastpath.drafter.FastDrafter`) can run
    ``drafter``, else why not: a plain DFlash network (not a DFlash2 / DSpark subclass: their
    convolutions and heads run eagerly), every layer non-causal without a window (the DFlash
    default), plain linears without bias and a power-of-two head_dim."""
    cfg = drafter.config
    if type(drafter) is not DFlashDrafter:
        return f"{type(drafter).__name__} is not a plain DFlash network"
    if not _pow2(cfg.head_dim):
        return f"head_dim {cfg.head_dim} is not a power of two"
    if any(cfg.layer_causal(i) or cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)):
        return "causal or windowed draft layers"
    for layer in drafter.layers:
        if layer.attention_conv is not None or layer.mlp_conv is not None:
            return "convolution layers"
    lin = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
    if not all(type(m) is nn.Linear and m.bias is None for m in lin):
        return "linears with bias or another weight format"
    return None

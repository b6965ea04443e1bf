"""Lossless 12-bit weights ("w12"): format, linear layer, checkpoint converter.

A bf16 weight is stored as a sign+mantissa byte plus a 4-bit exponent code relative to a
per-tensor base (codes 1..15; code 0 = escape, stored exactly on the side), so decoding is
bit-exact and weight bytes drop by a quarter. After Turbo-Lossless (cenconq25/Turbo-Lossless) and
NyoomFloat12 (openreview.net/forum?id=yYFj1E1mSZ). Triton kernels live in ``specpilot/kernels/w12_triton.py``
at the repository root and are imported only on CUDA.

Public API: :func:`pack`, :func:`unpack`, :func:`escape_rate`, :func:`nbytes`, :class:`W12Tensor`,
:class:`W12Linear`, :func:`apply_w12`, :func:`save_w12_state`, :func:`load_w12_state`, and
:data:`DIRECTION` (the agent-loop direction this mechanism registers).
"""

from .format import W12Tensor, escape_rate, nbytes, pack, unpack
from .linear import W12Linear, apply_w12, load_w12_state, save_w12_state

# The agent loop's direction for this mechanism: it attacks the weight-bytes term of the cost model.
DIRECTION = {"name": "w12_weights", "cost_term": "weight_bytes", "space": {"weight_format": ["bf16", "w12"]}}

__all__ = ["W12Tensor", "pack", "unpack", "escape_rate", "nbytes", "W12Linear", "apply_w12",
           "save_w12_state", "load_w12_state", "DIRECTION"]

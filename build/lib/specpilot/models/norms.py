"""RMSNorm variants of the hybrid and Muse-Glimmer families (Zhang & Sennrich 2019, fp32 math).

- :class:`WeightedRMSNorm`: scale ``1 + w`` with ``w`` stored zero-centred (``offset``: Qwen3.5
  ``Qwen3_5RMSNorm``, Muse-Glimmer's layer norms) or plain ``w`` (Muse-Glimmer's final norm); the
  product is taken in fp32, then cast.
- :class:`ScalelessRMSNorm`: no weight at all (Muse-Glimmer's q/k norm and embedding norm).
- :class:`GatedRMSNorm`: ``w * norm(x) * silu(z)`` (the Gated DeltaNet output norm; Yang et al.,
  "Gated Delta Networks", arXiv 2412.06464).
- :func:`make_norm`: the weighted norm a config asks for (plain ``w`` or ``1 + w``).

Input [..., dim] of any float dtype; output the same shape and dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .layers import RMSNorm


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class WeightedRMSNorm(nn.Module):
    """``norm(x) * (1 + w)`` when ``offset`` (``w`` initialised to zero), else ``norm(x) * w`` (``w``
    initialised to one); the product in fp32, cast back."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = True):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        return (_normalize(x.float(), self.eps) * (1.0 + w if self.offset else w)).type_as(x)


class ScalelessRMSNorm(nn.Module):
    """``norm(x)`` without a weight (no parameters, so no checkpoint tensor)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(x.float(), self.eps).type_as(x)


class GatedRMSNorm(nn.Module):
    """``w * norm(x) * silu(z)``: x, z [..., dim]; the norm in fp32, the gate in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.weight * _normalize(x.float(), self.eps).to(dtype)
        return (y * F.silu(z.float())).to(dtype)


def make_norm(dim: int, eps: float, offset: bool) -> nn.Module:
    """The weighted RMSNorm of a family: ``1 + w`` when ``offset`` (Qwen3.5, Muse-Glimmer), else ``w``."""
    return WeightedRMSNorm(dim, eps) if offset else RMSNorm(dim, eps)

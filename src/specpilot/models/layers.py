"""Building blocks shared by the target and the drafters: RMSNorm, RoPE, SwiGLU, attention masks.

Tensor names follow Hugging Face Qwen3 (``q_proj``, ``k_norm``, ``gate_proj``, ...) so checkpoints
load by name.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) computed in fp32, as Qwen3 does.

    Input [..., dim] of any float dtype; output the same shape and dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, the same fp32 math (bit-identical on CPU, tests/test_layers.py); a
            # decode step of a small model is ~2000 tiny ops, 25 norms of 8 ops each among them
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``. [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(head_dim: int, max_seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables (Su et al. 2021, HF "rotate_half" layout).

    Returns cos, sin, each fp32 [max_seq, head_dim].
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_seq, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, D] by per-position tables ``cos``/``sin`` [B, T, D]."""
    cos = cos[:, None].to(x.dtype)
    sin = sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def block_mask(start: torch.Tensor, ancestors: torch.Tensor, cache_len: int) -> torch.Tensor:
    """Visibility of cache slots for the queries of a verify block.

    Slot ``s`` is visible to block query ``q`` of row ``b`` if it holds committed context
    (``s < start[b]``) or it is block slot ``j = s - start[b]`` with ``ancestors[b, q, j]``
    (a node sees itself and its ancestors; a chain is the lower triangle). Slots past the block,
    e.g. stale entries from a rolled-back draft, are never visible.

    Args:
        start: int64 [B], committed length per row (first block slot).
        ancestors: bool [B, T, T].
        cache_len: number of slots S in the static cache.
    Returns:
        bool [B, 1, T, S], True = attend.
    """
    B, T, _ = ancestors.shape
    rel = torch.arange(cache_len, device=start.device)[None, :] - start[:, None]  # [B, S]
    in_block = (rel >= 0) & (rel < T)
    idx = rel.clamp(0, T - 1)[:, None, :].expand(B, T, cache_len)
    visible = torch.gather(ancestors, 2, idx) & in_block[:, None, :]
    return (visible | (rel < 0)[:, None, :])[:, None]


def chain_ancestors(batch: int, length: int, device: torch.device | str) -> torch.Tensor:
    """Ancestor mask of a chain (causal lower triangle), bool [batch, length, length]."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril().expand(batch, length, length)


def tree_ancestors(parents: torch.Tensor, max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask and depth of a token tree given parent indices.

    Args:
        parents: int64 [B, T]; ``parents[b, i]`` is the block index of node i's parent (< i), or -1
            for the root. A chain is ``[-1, 0, 1, ...]``.
        max_depth: a bound of the tree's depth known to the caller: products enough for that many
            levels and no host synchronization (None: square until nothing changes).
    Returns:
        ancestors bool [B, T, T] (node sees itself and its ancestors) and depth int64 [B, T].

    Repeated squaring (pointer doubling as matrix products): with A = I + P (P[t, j] = 1 when j is
    t's parent), the clamped product A @ A holds the ancestors up to 2 levels up, and after i
    squarings up to 2^i, so a tree of depth D costs ceil(log2(D)) products (one host read each,
    to stop, unless ``max_depth`` is given; issue 54: a lattice tree of depth 11 in 4 products,
    ~15 launches in all, was 11 iterations of ~7), not one per node. 0/1 products of at most 256
    terms are exact in fp32 (and tf32).
    """
    B, T = parents.shape
    dev = parents.device
    par = torch.zeros(B, T, T + 1, device=dev).scatter_(2, torch.where(parents >= 0, parents, T)[..., None], 1.0)
    A = par[..., :T] + torch.eye(T, device=dev)  # ancestors up to 1 level up (itself included)
    levels = T - 1 if max_depth is None else max_depth
    reach = 1
    while reach < levels:
        nxt = torch.bmm(A, A).clamp_(max=1.0)
        if max_depth is None and torch.equal(nxt, A):
            break
        A, reach = nxt, reach * 2
    return A.bool(), A.sum(-1).long() - 1

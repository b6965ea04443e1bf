"""CPU fast paths of the building blocks: the fused fp32 RMSNorm equals the fp32 formula bit for
bit, and the transposed weight storage of CPU linears keeps every value and the outputs."""

from __future__ import annotations

import pytest
import torch

from specpilot.models.layers import RMSNorm
from specpilot.models.loading import cpu_matmul_layout


def reference_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm as transformers writes it: fp32 statistics, cast, then the weight."""
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 1, 192), (1, 8, 192), (3, 17, 192), (2, 5, 4, 48), (1, 64, 2, 128)])
def test_fused_fp32_rmsnorm_is_bit_identical(shape):
    torch.manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = torch.randn(shape) * 4
    assert torch.equal(norm(x), reference_rms(x, norm.weight, 1e-6))


def test_bf16_rmsnorm_keeps_the_formula():
    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert torch.equal(norm(x), reference_rms(x, norm.weight, norm.eps))


def test_cpu_matmul_layout_keeps_values_and_unties_only_the_head():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied, as a tiny target's LM head
    proj = torch.nn.Linear(16, 24, bias=True)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "proj": proj})
    x = torch.randn(3, 16)
    before = (head(x), proj(x), emb.weight.clone(), proj.weight.clone())
    cpu_matmul_layout(model)
    assert head.weight.stride() == (1, 50) and proj.weight.stride() == (1, 24)  # [in, out] in memory
    assert emb.weight.is_contiguous() and head.weight is not emb.weight
    assert torch.equal(emb.weight, before[2]) and torch.equal(proj.weight, before[3]) \
        and torch.equal(head.weight, before[2])
    torch.testing.assert_close(head(x), before[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(proj(x), before[1], rtol=0, atol=1e-5)


def test_tree_ancestors_by_pointer_doubling_match_a_walk():
    """tree_ancestors (repeated squaring, issue 54: log2 of the depth in products) against a walk
    up each node's parents, on random trees, chains as deep as their width, with and without a
    depth bound (a bound at the tree's depth or beyond it gives the same mask)."""
    import torch

    from specpilot.models.layers import tree_ancestors

    g = torch.Generator().manual_seed(3)
    for trial in range(120):
        B, T = 2, int(torch.randint(1, 70, (1,), generator=g))
        span = 1 if trial % 4 == 0 else int(torch.randint(1, 6, (1,), generator=g))  # span 1: a chain
        parents = torch.full((B, T), -1, dtype=torch.long)
        for b in range(B):
            for i in range(1, T):
                parents[b, i] = int(torch.randint(max(0, i - span), i, (1,), generator=g))
        want = torch.zeros(B, T, T, dtype=torch.bool)
        for b in range(B):
            for i in range(T):
                n = i
                while n >= 0:
                    want[b, i, n] = True
                    n = int(parents[b, n])
        depth = want.sum(-1) - 1
        for bound in (None, int(depth.max()), int(depth.max()) + 5):
            anc, d = tree_ancestors(parents, bound)
            assert torch.equal(anc, want) and torch.equal(d, depth) and d.dtype == torch.long, (trial, bound)

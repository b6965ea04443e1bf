"""A token tree's inputs to the Triton step in one launch (issue 63).

:func:`tree_walk` turns a tree's parent indices into what the step and the acceptance read: the
ancestor mask, each node's depth and its ancestors in the order of depth. The torch build
(:func:`specpilot.models.layers.tree_ancestors` by repeated squaring, then
:func:`specpilot.engine.verify.tree_paths`) takes some 25 eager launches, 0.64-0.68 ms per step of a
lattice tree on an H100 (issue 63); here one program per node walks up its parents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PATH_DEPTH = 64  # ancestors per node in the path table (specpilot.engine.verify.PATH_DEPTH)


@triton.jit
def _tree_walk_kernel(par_ptr, anc_ptr, d32_ptr, d64_ptr, path_ptr, T, MAXD: tl.constexpr, BT: tl.constexpr,
                      PD: tl.constexpr):
    """Program (b, node t): walk up to MAXD parents from t (parents[b, i] < i, -1 at the root):
    row t of the ancestor mask (t and its ancestors), depth (ancestors met), and the ancestors by
    depth (the k-th one met sits at depth - 1 - k; 0 past the depth), each stored once."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    cols = tl.arange(0, BT)
    ds = tl.arange(0, PD)
    row = cols == t
    cur = t + 0
    dep = t * 0
    for _ in range(MAXD):  # the depth and the mask
        nxt = tl.load(par_ptr + b * T + tl.maximum(cur, 0), mask=cur >= 0, other=-1).to(tl.int32)
        nxt = tl.where(cur >= 0, nxt, -1)
        row = row | (cols == nxt)
        dep += (nxt >= 0).to(tl.int32)
        cur = nxt
    path = tl.zeros((PD,), dtype=tl.int32)
    cur = t + 0
    for k in range(MAXD):  # the ancestors by depth
        nxt = tl.load(par_ptr + b * T + tl.maximum(cur, 0), mask=cur >= 0, other=-1).to(tl.int32)
        nxt = tl.where(cur >= 0, nxt, -1)
        path = tl.where((ds == dep - 1 - k) & (nxt >= 0), nxt, path)
        cur = nxt
    node = (b * T + t).to(tl.int64)
    tl.store(anc_ptr + node * T + cols, row.to(tl.int8), mask=cols < T)
    tl.store(d32_ptr + node, dep)
    tl.store(d64_ptr + node, dep.to(tl.int64))
    tl.store(path_ptr + node * PD + ds, path)


def tree_walk(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ancestors bool [B, T, T] (t sees itself and its ancestors), depth int64 [B, T], depth int32
    [B, T], ancestors by depth int32 [B, T, 64] (entry d: the block index of the ancestor at depth
    d, 0 past the depth)) of a token tree, in one launch, no host read.

    ``parents`` int64 [B, T] on the device (or the CPU under ``TRITON_INTERPRET=1``): the block
    index of each node's parent (< its own index), -1 for the root. ``max_depth``: a bound of the
    depth (0 .. 64): the walk takes that many steps, so a deeper node sees only its nearest
    ``max_depth`` ancestors (the bound is the caller's, as for
    :func:`specpilot.models.layers.tree_ancestors`). The same values as that function and
    :func:`specpilot.engine.verify.tree_paths` (``tests/test_tree_attention_split.py``).

    Raises:
        ValueError: ``max_depth`` outside 0 .. 64.
    """
    if not 0 <= max_depth <= PATH_DEPTH:
        raise ValueError(f"tree_walk: max_depth must be 0 .. {PATH_DEPTH}, got {max_depth}")
    B, T = parents.shape
    dev = parents.device
    anc = torch.empty(B, T, T, dtype=torch.int8, device=dev)
    d32 = torch.empty(B, T, dtype=torch.int32, device=dev)
    d64 = torch.empty(B, T, dtype=torch.int64, device=dev)
    path = torch.empty(B, T, PATH_DEPTH, dtype=torch.int32, device=dev)
    _tree_walk_kernel[(B, T)](parents.contiguous(), anc, d32, d64, path, T, MAXD=max_depth,
                              BT=max(16, triton.next_power_of_2(T)), PD=PATH_DEPTH, num_warps=1)
    return anc.view(torch.bool), d64, d32, path

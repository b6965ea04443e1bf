"""Tree attention by paths, the split form (issue 63), under Triton's CPU interpreter.

A tree of more than ``PREFIX_ONCE_NODES`` nodes runs two launches: PREFIX sums every key tile
wholly below the tile holding ``start`` in row tiles of many nodes' rows and writes each chunk's
state; TAIL goes on per node from that state over the tile holding ``start`` and the node's
ancestors. Each node's output must be bit-equal to a one-token decode at its position (its
ancestors at the slots of their depths, its own key next): the same keys in the same tiles and
order. Checked here on the kernel itself (no model), full attention and a sliding-window ring, at
block starts where start's chunk has prefix tiles below start's tile (the PREFIX state continued
by TAIL), where it has none, and where the deepest path crosses into the next chunk. And the
tree's inputs built in one launch (:func:`specpilot.kernels.tree.tree_walk`) equal the torch build.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = r"""
from specpilot.engine.verify import tree_inputs
from specpilot.kernels import step as K

Hq, Hkv, D, T, MAXPOS = 8, 2, 32, 40, 448  # G = 4 query heads per KV head, as the Qwen3-8B shape
g = torch.Generator().manual_seed(0)
par, depth = [-1], [0]
for i in range(1, T):  # a lattice-like tree: parents scattered, depth <= 9
    cands = [j for j in range(i) if depth[j] < 9]
    p = cands[int(torch.randint(0, len(cands), (1,), generator=g))]
    par.append(p); depth.append(depth[p] + 1)
_, dep, path = tree_inputs(torch.tensor([par]), max_depth=9)
assert K.PREFIX_ONCE_NODES < T
deepest = max(range(T), key=lambda t: depth[t])
check = sorted({0, deepest, T - 1} | {t for t in range(1, T) if depth[t] >= 3 and t > depth[t]})[:8]
res = {"split": K.PREFIX_ONCE_NODES < T, "max_depth": max(depth), "nodes": 0, "differing": []}


def attend(q, kc, vc, st, n, window, ring, path=None, depth=None):
    ws = K.AttnWorkspace(1, n, Hq, Hkv, D, MAXPOS, "cpu")
    out = torch.zeros(n, Hq * D)
    K.attention(q, kc, vc, torch.tensor([st]), n, Hq, Hkv, D, out, ws, window=window, ring=ring, path=path,
                depth=depth)
    return out


# (window, ring slots, block starts): 250: chunk [128, 256) has the tile [128, 192) below start's tile
# [192, 256), the deepest path crosses into chunk [256, 384); 150: no prefix tile in start's chunk;
# 321: two full chunks below; the ring (window 100): positions wrap around 160 slots, the window's
# first tile below start's tile (so in the PREFIX launch, each row masking its own node's window)
for window, ring, starts in ((0, 0, (250, 150, 321)), (100, 160, (250, 321))):
    S = ring or MAXPOS
    for st in starts:
        kc = torch.randn(1, Hkv, S, D, generator=g)
        vc = torch.randn(1, Hkv, S, D, generator=g)
        q = torch.randn(T, Hq * D, generator=g)
        slot = lambda pos: pos % ring if ring else pos
        kblk = torch.randn(Hkv, T, D, generator=g)
        vblk = torch.randn(Hkv, T, D, generator=g)
        for t in range(T):  # the block's K/V at slots start + t
            kc[0, :, slot(st + t)] = kblk[:, t]
            vc[0, :, slot(st + t)] = vblk[:, t]
        out = attend(q, kc, vc, st, T, window, ring, path, dep)
        for t in check:
            anc, n = [], t
            while n > 0:
                n = par[n]; anc.append(n)
            anc, d = anc[::-1], depth[t]
            k1, v1 = kc.clone(), vc.clone()
            for j, a in enumerate(anc + [t]):  # ancestors at the slots of their depths, the node next
                k1[0, :, slot(st + j)] = kblk[:, a]
                v1[0, :, slot(st + j)] = vblk[:, a]
            ref = attend(q[t:t + 1].clone(), k1, v1, st + d, 1, window, ring)
            res["nodes"] += 1
            if not torch.equal(out[t], ref[0]):
                res["differing"].append([window, st, t, float((out[t] - ref[0]).abs().max())])
# the tree inputs in one launch (kernels.tree.tree_walk) against the torch build, on lattice-like
# trees of 40 (2 rows) and 255 nodes (1 row: ~4 s interpreted) and a chain
from specpilot.engine.verify import tree_paths
from specpilot.kernels.tree import tree_walk
from specpilot.models.layers import tree_ancestors
res["walk_equal"] = []
for T2, maxd in ((40, 9), (255, 11), (20, 19)):
    rows = []
    for _ in range(1 if T2 == 255 else 2):
        pr, dp = [-1], [0]
        for i in range(1, T2):
            cands = [j for j in range(i) if dp[j] < maxd] if T2 != 20 else [i - 1]
            p = cands[int(torch.randint(0, len(cands), (1,), generator=g))]
            pr.append(p); dp.append(dp[p] + 1)
        rows.append(pr)
    parents = torch.tensor(rows)
    a_ref, d_ref = tree_ancestors(parents, maxd)
    anc, d64, d32, pth = tree_walk(parents, maxd)
    res["walk_equal"].append([T2, bool(torch.equal(anc, a_ref)), bool(torch.equal(d64, d_ref)),
                              bool(torch.equal(d32, d_ref.int())), bool(torch.equal(pth, tree_paths(a_ref)))])
print("RESULT " + json.dumps(res))
"""


@needs_triton
def test_split_tree_attention_nodes_equal_their_decodes_interpreted(tmp_path):
    """Every checked node of a 40-node tree (split launches) bit-equal to a decode at its position;
    the one-launch tree inputs equal the torch build (ancestors, depths, paths)."""
    from triton_interp import run_interpreted

    res = run_interpreted(tmp_path / "check.py", CHECK, REPO)
    assert res["split"] and res["max_depth"] >= 6 and res["nodes"] >= 5 * 6, res
    assert res["differing"] == [], res
    assert res["walk_equal"] == [[40] + [True] * 4, [255] + [True] * 4, [20] + [True] * 4], res

"""Static token trees chosen from a rank profile (drafters.static_tree): the optimal shape, its
expected acceptance against the replay drafter's draws, and the engine's output equal to AR."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.drafters.static_tree import (StaticTreeProposer, TreeShape, expected_tau_shape, optimal_tree,
                                            rank_probability)
from specpilot.drafters.replay import AcceptanceProfile, ReplayProposer, load_profile, expected_tau
from specpilot.errors import SpecpilotError


def _profile(rows):
    return AcceptanceProfile("t", [r[0] for r in rows], block_size=len(rows) + 1, recall=rows)


SMALL = _profile([[0.6, 0.8, 0.9], [0.7, 0.85, 0.95], [0.5, 0.7, 0.8]])


def _all_trees(depth, max_rank, nodes):
    """Every prefix-closed set of ``nodes`` rank paths (brute force for small cases)."""
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(1, max_rank + 1), repeat=d)]
    for subset in itertools.combinations(paths, nodes):
        s = set(subset)
        if all(p[:-1] in s or len(p) == 1 for p in s):
            yield s


def _path_prob(profile, path):
    out = 1.0
    for j, r in enumerate(path, 1):
        out *= rank_probability(profile, j, r)
    return out


@pytest.mark.parametrize("nodes", [1, 2, 4, 6])
def test_optimal_tree_is_the_best_of_all_trees(nodes):
    best = max(sum(_path_prob(SMALL, p) for p in t) for t in _all_trees(3, 3, nodes))
    shape = optimal_tree(SMALL, nodes, 3, max_rank=3)
    assert shape.nodes == nodes
    assert shape.expected_tau == pytest.approx(1 + best, abs=1e-12)
    assert expected_tau_shape(SMALL, shape) == pytest.approx(shape.expected_tau, abs=1e-12)


def test_optimal_tree_of_a_chain_budget_under_a_sharp_profile_is_the_chain():
    sharp = _profile([[0.95, 0.96, 0.97]] * 5)
    shape = optimal_tree(sharp, 5, 5, max_rank=3)
    assert shape.ranks == (1,) * 5 and shape.positions == (1, 2, 3, 4, 5)
    assert shape.expected_tau == pytest.approx(expected_tau(sharp, 6))


def test_tree_shape_rejects_bad_trees_and_gathers_spine_tree_columns():
    with pytest.raises(SpecpilotError, match="position"):
        TreeShape((0, 0), (1, 2), (1, 2))
    with pytest.raises(SpecpilotError, match="same rank"):
        TreeShape((0, 0), (1, 1), (2, 2))
    shape = TreeShape((0, 0, 1, 2), (1, 1, 2, 2), (1, 3, 1, 1))
    assert (shape.branch, shape.side_depth, shape.depth) == (2, 1, 2)
    # spine-tree layout for k = 3 drafts, 2 side branches on 1 position: [anchor, s1, s2, s3, a1r2, a1r3]
    assert shape.gather_index(3) == [0, 1, 5, 2, 2]
    with pytest.raises(SpecpilotError, match="block has 1 drafts"):
        shape.gather_index(1)


def test_static_tree_replay_commits_what_the_shape_expects():
    """The replay's rank draws (one per position) planted into the spine tree, gathered into the
    static tree and walked like the target would: mean tokens per step = expected_tau_shape."""
    profile = load_profile("study_stock")
    ref = list(range(100, 100 + 4000))
    replay = ReplayProposer([ref], profile, vocab_size=50_000, block_size=16, rank_draws=True)
    shape = optimal_tree(profile, 31, 15)
    wrapped = StaticTreeProposer(replay, shape)
    replay.device = torch.device("cpu")
    replay.pos, replay.rngs = [1], [random.Random(3)]
    par = shape.parent_list()
    total, steps = 0, 3000
    for _ in range(steps):
        prop = wrapped.propose(torch.tensor([ref[0]]), torch.tensor([0]))
        toks = prop.tokens[0].tolist()
        depth = [0] * len(toks)
        ok = [True] + [False] * (len(toks) - 1)
        for i in range(1, len(toks)):
            depth[i] = depth[par[i]] + 1
            ok[i] = ok[par[i]] and toks[i] == ref[1 + depth[i] - 1]  # position j holds ref[pos + j - 1]
        total += 1 + max(d for d, o in zip(depth, ok) if o)
    assert wrapped.verify_width == 32
    assert total / steps == pytest.approx(shape.expected_tau, rel=0.04)
    assert shape.expected_tau > expected_tau(profile, 16) * 1.05  # a 31-node tree beats the 15-draft chain


def test_static_tree_engine_equals_ar_and_beats_the_chain(quick_deployment, quick_prompts):
    from specpilot.engine.config import EngineSpec
    from specpilot.engine.serve import serve
    from specpilot.models.loading import load_drafter, load_target

    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), quick_prompts, 40, 2, meta, ServeOptions(progress=False))
    chain = serve(EngineSpec("stock", 6), Deployment.of(target, drafter), quick_prompts, 40, 2, meta, ServeOptions(progress=False))
    cfg = {"tree_nodes": 12, "tree_profile": "tiny_dflash_ranks"}
    tree = serve(EngineSpec("specpilot", 6, cfg), Deployment.of(target, drafter), quick_prompts, 40, 2, meta, ServeOptions(progress=False))
    assert [t.output_ids for t in tree] == [a.output_ids for a in ar]
    assert sum(t.verify_steps for t in tree) <= sum(c.verify_steps for c in chain)
    with pytest.raises(SpecpilotError, match="tree_nodes"):
        serve(EngineSpec("specpilot", 6, {"tree_nodes": 12, "tree_branch": 2}), Deployment.of(target, drafter), quick_prompts[:1], 8, 1, meta, ServeOptions(progress=False))
    with pytest.raises(SpecpilotError, match=r"tree_nodes = '12' \(a string\) is not allowed"):
        serve(EngineSpec("specpilot", 6, {"tree_nodes": "12"}), Deployment.of(target, drafter), quick_prompts[:1], 8, 1, meta, ServeOptions(progress=False))

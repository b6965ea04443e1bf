"""Path-conditioned lattice trees from DFlash2's selector (drafters.lattice): the best-first tree is
the exact top-N of all lattice paths and ancestor-closed, the prefix ranks say which trees hold the
correct path, the lattice reproduces the selector's walk, the engine's outputs equal AR, the
config refuses what it cannot run, and the replay drafter emulates a measured lattice profile."""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
from pathlib import Path

import pytest
import torch

from specpilot.deployment import Deployment
from specpilot.drafters.lattice import (LatticeTreeProposer, best_first_tree, lattice_beams, lattice_paths,
                                        prefix_ranks, select_nodes, transition_logprobs)
from specpilot.drafters.lattice_profile import LatticeProfile, LatticeReplayProposer, shape_parents
from specpilot.drafters.replay import AcceptanceProfile
from specpilot.engine.config import EngineConfig, EngineSpec, tree_width_of
from specpilot.engine.serve import ServeOptions, serve
from specpilot.errors import SpecpilotError

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _random_lattice(B=3, k=4, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp1 = torch.randn(B, K, generator=g).mul(2).log_softmax(-1)
    lpT = torch.randn(B, k - 1, K, K, generator=g).mul(2).log_softmax(-1)
    cands = torch.stack([torch.randperm(50, generator=g)[: k * K].view(k, K) for _ in range(B)])
    return cands, lp1, lpT


def _all_paths(lp1, lpT, b):
    """Every lattice path of row b as (log-probability, candidate indices)."""
    K, k = lp1.shape[1], lpT.shape[1] + 1
    out = []
    for d in range(1, k + 1):
        for path in itertools.product(range(K), repeat=d):
            lp = float(lp1[b, path[0]]) + sum(float(lpT[b, j, path[j], path[j + 1]]) for j in range(d - 1))
            out.append((lp, path))
    return out


@pytest.mark.parametrize("nodes", [1, 5, 17, 60])
def test_best_first_tree_is_the_top_n_of_all_paths_and_ancestor_closed(nodes):
    cands, lp1, lpT = _random_lattice()
    prop = best_first_tree(cands, lp1, lpT, torch.tensor([7, 8, 9]), nodes)
    assert prop.tokens.shape == (3, nodes + 1) and prop.parents.shape == (3, nodes + 1)
    for b in range(3):
        paths = sorted(_all_paths(lp1, lpT, b), key=lambda t: -t[0])
        want = sorted(lp for lp, _ in paths[:nodes])
        got = sorted(prop.scores[b, 1:].tolist())
        assert got == pytest.approx(want, abs=1e-5)
        par = prop.parents[b].tolist()
        assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, nodes + 1))
        # every node's score = its parent's + the transition into its token, and siblings differ
        depth = [0] * (nodes + 1)
        for i in range(1, nodes + 1):
            depth[i] = depth[par[i]] + 1
            sib = [j for j in range(1, nodes + 1) if par[j] == par[i] and j != i]
            assert all(prop.tokens[b, j] != prop.tokens[b, i] for j in sib)
            assert prop.scores[b, i] <= prop.scores[b, par[i]] + 1e-6
            assert int(prop.tokens[b, i]) in cands[b, depth[i] - 1].tolist()


def test_prefix_ranks_say_which_trees_hold_the_correct_path():
    cands, lp1, lpT = _random_lattice(B=4, k=4, K=3, seed=1)
    g = torch.Generator().manual_seed(5)
    truth = torch.stack([cands[b, torch.arange(4), torch.randint(0, 3, (4,), generator=g)] for b in range(4)])
    truth[3, 2] = 999  # not a candidate: the path leaves the lattice at depth 3
    path = lattice_paths(cands, truth)
    assert path[3, 2] == -1 and (path[:3] >= 0).all()
    ranks = prefix_ranks(lattice_beams(lp1, lpT, 200), path)
    assert (ranks[3, 2:] == 0).all()
    for n in (1, 3, 10, 40):
        prop = best_first_tree(cands, lp1, lpT, torch.zeros(4, dtype=torch.long), n)
        for b in range(4):
            toks, par = prop.tokens[b].tolist(), prop.parents[b].tolist()
            held, node = 0, 0
            for d in range(4):  # walk the tree along the true path
                nxt = next((i for i in range(1, n + 1) if par[i] == node and toks[i] == int(truth[b, d])), None)
                if nxt is None:
                    break
                held, node = d + 1, nxt
            assert held == int(((ranks[b] > 0) & (ranks[b] <= n)).sum()), (n, b)
    # ranks grow along the path (a child comes after its parent); beyond the width: 0
    r = prefix_ranks(lattice_beams(lp1, lpT, 2), path)
    assert ((r == 0) | (r <= 2)).all()


def test_select_nodes_refuses_a_budget_beyond_the_lattice():
    cands, lp1, lpT = _random_lattice(B=1, k=2, K=2)
    assert select_nodes(lattice_beams(lp1, lpT, 6), 6)[2].shape == (1, 7)  # 2 + 2 x 2 paths: all of them
    with pytest.raises(SpecpilotError, match="7 nodes asked of a lattice of 6 paths"):
        select_nodes(lattice_beams(lp1, lpT, 7), 7)


def test_lattice_tables_reproduce_the_selector_walk(quick_deployment):
    from specpilot.models.loading import load_drafter

    drafter = load_drafter(quick_deployment / "drafter-dflash2")
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, drafter.config.hidden_size, generator=g)
    logits = torch.randn(2, 5, drafter.config.vocab_size, generator=g)
    anchor = torch.tensor([3, 4])
    path, cands, scores = sel.walk(hidden, logits, anchor)
    c2, unary, first, trans = sel.lattice(hidden, logits, anchor)
    assert torch.equal(cands, c2)
    assert torch.allclose(scores[:, 0], unary[:, 0] + first, atol=1e-5)
    idx = (cands == path[..., None]).long().argmax(-1)  # the walk's candidate index per slot
    for j in range(1, 5):
        row = trans[torch.arange(2), j - 1, idx[:, j - 1]]
        assert torch.allclose(scores[:, j], unary[:, j] + row, atol=1e-5)
    lp1, lpT = transition_logprobs(unary, first, trans)
    greedy = best_first_tree(cands, lp1, lpT, anchor, 1)  # the best single node: the walk's first step
    assert torch.equal(greedy.tokens[:, 1], path[:, 0])


def _meta():
    return {"deployment": "quick", "target": "t", "drafter": "dflash2", "gpu": "cpu"}


def test_lattice_engine_equals_ar(quick_deployment, quick_prompts):
    from specpilot.models.loading import load_drafter, load_target

    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash2")
    dep, opts = Deployment.of(target, drafter), ServeOptions(progress=False)
    prompts = quick_prompts[:6]
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), prompts, 32, 2, _meta(), opts)
    chain = serve(EngineSpec("stock", 8), dep, prompts, 32, 2, _meta(), opts)
    for n in (9, 40):
        spec = EngineSpec("specpilot", 8, {"tree_lattice": n})
        assert spec.verify_width == n + 1
        tree = serve(spec, dep, prompts, 32, 2, _meta(), opts)
        assert [t.output_ids for t in tree] == [a.output_ids for a in ar]
        assert max(c for t in tree for c in t.committed_per_step) <= 8
    assert sum(t.verify_steps for t in tree) < sum(c.verify_steps for c in chain)


def test_lattice_config_refuses_what_it_cannot_run(quick_deployment, quick_prompts):
    from specpilot.models.loading import load_drafter, load_target

    assert EngineConfig.parse({"tree_lattice": 127}).verify_width(12) == 128
    assert tree_width_of({"tree_lattice": 255, "block_size": 12}) == 256
    with pytest.raises(SpecpilotError, match=r"tree_lattice = 1.5 \(a number\) is not allowed"):
        EngineConfig.parse({"tree_lattice": 1.5})
    target = load_target(quick_deployment / "target")
    opts, p = ServeOptions(progress=False), quick_prompts[:1]
    dflash = Deployment.of(target, load_drafter(quick_deployment / "drafter-dflash"))
    with pytest.raises(SpecpilotError, match="tree_lattice needs a drafter with a candidate selector .* 'dflash'"):
        serve(EngineSpec("specpilot", 8, {"tree_lattice": 15}), dflash, p, 8, 1, _meta(), opts)
    dflash2 = Deployment.of(target, load_drafter(quick_deployment / "drafter-dflash2"))
    for extra in ({"tree_nodes": 15}, {"tree_branch": 2}, {"second_level": 2}, {"verify_budget": "load_aware"}):
        key = next(iter(extra))
        with pytest.raises(SpecpilotError, match=f"tree_lattice .* cannot be combined with {key}"):
            serve(EngineSpec("specpilot", 8, {"tree_lattice": 15, **extra}), dflash2, p, 8, 1, _meta(), opts)
    with pytest.raises(SpecpilotError, match=r"tree_lattice must lie in 1\.\.21844 .* 7 slots x 4 candidates"):
        LatticeTreeProposer(dflash2.drafter, nodes=30000)


def _lattice_profile(k=5):
    """A consistent lattice profile: prefix ranks of depth d drawn as a growing sequence."""
    rng = random.Random(0)
    grid = [1, 2, 4, 8, 16, 32, 64]
    samples = []
    for _ in range(4000):
        r, row = 0, []
        for _d in range(k):
            r += 1 + int(rng.expovariate(0.3))
            row.append(r if rng.random() < 0.97 else 0)
            if row[-1] == 0:
                row += [0] * (k - len(row))
                break
        samples.append(row)
    recall = [[sum(1 for s in samples if 0 < s[d] <= n) / len(samples) for n in grid] for d in range(k)]
    shapes = {"8": [3, 2, 1.5, 1, 0.5], "32": [10, 8, 7, 4, 3]}
    return LatticeProfile(grid, recall, shapes, oracle=[0.97 ** (d + 1) for d in range(k)], samples=len(samples))


def test_lattice_profile_checks_and_shapes():
    lat = _lattice_profile()
    assert lat.expected_tau(1) < lat.expected_tau(8) < lat.expected_tau(64)
    assert lat.recall(2, 12) == pytest.approx((lat.recall(2, 8) + lat.recall(2, 16)) / 2)
    for n in (1, 3, 8, 20, 32, 100):
        c = lat.counts(n)
        assert sum(c) == n and len(c) == 5
        first_zero = next((d for d, x in enumerate(c) if x == 0), 5)
        assert all(x == 0 for x in c[first_zero:])
        parents, spine = shape_parents(c)
        assert len(parents) == n + 1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        assert [parents[s] for s in spine] == [0] + spine[:-1]
    with pytest.raises(SpecpilotError, match="depth 2 exceeds"):
        LatticeProfile([1, 2], [[0.5, 0.6], [0.7, 0.8]])
    with pytest.raises(SpecpilotError, match="non-decreasing"):
        LatticeProfile([1, 2], [[0.5, 0.4]])
    with pytest.raises(SpecpilotError, match="summing to 8"):
        LatticeProfile([1, 2], [[0.5, 0.6]], {"8": [3]})


def test_lattice_replay_commits_what_the_profile_predicts():
    lat = _lattice_profile()
    prof = AcceptanceProfile("t", [0.8] * 5, block_size=6, extra={"lattice": lat.to_dict()})
    ref = list(range(100, 100 + 40000))
    for n in (8, 32):
        rp = LatticeReplayProposer([ref], prof, vocab_size=50_000, block_size=6, nodes=n)
        rp.device = torch.device("cpu")
        rp.pos, rp.rngs = [1], [random.Random(4)]
        total, steps = 0, 4000
        for _ in range(steps):
            prop = rp.propose(torch.tensor([ref[0]]), torch.tensor([0]))
            toks, par = prop.tokens[0].tolist(), prop.parents[0].tolist()
            depth, ok = [0] * len(toks), [True] + [False] * (len(toks) - 1)
            for i in range(1, len(toks)):
                depth[i] = depth[par[i]] + 1
                ok[i] = ok[par[i]] and toks[i] == ref[depth[i]]
            total += 1 + max(d for d, o in zip(depth, ok) if o)
        assert rp.verify_width == n + 1 and prop.tokens.shape[1] == n + 1
        assert total / steps == pytest.approx(lat.expected_tau(n), rel=0.03)
    with pytest.raises(SpecpilotError, match="measured over 5 draft positions"):
        LatticeReplayProposer([ref], prof, vocab_size=50_000, block_size=8, nodes=8)
    with pytest.raises(SpecpilotError, match="has none"):
        LatticeReplayProposer([ref], AcceptanceProfile("p", [0.8] * 5, block_size=6), vocab_size=50_000,
                              block_size=6, nodes=8)
    assert math.isclose(lat.expected_tau(10 ** 6), 1 + sum(lat.prefix_recall[d][-1] for d in range(5)))


# Under Triton's CPU interpreter: (1) a lattice-shaped tree (40 nodes, parents scattered, built as a
# tree that changes every step: max_depth given, so the path form without a host read; its prefix
# read once per row tile, its ancestors per node) verified in the Triton step: each checked node's
# logits are bit-equal to the same node with its ancestors at the slots of their depths (the
# ancestor-bits form, whose attention sums the keys in a decode's tiles), at three block starts; (2) the engine's lattice trees through the Triton step (runner:
# tree inputs every step, path form) give AR's outputs.
LATTICE_STEP_CHECK = r"""
from specpilot.bench import _engine as E
from specpilot.drafters.lattice import LatticeTreeProposer
from specpilot.engine.verify import tree_inputs
from specpilot.fastpath.dense import FastTarget
from specpilot.models.config import TargetConfig
from specpilot.models.layers import chain_ancestors
from specpilot.models.qwen3 import Transformer
from specpilot.models.random_checkpoint import fill_random_

cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
m = fill_random_(Transformer(cfg), 3).eval()
B, S, W = 1, 320, 40
m.setup_cache(B, S)
fast = FastTarget(m)
g = torch.Generator().manual_seed(0)
par, depth = [-1], [0]
for i in range(1, W):
    cands = [j for j in range(i) if depth[j] < 6]
    p = cands[int(torch.randint(0, len(cands), (1,), generator=g))]
    par.append(p); depth.append(depth[p] + 1)
res = {"nodes": 0, "equal": True, "scattered": 0}
check = [t for t in range(1, W) if depth[t] >= 3 and t > depth[t]][:2] + [next(t for t in range(W) if depth[t] == 6)]
with torch.inference_mode():
    m(torch.randint(0, 128, (B, 300), generator=g), torch.zeros(B, dtype=torch.long), chain_ancestors(B, 300, "cpu"))
    tin = tree_inputs(torch.tensor([par]), max_depth=6)
    res["form"] = len(tin)
    # block starts: the prefix in chunks wholly below the block (read once per row tile) and the
    # ancestors in one chunk or across two (250: the path's slots 250 .. 255 and 256)
    for st in (250, 150, 60):
        start = torch.tensor([st])
        tok = torch.randint(0, 128, (B, W), generator=g)
        lt = fast.forward(tok, start, tree=tin)[0].clone()
        for t in check:
            path, n = [], t
            while n > 0:
                n = par[n]; path.append(n)
            path, d = path[::-1], depth[t]
            res["scattered"] += int(path != list(range(d)))
            rp = [-1] + [j - 1 for j in range(1, d)] + [0] * (W - d)
            rp[t] = d - 1
            rt = torch.randint(0, 128, (B, W), generator=g)
            rt[0, :d] = tok[0, path]
            rt[0, t] = tok[0, t]
            ref_in = tree_inputs(torch.tensor([rp]))
            res["ref_form"] = len(ref_in)
            lr = fast.forward(rt, start, tree=ref_in)[0]
            res["nodes"] += 1
            res["equal"] &= bool(torch.equal(lt[:, t], lr[:, t]))
    target = E.dry_target(seed=1)
    drafter = E.dry_drafter(target, block_size=6, seed=2, kind="dflash2")
    prompts = [torch.randint(0, 256, (9,), generator=g).tolist(), torch.randint(0, 256, (13,), generator=g).tolist()]
    ar = [r.output_ids for r in E.generate_ar(fast_runner(target, 2, 40), prompts, 6)]
    prop = LatticeTreeProposer(drafter, nodes=20)
    runner = fast_runner(target, 2, 60, prop.capture)
    rows = E.generate(runner, prop, prompts, 6)
    res["engine_equal"] = [r.output_ids == x for r, x in zip(rows, ar)]
    res["engine_form"] = len(runner._tree)
print("RESULT " + json.dumps(res))
"""


@needs_triton
def test_lattice_trees_in_the_triton_step_interpreted(tmp_path):
    from triton_interp import run_interpreted

    res = run_interpreted(tmp_path / "check.py", LATTICE_STEP_CHECK, REPO)
    assert res["form"] == 3 and res["ref_form"] == 2 and res["nodes"] == 9 and res["scattered"] >= 3, res
    assert res["equal"], res
    assert res["engine_equal"] == [True, True] and res["engine_form"] == 3, res


def test_tree_budget_ranks_budgets_by_tokens_per_ms(quick_deployment, quick_prompts):
    """The plan's cost model for lattice budgets: a tau curve from one recorded run (its own budget
    predicted within a few percent of what the run measured) and a verify-cost curve on this device."""
    from specpilot.agent import directions as dirs
    from specpilot.agent.tree_budget import rank_budgets, tau_curve, verify_ms
    from specpilot.engine.loop import generate, generate_ar
    from specpilot.engine.runner import TargetRunner
    from specpilot.models.loading import load_drafter, load_target

    ranked = rank_budgets({15: 6.0, 63: 7.0, 255: 7.2}, {15: 5.0, 63: 5.5, 255: 9.0}, 1.0)
    assert [r["nodes"] for r in ranked] == [63, 15, 255] and ranked[0]["tokens_per_ms"] == pytest.approx(7 / 6.5, abs=1e-5)
    d = dirs.REGISTRY["tree_lattice"]
    assert d.applies({"drafter": "dflash2", "gpu": "h200"}) and not d.applies({"drafter": "dflash2", "gpu": "cpu"})
    assert not d.applies({"drafter": "dflash", "gpu": "h200"})
    assert d.apply({"block_size": 8, "tree_branch": 2, "tree_depth": 3}, {"tree_lattice": 63}) == \
        {"block_size": 8, "tree_lattice": 63}
    assert dirs.REGISTRY["tree_verify"].apply({"tree_lattice": 63}, {"tree_branch": 2, "tree_depth": 1}) == \
        {"tree_branch": 2, "tree_depth": 1}

    target = load_target(quick_deployment / "target")
    dep = Deployment.of(target, load_drafter(quick_deployment / "drafter-dflash2"))
    prompts = [p["prompt_ids"] for p in quick_prompts[:4]]
    S = max(map(len, prompts)) + 90
    refs = [r.output_ids for r in generate_ar(TargetRunner(target, 4, S), prompts, 40)]
    lat = tau_curve(dep, prompts, refs, 8, 40)
    assert lat.samples > 0 and sum(lat.shapes["40"]) == pytest.approx(40)
    assert lat.expected_tau(1) <= lat.expected_tau(10) <= lat.expected_tau(40) <= 8
    prop = LatticeTreeProposer(dep.drafter, block_size=8, nodes=40)
    rows = generate(TargetRunner(target, 4, S, prop.capture), prop, prompts, 40)
    steps = [c for r in rows for c in r.committed_per_step[:-1]]
    assert lat.expected_tau(40) == pytest.approx(sum(steps) / len(steps), rel=0.08)
    ms = verify_ms(dep, lat, [7, 40], batch=1, context=30, repeats=2, chain=8)
    assert set(ms) == {0, 7, 40} and all(v > 0 for v in ms.values())  # 0: the chain of the block ("no tree")


def test_tree_budget_ranks_no_tree():
    """"No tree" (budget 0, the base's chain) is ranked with the budgets: a plan says trees do not
    pay when the chain is predicted fastest (the GPU's measured case of issue 54: 63 nodes verify in
    7.94 ms against the chain's 6.69 at a 1.2x tau), and the chain's tau is the base run's only
    when the base verifies a chain."""
    from specpilot.agent.tree_budget import chain_tau, rank_budgets

    other = 1.35 + 0.4
    pays = rank_budgets({0: 5.0, 63: 6.5, 127: 6.8}, {0: 6.69, 63: 7.94, 127: 9.46}, other)
    assert [(r["nodes"], r["tree"]) for r in pays] == [(63, True), (127, True), (0, False)]
    flat = rank_budgets({0: 5.0, 63: 5.3, 127: 5.5}, {0: 6.69, 63: 7.94, 127: 9.46}, other)
    assert flat[0] == {"nodes": 0, "tree": False, "tau": 5.0, "step_ms": round(other + 6.69, 4),
                       "tokens_per_ms": round(5.0 / (other + 6.69), 5)}
    tie = rank_budgets({0: 2.0, 15: 2.0}, {0: 1.0, 15: 1.0}, 1.0)
    assert [r["nodes"] for r in tie] == [0, 15]  # a tree must beat the chain, not tie it
    assert chain_tau({"block_size": 12}, {"tau": 4.2}) == 4.2
    assert chain_tau({"block_size": 12, "tree_lattice": 0, "tree_nodes": 0}, {"tau": 4.2}) == 4.2
    for tree in ({"tree_lattice": 63}, {"tree_nodes": 31}, {"tree_branch": 2, "tree_depth": 3}):
        assert chain_tau({"block_size": 12, **tree}, {"tau": 4.2}) is None


def test_tree_acceptance_on_the_device_equals_the_host_walk():
    """accept_tree_device (the engine's tree decision, one host read) against accept_tree (the host
    walk) on random trees and logits rigged so that long paths are accepted, with padding rows."""
    from specpilot.engine.verify import accept_tree_host, accept_tree, accept_tree_device

    g = torch.Generator().manual_seed(0)
    longest = 0
    for trial in range(40):
        B, N, V = 3, int(torch.randint(2, 40, (1,), generator=g)), 7
        parents = torch.full((B, N), -1, dtype=torch.long)
        for b in range(B):
            for i in range(1, N):
                parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
        tokens = torch.randint(0, V, (B, N), generator=g)
        for b in range(B):  # siblings with distinct tokens, as every builder makes them
            for p in range(N):
                kids = (parents[b] == p).nonzero().flatten().tolist()
                for r, c in enumerate(kids):
                    tokens[b, c] = r % V
        logits = torch.randn(B, N, V, generator=g)
        for b in range(B):  # most nodes' argmax is one of their children's tokens: long accepted paths
            for p in range(N):
                kids = (parents[b] == p).nonzero().flatten().tolist()
                if kids and float(torch.rand(1, generator=g)) < 0.8:
                    logits[b, p, tokens[b, kids[int(torch.randint(0, len(kids), (1,), generator=g))]]] += 10
        lengths = torch.randint(1, N + 1, (B,), generator=g) if trial % 3 == 0 else None
        want_paths, want_bonus = accept_tree(tokens, parents, logits, lengths)
        paths, bonus, proposed, slots = accept_tree_device(tokens, parents, logits, lengths,
                                                           max_depth=N - 1 if trial % 2 else None)
        assert (paths, bonus) == (want_paths, want_bonus)
        assert proposed == [[int(tokens[b, i]) for i in p[1:]] + [bonus[b]] for b, p in enumerate(paths)]
        assert slots.shape[1] == max(map(len, paths))
        assert all(slots[b, :len(p)].tolist() == p for b, p in enumerate(paths))
        assert accept_tree_host(tokens, parents, logits, lengths) == (paths, bonus, proposed)  # the host's
        longest = max(longest, max(map(len, paths)))
    assert longest >= 6  # deep paths were accepted


def test_host_decisions_equal_the_device_ones_with_ties():
    """The engine's host-side decisions (issue 54: fewer launches per step) against the device
    ones: a static tree (accept_tree_host) where siblings carry equal tokens (the deepest accepted
    node wins, the lowest index among equally deep ones: not what a first-match walk finds), and a
    chain under the greedy rule (decide) against accept_greedy, with padded rows."""
    from specpilot.drafters.proposal import Proposal
    from specpilot.engine.verify import (accept_greedy, accept_tree_host, accept_tree, accept_tree_device,
                                        chain_drafts, decide)

    g = torch.Generator().manual_seed(1)
    differs = 0
    for trial in range(60):
        B, N, V = 2, int(torch.randint(3, 30, (1,), generator=g)), 3  # 3 tokens: many equal siblings
        parents = torch.full((B, N), -1, dtype=torch.long)
        for b in range(B):
            for i in range(1, N):
                parents[b, i] = int(torch.randint(max(0, i - 3), i, (1,), generator=g))
        tokens = torch.randint(0, V, (B, N), generator=g)
        logits = torch.randn(B, N, V, generator=g)
        lengths = torch.randint(1, N + 1, (B,), generator=g) if trial % 2 else None
        want = accept_tree_device(tokens, parents, logits, lengths)[:3]
        assert accept_tree_host(tokens, parents, logits, lengths) == want
        differs += want[0] != accept_tree(tokens, parents, logits, lengths)[0]
        chain = Proposal(tokens, None, lengths)
        acc, bonus = accept_greedy(chain_drafts(chain), logits)
        out = decide(chain, logits)
        assert out.accepted == acc.tolist() and out.bonus == bonus.tolist()
        assert out.proposed == [tokens[b, 1:a + 1].tolist() + [bonus[b].item()] for b, a in enumerate(out.accepted)]
    assert differs > 0  # ties occurred where the first-match walk picks another path

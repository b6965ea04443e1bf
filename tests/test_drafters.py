"""Drafter plug-ins over one verify path: proposals, trees, DFlash2 / DSpark networks and layouts,
stock == AR for every drafter (chain and tree, concurrency 1 and > 1)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.engine.proposers import make_proposer
from specpilot.drafters.proposal import Proposal, chain, side_branches, spine_tree, spine_tree_parents
from specpilot.engine.verify import accept_tree
from specpilot.engine.loop import generate, generate_ar
from specpilot.engine.runner import TargetRunner
from specpilot.engine.config import EngineSpec
from specpilot.engine.serve import serve
from specpilot.errors import SpecpilotError
from specpilot.forcing import check
from specpilot.models.loading import drafter_config, load_drafter, load_target

META = {"deployment": "quick", "target": "t", "drafter": "d", "gpu": "cpu"}


def test_chain_proposal_survival_and_truncate():
    p = chain(torch.tensor([5, 6]), torch.tensor([[1, 2, 3], [4, 5, 6]]),
              confidence=torch.tensor([[0.9, 0.5, 0.8], [0.99, 0.99, 0.1]]))
    assert p.width == 4 and p.is_chain
    assert torch.allclose(p.survival[0], torch.tensor([1.0, 0.9, 0.45, 0.36]))
    t = p.truncate(torch.tensor([2, 3]))
    assert t.width == 3 and t.lengths.tolist() == [2, 3] and t.tokens[1].tolist() == [6, 4, 5]


def test_spine_tree_layout_and_side_branches():
    assert spine_tree_parents(3, 2, 2) == [-1, 0, 1, 2, 0, 0, 1, 1]
    logits = torch.zeros(1, 3, 10)
    logits[0, 0, [4, 7, 2]] = torch.tensor([3.0, 2.0, 1.0])
    logits[0, 1, [1, 4, 9]] = torch.tensor([3.0, 2.5, 2.0])
    spine = torch.tensor([[4, 9, 0]])  # position 1: the spine took 9, not the argmax 1
    alts = side_branches(logits, spine, 2, 2)
    assert alts[0, 0].tolist() == [7, 2] and alts[0, 1].tolist() == [1, 4]
    p = spine_tree(torch.tensor([3]), spine, alts)
    assert p.tokens[0].tolist() == [3, 4, 9, 0, 7, 2, 1, 4]


def test_accept_tree_never_accepts_padding():
    tokens = torch.tensor([[0, 5, 6]])
    parents = torch.tensor([[-1, 0, 1]])
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 5] = logits[0, 1, 6] = logits[0, 2, 7] = 1.0
    assert accept_tree(tokens, parents, logits)[0] == [[0, 1, 2]]
    paths, bonus = accept_tree(tokens, parents, logits, torch.tensor([2]))
    assert paths == [[0, 1]] and bonus == [6]


def test_quick_build_writes_each_public_layout(quick_deployment):
    for kind, arch in (("dflash", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel"),
                       ("dspark", "Qwen3DSparkModel")):
        d = quick_deployment / f"drafter-{kind}"
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == [arch]
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "fc.weight" in names and "layers.0.self_attn.k_norm.weight" in names
        if kind == "dflash2":
            assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                    "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
                    "layers.1.mlp_conv.kernel_projection.weight"} <= names
            assert cfg["is_causal"] is False and set(cfg["layer_types"]) == {"sliding_attention"}
        if kind == "dspark":
            assert {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight",
                    "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                    "confidence_head.proj.bias"} <= names
            for key in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type"):
                assert key in cfg, key
            with safe_open(str(d / "model.safetensors"), "pt") as f:
                r, h = cfg["markov_rank"], cfg["hidden_size"]
                assert list(f.get_tensor("confidence_head.proj.weight").shape) == [1, h + r]
        assert load_drafter(d).kind == kind


def test_unsupported_drafter_configs_give_one_clear_error(quick_deployment):
    cfg = json.loads((quick_deployment / "drafter-dspark" / "config.json").read_text())
    with pytest.raises(SpecpilotError, match="markov_head_type 'gated'"):
        drafter_config({**cfg, "markov_head_type": "gated"})
    with pytest.raises(SpecpilotError, match="unsupported drafter architecture 'EagleModel'"):
        drafter_config({**cfg, "architectures": ["EagleModel"]})
    with pytest.raises(SpecpilotError, match="unsupported layer type"):
        drafter_config({**cfg, "layer_types": ["linear_attention"] * cfg["num_hidden_layers"]})
    d2 = json.loads((quick_deployment / "drafter-dflash2" / "config.json").read_text())
    d2["dflash_config"].pop("selector_rank")
    from specpilot.models.dflash2 import DFlash2Drafter

    with pytest.raises(SpecpilotError, match="selector_rank"):
        DFlash2Drafter(drafter_config(d2))


@torch.no_grad()
def test_identity_dflash2_drafts_like_dflash(quick_deployment, quick_prompts):
    """Identity convolutions + zero successor codebook make DFlash2 exactly DFlash (SpecForge docs)."""
    from specpilot.models.dflash2 import DFlash2Drafter

    target = load_target(quick_deployment / "target")
    v1 = load_drafter(quick_deployment / "drafter-dflash")
    c2 = drafter_config(json.loads((quick_deployment / "drafter-dflash2" / "config.json").read_text()))
    c2.layer_types, c2.sliding_window, c2.is_causal = v1.config.layer_types, None, None
    v2 = DFlash2Drafter(c2)
    v2.load_state_dict(v1.state_dict(), strict=False)
    for layer in v2.layers:
        layer.attention_conv.identity_()
        layer.mlp_conv.identity_()
    torch.nn.init.zeros_(v2.candidate_selector.successor_codebook.weight)
    prompt = quick_prompts[0]["prompt_ids"]
    r = TargetRunner(target, 1, len(prompt) + 16, tuple(v1.config.target_layer_ids))
    _, feats, _ = r.prefill([prompt])
    outs = []
    for net in (v1, v2):
        net.setup_cache(1, len(prompt) + 16)
        net.add_context(feats, torch.zeros(1, dtype=torch.long))
        outs.append(net.draft(torch.tensor([prompt[-1]]), torch.tensor([len(prompt)]),
                              target.model.embed_tokens, target.lm_head, 6)[0])
    assert outs[0].tolist() == outs[1].tolist()
    # a non-identity base kernel changes the drafts' logits (the convolution is on the path)
    with torch.no_grad():
        v2.layers[0].attention_conv.base_kernel[0, 1] = 0.7
    v2.setup_cache(1, len(prompt) + 16)
    v2.add_context(feats, torch.zeros(1, dtype=torch.long))
    a = v1.draft(torch.tensor([prompt[-1]]), torch.tensor([len(prompt)]), target.model.embed_tokens,
                 target.lm_head, 6)[1]
    b = v2.draft_logits(torch.tensor([prompt[-1]]), torch.tensor([len(prompt)]), target.model.embed_tokens,
                        target.lm_head, 6)
    assert (a - b).abs().max() > 1e-3


@torch.no_grad()
def test_dspark_drafts_gamma_per_step_with_confidence(quick_deployment, quick_prompts):
    target = load_target(quick_deployment / "target")
    net = load_drafter(quick_deployment / "drafter-dspark")
    gamma = net.config.block_size
    prop = make_proposer(net)
    assert prop.gamma == gamma and prop.verify_width == gamma + 1
    seen = []
    prompts = [p["prompt_ids"] for p in quick_prompts[:2]]
    rows = generate(TargetRunner(target, 2, 200, prop.capture), prop, prompts, 24,
                    on_step=lambda p, paths: seen.append(p))
    assert all(p.width == gamma + 1 and p.confidence is not None for p in seen)
    s = seen[0].survival
    assert s.shape == (2, gamma + 1) and bool((s[:, 1:] <= s[:, :-1] + 1e-7).all()) and bool((s > 0).all())
    assert all(max(r.committed_per_step) <= gamma + 1 for r in rows)
    ar = generate_ar(TargetRunner(target, 2, 200), prompts, 24)
    assert [r.output_ids for r in rows] == [a.output_ids for a in ar]
    # a confidence-threshold stop gives rows of different lengths; the output is unchanged
    cut = make_proposer(net, config={"confidence_threshold": 0.6})
    seen.clear()
    rows = generate(TargetRunner(target, 2, 200, cut.capture), cut, prompts, 24,
                    on_step=lambda p, paths: seen.append((p, paths)))
    assert [r.output_ids for r in rows] == [a.output_ids for a in ar]
    for p, paths in seen:
        assert p.lengths is not None and all(len(pa) <= n for pa, n in zip(paths, p.lengths.tolist()))


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
@torch.no_grad()
def test_stock_and_tree_equal_ar_for_every_drafter(quick_deployment, quick_prompts, kind):
    target = load_target(quick_deployment / "target")
    net = load_drafter(quick_deployment / f"drafter-{kind}")
    prompts = quick_prompts[::2]
    block = 5
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), prompts, 32, 1, META, ServeOptions(progress=False))
    for conc in (1, 3):
        meta = dict(META, drafter=kind)  # the records name the drafter: forcing knows its block counting
        chain_recs = serve(EngineSpec("stock", block), Deployment.of(target, net), prompts, 32, conc, meta, ServeOptions(progress=False))
        tree = serve(EngineSpec("specpilot", block, {"tree_branch": 2, "tree_depth": 2}), Deployment.of(target, net), prompts, 32, conc, meta, ServeOptions(progress=False))
        width = block + (1 if kind == "dspark" else 0)
        for a, c, t in zip(ar, chain_recs, tree):
            assert c.output_ids == a.output_ids and t.output_ids == a.output_ids
            assert max(c.committed_per_step) <= width
        assert sum(t.verify_steps for t in tree) <= sum(c.verify_steps for c in chain_recs)
        ids = {p["request_id"]: p["prompt_ids"] for p in prompts}
        assert check(chain_recs, ar, ids, target)["passed"] and check(tree, ar, ids, target)["passed"]


@torch.no_grad()
def test_two_level_drafting_equals_ar(quick_deployment, quick_prompts):
    """Two-level drafting (second_level L): the chain grows to B + L tokens per verify (level 2
    drafted beyond level 1's last draft), outputs equal AR at concurrency 1 and 3, a step never
    commits more than B + L tokens, and bad settings give one clear error."""
    target = load_target(quick_deployment / "target")
    net = load_drafter(quick_deployment / "drafter-dflash")
    prompts = quick_prompts[::2]
    block, L = 5, 3
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), prompts, 32, 1, META, ServeOptions(progress=False))
    for conc in (1, 3):
        recs = serve(EngineSpec("specpilot", block, {"second_level": L}), Deployment.of(target, net), prompts, 32, conc, dict(META, drafter="dflash"), ServeOptions(progress=False))
        assert [r.output_ids for r in recs] == [a.output_ids for a in ar]
        assert max(max(r.committed_per_step) for r in recs) <= block + L
    prop = make_proposer(net, block, {"second_level": L})
    assert prop.verify_width == block + L
    widths = []
    ids = [p["prompt_ids"] for p in prompts[:2]]
    runner = TargetRunner(target, 2, max(map(len, ids)) + 40 + block + L, prop.capture)
    generate(runner, prop, ids, 16, on_step=lambda p, paths: widths.append(p.width))
    assert set(widths) == {block + L}
    with pytest.raises(SpecpilotError, match="second_level"):
        make_proposer(net, block, {"second_level": block})
    with pytest.raises(SpecpilotError, match="second_level"):
        make_proposer(net, block, {"second_level": 2, "tree_branch": 1})

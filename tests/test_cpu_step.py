"""The fused CPU steps (fastpath.cpu_target, fastpath.cpu_drafter), the kernel sub-agent's CPU section
that checks and chooses them, their directions, and token forcing of cells that ran them.

On the quick deployment (CPU, seconds).
"""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.agent import directions as dirs
from specpilot.agent.kernel_cpu import check_target, choose_paths
from specpilot.deployment import Deployment, load_deployment
from specpilot.engine.backend import choose_backend
from specpilot.engine.config import EngineConfig, EngineSpec
from specpilot.engine.runner import TargetRunner
from specpilot.engine.serve import ServeOptions, serve
from specpilot.errors import SpecpilotError
from specpilot.fastpath.cpu_drafter import FusedDrafter, fused_drafter
from specpilot.fastpath.cpu_linear import onednn_problem
from specpilot.fastpath.cpu_target import FusedTarget, cpu_support
from specpilot.models.layers import tree_ancestors
from specpilot.models.random_checkpoint import build_target
from specpilot.records import write_records

META = {"deployment": "quick", "target": "t", "drafter": "d", "gpu": "cpu"}
DRAFTERS = ("dflash", "dflash2", "dspark")


def _dep(quick_deployment, kind="dflash"):
    return load_deployment(quick_deployment / "target", quick_deployment / f"drafter-{kind}", torch.device("cpu"),
                           torch.float32)


def _rows(quick_prompts, n=3):
    return [p for p in quick_prompts if p["benchmark"] in ("gsm8k", "mbpp")][:n]


KERNELS = ["aten"] + ([] if onednn_problem() else ["onednn"])


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_target_equals_the_plain_forward(quick_deployment, kernel):
    """Chains (one row, and two rows at different lengths), a one-token step and a tree: the fused
    step's logits, features and written K/V against the plain forward at the same state, with each
    matmul kernel."""
    dep = _dep(quick_deployment)
    m = dep.target
    step = FusedTarget(m, kernel)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 500, (2, 40), generator=g)
    for B, T, parents in ((1, 9, None), (2, 7, None), (1, 1, None), (1, 6, torch.tensor([[-1, 0, 1, 0, 3, 1]]))):
        runner = TargetRunner(m, B, 64, (1, 2), dep.backend)
        runner.prefill([p.tolist()[: 40 - 5 * b] for b, p in enumerate(prompt[:B])])
        block = torch.randint(4, 500, (B, T), generator=g)
        want, wf = runner.verify(block, parents)
        k_plain = m.cache.k.clone()
        m.cache.k.zero_()
        runner2 = TargetRunner(m, B, 64, (1, 2), dep.backend)
        runner2.prefill([p.tolist()[: 40 - 5 * b] for b, p in enumerate(prompt[:B])])
        anc, depth = tree_ancestors(parents) if parents is not None else (None, None)
        got, gf = step.forward(block, runner2.length, (1, 2), anc, depth)
        assert (want - got).abs().max() < 1e-5 and (wf - gf).abs().max() < 1e-5, (B, T)
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        hi = int(runner2.length.max()) + T
        assert (k_plain[..., :hi, :] - m.cache.k[..., :hi, :]).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_drafter_drafts_what_the_network_drafts(quick_deployment, kernel):
    """Context injection writes the network's K/V; the draft's tokens equal the network's, its scores
    agree; for one row (the mask-free draft) and for two rows at different lengths (masks)."""
    g = torch.Generator().manual_seed(1)
    for kind in DRAFTERS:
        dep = _dep(quick_deployment, kind)
        net = dep.drafter
        fused = FusedDrafter(net, kernel)
        embed, head = (net.embed_tokens, net.lm_head) if kind == "dspark" else \
            (dep.target.model.embed_tokens, dep.target.lm_head)
        for B in (1, 2):
            net.setup_cache(B, 80)
            feats = torch.randn(B, 30, len(net.config.target_layer_ids) * net.config.hidden_size, generator=g)
            start = torch.tensor([0, 5][:B])
            with torch.inference_mode():
                net.add_context(feats, start)
                k_plain = net.ctx_k.clone()
                net.ctx_k.zero_()
                fused.add_context(feats, start)
                assert (net.ctx_k - k_plain).abs().max() < 1e-5, kind
                anchor, at = torch.tensor([7, 9][:B]), torch.tensor([30, 35][:B])
                want_t, want_s = net.draft(anchor, at, embed, head, 8)
                got_t, got_s = fused.draft(anchor, at, embed, head, 8)
            assert torch.equal(want_t, got_t), (kind, B)
            finite = want_s.isfinite()
            assert torch.equal(finite, got_s.isfinite()) and (want_s[finite] - got_s[finite]).abs().max() < 1e-4


@pytest.mark.parametrize("kind", DRAFTERS)
def test_fused_engine_equals_ar_and_plain_steps(quick_deployment, quick_prompts, kind):
    """specpilot with the fused target and drafter steps (chain and spine tree, c1 and c2) decodes AR's
    tokens in the plain engine's steps, and records the paths it ran."""
    dep = _dep(quick_deployment, kind)
    rows = _rows(quick_prompts)
    block = 7 if kind == "dspark" else 8
    ar = serve(EngineSpec("ar"), dep, rows, 24, 1, META, ServeOptions(progress=False))
    fused = {"verify_path": "fused", "draft_path": "fused", "context_path": "fused"}
    for c in (1, 2):
        for extra in ({}, {"tree_branch": 2, "tree_depth": 2}):
            plain = serve(EngineSpec("specpilot", block, extra), dep, rows, 24, c, META, ServeOptions(progress=False))
            got = serve(EngineSpec("specpilot", block, {**extra, **fused}), dep, rows, 24, c, META,
                        ServeOptions(progress=False))
            assert [r.output_ids for r in got] == [r.output_ids for r in ar]
            assert [r.committed_per_step for r in got] == [r.committed_per_step for r in plain]
            assert got[0].engine_config["verify_path"] == "fused" and got[0].engine_config["draft_path"] == "fused"


def test_fused_paths_are_refused_where_they_cannot_run(quick_deployment):
    """A hybrid target: the fused target step names why; a bad engine config value names the key."""
    hybrid = build_target("tiny-hybrid", dtype=torch.float32)
    assert "dense" in cpu_support(hybrid)
    with pytest.raises(SpecpilotError, match="verify_path fused|cannot run this target"):
        TargetRunner(hybrid, 1, 32, (), choose_backend(hybrid), fused=True)
    with pytest.raises(SpecpilotError, match="verify_path = 'compiled'"):
        EngineConfig.parse({"verify_path": "compiled"})
    net = _dep(quick_deployment).drafter
    assert fused_drafter(net) is fused_drafter(net)  # built once per network


def test_kernel_agent_checks_then_chooses_and_rejects_a_wrong_step(quick_deployment, quick_prompts, monkeypatch):
    """The sub-agent's CPU section: both fused steps pass their checks on the calibration prompts and
    are timed; a fused target step whose logits are off by more than the tolerance is rejected."""
    rows = _rows(quick_prompts, 2)
    res = choose_paths(str(quick_deployment / "target"), str(quick_deployment / "drafter-dflash"), rows, 8, 1e-3,
                       new_tokens=12)
    for k, check in res["target"]["check"].items():
        assert check["passed"] and check["max_logit_diff"] <= 1e-3 and res["drafter"]["check"][k]["passed"]
    assert {f"{s}_{p}" for s in ("verify", "draft") for p in ("plain", "fused_aten")} <= set(res["times_ms"])
    assert res["verify_path"] in ("plain", "fused") and res["matmul"] in res["target"]["check"]
    assert sum(w.startswith(("verify_path", "draft_path", "context_path")) for w in res["why"]) == 3
    forward = FusedTarget.forward

    def skewed(self, tokens, start, capture=(), ancestors=None, depth=None):
        logits, feats = forward(self, tokens, start, capture, ancestors, depth)
        return logits + 0.01 * torch.arange(logits.shape[-1], dtype=logits.dtype), feats

    monkeypatch.setattr(FusedTarget, "forward", skewed)
    dep = _dep(quick_deployment)
    check = check_target(dep, rows, 8, 1e-3, 12)
    assert not check["passed"] and check["max_logit_diff"] > 1e-3


def test_verify_and_draft_directions_apply_where_the_sub_agent_chose_fused():
    ctx = {"gpu": "cpu", "drafter": "dflash", "dtype": "fp32", "concurrency": 1}
    names = lambda c: {d.name for d in dirs.applicable(c)}  # noqa: E731
    assert not {"verify_path", "draft_path"} & names(ctx)
    ctx["kernels"] = {"applies": False, "cpu": {"verify_path": "fused", "draft_path": "plain"}}
    assert "verify_path" in names(ctx) and "draft_path" not in names(ctx)
    ctx["kernels"]["cpu"].update(draft_path="fused", context_path="fused")
    assert {"verify_path", "draft_path", "context_path"} <= names(ctx)
    base = {"block_size": 8}
    assert dirs.REGISTRY["verify_path"].apply(base, {"verify_path": "plain"}) == base  # "plain" = off
    terms = {d.cost_term for d in dirs.applicable(ctx)}
    assert {"verify", "draft", "host", "acceptance"} <= terms  # a direction for every term ranked on the CPU


def test_forcing_checks_a_cell_that_ran_the_fused_steps(quick_deployment, quick_prompts, tmp_path, monkeypatch):
    """`specpilot force` on a specpilot cell of the fused steps: passes against the plain teacher
    (its re-execution runs the records' own fused config); a fused step that flips tokens fails."""
    from specpilot.cli import main

    rows = [p for p in quick_prompts if p["benchmark"] == "gsm8k"]
    dep = _dep(quick_deployment)
    cfg = {"verify_path": "fused", "draft_path": "fused", "context_path": "fused"}
    ar = serve(EngineSpec("ar"), dep, rows, 24, 1, META, ServeOptions(progress=False))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_records(tmp_path / "ar-c1.jsonl", ar)

    def force(recs):
        write_records(tmp_path / "specpilot-c1.jsonl", recs)
        out = tmp_path / "v.json"
        main(["force", "--candidate", str(tmp_path / "specpilot-c1.jsonl"), "--reference", str(tmp_path / "ar-c1.jsonl"),
              "--target", str(quick_deployment / "target"), "--drafter", str(quick_deployment / "drafter-dflash"),
              "--prompts", str(prompts), "--tolerance", "0.001", "--max-new-tokens", "24", "--out", str(out)])
        return json.loads(out.read_text())

    honest = serve(EngineSpec("specpilot", 8, cfg), dep, rows, 24, 1, META, ServeOptions(progress=False))
    v = force(honest)
    assert v["passed"] and v["replay"]["reproduced"] == len(rows)
    forward = FusedTarget.forward

    def flipped(self, tokens, start, capture=(), ancestors=None, depth=None):
        logits, feats = forward(self, tokens, start, capture, ancestors, depth)
        logits = logits.clone()
        logits[..., 5] = logits.max() + 1.0  # token 5 wins everywhere: the numerics flip tokens
        return logits, feats

    monkeypatch.setattr(FusedTarget, "forward", flipped)
    wrong = serve(EngineSpec("specpilot", 8, cfg), Deployment.of(dep.target, dep.drafter), rows, 24, 1, META,
                  ServeOptions(progress=False))
    assert [r.output_ids for r in wrong] != [r.output_ids for r in ar]
    assert not force(wrong)["passed"]

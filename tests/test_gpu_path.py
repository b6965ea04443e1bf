"""The GPU path, as far as the CPU can test it: random checkpoints, the replay drafter, the Triton
step kernels under Triton's interpreter, and (skipped without CUDA) CUDA graphs."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpilot.engine.backend import choose_backend
from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.engine.loop import generate, generate_ar
from specpilot.drafters.dflash import DFlashProposer
from specpilot.drafters.replay import AcceptanceProfile, ReplayProposer, calibrate, expected_tau, load_profile
from specpilot.engine.runner import TargetRunner
from specpilot.engine.backend import use_graphs
from specpilot.engine.config import EngineSpec
from specpilot.engine.serve import serve
from specpilot.errors import SpecpilotError
from specpilot.models.layers import chain_ancestors
from specpilot.models.loading import load_drafter, load_target
from specpilot.models.random_checkpoint import build_drafter, build_target, drafter_config, target_config

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs and the Triton step need a CUDA device")


# ---------------------------------------------------------------------------------------------
# random checkpoints
# ---------------------------------------------------------------------------------------------


def test_named_shapes():
    q = target_config("qwen3-8b")
    assert (q.hidden_size, q.intermediate_size, q.num_hidden_layers, q.num_attention_heads,
            q.num_key_value_heads, q.head_dim, q.vocab_size, q.rope_theta, q.tie_word_embeddings) == \
        (4096, 12288, 36, 32, 8, 128, 151936, 1e6, False)
    d = drafter_config("qwen3-8b")
    assert d.num_hidden_layers == 5 and d.target_layer_ids == [1, 9, 17, 25, 33] and d.block_size == 16
    b = target_config("qwen3-27b-dense")
    assert (b.hidden_size, b.intermediate_size, b.num_hidden_layers, b.num_attention_heads,
            b.num_key_value_heads) == (5120, 17408, 64, 40, 8)
    with torch.device("meta"):
        from specpilot.models.qwen3 import Transformer

        n = sum(p.numel() for p in Transformer(q).parameters())
    assert 8.1e9 < n < 8.3e9  # Qwen3-8B: 8.19 B parameters


def test_random_checkpoint_roundtrip(tmp_path):
    from specpilot.cli import main

    out = tmp_path / "t"
    assert main(["random-checkpoint", "--shape", "tiny", "--out", str(out), "--dtype", "fp32",
                 "--shard-gb", "0.001"]) == 0
    assert (out / "model.safetensors.index.json").exists()  # sharded
    assert len(list(out.glob("*.safetensors"))) > 1
    target = load_target(out)
    ref = build_target("tiny", dtype=torch.float32)
    for k, v in ref.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k
    drafter = load_drafter(tmp_path / "t-drafter")
    dref = build_drafter("tiny", dtype=torch.float32)
    for k, v in dref.state_dict().items():
        assert torch.equal(drafter.state_dict()[k], v), k
    assert drafter.config.target_layer_ids == drafter_config("tiny").target_layer_ids
    w = target.model.layers[0].mlp.up_proj.weight
    assert abs(float(w.detach().std()) - 0.02) < 0.002 and torch.equal(target.model.norm.weight, torch.ones(128))
    # loadable by transformers like a real checkpoint, same logits
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 1024, (1, 24))
    target.setup_cache(1, 32)
    with torch.no_grad():
        ours, _ = target(x, torch.zeros(1, dtype=torch.long), chain_ancestors(1, 24, "cpu"))
        theirs = hf(x).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


def test_random_checkpoint_bad_shape():
    from specpilot.models.random_checkpoint import target_config as tc

    with pytest.raises(SpecpilotError, match="unknown shape"):
        tc("qwen9-1t")


# ---------------------------------------------------------------------------------------------
# replay drafter
# ---------------------------------------------------------------------------------------------


def test_expected_tau_formula():
    p = 0.8
    prof = AcceptanceProfile("const", [p] * 15)
    # constant p: tau = 1 + p + ... + p^k = (1 - p^(k+1)) / (1 - p)
    assert expected_tau(prof, 16) == pytest.approx((1 - p ** 16) / (1 - p))
    assert expected_tau(prof, 2) == pytest.approx(1 + p)
    assert expected_tau(AcceptanceProfile("none", [0.0]), 16) == 1.0
    assert expected_tau(AcceptanceProfile("all", [1.0]), 16) == 16.0
    assert expected_tau(AcceptanceProfile("x", calibrate(5.5, 16)), 16) == pytest.approx(5.5, abs=1e-3)


def test_checked_in_profiles_match_their_published_tau():
    for name, tau in (("dflash_qwen3_8b_gsm8k", 6.55), ("study_stock", 4.8)):
        prof = load_profile(name)
        assert prof.block_size == 16 and prof.target_tau == tau
        assert expected_tau(prof, 16) == pytest.approx(tau, abs=0.01)
        assert all(a >= b for a, b in zip(prof.rates, prof.rates[1:]))  # declining with position
    with pytest.raises(SpecpilotError, match="not found"):
        load_profile("no_such_profile")


def test_sampled_acceptance_matches_expected_tau():
    prof = load_profile("dflash_qwen3_8b_gsm8k")
    rng = random.Random(0)
    n = 20000
    mean = 1 + sum(prof.sample(15, rng) for _ in range(n)) / n
    # std of 1 + A is about 4.5 here: 3 standard errors is about 0.1
    assert mean == pytest.approx(6.55, abs=0.1)


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    return build_target("tiny", dtype=torch.float32, seed=1), build_drafter("tiny", dtype=torch.float32, seed=1)


def test_replay_equals_ar_and_hits_its_tau(tiny_pair):
    target, drafter = tiny_pair
    prompts = [torch.randint(0, 1024, (20,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    n_new, block = 400, 16
    runner = TargetRunner(target, 2, 20 + n_new + 32)
    ar = [r.output_ids for r in generate_ar(runner, prompts, n_new)]
    prof = load_profile("study_stock")
    cap = tuple(drafter.config.target_layer_ids)
    prop = ReplayProposer(ar, prof, 1024, DFlashProposer(drafter), seed=3, block_size=block)
    rows = generate(TargetRunner(target, 2, 20 + n_new + 32, cap), prop, prompts, n_new)
    for r, a in zip(rows, ar):
        assert r.output_ids == a  # the target decided every token
        assert sum(r.committed_per_step) == n_new - 1
    # every step committed exactly the planted accepted count + the bonus, except budget-truncated ends
    steps = [c for r in rows for c in r.committed_per_step[:-1]]
    tau = sum(steps) / len(steps)
    assert tau == pytest.approx(expected_tau(prof, block), abs=0.6)  # ~160 steps: 3 standard errors
    planted = prop.planted
    assert 1 + sum(planted) / len(planted) == pytest.approx(tau, abs=0.5)
    assert rows[0].draft_s > 0  # the drafter network ran


def test_packaged_profiles_load_and_measured_tree_profiles_match_their_drafters():
    """Every packaged profile loads (rank recall consistent); the measured tiny-drafter profiles
    predict their own drafter's tree tau within 6 % (gpu_bench/drafter_ranks.py --tree)."""
    from specpilot.drafters.replay import expected_tau_tree, profile_names

    names = profile_names()
    assert {"study_stock", "tiny_dflash_ranks", "tiny_dflash2_ranks", "tiny_dspark_ranks"} <= set(names)
    for name in names:
        prof = load_profile(name)
        if not name.startswith("tiny_"):
            continue
        if "lattice" in prof.extra:  # a measured lattice profile: predicts every measured budget within 5 %
            from specpilot.drafters.lattice_profile import lattice_of
            lat = lattice_of(prof)
            assert lat.depth == prof.block_size - 1 and prof.extra["lattice_fit"]
            for n, fit in prof.extra["lattice_fit"].items():
                assert lat.expected_tau(int(n)) == pytest.approx(fit["predicted"], abs=1e-3)
                assert abs(fit["predicted"] / fit["measured"] - 1) < 0.05, (name, n, fit)
            continue
        assert prof.recall is not None and prof.extra["outputs_equal_ar"] == "20/20"
        for key, chk in prof.extra["tree_checks"].items():
            b, d = (int(x) for x in key.replace("branch", "").split("_depth"))
            pred = expected_tau_tree(prof, prof.block_size, b, d)
            assert pred == pytest.approx(chk["predicted_tau"], abs=1e-3)
            assert abs(pred - chk["measured_tau"]) / chk["measured_tau"] < 0.06, (name, key, chk)


def test_replay_tree_profile_and_sampling():
    from specpilot.drafters.replay import expected_tau_tree, geometric_recall

    prof = load_profile("study_stock")
    assert prof.recall is not None and [r[0] for r in prof.recall] == prof.rates
    # DFlash2's published recall ratio: top-16 misses are 0.005 / 0.146 of top-1 misses
    r0 = prof.recall[0]
    assert (1 - r0[15]) / (1 - r0[0]) == pytest.approx(0.005 / 0.146, rel=1e-3)
    assert expected_tau_tree(prof, 16, 0, 15) == pytest.approx(4.8, abs=0.01)
    t3 = expected_tau_tree(prof, 16, 3, 15)
    assert 4.8 < t3 < expected_tau_tree(prof, 16, 4, 15) < 16
    # a hand-computed case: 2 drafts, p = 0.5, recall(2) = 0.75: leaves catch half the misses
    small = AcceptanceProfile("s", [0.5, 0.5], recall=[[0.5, 0.75], [0.5, 0.75]])
    # chain tau 1 + .5 + .25; + miss at 1 (.5) x .5 + miss at 2 (.25) x .5
    assert expected_tau_tree(small, 3, 1, 2) == pytest.approx(1.75 + 0.25 + 0.125)
    assert expected_tau_tree(small, 3, 1, 1) == pytest.approx(1.75 + 0.25)
    rng, n = random.Random(0), 40000
    draws = [small.sample_tree(2, 1, 2, rng) for _ in range(n)]
    mean = sum(1 + a + (leaf is not None) for a, leaf in draws) / n
    assert mean == pytest.approx(2.125, abs=0.03)
    assert all(leaf is None or (a < 2 and leaf == 0) for a, leaf in draws)
    with pytest.raises(SpecpilotError, match="starts at"):
        AcceptanceProfile("bad", [0.5], recall=[[0.6, 0.7]])
    with pytest.raises(SpecpilotError, match="non-decreasing"):
        AcceptanceProfile("bad", [0.5], recall=[[0.5, 0.4]])
    assert geometric_recall([0.8], 4, 0.5 ** 3) == [[0.8, 0.9, 0.95, 0.975]]


def test_replay_tree_equals_ar_and_hits_its_tau(tiny_pair):
    """The replay drafter proposing the spine + side-branch tree: the target decides every token,
    and tau follows expected_tau_tree (the side leaves add what the rank profile says)."""
    from specpilot.drafters.replay import expected_tau_tree

    target, drafter = tiny_pair
    prompts = [torch.randint(0, 1024, (20,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    n_new, block, branch, depth = 400, 8, 3, 7
    runner = TargetRunner(target, 2, 20 + n_new + 64)
    ar = [r.output_ids for r in generate_ar(runner, prompts, n_new)]
    # a profile whose leaves matter: p = 0.6 per position, recall 0.6 / 0.8 / 0.9 / 0.95
    prof = AcceptanceProfile("leafy", [0.6] * 7, recall=[[0.6, 0.8, 0.9, 0.95]] * 7)
    cap = tuple(drafter.config.target_layer_ids)
    prop = ReplayProposer(ar, prof, 1024, DFlashProposer(drafter), seed=5, block_size=block,
                          tree_branch=branch, tree_depth=depth)
    assert prop.verify_width == block + branch * depth
    rows = generate(TargetRunner(target, 2, 20 + n_new + 64, cap), prop, prompts, n_new)
    for r, a in zip(rows, ar):
        assert r.output_ids == a
    steps = [c for r in rows for c in r.committed_per_step[:-1]]
    tau = sum(steps) / len(steps)
    want = expected_tau_tree(prof, block, branch, depth)
    assert want - expected_tau(prof, block) > 0.5  # the leaves are worth measuring here
    assert tau == pytest.approx(want, abs=0.35)  # ~240 steps, std of tau per step ~1.7: 3 standard errors
    hits = sum(leaf is not None for leaf in prop.leaves)
    assert 1 + (sum(prop.planted) + hits) / len(prop.planted) == pytest.approx(tau, abs=0.3)
    with pytest.raises(SpecpilotError, match="rank_recall"):
        ReplayProposer(ar, AcceptanceProfile("chain", [0.6]), 1024, tree_branch=2)


def test_serve_with_replay_marks_records_synthetic(tiny_pair):
    target, drafter = tiny_pair
    prompts = [{"request_id": f"gsm8k/{i:04d}", "benchmark": "gsm8k",
                "prompt_ids": torch.randint(0, 1024, (12,)).tolist()} for i in range(3)]
    meta = {"deployment": "random-tiny", "target": "t", "drafter": "replay:dflash", "gpu": "cpu"}
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), prompts, 24, 2, meta, ServeOptions(progress=False))
    prof = load_profile("dflash_qwen3_8b_gsm8k")
    refs = {r.request_id: r.output_ids for r in ar}
    st = serve(EngineSpec("stock", 8, {"replay_profile": prof.name}), Deployment.of(target, drafter), prompts, 24, 2, meta, ServeOptions(progress=False, replay=prof, references=refs))
    for a, s in zip(ar, st):
        assert s.output_ids == a.output_ids and s.synthetic and not a.synthetic
        assert s.engine_config["replay_profile"] == "dflash_qwen3_8b_gsm8k"
    # without references the AR engine runs first, with the same outputs
    st2 = serve(EngineSpec("stock", 8), Deployment.of(target, drafter), prompts, 24, 2, meta, ServeOptions(progress=False, replay=prof))
    assert [s.output_ids for s in st2] == [a.output_ids for a in ar]
    with pytest.raises(SpecpilotError, match="lack request"):
        serve(EngineSpec("stock", 8), Deployment.of(target, drafter), prompts, 24, 2, meta, ServeOptions(progress=False, replay=prof, references={}))


def test_cli_replay_run(tmp_path, tiny_pair):
    from specpilot.cli import main
    from specpilot.records import read_records

    out = tmp_path / "t"
    assert main(["random-checkpoint", "--shape", "tiny", "--out", str(out), "--dtype", "fp32"]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"request_id": f"x/{i:04d}", "benchmark": "x",
                                           "prompt_ids": list(range(5 + i, 25 + i))}) + "\n" for i in range(2)))
    base = ["run", "--target", str(out), "--prompts", str(prompts), "--max-new-tokens", "16", "--gpu", "cpu"]
    assert main(base + ["--engine", "ar", "--out", str(tmp_path / "ar.jsonl")]) == 0
    assert main(base + ["--engine", "stock", "--drafter", str(tmp_path / "t-drafter"), "--block-size", "8",
                        "--replay-profile", "study_stock", "--replay-reference", str(tmp_path / "ar.jsonl"),
                        "--out", str(tmp_path / "st.jsonl"), "--no-profile"]) == 0
    ar, st = read_records(tmp_path / "ar.jsonl"), read_records(tmp_path / "st.jsonl")
    assert [r.output_ids for r in st] == [r.output_ids for r in ar]
    assert all(r.synthetic and r.drafter == "replay:dflash" for r in st)


# ---------------------------------------------------------------------------------------------
# runner options on the CPU
# ---------------------------------------------------------------------------------------------


def test_graphs_are_cuda_only(tiny_pair):
    target, _ = tiny_pair
    assert use_graphs(None, torch.device("cpu")) is False
    with pytest.raises(SpecpilotError, match="CUDA"):
        TargetRunner(target, 1, 32, backend=choose_backend(target, True))
    r = TargetRunner(target, 1, 32)
    assert r.steps is None and r.backend.path == "eager"


def test_cache_is_reused_for_the_same_shape(tiny_pair):
    target, _ = tiny_pair
    TargetRunner(target, 2, 48)
    k = target.cache.k
    TargetRunner(target, 2, 48)
    assert target.cache.k is k  # same storage: captured graphs stay valid
    TargetRunner(target, 1, 48)
    assert target.cache.k is not k


def test_room_check_without_per_step_sync(tiny_pair):
    target, _ = tiny_pair
    r = TargetRunner(target, 1, 30)
    r.prefill([[1, 2, 3, 4, 5]])
    for _ in range(20):
        r.verify(torch.tensor([[1, 2, 3, 4]]))
        r.commit(torch.tensor([1], dtype=torch.long))
    assert int(r.length) == 25
    r.verify(torch.tensor([[1, 2, 3, 4, 5]]))  # 25 + 5 == 30 fits exactly
    with pytest.raises(SpecpilotError, match="KV-cache slots"):
        r.verify(torch.tensor([[1, 2, 3, 4, 5, 6]]))


# ---------------------------------------------------------------------------------------------
# the Triton step kernels, interpreted on the CPU
# ---------------------------------------------------------------------------------------------

INTERP_CHECK = r'''
from specpilot.fastpath.dense import FastTarget
from specpilot.models.config import TargetConfig
from specpilot.models.layers import chain_ancestors
from specpilot.models.qwen3 import Transformer
from specpilot.models.random_checkpoint import fill_random_

cfg = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
m, ref = fill_random_(Transformer(cfg), 5).eval(), fill_random_(Transformer(cfg), 5).eval()
B, S, P = 2, 160, 140
m.setup_cache(B, S); ref.setup_cache(B, S)
fast = FastTarget(m)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 256, (B, P), generator=g)
res = {}
with torch.inference_mode():
    for model in (m, ref):
        model(prompt, torch.zeros(B, dtype=torch.long), chain_ancestors(B, P, "cpu"))
    start = torch.tensor([130, 137])  # rows at different lengths (>1 KV chunk); stale slots past start
    tok = torch.randint(0, 256, (B, 3), generator=g)
    lf, hf = fast.forward(tok, start, capture=(0, 1))
    lf, hf = lf.clone(), hf.clone()
    lr, hr = ref(tok, start, chain_ancestors(B, 3, "cpu"), capture=(0, 1))
    res["logits"] = ((lf - lr).abs().max() / lr.abs().max()).item()
    res["hidden"] = ((hf - hr).abs().max() / hr.abs().max()).item()
    res["kv"] = max((m.cache.k[b, :, :, s:s + 3] - ref.cache.k[b, :, :, s:s + 3]).abs().max().item()
                    + (m.cache.v[b, :, :, s:s + 3] - ref.cache.v[b, :, :, s:s + 3]).abs().max().item()
                    for b, s in enumerate(start.tolist()))
    l1 = fast.forward(tok[:, :1], start)[0]
    res["row_independent"] = bool(torch.equal(l1[:, 0], lf[:, 0]))
    # the cuBLAS variant (torch.mm + separate norm / SwiGLU kernels; rows padded to 16), and a mix
    for name, cfgs in (("cublas", {r: "cublas" for r in ("qkv", "o", "gate_up", "down", "lm_head")}),
                       ("mixed", {"qkv": "cublas", "down": "cublas"}),
                       ("prenorm", {r: "bn16-bk512-w4-s3-p" for r in ("qkv", "gate_up", "lm_head")})):
        fast.set_configs(cfgs)
        lc, hc = fast.forward(tok, start, capture=(0, 1))
        res[name] = max(((lc - lr).abs().max() / lr.abs().max()).item(), ((hc - hr).abs().max() / hr.abs().max()).item())
        fast.set_configs({r: "bn16-bk512-w4-s3" for r in ("qkv", "o", "gate_up", "down", "lm_head")})
    # M-aware row tiles: a table by rows; 2 x 20 = 40 rows run 32-row tiles (one partial), K steps
    # that divide K (no K mask); rows of the 40-row block vs the eager forward and vs a 2-row step
    roles = ("qkv", "o", "gate_up", "down", "lm_head")
    fast.set_configs({r: {"16": "bn16-bk512-w4-s3", "64": "bn32-bk32-w4-s3-m32", "4096": "bn16-bk64-w4-s3-p-m64"}
                      for r in roles})
    res["tiers"] = [fast.config_for("qkv", n).key() for n in (1, 40, 100)]
    tok20 = torch.randint(0, 256, (B, 20), generator=g)
    lt = fast.forward(tok20, start)[0].clone()
    lr20 = ref(tok20, start, chain_ancestors(B, 20, "cpu"))[0]
    res["tiled"] = ((lt - lr20).abs().max() / lr20.abs().max()).item()
    fast.set_configs({r: "bn16-bk512-w4-s3" for r in roles})
    l1t = fast.forward(tok20[:, :1], start)[0]
    res["tiled_row0_vs_m2"] = (lt[:, 0] - l1t[:, 0]).abs().max().item()
    # token trees in the fast path (ancestor bits, RoPE at start + depth) vs the eager tree forward
    from specpilot.engine.verify import compact_path_, tree_inputs
    from specpilot.models.layers import tree_ancestors
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5], [-1, 0, 1, 0, 3, 3, 4]])
    anc, depth = tree_ancestors(parents)
    tt = torch.randint(0, 256, (B, 7), generator=g)
    ltr = fast.forward(tt, start, capture=(1,), tree=tree_inputs(parents))
    ltr = (ltr[0].clone(), ltr[1].clone())
    lrr = ref(tt, start, anc, depth, capture=(1,))
    res["tree"] = max(((ltr[0] - lrr[0]).abs().max() / lrr[0].abs().max()).item(),
                      ((ltr[1] - lrr[1]).abs().max() / lrr[1].abs().max()).item())
    res["tree_kv"] = max((m.cache.k[b, :, :, s:s + 7] - ref.cache.k[b, :, :, s:s + 7]).abs().max().item()
                         + (m.cache.v[b, :, :, s:s + 7] - ref.cache.v[b, :, :, s:s + 7]).abs().max().item()
                         for b, s in enumerate(start.tolist()))
    chain = torch.tensor([[-1, 0, 1, 2, 3, 4, 5]] * B)
    lc = fast.forward(tt, start, tree=tree_inputs(chain))[0].clone()
    res["tree_chain_equal"] = bool(torch.equal(lc, fast.forward(tt, start)[0]))
    # the accepted path's K/V compacted on the device vs the runner's host-side moves
    fast.forward(tt, start, tree=tree_inputs(parents))
    k0, v0 = m.cache.k.clone(), m.cache.v.clone()
    path, counts = torch.tensor([[0, 2, 5, 6], [0, 3, 4, 6]]), torch.tensor([3, 4])
    compact_path_(m.cache, start, counts, path)
    for b in range(B):
        for j in range(int(counts[b])):
            src, dst = int(start[b] + path[b, j]), int(start[b] + j)
            k0[b, :, :, dst] = k0[b, :, :, src].clone()
            v0[b, :, :, dst] = v0[b, :, :, src].clone()
    res["compact_equal"] = bool(torch.equal(k0, m.cache.k) and torch.equal(v0, m.cache.v))
    # one newcomer's prefill into its own row (continuous batching): rows=slice(1, 2), logits of
    # the last position only; row 0 of the cache is untouched
    k_row0 = m.cache.k[0].clone()
    tp = torch.randint(0, 256, (B, 9), generator=g)
    lp = fast.forward(tp[1:], start[1:], rows=slice(1, 2), last_only=True)[0].clone()
    lpr = ref(tp, start, chain_ancestors(B, 9, "cpu"))[0]
    res["row_prefill"] = ((lp[0, 0] - lpr[1, -1]).abs().max() / lpr[1, -1].abs().max()).item()
    s1 = int(start[1])
    res["row_prefill_kv"] = (m.cache.k[1, :, :, s1:s1 + 9] - ref.cache.k[1, :, :, s1:s1 + 9]).abs().max().item()
    res["row_prefill_other_rows"] = bool(torch.equal(m.cache.k[0], k_row0))
print("RESULT " + json.dumps(res))
'''


def _interpreted(script: Path, text: str) -> dict:
    """Run a check script under Triton's CPU interpreter in a subprocess; its RESULT line as a dict."""
    from triton_interp import run_interpreted  # imports triton: only where the test is not skipped

    return run_interpreted(script, text, REPO)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_step_matches_eager_forward_interpreted(tmp_path):
    """FastTarget (7 Triton kernels per layer) vs the eager forward: logits, features, KV writes."""
    res = _interpreted(tmp_path / "check.py", INTERP_CHECK)
    assert res["logits"] < 1e-5 and res["hidden"] < 1e-5 and res["kv"] < 1e-5, res
    assert res["cublas"] < 1e-5 and res["mixed"] < 1e-5 and res["prenorm"] < 1e-5, res
    assert res["row_independent"]
    assert res["tiers"] == ["bn16-bk512-w4-s3", "bn32-bk32-w4-s3-m32", "bn16-bk64-w4-s3-p-m64"], res
    assert res["tiled"] < 1e-5 and res["tiled_row0_vs_m2"] < 1e-5, res
    assert res["tree"] < 1e-5 and res["tree_kv"] < 1e-5 and res["tree_chain_equal"] and res["compact_equal"], res
    assert res["row_prefill"] < 1e-5 and res["row_prefill_kv"] < 1e-5 and res["row_prefill_other_rows"], res


# a one-layer random dense target on the Triton step (FastTarget), cache of 224 slots, and a seeded generator
TREE_TARGET = r'''
from specpilot.fastpath.dense import FastTarget
from specpilot.engine.verify import tree_inputs
from specpilot.models.config import TargetConfig
from specpilot.models.layers import chain_ancestors
from specpilot.models.qwen3 import Transformer
from specpilot.models.random_checkpoint import fill_random_

cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)
m = fill_random_(Transformer(cfg), 3).eval()
B, S = 1, 224
m.setup_cache(B, S)
fast = FastTarget(m)
g = torch.Generator().manual_seed(0)
'''

TREE_LEAF_CHECK = TREE_TARGET + r'''
from specpilot.drafters.proposal import spine_tree_parents
res = {"leaves": 0, "leaf_equal": True, "spine_equal": True}
k, branch, depth = 6, 2, 3
par = torch.tensor([spine_tree_parents(k, branch, depth)])
W = par.shape[1]
with torch.inference_mode():
    m(torch.randint(0, 128, (B, 200), generator=g), torch.zeros(B, dtype=torch.long), chain_ancestors(B, 200, "cpu"))
    # blocks at 124 and 60: the side leaves' own slots (start + 7 ..) fall in the next 64-key tile
    # (and at 124 the next 128-slot chunk) while the same token decoded by AR sits at start + depth
    for st in (124, 60):
        start = torch.tensor([st])
        tok = torch.randint(0, 128, (B, W), generator=g)
        # chains of the same width W (so the same row tiles: under the interpreter numpy's matmul
        # may sum differently for other tile shapes); a chain's row d sees only its first d + 1
        lt = fast.forward(tok, start, tree=tree_inputs(par))[0].clone()
        lc = fast.forward(tok, start)[0].clone()
        res["spine_equal"] &= bool(torch.equal(lt[:, :k + 1], lc[:, :k + 1]))
        for t in range(k + 1, W):
            d = int(par[0, t]) + 1  # depth of the leaf: its parent is spine node d - 1
            path = torch.cat([tok[:, :d], tok[:, t:t + 1], tok[:, d:W - 1]], 1)
            lp = fast.forward(path, start)[0]
            res["leaves"] += 1
            res["leaf_equal"] &= bool(torch.equal(lt[:, t], lp[:, d]))
print("RESULT " + json.dumps(res))
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tree_leaves_equal_their_chains_across_tiles_interpreted(tmp_path):
    """A side leaf of a tree verified in the Triton step has the bits of the same token verified as
    a chain (what AR decodes), also when its own block slot and the chain's lie in different key
    tiles or attention chunks: the own key is folded in last, outside the slot tiles."""
    res = _interpreted(tmp_path / "check.py", TREE_LEAF_CHECK)
    assert res["leaves"] == 12 and res["spine_equal"] and res["leaf_equal"], res


STATIC_TREE_CHECK = TREE_TARGET + r'''
from specpilot.drafters.static_tree import optimal_tree
from specpilot.drafters.replay import load_profile
shape = optimal_tree(load_profile("study_stock"), 11, 7)  # best-first order: the spine is not contiguous
par = torch.tensor([shape.parent_list()])
W = par.shape[1]
depth = [0] * W
for i in range(1, W):
    depth[i] = depth[int(par[0, i])] + 1
res = {"nodes": 0, "equal": True, "off_spine": sum(1 for r in shape.ranks if r > 1),
       "scattered": any(shape.parents[i] != i for i in range(1, len(shape.parents)))}
chain = torch.tensor([[-1] + list(range(W - 1))])
with torch.inference_mode():
    m(torch.randint(0, 128, (B, 200), generator=g), torch.zeros(B, dtype=torch.long), chain_ancestors(B, 200, "cpu"))
    for st in (124, 60):  # the ancestors' block slots fall in other 64-key tiles / 128-slot chunks
        start = torch.tensor([st])
        tok = torch.randint(0, 128, (B, W), generator=g)
        lt = fast.forward(tok, start, tree=tree_inputs(par))[0].clone()
        for t in range(W):
            path, n = [t], t
            while n > 0:
                n = int(par[0, n])
                path.append(n)
            path = path[::-1]
            row = torch.cat([tok[:, path], torch.randint(0, 128, (B, W - len(path)), generator=g)], 1)
            lc = fast.forward(row, start, tree=tree_inputs(chain))[0]  # the same path as a chain, same tiles
            res["nodes"] += 1
            res["equal"] &= bool(torch.equal(lt[:, t], lc[:, depth[t]]))
print("RESULT " + json.dumps(res))
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_static_tree_nodes_equal_their_paths_interpreted(tmp_path):
    """Every node of a static tree (nodes in best-first order, so ancestors sit at scattered block
    slots) verified in the Triton step has the bits of its root-to-node path verified as a chain:
    the attention reads a node's ancestors in the order of their positions, not their slots."""
    res = _interpreted(tmp_path / "check.py", STATIC_TREE_CHECK)
    assert res["nodes"] == 24 and res["off_spine"] >= 2 and res["scattered"] and res["equal"], res


DRAFT_CHECK = r"""
from torch import nn
from specpilot.fastpath.drafter import FastDrafter
from specpilot.fastpath.support import drafter_support
from specpilot.models.dflash import DFlashDrafter, DrafterConfig
from specpilot.models.random_checkpoint import fill_random_

V, H = 256, 64
cfg = DrafterConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=V, target_layer_ids=[0, 1], mask_token_id=3,
                    block_size=6)
fast_net, ref = fill_random_(DFlashDrafter(cfg), 7).eval(), fill_random_(DFlashDrafter(cfg), 7).eval()
emb, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
torch.manual_seed(1); nn.init.normal_(emb.weight, std=0.5); nn.init.normal_(head.weight, std=0.5)
B, S = 2, 160
for d in (fast_net, ref):
    d.setup_cache(B, S)
fast = FastDrafter(fast_net, emb.weight, head.weight)
g = torch.Generator().manual_seed(0)
res = {"supported": drafter_support(fast_net) is None}
with torch.inference_mode():
    feats = torch.randn(B, 140, 2 * H, generator=g)
    zero = torch.zeros(B, dtype=torch.long)
    fast.add_context(feats, zero); ref.add_context(feats, zero)
    res["ctx_kv"] = max(((fast_net.ctx_k - ref.ctx_k).abs().max() / ref.ctx_k.abs().max()).item(),
                        ((fast_net.ctx_v - ref.ctx_v).abs().max() / ref.ctx_v.abs().max()).item())
    start = torch.tensor([130, 137])  # rows at different lengths, more than one KV chunk
    anchor = torch.tensor([5, 9])
    tf = fast.draft(anchor, start, 6).clone()
    tr, lr = ref.draft(anchor, start, emb, head, 6)
    res["tokens_equal"] = bool(torch.equal(tf, tr))
    lf = next(w for k, w in fast._ws.items() if k[:2] == (B, 6)).logits[: B * 6].view(B, 6, -1)[:, 1:]
    res["logits"] = ((lf - lr).abs().max() / lr.abs().max()).item()
    # a block's K/V sit past start: the next context injection overwrites them, and a second
    # draft at the same start gives the same tokens (nothing of the first leaks into the second)
    res["redraft_equal"] = bool(torch.equal(fast.draft(anchor, start, 6), tf))
    # side branches of a spine + side-branch tree from the same step: the eager builder's
    # (drafters.proposal.side_branches over the eager logits), and never the spine's token
    from specpilot.drafters.proposal import side_branches
    sp, alts = fast.draft(anchor, start, 6, branch=2, depth=3)
    res["tree_spine_equal"] = bool(torch.equal(sp, tr))
    res["tree_alts_equal"] = bool(torch.equal(alts, side_branches(lr, tr, 3, 2)))
    res["tree_alts_shape"] = list(alts.shape)
    res["tree_alts_not_spine"] = bool((alts != sp[:, :3, None]).all())
    # an incremental context step (T = 6 at start) then a draft further on
    f2 = torch.randn(B, 6, 2 * H, generator=g)
    fast.add_context(f2, start); ref.add_context(f2, start)
    t2f = fast.draft(anchor, start + 6, 6).clone()
    t2r = ref.draft(anchor, start + 6, emb, head, 6)[0]
    res["tokens2_equal"] = bool(torch.equal(t2f, t2r))
    kk = [(fast_net.ctx_k[:, b, :, :s + 6] - ref.ctx_k[:, b, :, :s + 6]).abs().max().item()
          for b, s in enumerate(start.tolist())]
    res["ctx_kv2"] = max(kk)
    # a newcomer's context into its own draft-cache row (rows=slice(0, 1)); row 1 untouched
    k1 = fast_net.ctx_k[:, 1].clone()
    f3 = torch.randn(1, 7, 2 * H, generator=g)
    fast.add_context(f3, torch.tensor([20]), rows=slice(0, 1))
    ref.add_context(torch.cat([f3, f3]), torch.tensor([20, 20]))
    res["ctx_row"] = (fast_net.ctx_k[:, 0, :, 20:27] - ref.ctx_k[:, 0, :, 20:27]).abs().max().item()
    res["ctx_row_other"] = bool(torch.equal(fast_net.ctx_k[:, 1], k1))
print("RESULT " + json.dumps(res))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_draft_step_matches_eager_drafter_interpreted(tmp_path):
    """FastDrafter (the DFlash draft step and context injection in the target's Triton kernels) vs
    the eager DFlash network: context K/V, draft logits and tokens, at two rows of different lengths;
    the side branches of a tree proposal from the same step equal the eager builder's."""
    res = _interpreted(tmp_path / "draft_check.py", DRAFT_CHECK)
    assert res["supported"]
    assert res["ctx_kv"] < 1e-5 and res["ctx_kv2"] < 1e-5, res
    assert res["logits"] < 1e-5, res
    assert res["tokens_equal"] and res["redraft_equal"] and res["tokens2_equal"], res
    assert res["tree_spine_equal"] and res["tree_alts_equal"] and res["tree_alts_not_spine"], res
    assert res["tree_alts_shape"] == [2, 3, 2], res
    assert res["ctx_row"] < 1e-5 and res["ctx_row_other"], res


PREFILL_CHECK = r"""
from specpilot.engine.loop import generate_ar
from specpilot.engine.scheduler import Request, Scheduler, slots_needed
from specpilot.models.config import TargetConfig
from specpilot.models.qwen3 import Transformer
from specpilot.models.random_checkpoint import fill_random_

cfg = TargetConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
m = fill_random_(Transformer(cfg), 4).eval()
with torch.no_grad():  # logits of a few units: outputs that do not all collapse to one token
    m.lm_head.weight.mul_(30)
g = torch.Generator().manual_seed(1)
N = 4  # new tokens per request
reqs = [Request(torch.randint(0, 128, (5 + i,), generator=g).tolist(), N) for i in range(5)]


def logged(runner, eager_first=False, parked=lambda b: False):
    # per cache row, one segment per prompt prefilled into it: the prompt, then the logits the
    # request's tokens were the argmax of (its prefill's last position, then each decode step;
    # not the steps while the row is parked for a prefill beside them, whose logits nothing reads)
    log = [[] for _ in range(runner.batch)]
    row, verify, prefill = runner.prefill_row, runner.verify, runner.prefill

    def prefill_row(b, tokens, start, **kw):
        lg, f = row(b, tokens, start, **kw)
        if start == 0:
            log[b].append({"prompt": list(tokens), "logits": [lg.clone()]})
        else:  # a later chunk of the same prompt
            log[b][-1]["prompt"] += list(tokens)
            log[b][-1]["logits"][0] = lg.clone()
        return lg, f

    def verify_logged(block, parents=None):
        lg, f = verify(block, parents)
        for b in range(runner.batch):
            if log[b] and not parked(b):
                log[b][-1]["logits"].append(lg[b, 0].clone())
        return lg, f

    def prefill_eager(prompts, pad_id=0, rows=None, chunk=None):  # the engine before: one eager block
        last, feats, lengths = prefill(prompts, rows=False)
        for b, p in enumerate(prompts):
            log[b].append({"prompt": list(p), "logits": [last[b].clone()]})
        return last, feats, lengths

    runner.prefill_row, runner.verify = prefill_row, verify_logged
    if eager_first:
        runner.prefill = prefill_eager
    return log


def per_request(log, prompts):
    out = []
    for p in prompts:
        seg = next(s for row in log for s in row if s["prompt"] == list(p))
        out.append(torch.stack(seg["logits"][:N]))
    return out


def serve(c, order, eager_first=False, chunk=None, beside=None, delay=0):
    rs = [reqs[i] for i in order]
    runner = fast_runner(m, c, slots_needed(rs, 1, c > 1))
    holder = []
    log = logged(runner, eager_first, parked=lambda b: bool(holder) and b in holder[0]._pending)
    sched = Scheduler(runner, prefill_chunk=chunk, prefill_beside=beside)
    holder.append(sched)
    sched._beside_delay = delay  # admit a finished prefill only after this many polls
    rows = sched.run(rs)
    assert sched.beside == bool(beside), (sched.beside, beside)
    outs = {i: r.output_ids for i, r in zip(order, rows)}
    logits = dict(zip(order, per_request(log, [r.prompt_ids for r in rs])))
    return [outs[i] for i in range(len(reqs))], [logits[i] for i in range(len(reqs))]


res = {}
with torch.inference_mode():
    ref_out, ref_lg = serve(1, range(5))  # c1: request 0 prefilled at the start, 1..4 as refills
    runs = {"c2": serve(2, range(5)), "c3": serve(3, range(5)),  # requests 1, 2 now start the run
            "c3_reversed": serve(3, [4, 3, 2, 1, 0]), "c2_chunked": serve(2, range(5), chunk=3),
            # refills prefilled beside the running rows' steps, admitted 0 / 2 polls late
            "c3_beside": serve(3, range(5), beside=True), "c2_beside_late": serve(2, range(5), beside=True, delay=2),
            "c3_beside_chunked": serve(3, [4, 3, 2, 1, 0], chunk=3, beside=True, delay=1)}
    runner = fast_runner(m, 2, slots_needed(reqs[:2], 1, True))  # static: one lock-step batch of 2
    log = logged(runner)
    static = generate_ar(runner, [r.prompt_ids for r in reqs[:2]], N)
    res["static_outputs_equal"] = [r.output_ids for r in static] == ref_out[:2]
    res["static_logits_equal"] = all(torch.equal(a, b) for a, b in
                                     zip(per_request(log, [r.prompt_ids for r in reqs[:2]]), ref_lg))
    for name, (out, lg) in runs.items():
        res[name + "_outputs_equal"] = out == ref_out
        res[name + "_logits_equal"] = [bool(torch.equal(a, b)) for a, b in zip(lg, ref_lg)]
    res["distinct_outputs"] = len({tuple(o) for o in ref_out})
    # the engine before this path: the first c requests in one eager block (cuBLAS on the GPU)
    _, eager_lg = serve(3, range(5), eager_first=True)
    res["eager_first_logits_equal"] = [bool(torch.equal(a, b)) for a, b in zip(eager_lg, ref_lg)]
    # the speculative loop (replay drafter, budgets of N tokens) with refills beside, with and
    # without overlap scheduling: outputs equal AR's, every request's K/V came from its own prefill
    from specpilot.drafters.replay import AcceptanceProfile, ReplayProposer
    for ov in (False, True):
        for delay in (0, 3):
            runner = fast_runner(m, 3, slots_needed(reqs, 4, True))
            rp = ReplayProposer([ref_out[i] for i in range(3)], AcceptanceProfile("half", [0.5] * 3), 128,
                                block_size=4)
            spec_reqs = [Request(r.prompt_ids, N, ref_out[i]) for i, r in enumerate(reqs)]
            sched = Scheduler(runner, rp, prefill_beside=True, overlap=ov)
            sched._beside_delay = delay
            rows = sched.run(spec_reqs)
            res[f"spec_beside_ov{int(ov)}_d{delay}"] = [r.output_ids for r in rows] == ref_out and sched.beside
print("RESULT " + json.dumps(res))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_prefill_is_the_same_first_or_as_refill_interpreted(tmp_path):
    """Fast path (Triton step, interpreted): a request's logits at every token (its prefill's last
    position, then each decode step) and outputs are bit-identical whether it is prefilled at the
    start of a continuous-batching run or as a refill, at c1, c2, c3, in reverse arrival order, in
    prefill chunks, in a static batch, and with refills prefilled beside the running rows' steps
    (admitted at once or some polls late, AR and the speculative loop with and without overlap):
    every prompt takes TargetRunner.prefill_row."""
    res = _interpreted(tmp_path / "prefill_check.py", PREFILL_CHECK)
    assert res["distinct_outputs"] > 1, res
    for name in ("c2", "c3", "c3_reversed", "c2_chunked", "c3_beside", "c2_beside_late", "c3_beside_chunked"):
        assert res[name + "_outputs_equal"] and all(res[name + "_logits_equal"]), (name, res)
    assert all(res[f"spec_beside_ov{o}_d{d}"] for o in (0, 1) for d in (0, 3)), res
    assert res["static_outputs_equal"] and res["static_logits_equal"], res
    # the check has teeth: the former eager first batch gives other bits than its refill
    # (recorded, not required: it depends on the CPU's BLAS)
    print("eager first batch, logits equal to the row path per request:", res["eager_first_logits_equal"])


def test_fast_drafter_refuses_other_networks():
    """DFlash2 (convolutions) and causal/sliding drafters stay on the eager network."""
    from specpilot.fastpath.support import drafter_support
    from specpilot.models.dflash import DFlashDrafter, DrafterConfig

    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=64, target_layer_ids=[0, 1], mask_token_id=3)
    assert drafter_support(DFlashDrafter(DrafterConfig(**base))) is None
    assert drafter_support(DFlashDrafter(DrafterConfig(**base, is_causal=True))) is not None
    assert drafter_support(DFlashDrafter(DrafterConfig(
        **base, layer_types=["sliding_attention", "full_attention"], sliding_window=8))) is not None
    assert drafter_support(DFlashDrafter(DrafterConfig(**dict(base, head_dim=24)))) is not None


def test_tree_bits_pack_ancestors():
    pytest.importorskip("triton")  # triton_step imports it; README: without Triton these tests skip
    from specpilot.engine.verify import tree_inputs
    from specpilot.engine.verify import tree_bits

    bits = tree_bits(chain_ancestors(1, 64, "cpu"))
    assert int(bits[0, 0]) == 1 and int(bits[0, 1]) == 3 and int(bits[0, 63]) == -1  # all 64 bits
    b, d, p = tree_inputs(torch.tensor([[-1, 0, 0, 1, 2]]))
    assert b.tolist() == [[0b1, 0b11, 0b101, 0b1011, 0b10101]] and d.tolist() == [[0, 1, 1, 2, 2]]
    assert d.dtype == torch.int32 and p.dtype == torch.int32 and p.shape == (1, 5, 64)
    # ancestors by depth: node 3's are the root (depth 0) and node 1 (depth 1); node 4's 0 and 2
    assert p[0, :, :2].tolist() == [[0, 0], [0, 0], [0, 0], [0, 1], [0, 2]]
    _, _, p2 = tree_inputs(torch.tensor([[-1, 0, 1, 0, 3, 2]]))  # nodes out of depth order
    assert p2[0, 4, :2].tolist() == [0, 3] and p2[0, 5, :3].tolist() == [0, 1, 2]
    # a spine + side-leaf tree has its ancestors at the slots of their depths: bits and depths only
    from specpilot.drafters.proposal import spine_tree_parents
    assert len(tree_inputs(torch.tensor([spine_tree_parents(6, 2, 3)]))) == 2
    assert len(tree_inputs(torch.tensor([spine_tree_parents(6, 2, 3)]), paths=True)) == 3  # the family step's form
    with pytest.raises(SpecpilotError, match="at most 256 nodes"):
        tree_inputs(torch.full((1, 257), -1))
    # wider than the bits: the path form (bits a zero placeholder); no deeper than the path table
    wide = tree_inputs(torch.tensor([[-1] + [0] * 99]))
    assert len(wide) == 3 and not wide[0].any() and wide[1].tolist() == [[0] + [1] * 99]
    b, d, p = tree_inputs(torch.tensor([[-1] + [0] * 70 + [70]]))
    assert not bool(b.any()) and d[0, -1] == 2 and p[0, -1, :2].tolist() == [0, 70]
    with pytest.raises(SpecpilotError, match="depth 69: .* at most 64 levels"):
        tree_inputs(torch.tensor([[-1] + list(range(69))]))
    with pytest.raises(SpecpilotError, match="depth up to 70: .* at most 64 levels"):
        tree_inputs(torch.tensor([[-1, 0]]), max_depth=70)
    # a tree that changes every step (max_depth given): the path form, no host read, same tables
    par = torch.tensor([[-1, 0, 0, 1, 2]])
    ref, dyn = tree_inputs(par), tree_inputs(par, max_depth=2)
    assert len(ref) == len(dyn) == 3 and all(torch.equal(x, y) for x, y in zip(dyn[1:], ref[1:]))
    assert not dyn[0].any()  # the path form reads no bits: a placeholder, not built every step (issue 54)


def test_row_tiles_and_config_tables():
    pytest.importorskip("triton")
    from specpilot.kernels import step as K
    from specpilot.fastpath.dense import FastTarget
    from specpilot.fastpath.tables import config_tiers

    assert [K.row_tile(m, 128) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 384)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 128, 128]
    assert [K.row_tile(m, 16) for m in (1, 17, 384)] == [16, 16, 16]
    assert K.row_tile(300, 256) == 256 and K.row_tile(40, 32) == 32
    c = K.LinearConfig.parse("bn128-bk64-w8-s3-p-m128")
    assert (c.bn, c.bk, c.warps, c.stages, c.prenorm, c.bm) == (128, 64, 8, 3, True, 128)
    assert c.key() == "bn128-bk64-w8-s3-p-m128" and K.LinearConfig.parse("bn64-bk256-w4-s3").bm == 16
    with pytest.raises(ValueError, match="bm must be"):
        K.LinearConfig.parse("bn64-bk256-w4-s3-m48")
    t = config_tiers({"64": "bn32-bk256-w4-s4-m64", "16": "bn64-bk256-w4-s3", "384": "cublas"})
    fast = FastTarget.__new__(FastTarget)  # table logic only, no model
    fast.configs = {"qkv": t}
    assert [fast.config_for("qkv", n) if n > 64 else fast.config_for("qkv", n).key() for n in (1, 16, 17, 64)] == \
        ["bn64-bk256-w4-s3", "bn64-bk256-w4-s3", "bn32-bk256-w4-s4-m64", "bn32-bk256-w4-s4-m64"]
    assert fast.config_for("qkv", 65) == "cublas" and fast.config_for("qkv", 1000) == "cublas"
    assert fast.config_keys() == {"qkv": {"16": "bn64-bk256-w4-s3", "64": "bn32-bk256-w4-s4-m64", "384": "cublas"}}
    with pytest.raises(SpecpilotError, match="row counts"):
        config_tiers({"many": "bn64-bk256-w4-s3"})
    with pytest.raises(SpecpilotError, match="bad matmul config"):
        config_tiers({"16": "bn64"})


def test_decode_configs_merge_into_tables():
    from specpilot.fastpath.tables import with_decode_configs

    tables = {"qkv": {"16": "bn32-bk128-w4-s6-p", "64": "bn64-bk128-w4-s4-p-m64"},
              "o": {"16": "bn32-bk256-w4-s4", "384": "bn128-bk64-w8-s5-m128"}}
    m = with_decode_configs({"qkv": "bn16-bk512-w4-s3-p", "o": "bn64-bk256-w4-s3"}, tables)
    assert m == {"qkv": {"16": "bn16-bk512-w4-s3-p", "64": "bn64-bk128-w4-s4-p-m64"},
                 "o": {"16": "bn64-bk256-w4-s3", "384": "bn128-bk64-w8-s5-m128"}}
    # a fused-norm decode config would round differently from the prenorm buckets: not taken
    assert with_decode_configs({"qkv": "bn64-bk256-w4-s3"}, tables)["qkv"] == tables["qkv"]
    assert with_decode_configs({"o": "cublas"}, tables)["o"] == "cublas"


# ---------------------------------------------------------------------------------------------
# CUDA graphs (skipped without a GPU)
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_graph_path_equals_eager_on_cuda(kernels):
    target = build_target("tiny", device="cuda", dtype=torch.bfloat16, seed=2)
    drafter = build_drafter("tiny", device="cuda", dtype=torch.bfloat16, seed=2)
    prompts = [list(range(3, 40)), list(range(50, 70))]
    eager = generate_ar(TargetRunner(target, 2, 128, backend=choose_backend(target, False)), prompts, 32)
    graph = generate_ar(TargetRunner(target, 2, 128, backend=choose_backend(target, None, kernels)), prompts, 32)
    if kernels == "torch":
        assert [r.output_ids for r in graph] == [r.output_ids for r in eager]
    cap = tuple(drafter.config.target_layer_ids)
    spec = generate(TargetRunner(target, 2, 128, cap, backend=choose_backend(target, None, kernels)),
                    DFlashProposer(drafter, block_size=8), prompts, 32)
    assert [r.output_ids for r in spec] == [r.output_ids for r in graph]


@needs_cuda
def test_tree_verify_in_fast_path_on_cuda():
    """Tree verification of a dense target runs in the Triton step under CUDA graphs (no eager
    fallback) and commits exactly the AR tokens, at batch 2 with a tree of side branches."""
    target = build_target("tiny", device="cuda", dtype=torch.bfloat16, seed=2)
    drafter = build_drafter("tiny", device="cuda", dtype=torch.bfloat16, seed=2)
    prompts = [list(range(3, 40)), list(range(50, 70))]
    ar = generate_ar(TargetRunner(target, 2, 192, backend=choose_backend(target, None, "triton")), prompts, 40)
    cap = tuple(drafter.config.target_layer_ids)
    runner = TargetRunner(target, 2, 192, cap, backend=choose_backend(target, None, "triton"))
    assert runner.tree_fast
    before = runner.steps.cache.captures
    prop = DFlashProposer(drafter, block_size=8, tree_branch=2, tree_depth=2)
    spec = generate(runner, prop, prompts, 40)
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert runner.steps.cache.captures > before  # the tree step was captured, not run eager
    # the side branches came from the captured Triton draft step too (not the eager network)
    assert prop.graphs is not None and prop.graphs.fast is not None
    assert any(k[0] == "draft" and len(k) == 5 for k in prop.graphs.cache.entries), list(prop.graphs.cache.entries)


def test_fast_drafter_context_roles_have_their_own_tables():
    """The context injection's two matmuls (ctx_fc, ctx_kv) take their own configs: the packaged
    drafter table by default (ctx_kv at 16 rows not the target's qkv entry), a given key when
    configs name them; the target step knows no such role."""
    pytest.importorskip("triton")
    from torch import nn

    from specpilot.fastpath.tables import DEFAULT_CONFIGS, DRAFTER_CONTEXT_CONFIGS

    from specpilot.fastpath.drafter import FastDrafter

    from specpilot.fastpath.dense import FastTarget
    from specpilot.errors import SpecpilotError
    from specpilot.models.dflash import DFlashDrafter, DrafterConfig
    from specpilot.models.qwen3 import Transformer
    from specpilot.tiny.build import QUICK
    from specpilot.tiny.targets import tiny_target_config

    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, vocab_size=64, target_layer_ids=[0, 1], mask_token_id=3)
    net = DFlashDrafter(cfg)
    net.setup_cache(1, 32)
    emb, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    fast = FastDrafter(net, emb.weight, head.weight)
    assert fast.config_for("ctx_kv", 16).key() == DRAFTER_CONTEXT_CONFIGS["ctx_kv"]["16"] \
        != DEFAULT_CONFIGS["qkv"]["16"]
    assert fast.config_for("ctx_fc", 16).key() == DEFAULT_CONFIGS["down"]["16"]
    fast.set_configs({"ctx_fc": "bn16-bk256-w4-s4"})
    assert fast.config_for("ctx_fc", 64).key() == "bn16-bk256-w4-s4"
    target = FastTarget(Transformer(tiny_target_config("dense", QUICK, 64)))
    with pytest.raises(SpecpilotError, match="'ctx_fc'"):
        target.set_configs({"ctx_fc": "bn16-bk256-w4-s4"})

"""Token forcing through the family kernels (issue 35, item 0): the teacher-forced pass of a hybrid
(Gated DeltaNet) or Muse-Glimmer-style (sliding window ring + NoPE) target runs the Triton family
step the engine ran, so an honest engine's margins are exactly 0, under Triton's CPU interpreter.

The "engine" is the fast runner (row prefill, chain verify of scripted drafts + commit, decode
steps), long enough that the sliding-window ring wraps; the negative control is an engine whose
recurrent state goes stale (the commit's re-run switched off): its tokens are the argmax of wrong
logits, which the teacher-forced pass must flag.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = r'''
import random
from specpilot.engine.verify import accept_greedy
from specpilot.forcing import force
from specpilot.engine.backend import choose_backend
from specpilot.records import Record
from test_target_state import build, hybrid_config, muse_config

V, WIDTH, NEW = 96, 6, 16
# one layer of each kind (the family step's per-layer code is the same for every layer of a kind)
POW2 = dict(vocab_size=V, hidden_size=64, head_dim=16, num_hidden_layers=2)
cfgs = {"hybrid": hybrid_config(**POW2, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                                linear_value_head_dim=16),
        "muse": muse_config(**POW2, layer_types=["sliding_attention", "full_attention"], layer_rope=[True, False],
                            sliding_window=8)}
prompts = [[(5 * i + 3) % V for i in range(66)], [(7 * i + 1) % V for i in range(60)]]  # past window + 64: wraps


def engine(m, stale=False):
    """Scripted speculative decoding (chain verify + commit, and plain decode steps) of NEW tokens."""
    r = fast_runner(m, 2, 96)
    if stale:
        r.steps.fast.commit_recurrent = lambda counts: None
    last, _, _ = r.prefill(prompts)
    got = [[int(x)] for x in last.argmax(-1)]
    rng = random.Random(3)
    step = 0
    while min(len(g) for g in got) < NEW:
        step += 1
        if step % 3 == 0:  # a decode step now and then
            tok = r.decode(torch.tensor([g[-1] for g in got])).argmax(-1)
            for b in range(2):
                got[b].append(int(tok[b]))
            continue
        block = torch.tensor([[got[b][-1]] + [rng.randrange(V) for _ in range(WIDTH - 1)] for b in range(2)])
        logits, _ = r.verify(block)
        argm = logits.argmax(-1)
        k = [rng.randrange(WIDTH) for _ in range(2)]  # plant the target's own tokens up to a random depth
        for b in range(2):
            for j in range(1, k[b] + 1):
                block[b, j] = argm[b, j - 1]
        logits, _ = r.verify(block)
        acc, bonus = accept_greedy(block[:, 1:], logits)
        r.commit(acc + 1)
        for b in range(2):
            got[b] += [int(t) for t in block[b, 1:int(acc[b]) + 1]] + [int(bonus[b])]
    return [g[:NEW] for g in got], m.state.ring.R if m.state.ring is not None else 0


def rec(i, out):
    return Record(request_id=f"t/{i:04d}", benchmark="t", deployment="t", target="t", drafter="d", gpu="cpu",
                  engine="stock", concurrency=2, prompt_tokens=len(prompts[i]), new_tokens=len(out), prefill_s=0.0,
                  decode_s=0.0, verify_steps=len(out) - 1, committed_per_step=[1] * (len(out) - 1),
                  output_ids=list(out), engine_config={"block_size": WIDTH})


def verdict(m, outs):
    """specpilot force through the family step: a token passes only at margin exactly 0 (its
    logit is the top-1 logit) or below the tolerance 1e-4 (a near tie, counted)."""
    return force([rec(0, outs[0]), rec(1, outs[1])], {}, {f"t/{i:04d}": p for i, p in enumerate(prompts)},
                 choose_backend(m), 1e-4, teacher_forced_path="triton")


res = {}
for kind, cfg in cfgs.items():
    m = build(cfg)
    outs, R = engine(m)
    v = verdict(m, outs)
    res[kind] = {"ring_R": R, "passed": v["passed"], "violations": v["violations"], "near_ties": v["near_ties"],
                 "path": v["teacher_forced_path"]}
m = build(cfgs["hybrid"])
stale, _ = engine(m, stale=True)
v = verdict(m, stale)
res["hybrid_stale"] = {"passed": v["passed"], "violations": v["violations"]}
print("RESULT " + json.dumps(res))
'''


def test_family_teacher_forced_pass_through_the_family_step_interpreted(tmp_path):
    from triton_interp import run_interpreted

    res = run_interpreted(tmp_path / "check.py", CHECK, Path(__file__).resolve().parents[1])
    for kind in ("hybrid", "muse"):
        r = res[kind]
        # 0 violations and 0 near ties at tolerance 1e-4: every margin is exactly 0 (the engine's logits, bit for bit)
        assert r["passed"] and r["violations"] == 0 and r["near_ties"] == 0 and r["path"] == "triton", r
    assert res["muse"]["ring_R"] == 8 + 64 < 66 + 16  # window 8 + the default reserve 64: the ring wrapped
    # negative control: a stale recurrent state in the engine is caught (its tokens are not the target's)
    assert not res["hybrid_stale"]["passed"] and res["hybrid_stale"]["violations"] > 0, res


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the family step runs on CUDA")
@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-muse"])
def test_family_forcing_on_cuda_passes_an_honest_engine_and_fails_a_stale_one(shape):
    """On a GPU, bf16: stock (a random DFlash drafter) and AR served through the family step under
    CUDA graphs pass token forcing through the Triton teacher-forced path (auto picks it) with 0
    violations and 0 near ties; an engine whose recurrent state goes stale fails it (hybrid)."""
    import torch

    from specpilot.deployment import Deployment
    from specpilot.engine.config import EngineSpec
    from specpilot.engine.serve import ServeOptions, serve
    from specpilot.forcing import force
    from specpilot.models.random_checkpoint import build_drafter, build_target

    target = build_target(shape, device="cuda", dtype=torch.bfloat16, seed=3)
    drafter = build_drafter(shape, device="cuda", dtype=torch.bfloat16, seed=3, block_size=8)
    dep = Deployment.of(target, drafter)
    assert dep.backend.path == "triton-family"
    rows = [{"request_id": f"t/{i}", "benchmark": "t", "prompt_ids": list(range(3 + i, 90 + 7 * i))} for i in range(3)]
    meta = {"deployment": "t", "target": shape, "drafter": "dflash", "gpu": "test"}
    opts = ServeOptions(progress=False)
    ar = serve(EngineSpec("ar"), dep, rows, 96, 2, meta, opts)
    stock = serve(EngineSpec("stock", 8), dep, rows, 96, 2, meta, opts)
    prompts = {r["request_id"]: r["prompt_ids"] for r in rows}
    for cell in (ar, stock):
        v = force(cell, {"ar": ar}, prompts, dep.backend, 0.1)
        assert v["teacher_forced_path"] == "triton"
        assert v["passed"] and v["violations"] == 0 and v["near_ties"] == 0, v["violation_list"][:3]
    if shape == "tiny-hybrid":
        dep.backend.fast.commit_recurrent = lambda counts: None  # the engine forgets its accepted tokens
        stale = serve(EngineSpec("stock", 8), dep, rows, 96, 2, meta, opts)
        v = force(stale, {}, prompts, dep.backend, 0.1)
        assert not v["passed"] and v["violations"] > 0

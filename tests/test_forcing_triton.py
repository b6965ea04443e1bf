"""Token forcing through the engine's own kernels (the Triton step), as far as the CPU can test it.

The interpreted check runs a tiny target's Triton step under ``TRITON_INTERPRET=1`` in a
subprocess: an "engine" (the static AR regime of the fast path: ``TargetRunner.prefill`` row by row
through the Triton step, then one-token decode steps through
:class:`~specpilot.fastpath.dense.FastTarget`, as the CUDA-graph path replays them; a runner whose
step graphs run uncaptured) produces the outputs, and the teacher-forced pass through the same kernels
(:func:`specpilot.forcing.teacher_forced_engine`, wider chunks) must give margin exactly 0 at every
token, the engine's own margin (bit for bit) at a planted second-best token, and a violation at a
planted wrong token. The path choice and the prefill plan are tested without the interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpilot.engine.backend import choose_backend
from specpilot.errors import SpecpilotError
from specpilot.records import Record

REPO = Path(__file__).resolve().parents[1]

CHECK = r'''
from specpilot.engine.backend import choose_backend
from specpilot.engine.serve import kv_slots_needed
from specpilot.forcing import force, teacher_forced, teacher_forced_engine
from specpilot.models.config import TargetConfig
from specpilot.models.qwen3 import Transformer
from specpilot.models.random_checkpoint import fill_random_
from specpilot.records import Record

cfg = TargetConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
m = fill_random_(Transformer(cfg), 3).eval()
with torch.no_grad():  # logits of a few units, so margins are well above the fp32 tolerance
    m.lm_head.weight.mul_(50)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 128, (7,), generator=g).tolist(), torch.randint(0, 128, (5,), generator=g).tolist()]
n, B = 6, 2
S = max(kv_slots_needed(len(p), n, 1, True) for p in prompts)  # serve()'s cache size, static regime
res = {}
with torch.inference_mode():
    # the engine: static AR at c2 on the fast path = TargetRunner.prefill (row by row through the
    # Triton step) + decode steps through FastTarget (the step graphs, run uncaptured here)
    runner = fast_runner(m, B, S)
    res["prefill_path"] = runner.prefill_path
    last, _, lengths = runner.prefill(prompts)
    steps = [last.float().clone()]  # the logits each emitted token was the argmax of
    tok = last.argmax(-1)
    outs = [[t] for t in tok.tolist()]
    for _ in range(n - 1):
        logits = runner.decode(tok).float().clone()
        steps.append(logits)
        tok = logits.argmax(-1)
        for b, t in enumerate(tok.tolist()):
            outs[b].append(t)
cache_before = (m.cache, m.state, m.cos)
tf = teacher_forced_engine(choose_backend(m), prompts, outs)
res["top1_equal"] = [top == o for (top, _), o in zip(tf, outs)]
res["margins"] = [mg for _, mg in tf]
res["state_restored"] = m.cache is cache_before[0] and m.state is cache_before[1] and m.cos is cache_before[2]
# the same rows in other batches (one row alone, the rows swapped) and widths: the same margins
tf3 = teacher_forced_engine(choose_backend(m), prompts, outs, width=3)
tf_alone = teacher_forced_engine(choose_backend(m), prompts[1:], outs[1:], width=2)
tf_swapped = teacher_forced_engine(choose_backend(m), prompts[::-1], outs[::-1])
res["other_batches_margins"] = [mg for _, mg in tf3 + tf_alone + tf_swapped]

def rec(i, out):
    return Record(request_id=f"t/{i:04d}", benchmark="t", deployment="t", target="t", drafter="none", gpu="cpu",
                  engine="ar", concurrency=B, prompt_tokens=len(prompts[i]), new_tokens=len(out), prefill_s=0.0,
                  decode_s=0.0, verify_steps=len(out) - 1, committed_per_step=[1] * (len(out) - 1),
                  output_ids=list(out), engine_config={"block_size": 1})

prompt_map = {f"t/{i:04d}": p for i, p in enumerate(prompts)}
# planted: row 0's last token -> the engine's second-best there; row 1's token 2 -> its worst
lg0, lg1 = steps[n - 1][0], steps[2][1]
second = int(lg0.topk(2).indices[1])
worst = int(lg1.argmin())
res["engine_margin_second"] = (lg0.max() - lg0[second]).item()
res["engine_margin_worst"] = (lg1.max() - lg1[worst]).item()
p0, p1 = list(outs[0]), list(outs[1])
p0[-1], p1[2] = second, worst
v = force([rec(0, p0), rec(1, p1)], {}, prompt_map, m, 1e-3, teacher_forced_path="triton")
res["planted"] = {k: v[k] for k in ("passed", "violations", "near_ties", "teacher_forced_path")}
res["planted_list"] = [(x["request_id"], x["position"], x["margin"]) for x in v["violation_list"] if x["check"] == "token"]
res["planted_near"] = [(x["request_id"], x["position"], x["margin"]) for x in v["near_tie_list"]]
# the eager pass over the same planted tokens: other kernels, other low bits (reported only)
res["eager_margin_second"] = teacher_forced(m, prompts[0], p0)[1][-1]
print("RESULT " + json.dumps(res))
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_teacher_forced_through_the_engine_kernels_interpreted(tmp_path):
    """Margins exactly 0 on the fast path's own outputs; a planted token keeps the engine's exact
    margin and is a violation."""
    from triton_interp import run_interpreted  # imports triton: only where the test is not skipped

    res = run_interpreted(tmp_path / "tf_check.py", CHECK, REPO, timeout=600)
    assert res["top1_equal"] == [True, True], res
    assert all(mg == 0.0 for row in res["margins"] for mg in row), res["margins"]
    assert res["prefill_path"] == "triton"
    assert all(mg == 0.0 for row in res["other_batches_margins"] for mg in row), res["other_batches_margins"]
    assert res["state_restored"]
    assert res["planted"]["teacher_forced_path"] == "triton" and not res["planted"]["passed"], res
    flagged = {(rid, pos): mg for rid, pos, mg in res["planted_list"] + res["planted_near"]}
    # the planted tokens carry the engine's own margins, bit for bit (the same logits)
    assert flagged[("t/0000", 5)] == res["engine_margin_second"] > 0, res
    assert flagged[("t/0001", 2)] == res["engine_margin_worst"] > 1e-3, res
    assert ("t/0001", 2) in {(r, p) for r, p, _ in res["planted_list"]}, res  # a violation, not a near tie
    # everything before the planted tokens is the target's choice
    assert not any(rid == "t/0000" and pos < 5 or rid == "t/0001" and pos < 2 for rid, pos in flagged), res


def _rec(i: int, c: int, arrival: float | None, engine: str = "stock", cfg: dict | None = None) -> Record:
    return Record(request_id=f"random/{i:04d}", benchmark="random", deployment="d", target="t", drafter="x",
                  gpu="h200", engine=engine, concurrency=c, prompt_tokens=8, new_tokens=4, prefill_s=0.0,
                  decode_s=0.0, verify_steps=1, committed_per_step=[3], output_ids=[1, 2, 3, 4],
                  engine_config=cfg if cfg is not None else {"block_size": 16}, arrival_s=arrival)


def test_engine_prefill_batches_are_record_order_chunks():
    """Every prompt of a fast-path run is prefilled the same way (row by row through the Triton
    step) whatever the regime, concurrency or arrival: the batches are plain TF_BATCH chunks of the
    records with a prompt, in record order."""
    from specpilot.forcing import TF_BATCH, engine_prefill_batches

    prompt = lambda r: [5] * 8  # noqa: E731
    cont = [_rec(i, 4, 0.0 if i < 4 else 1.0 + i) for i in range(7)]
    static = [_rec(i, 3, None) for i in range(7)]
    for recs in (cont, static):
        plan = engine_prefill_batches(recs, prompt)
        assert [[r.request_id[-1] for r in b] for b in plan] == [list("0123456")]
    many = [_rec(i, 1, float(i)) for i in range(TF_BATCH + 3)] + [_rec(99, 16, None)]
    plan = engine_prefill_batches(many, prompt)
    assert [len(b) for b in plan] == [TF_BATCH, 4]
    assert [r.request_id for b in plan for r in b] == [r.request_id for r in many]
    odd = lambda r: None if r.request_id.endswith("1") else [5]  # noqa: E731
    assert [r.request_id[-1] for b in engine_prefill_batches(cont, odd) for r in b] == list("023456")
    assert engine_prefill_batches(static, lambda r: None) == []


def test_teacher_forced_path_choice():
    """The CPU target runs the eager pass; a Triton pass on the CPU needs the interpreter."""
    from specpilot.forcing import pick_teacher_forced_path
    from specpilot.models.config import TargetConfig
    from specpilot.models.qwen3 import Transformer

    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    m = Transformer(cfg)
    recs = [_rec(0, 1, 0.0)]
    assert pick_teacher_forced_path(choose_backend(m), recs) == "eager"
    assert pick_teacher_forced_path(choose_backend(m), recs, "eager") == "eager"
    with pytest.raises(SpecpilotError, match="unknown teacher-forced path"):
        pick_teacher_forced_path(choose_backend(m), recs, "cublas")
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(SpecpilotError, match="CUDA target"):
            pick_teacher_forced_path(choose_backend(m), recs, "triton")
    odd = Transformer(TargetConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=24))
    with pytest.raises(SpecpilotError, match="power-of-two head_dim"):
        pick_teacher_forced_path(choose_backend(odd), recs, "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's kernels run on CUDA")
def test_auto_path_on_cuda_follows_the_engine_config():
    from specpilot.forcing import pick_teacher_forced_path
    from specpilot.models.random_checkpoint import build_target

    m = build_target("tiny", dtype=torch.bfloat16).cuda()
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0)]) == "triton"
    # trees of up to 256 nodes run in the Triton step (ancestor bits up to 64 nodes, paths beyond)
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0, cfg={"block_size": 8, "tree_branch": 2})]) == "triton"
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0, cfg={"block_size": 12, "tree_lattice": 255})]) == "triton"
    wide = {"block_size": 16, "tree_branch": 3, "tree_depth": 16}
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0, cfg=wide)]) == "triton"
    # an engine that ran another path (its records say so) is checked eagerly
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0, cfg={"block_size": 8, "path": "eager"})]) == "eager"
    # w12 in the fast path: the 12-bit loader of the same kernels (the bf16 bits); w12_fast off: eager layers
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0, cfg={"block_size": 8, "weight_format": "w12"})]) == "triton"
    off = {"block_size": 8, "weight_format": "w12", "w12_fast": False}
    assert pick_teacher_forced_path(choose_backend(m), [_rec(0, 1, 0.0, cfg=off)]) == "eager"


def test_tree_width_bound_follows_the_verify_width():
    """The bound of a record config's tree width equals the engine's verify width."""
    from specpilot.fastpath.tables import TREE_FAST_NODES
    from specpilot.engine.config import EngineSpec
    from specpilot.engine.config import tree_width_of as _tree_width_bound

    assert _tree_width_bound({"block_size": 16}) == 0  # a chain
    for cfg in ({"block_size": 16, "tree_branch": 3, "tree_depth": 15}, {"block_size": 8, "tree_branch": 2},
                {"block_size": 12, "second_level": 6}, {"block_size": 16, "tree_branch": 3, "tree_depth": 16}):
        spec = EngineSpec("specpilot", cfg["block_size"], config=cfg)
        assert _tree_width_bound(cfg) == spec.verify_width
    assert _tree_width_bound({"block_size": 16, "tree_branch": 3, "tree_depth": 16}) == 65 <= TREE_FAST_NODES
    assert _tree_width_bound({"block_size": 12, "tree_lattice": 255}) == 256 == TREE_FAST_NODES
    assert _tree_width_bound({"block_size": 16, "tree_nodes": 300}) > TREE_FAST_NODES
    assert _tree_width_bound({"tree_branch": 2}) > TREE_FAST_NODES  # no block size: eager

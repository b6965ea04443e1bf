"""Continuous batching (engine.scheduler): outputs equal AR at every concurrency with slot refills,
ragged prompts and budgets, EOS; batch invariance; closed-loop times; throughput; the CLI path."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.aggregate import build_table, throughput
from specpilot.engine.proposers import make_proposer
from specpilot.drafters.lookup import LookupProposer
from specpilot.engine.loop import generate_ar
from specpilot.engine.runner import TargetRunner
from specpilot.engine.scheduler import Request, Scheduler, slots_needed
from specpilot.engine.config import EngineSpec
from specpilot.engine.serve import serve
from specpilot.errors import SpecpilotError
from specpilot.models.loading import load_drafter, load_target
from specpilot.records import read_records

CONCURRENCY = (1, 2, 3, 5)


@pytest.fixture(scope="module")
def pair(quick_deployment):
    return load_target(quick_deployment / "target"), load_drafter(quick_deployment / "drafter-dflash")


@pytest.fixture(scope="module")
def workload(pair, quick_prompts):
    """10 requests with ragged prompts (cut to different lengths) and budgets, an EOS id that
    stops some of them early, and each request's AR output decoded alone (batch 1)."""
    target, _ = pair
    reqs = []
    for i, p in enumerate(quick_prompts):
        ids = p["prompt_ids"][: 12 + 9 * i]  # ragged: 12 .. 93 tokens
        reqs.append(Request(ids, 6 + (11 * i) % 23))

    def alone(r, eos):
        runner = TargetRunner(target, 1, len(r.prompt_ids) + r.max_new_tokens + 2)
        return generate_ar(runner, [r.prompt_ids], r.max_new_tokens, eos_id=eos)[0].output_ids

    free = [alone(r, None) for r in reqs]
    # EOS: a token that some requests produce mid-way (not as their first token) and others never
    counts = {}
    for out in free:
        for t in set(out[1:-1]):
            counts[t] = counts.get(t, 0) + 1
    eos = min(counts, key=lambda t: (abs(counts[t] - len(reqs) // 3), t))
    ref = [alone(r, eos) for r in reqs]
    stopped = sum(len(o) < r.max_new_tokens for o, r in zip(ref, reqs))
    assert 0 < stopped < len(reqs), "the EOS id must stop some requests and not others"
    return reqs, eos, ref


def _proposer(kind, drafter, block=5):
    if kind == "lookup":
        return LookupProposer(3, block)
    if kind == "tree":
        return make_proposer(drafter, block, {"tree_branch": 2, "tree_depth": 2})
    return make_proposer(drafter, block)


def _run(target, proposer, reqs, c, eos):
    capture = proposer.capture if proposer is not None else ()
    width = proposer.verify_width if proposer is not None else 1
    runner = TargetRunner(target, c, slots_needed(reqs, width), capture)
    sched = Scheduler(runner, proposer, eos_id=eos)
    return sched, sched.run(reqs)


@pytest.mark.parametrize("kind", ["ar", "stock", "lookup", "tree"])
def test_outputs_equal_ar_at_every_concurrency(pair, workload, kind):
    target, drafter = pair
    reqs, eos, ref = workload
    per_c = {}
    for c in CONCURRENCY:
        sched, out = _run(target, None if kind == "ar" else _proposer(kind, drafter), reqs, c, eos)
        assert [r.output_ids for r in out] == ref, f"{kind} at c{c}"
        assert sched.prefill_steps >= (len(reqs) - c) // c + 1  # slots were refilled from the queue
        for r, q in zip(out, reqs):
            assert len(r.output_ids) <= q.max_new_tokens
            assert sum(r.committed_per_step) == len(r.output_ids) - 1
            if kind == "ar":
                assert set(r.committed_per_step) <= {1}
        per_c[c] = [r.committed_per_step for r in out]
    if kind == "lookup":
        # multi-token commits are exercised: prompt lookup accepts on the quick target's repetitive
        # text (the quick build's trained drafters may accept nothing on these prompts, depending on
        # the build's thread count: their runs still check equality with AR and per-slot acceptance)
        assert any(max(s, default=1) > 1 for s in per_c[1])
        # a request's acceptance does not depend on which requests shared its steps: each slot's
        # drafter state is its own (a leak would change acceptance while outputs stay equal)
        for c in CONCURRENCY[1:]:
            assert per_c[c] == per_c[1], f"{kind}: acceptance at c{c} differs from c1"


def test_tokens_do_not_depend_on_the_batch(pair, workload):
    target, drafter = pair
    reqs, eos, ref = workload
    order = list(reversed(range(len(reqs))))
    order = order[1::2] + order[::2]
    _, out = _run(target, _proposer("stock", drafter), [reqs[i] for i in order], 3, eos)
    _, base = _run(target, _proposer("stock", drafter), reqs, 3, eos)
    for k, i in enumerate(order):
        assert out[k].output_ids == ref[i] == base[i].output_ids
        assert out[k].committed_per_step == base[i].committed_per_step


def test_closed_loop_times(pair, workload):
    target, drafter = pair
    reqs, eos, _ = workload
    c = 3
    _, out = _run(target, _proposer("stock", drafter), reqs, c, eos)
    assert [r.arrival_s for r in out[:c]] == [0.0] * c
    finishes = sorted(r.finish_s for r in out)
    for r in out:
        assert 0.0 <= r.arrival_s <= r.first_token_s <= r.finish_s
        assert r.decode_s == pytest.approx(r.finish_s - r.first_token_s)
        assert r.prefill_s > 0 and r.first_token_s - r.arrival_s >= r.prefill_s - 1e-9
    for r in out[c:]:  # a queued request is issued when a slot frees: at some request's finish
        assert min(abs(r.arrival_s - f) for f in finishes) < 1e-9
    # never more than c requests in flight
    for t in sorted({r.arrival_s for r in out} | {r.first_token_s for r in out}):
        assert sum(1 for r in out if r.arrival_s <= t < r.finish_s) <= c


def test_serve_records_and_throughput_column(pair, quick_prompts):
    target, drafter = pair
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    prompts = quick_prompts[:7]
    recs = {e: serve(EngineSpec(e, 4), Deployment.of(target, drafter if e == "stock" else None), prompts, 12, 3, meta, ServeOptions(progress=False)) for e in ("ar", "stock")}
    static = serve(EngineSpec("ar"), Deployment.of(target, None), prompts, 12, 3, meta, ServeOptions(progress=False, regime="static"))
    assert [r.output_ids for r in recs["stock"]] == [r.output_ids for r in recs["ar"]] == \
        [r.output_ids for r in static]
    for r in recs["stock"]:
        assert r.concurrency == 3 and r.new_tokens == 12
        assert 0 <= r.arrival_s <= r.first_token_s <= r.finish_s
    table = build_table(recs["ar"] + recs["stock"])
    cell = table[(table["benchmark"] == "gsm8k")].iloc[0]
    cell_recs = [r for r in recs["stock"] if r.benchmark == "gsm8k"]
    wall = max(r.finish_s for r in cell_recs) - min(r.arrival_s for r in cell_recs)
    assert cell["stock_throughput"] == pytest.approx(sum(r.new_tokens for r in cell_recs) / wall)
    assert cell["ar_throughput"] == pytest.approx(throughput([r for r in recs["ar"] if r.benchmark == "gsm8k"]))
    assert cell["stock_throughput"] != cell["stock_tok_s"]  # system rate, not the per-request one
    assert math.isnan(throughput(static))  # static batches carry no times


def test_bad_inputs(pair):
    target, _ = pair
    runner = TargetRunner(target, 2, 16)
    sched = Scheduler(runner)
    with pytest.raises(SpecpilotError, match="needs 23 KV-cache slots"):
        sched.run([Request([1, 2, 3], 20)])
    with pytest.raises(SpecpilotError, match="empty prompt"):
        sched.run([Request([], 4)])
    with pytest.raises(SpecpilotError, match="object is not a specpilot.drafters.base.Proposer"):
        Scheduler(runner, object())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "specpilot.cli", *args], capture_output=True, text=True)


def test_cli_concurrency_3(quick_deployment, quick_prompts, tmp_path):
    """The workflow's path: ``specpilot run --concurrency 3`` serves 5 requests with refills."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in quick_prompts[:5]))
    t, d = str(quick_deployment / "target"), str(quick_deployment / "drafter-dflash")
    outs = {}
    for eng, c in (("ar", 1), ("stock", 3)):
        out = tmp_path / f"{eng}-c{c}.jsonl"
        res = _cli("run", "--engine", eng, "--target", t, "--drafter", d, "--prompts", str(prompts), "--out",
                   str(out), "--max-new-tokens", "10", "--block-size", "4", "--block-reason", "a short block keeps the test fast",
                   "--concurrency", str(c))
        assert res.returncode == 0, res.stderr
        outs[eng] = read_records(out)
    assert [r.output_ids for r in outs["stock"]] == [r.output_ids for r in outs["ar"]]
    st = outs["stock"]
    assert all(r.concurrency == 3 and r.finish_s >= r.first_token_s >= r.arrival_s for r in st)
    assert sum(r.arrival_s > 0 for r in st) == 2  # two requests waited for a slot


def test_plan_lengths_takes_the_global_best_prefix():
    from specpilot.drafters.verify_budget import plan_lengths

    surv = torch.tensor([[1.0, 0.9, 0.8, 0.1], [1.0, 0.2, 0.1, 0.05]])
    # admission order (0,1) (0,2) (1,1) (0,3) (1,2) (1,3); rates 2.0, 2.64, 3.08, 3.25, 1.33, ...
    assert plan_lengths(surv, {1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0}).tolist() == [3, 2]
    # a cheap widest step beats every earlier prefix (staircase costs: global argmax, not first dip)
    assert plan_lengths(surv, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.25}).tolist() == [4, 4]
    # a large fixed overhead favours verifying everything; a costly width 2+ favours plain decode
    assert plan_lengths(surv, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, overhead_s=100.0).tolist() == [4, 4]
    assert plan_lengths(surv, {1: 1.0, 2: 9.0, 3: 9.0, 4: 9.0}).tolist() == [1, 1]
    with pytest.raises(SpecpilotError, match="width 1"):
        plan_lengths(surv, {2: 1.0})


def test_load_aware_verify_length_keeps_outputs(pair, quick_prompts):
    from specpilot.agent.directions import REGISTRY

    target, drafter = pair
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    prompts = quick_prompts[:5]
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), prompts, 12, 3, meta, ServeOptions(progress=False))
    la = serve(EngineSpec("specpilot", 6, {"verify_budget": "load_aware"}), Deployment.of(target, drafter), prompts, 12, 3, meta, ServeOptions(progress=False))
    assert [r.output_ids for r in la] == [r.output_ids for r in ar]
    assert all(max(r.committed_per_step) <= 6 for r in la)
    d = REGISTRY["verify_budget"]
    assert d.apply({}, {"verify_budget": "off"}) == {} and d.cost_term == "verify"
    assert d.applies({"drafter": "dflash", "concurrency": 16}) and not d.applies({"drafter": "dflash"})
    with pytest.raises(SpecpilotError, match="verify_budget"):
        serve(EngineSpec("specpilot", 6, {"verify_budget": "wide"}), Deployment.of(target, drafter), prompts, 4, 3, meta, ServeOptions(progress=False))


def test_cost_model_batched_terms():
    from specpilot.agent.costmodel import analyze, idle_fraction
    from specpilot.models.config import TargetConfig
    from specpilot.records import Record

    cfg = TargetConfig(vocab_size=1000, hidden_size=100, intermediate_size=300, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=25)
    ceil = {"memory_bandwidth_bytes_per_s": 1e9, "matmul_flop_per_s": 1e12}

    def rec(i, arrival, finish, stall):  # 10 steps of tau 4: draft 1 ms, verify 2 ms, decode 4 ms + stall
        return Record(request_id=f"x/{i:04d}", benchmark="x", deployment="d", target="t", drafter="dflash",
                      gpu="cpu", engine="stock", concurrency=2, prompt_tokens=50, new_tokens=41, prefill_s=0.0,
                      decode_s=0.040 + stall, verify_steps=10, committed_per_step=[4] * 10, output_ids=[0] * 41,
                      draft_s=0.010, verify_s=0.020, arrival_s=arrival, first_token_s=arrival, finish_s=finish,
                      prefill_stall_s=stall)

    # two slots over 1 s: slot A busy 0..1, slot B busy 0..0.25 and 0.5..1 -> idle 0.25 of 2 slot-seconds
    recs = [rec(0, 0.0, 1.0, 0.010), rec(1, 0.0, 0.25, 0.0), rec(2, 0.5, 1.0, 0.0)]
    assert idle_fraction(recs) == pytest.approx(0.125)
    a = analyze(recs, cfg, None, ceil, 4, block_size=8)
    terms = {t["term"]: t for t in a["terms"]}
    assert terms["prefill_stall"]["gap_s_per_token"] == pytest.approx(0.001 / 3 / 4)  # mean stall per step / tau
    assert terms["host"]["gap_s_per_token"] == pytest.approx(0.001 / 4)  # the stall is not host time
    assert terms["idle_slots"]["gap_s_per_token"] == pytest.approx(0.125 * 0.004 / 4)
    assert a["verify_rows"] == 16


def test_chunked_prefill_keeps_outputs(pair, workload):
    target, drafter = pair
    reqs, eos, ref = workload
    prop = _proposer("stock", drafter)
    need = slots_needed(reqs, prop.verify_width)
    assert need == max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) - 1 + prop.verify_width
    sched = Scheduler(TargetRunner(target, 3, need, prop.capture), prop, eos_id=eos, prefill_chunk=8)
    out = sched.run(reqs)
    assert [r.output_ids for r in out] == ref
    assert sched.prefill_steps > len(reqs) // 3 + 1  # long prompts took several chunks
    # the tightest cache: blocks cut to the room the fullest row has left, outputs unchanged
    prop = _proposer("lookup", drafter)
    sched = Scheduler(TargetRunner(target, 3, slots_needed(reqs, prop.verify_width)), prop, eos_id=eos)
    assert [r.output_ids for r in sched.run(reqs)] == ref


@pytest.mark.parametrize("regime", ["continuous", "static"])
def test_overlap_scheduling_keeps_outputs_and_acceptance(pair, workload, regime):
    """Overlap scheduling (engine.overlap: the next draft and the commit launched before the host
    reads the acceptance) gives AR's tokens and the same acceptance as the plain loop, with slot
    refills (a refilled slot's anchor is its new first token, not the stale bonus), ragged budgets
    and EOS. The replay drafter without a network overlaps on the CPU too."""
    from specpilot.engine.loop import generate
    from specpilot.drafters.replay import ReplayProposer, load_profile

    target, _ = pair
    reqs, eos, ref = workload
    prof = load_profile("study_stock")
    reqs = [Request(r.prompt_ids, r.max_new_tokens, ref[i]) for i, r in enumerate(reqs)]

    def replay(refs):
        return ReplayProposer(refs, prof, target.config.vocab_size, None, seed=3, block_size=6,
                              row_keys=[str(i) for i in range(len(refs))] if regime == "static" else None)

    for c in (1, 3):
        got = {}
        for overlap in (False, True):
            if regime == "continuous":
                runner = TargetRunner(target, c, slots_needed(reqs, 6, c > 1), ())
                sched = Scheduler(runner, replay([r.reference for r in reqs[:c]]), eos_id=eos, overlap=overlap)
                out = sched.run(reqs)
                assert sched.overlapped == overlap
                got[overlap] = [(r.output_ids, r.committed_per_step) for r in out]
            else:
                batch = reqs[:c]
                runner = TargetRunner(target, c, slots_needed(batch, 6, c > 1), ())
                rows = generate(runner, replay([r.reference for r in batch]), [r.prompt_ids for r in batch],
                                max(r.max_new_tokens for r in batch), eos_id=eos, overlap=overlap)
                got[overlap] = [(r.output_ids, r.committed_per_step) for r in rows]
        n = len(got[True])
        want = ref[:n] if regime == "continuous" else None
        if want is not None:
            assert [o for o, _ in got[True]] == want, f"overlap c{c}: outputs differ from AR"
        assert got[True] == got[False], f"{regime} c{c}: overlap changed outputs or acceptance"
        assert any(max(s, default=1) > 1 for _, s in got[True])  # multi-token commits happened


class _CountingNetwork:
    """A drafter network stand-in for the replay drafter that overlaps and counts its drafts."""

    kind, capture, block_size, verify_width = "count", (), 6, 6

    def __init__(self):
        self.drafts = 0

    def can_overlap(self):
        return True

    def start(self, *args):
        pass

    def propose(self, last, start):
        self.drafts += 1

    def draft_async(self, last, start):
        self.drafts += 1

    def observe(self, *args):
        pass

    def observe_device(self, *args):
        pass

    def reset_slot(self, *args, **kwargs):
        pass


def test_overlap_drafts_once_per_step(pair, workload):
    """Overlap launches each step's draft once, ahead (one more than the steps in all: the last
    step's look-ahead), not an extra draft per step."""
    from specpilot.drafters.replay import ReplayProposer, load_profile

    target, _ = pair
    reqs, eos, ref = workload
    reqs = [Request(r.prompt_ids, r.max_new_tokens, ref[i]) for i, r in enumerate(reqs)]
    counts = {}
    for overlap in (False, True):
        net = _CountingNetwork()
        rp = ReplayProposer([r.reference for r in reqs[:3]], load_profile("study_stock"), target.config.vocab_size,
                            net, seed=3, block_size=6)
        sched = Scheduler(TargetRunner(target, 3, slots_needed(reqs, 6, True), ()), rp, eos_id=eos, overlap=overlap)
        out = sched.run(reqs)
        assert [r.output_ids for r in out] == ref and sched.overlapped == overlap
        counts[overlap] = (net.drafts, sched.steps)
    assert counts[False][0] == counts[False][1]
    assert counts[True] == (counts[True][1] + 1, counts[False][1])

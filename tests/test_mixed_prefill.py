"""The mixed prefill step (engine.mixed, models.ragged): decode rows and newcomers' prompt chunks
in one ragged forward of a token budget. Outputs equal AR at c4 with prefills arriving mid-decode,
the records show chunks sharing decode steps and token forcing passes on them, the running
requests' prefill stall drops against the same run without it, and every path that cannot run it
refuses it by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specpilot.agent.directions import REGISTRY, plan_directions
from specpilot.cli import main
from specpilot.deployment import Deployment
from specpilot.engine.backend import choose_backend
from specpilot.engine.config import EngineConfig, EngineSpec
from specpilot.engine.loop import generate_ar
from specpilot.engine.proposers import make_proposer
from specpilot.engine.runner import TargetRunner
from specpilot.engine.scheduler import Request, Scheduler, slots_needed
from specpilot.engine.serve import ServeOptions, serve
from specpilot.errors import SpecpilotError
from specpilot.io import write_jsonl
from specpilot.models.loading import load_drafter, load_target
from specpilot.records import write_records

META = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}


@pytest.fixture(scope="module")
def pair(quick_deployment):
    return load_target(quick_deployment / "target"), load_drafter(quick_deployment / "drafter-dflash")


@pytest.fixture(scope="module")
def workload(pair, quick_prompts):
    """8 requests with ragged prompts (12 .. 75 tokens) and budgets, each one's AR output decoded
    alone, and an EOS id some of those outputs hold mid-way with the AR outputs it cuts."""
    target, _ = pair
    reqs = [Request(p["prompt_ids"][: 12 + 9 * i], 5 + (7 * i) % 13) for i, p in enumerate(quick_prompts[:8])]

    def alone(r, eos=None):
        runner = TargetRunner(target, 1, len(r.prompt_ids) + r.max_new_tokens + 2)
        return generate_ar(runner, [r.prompt_ids], r.max_new_tokens, eos_id=eos)[0].output_ids

    ref = [alone(r) for r in reqs]
    mid = {t for o in ref for t in o[1:-1]}
    eos = min(mid, key=lambda t: (abs(sum(t in o[1:-1] for o in ref) - 3), t))
    return reqs, ref, eos, [alone(r, eos) for r in reqs]


@pytest.mark.parametrize("kind", ["ar", "stock", "tree", "stock-eos"])
def test_mixed_step_outputs_equal_ar_at_c4(pair, workload, kind):
    """8 requests through 4 slots: every refill's prompt rides in chunks of a 16-token room in the
    running rows' decode steps (several chunks per prompt), and every output equals AR's (with an
    EOS id too: requests end mid-budget and free their slots at other steps)."""
    target, drafter = pair
    reqs, ref, eos, ref_eos = workload
    if kind == "stock-eos":
        ref = ref_eos
    assert kind != "stock-eos" or any(len(o) < r.max_new_tokens for o, r in zip(ref, reqs))
    prop = None if kind == "ar" else make_proposer(drafter, 4, {"tree_branch": 2, "tree_depth": 2} if kind == "tree" else {})
    width = prop.verify_width if prop is not None else 1
    runner = TargetRunner(target, 4, slots_needed(reqs, width), prop.capture if prop is not None else ())
    sched = Scheduler(runner, prop, mixed_prefill=4 * width + 16, eos_id=eos if kind == "stock-eos" else None)
    out = sched.run(reqs)
    assert [o.output_ids for o in out] == ref
    assert sched.prefill_steps == 1 or sched.prefill_steps < sched.mixed_steps  # refills ride in decode steps
    assert sched.mixed_steps >= 4 + 1  # 4 refills, the longer prompts in several chunks
    assert all(o.mixed_steps is not None for o in out) and sum(o.mixed_steps for o in out) >= sched.mixed_steps
    assert all(o.prefill_s >= 0 and o.first_token_s > o.arrival_s for o in out[4:])


def test_mixed_records_pass_token_forcing(pair, quick_prompts, quick_deployment, tmp_path):
    """Records of stock at c4 over 6 prompts with ``mixed_prefill`` (``specpilot run``'s path):
    AR's tokens, records that show decode steps which carried newcomers' chunks, and token forcing
    (teacher-forced pass and spot re-execution, which serves the records' engine config again)
    passes on them."""
    target, drafter = pair
    rows = quick_prompts[:6]
    opts = ServeOptions(progress=False, warmup=False)
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), rows, 10, 4, META, opts)
    assert all(r.mixed_steps is None for r in ar)
    mixed = serve(EngineSpec("stock", 4, {"mixed_prefill": 64}), Deployment.of(target, drafter), rows, 10, 4, META, opts)
    assert [r.output_ids for r in mixed] == [r.output_ids for r in ar]
    assert sum(r.mixed_steps for r in mixed) > 0 and mixed[0].engine_config["mixed_prefill"] == 64
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, rows)
    write_records(tmp_path / "ar.jsonl", ar)
    write_records(tmp_path / "mixed.jsonl", mixed)
    out = tmp_path / "v.json"
    main(["force", "--candidate", str(tmp_path / "mixed.jsonl"), "--reference", str(tmp_path / "ar.jsonl"),
          "--target", str(quick_deployment / "target"), "--drafter", str(quick_deployment / "drafter-dflash"),
          "--prompts", str(prompts), "--tolerance", "0.001", "--max-new-tokens", "10", "--out", str(out)])
    v = json.loads(out.read_text())
    assert v["passed"], v


def test_mixed_step_cuts_the_prefill_stall(pair, workload):
    """The same 8 requests at c4 with and without the mixed step: without it every refill stops the
    running requests for a prefill step over every row (a block as wide as the prompt); with it the
    running requests wait only for what the chunks add to a step they run anyway, so their summed
    prefill stall drops (the cost model's prefill_stall term), and the outputs stay AR's. Timed
    three times each, interleaved, the least kept (a loaded machine's preemptions only add)."""
    target, _ = pair
    reqs, ref = workload[:2]
    stall = {0: [], 68: []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            for budget in stall:
                runner = TargetRunner(target, 4, slots_needed(reqs, 1))
                sched = Scheduler(runner, mixed_prefill=budget)
                out = sched.run(reqs)
                assert [o.output_ids for o in out] == ref
                assert (sched.mixed_steps > 0) == (budget > 0)
                stall[budget].append(sum(o.prefill_stall_s for o in out))
    finally:
        torch.set_num_threads(threads)
    assert min(stall[68]) < min(stall[0]) and min(stall[0]) > 0, stall


def test_mixed_prefill_refused_where_it_cannot_run(pair, workload):
    """One clear error naming the setting (and the path) wherever the mixed step cannot run."""
    target, drafter = pair
    reqs = workload[0]
    for bad in (-1, "256", 1.5, True):
        with pytest.raises(SpecpilotError, match="mixed_prefill"):
            EngineConfig.parse({"mixed_prefill": bad})
    need = slots_needed(reqs, 1)
    fast = dataclasses.replace(choose_backend(target), path="triton-dense", reason="the Triton step")  # as a GPU reports it
    with pytest.raises(SpecpilotError, match=r"mixed_prefill: the triton-dense path .*needs the eager path"):
        Scheduler(TargetRunner(target, 2, need, backend=fast), mixed_prefill=64)
    with pytest.raises(SpecpilotError, match="mixed_prefill: the fused CPU step .*verify_path: plain"):
        Scheduler(TargetRunner(target, 2, need, fused=True), mixed_prefill=64)
    runner = TargetRunner(target, 4, need)
    with pytest.raises(SpecpilotError, match=r"mixed_prefill = 4 .*4 x 1 .*= 4"):
        Scheduler(runner, mixed_prefill=4)
    for kw in ({"prefill_chunk": 8}, {"overlap": True}, {"prefill_beside": True}):
        with pytest.raises(SpecpilotError, match=f"mixed_prefill cannot be combined with {next(iter(kw))}"):
            Scheduler(runner, mixed_prefill=64, **kw)
    with pytest.raises(SpecpilotError, match="mixed_prefill = 64 needs the continuous regime"):
        serve(EngineSpec("ar", 1, {"mixed_prefill": 64}), Deployment.of(target, None),
              [{"request_id": "a", "benchmark": "b", "prompt_ids": reqs[0].prompt_ids}], 4, 2, META,
              ServeOptions(progress=False, regime="static"))


def test_ragged_forward_refuses_stateful_layers(pair):
    """A target with sliding-window or linear-attention layers refuses the ragged forward."""
    from specpilot.models.ragged import Segment, forward_ragged
    target, _ = pair
    runner = TargetRunner(target, 2, 32)
    cfg = target.config
    saved = cfg.layer_types
    try:
        cfg.layer_types = ["linear_attention"] + list(saved[1:])
        assert "full-attention targets only" in runner.mix_refusal()
        seg = Segment(0, torch.tensor([1, 2]), 0, torch.ones(2, 2, dtype=torch.bool).tril())
        with pytest.raises(SpecpilotError, match="full-attention layers only"):
            forward_ragged(target, [seg])
    finally:
        cfg.layer_types = saved


def test_mixed_prefill_direction_ranked_by_prefill_stall():
    """The batched regime's direction for the prefill_stall term: planned when that gap leads,
    applies only where the mixed step runs (batched, the CPU's eager path), switches off the
    fused verify step and overlap it cannot combine with."""
    d = REGISTRY["mixed_prefill"]
    assert d.cost_term == "prefill_stall"
    ctx = {"gpu": "cpu", "concurrency": 4, "drafter": "dflash", "dense": True}
    assert plan_directions(ctx, {"prefill_stall": 2e-3, "verify": 1e-3}, {}, 1) == ["mixed_prefill"]
    assert not d.applies({**ctx, "concurrency": 1}) and not d.applies({**ctx, "gpu": "h100"})
    assert d.apply({"verify_path": "fused", "block_size": 8}, {"mixed_prefill": 256}) == \
        {"block_size": 8, "mixed_prefill": 256}
    assert d.apply({"mixed_prefill": 256}, {"mixed_prefill": 0}) == {}


def test_ragged_forward_matches_the_uniform_block(pair):
    """verify_mixed's decode rows (a tree) and a prompt chunk give the logits and KV-cache entries
    the uniform-block verify gives the same rows (fp32, to rounding)."""
    target, _ = pair
    prompts = [list(range(5, 30)), list(range(40, 52)), list(range(60, 97)), list(range(100, 118))]
    block = torch.tensor([[7, 8, 9, 10, 11]] * 4)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 4)
    runner = TargetRunner(target, 4, 64)

    def fresh():
        runner.prefill(prompts)

    fresh()
    want, _ = runner.verify(block, parents)
    k_want = runner.model.state.kv.k.clone()
    fresh()
    got, _, _ = runner.verify_mixed(block, [0, 1, 2, 3], [], parents)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(runner.model.state.kv.k, k_want, atol=1e-6)
    chunk = list(range(200, 213))
    fresh()
    uniform, _ = runner.verify(torch.tensor([chunk] * 4))
    fresh()
    _, _, pieces = runner.verify_mixed(block, [0, 1, 2], [(3, chunk)], parents)
    assert pieces[0][0].shape == (13, target.config.vocab_size)
    assert torch.allclose(pieces[0][0], uniform[3], atol=1e-5)

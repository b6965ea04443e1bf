"""Token forcing: the teacher-forced check of every token, record structure, spot re-execution,
the reference report, the verdict in the table, and five planted cheats, each caught with evidence.

All on the quick deployment (CPU, seconds): the two gsm8k prompts, 32 new tokens, block size 6.
Only :func:`specpilot.forcing.check` (whose signature predates this check) is imported at module
level, so the near-tie test can be run against an older ``specpilot.forcing`` to show it catches what
that one missed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.engine.verify import ACCEPT_RULES, accept_greedy
from specpilot.engine.runner import TargetRunner
from specpilot.engine.config import EngineSpec
from specpilot.engine.serve import serve
from specpilot.forcing import check
from specpilot.models.loading import load_drafter, load_target
from specpilot.records import Record, read_records, write_records

N, BLOCK = 32, 6
META = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}


@pytest.fixture(scope="module")
def cell(quick_deployment, quick_prompts, tmp_path_factory):
    """An AR and an honest stock cell of the quick deployment, written in the workflow's layout."""
    rows = [p for p in quick_prompts if p["benchmark"] == "gsm8k"]
    assert len(rows) == 2
    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), rows, N, 1, META, ServeOptions(progress=False, warmup=False))
    stock = serve(EngineSpec("stock", BLOCK), Deployment.of(target, drafter), rows, N, 1, META, ServeOptions(progress=False, warmup=False))
    assert [a.output_ids for a in ar] == [s.output_ids for s in stock]
    root = tmp_path_factory.mktemp("forcing")
    d = root / "results" / "cpu" / "quick" / "gsm8k"
    d.mkdir(parents=True)
    write_records(d / "ar-c1.jsonl", ar)
    prompt_file = root / "gsm8k.jsonl"
    prompt_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SimpleNamespace(rows=rows, target=target, drafter=drafter, ar=ar, stock=stock, dir=d,
                           prompt_file=prompt_file, deployment=quick_deployment,
                           prompts={r["request_id"]: r["prompt_ids"] for r in rows})


def reexecution_for(cell):
    from specpilot.forcing import REEXECUTION_TOKENS, Reexecution, serve_reexecution

    return Reexecution(serve_reexecution(lambda config: Deployment.of(cell.target, cell.drafter), META), REEXECUTION_TOKENS, N)


def force_cli(cell, candidate: list[Record], *extra: str) -> tuple[dict, int]:
    """`specpilot force` as the workflow runs it; returns (verdict, exit status)."""
    from specpilot.cli import main

    write_records(cell.dir / "stock-c1.jsonl", candidate)
    out = cell.dir / "stock-c1.forcing.json"
    rc = main(["force", "--candidate", str(cell.dir / "stock-c1.jsonl"), "--reference", str(cell.dir / "ar-c1.jsonl"),
               "--target", str(cell.deployment / "target"), "--prompts", str(cell.prompt_file), "--tolerance", "0.001",
               "--drafter", str(cell.deployment / "drafter-dflash"), "--max-new-tokens", str(N), "--out", str(out),
               *extra])
    return json.loads(out.read_text()), rc


def table_row(cell, candidate: list[Record], verdict: dict | None = None):
    """The study table's row for the cell, built from the records and the verdict file on disk."""
    from specpilot.aggregate import build_table, read_forcing
    from specpilot.io import write_json

    write_records(cell.dir / "stock-c1.jsonl", candidate)
    vpath = cell.dir / "stock-c1.forcing.json"
    if verdict is not None:
        write_json(vpath, verdict)
    recs = read_records(cell.dir / "ar-c1.jsonl") + read_records(cell.dir / "stock-c1.jsonl")
    df = build_table(recs, read_forcing([vpath]))
    return df[(df.benchmark == "gsm8k") & (df.deployment == "quick")].iloc[0]


def assert_table_fails(row):
    assert row.stock_forcing == "FAIL" and row.forcing == "FAIL"
    assert math.isnan(row.stock_speedup) and math.isnan(row.stock_tau) and math.isnan(row.stock_speedup_arith)
    assert "speedup withheld" in row.note


def by_check(verdict, name):
    return [v for v in verdict["violation_list"] if v["check"] == name]


# ---------------------------------------------------------------------------------------------
# the honest cell passes, fully covered


def test_honest_cell_passes_with_full_coverage(cell):
    verdict, rc = force_cli(cell, cell.stock)
    assert rc == 0 and verdict["passed"], verdict["violation_list"]
    assert verdict["violations"] == 0 and verdict["tokens_generated"] == verdict["tokens_checked"] == 2 * N
    assert verdict["coverage"] == 1.0
    assert all(p["tokens_checked"] == p["tokens_generated"] == N for p in verdict["per_request"])
    assert verdict["replay"]["requests"] == verdict["replay"]["reproduced"] == 2
    assert verdict["replay"]["steps_compared"] >= 2
    ref = verdict["references"][str(cell.dir / "ar-c1.jsonl")]
    assert ref["exact_match_rate"] == 1.0 and ref["divergences"] == [] and ref["missing"] == ref["extra"] == []
    assert verdict["tolerance"] == 0.001 and verdict["dtype"] == "float32"
    row = table_row(cell, cell.stock)
    assert row.stock_forcing == "pass" and row.stock_speedup > 0
    # records that ran another engine config than the one the cell was given
    other = cell.dir / "engine.json"
    other.write_text(json.dumps({"engine_config": {"block_size": BLOCK + 1, "weight_format": "w12"}}))
    verdict, rc = force_cli(cell, cell.stock, "--engine-config", str(other), "--replay-tokens", "0")
    assert rc == 1 and verdict["violations_by_check"] == {"engine_config": 2}
    assert verdict["violation_list"][0]["expected"] == {"block_size": BLOCK + 1}
    assert verdict["replay"]["skipped"] == ["not run"]


def test_one_job_forces_stock_then_specpilot_against_ar_and_stock(cell):
    """The workflow's forcing job: ``--candidate stock,specpilot`` checks each candidate as its own
    run would, specpilot against ar and against stock (the candidate before it), and writes one
    verdict per candidate; a specpilot that dropped a request fails there, stock still passes."""
    from specpilot.cli import main

    spec = serve(EngineSpec("specpilot", BLOCK, {"tree_branch": 2, "tree_depth": 2}), Deployment.of(cell.target, cell.drafter), cell.rows, N, 1, META, ServeOptions(progress=False, warmup=False))
    d = cell.dir
    write_records(d / "stock-c1.jsonl", cell.stock)
    base = ["--reference", str(d / "ar-c1.jsonl"), "--target", str(cell.deployment / "target"),
            "--prompts", str(cell.prompt_file), "--tolerance", "0.001", "--drafter", str(cell.deployment / "drafter-dflash"),
            "--max-new-tokens", str(N), "--report-only"]
    outs = [d / "stock-c1.forcing.json", d / "specpilot-c1.forcing.json"]

    def run(specpilot_records):
        write_records(d / "specpilot-c1.jsonl", specpilot_records)
        assert main(["force", "--candidate", f"{d / 'stock-c1.jsonl'},{d / 'specpilot-c1.jsonl'}",
                     "--out", ",".join(map(str, outs)), *base]) == 0
        return [json.loads(o.read_text()) for o in outs]

    stock_v, spec_v = run(spec)
    assert stock_v["passed"] and spec_v["passed"], (stock_v["violation_list"], spec_v["violation_list"])
    assert set(stock_v["references"]) == {str(d / "ar-c1.jsonl")}
    assert set(spec_v["references"]) == {str(d / "ar-c1.jsonl"), str(d / "stock-c1.jsonl")}
    assert spec_v["tokens_checked"] == stock_v["tokens_checked"] == 2 * N
    assert spec_v["replay"]["reproduced"] == 2
    stock_v, spec_v = run(spec[:1])
    assert stock_v["passed"] and not spec_v["passed"]
    assert {v["check"] for v in spec_v["violation_list"]} == {"missing_request"}
    assert len(by_check(spec_v, "missing_request")) == 2  # against ar and against stock
    assert main(["force", "--candidate", str(d / "stock-c1.jsonl"), "--out", ",".join(map(str, outs)), *base]) == 2


def test_chunked_teacher_forcing_equals_one_forward(cell):
    from specpilot.forcing import teacher_forced

    a = cell.ar[0]
    cache = cell.target.cache
    top_a, m_a = teacher_forced(cell.target, cell.prompts[a.request_id], a.output_ids, chunk=4096)
    top_b, m_b = teacher_forced(cell.target, cell.prompts[a.request_id], a.output_ids, chunk=7)
    assert cell.target.cache is cache  # the engine's cache is put back
    assert top_a == top_b == a.output_ids  # AR's tokens are the target's argmax everywhere
    assert m_a == m_b == [0.0] * N
    # a changed token gets its real margin: the target's own top-1 minus its logit
    flipped = a.output_ids[:5] + [(a.output_ids[5] + 1) % 512] + a.output_ids[6:]
    top_c, m_c = teacher_forced(cell.target, cell.prompts[a.request_id], flipped, chunk=3)
    with torch.inference_mode():
        logits, _ = cell.target.forward_causal(torch.tensor([cell.prompts[a.request_id] + flipped]))
    lg = logits[0, len(cell.prompts[a.request_id]) - 1 + 5]
    assert top_c[5] == int(lg.argmax()) and m_c[5] == pytest.approx(float(lg.max() - lg[flipped[5]]), abs=1e-4)
    assert m_c[5] > 0


# ---------------------------------------------------------------------------------------------
# (a) one unverified draft token accepted per step


def one_unverified(drafts, logits):
    """Cheat: accepts the first rejected draft token too, unverified."""
    acc, bonus = accept_greedy(drafts, logits)
    cheat = (acc < drafts.shape[1]).long()
    acc2 = acc + cheat
    bonus2 = torch.where(cheat.bool(), logits.argmax(-1).gather(1, acc2[:, None])[:, 0], bonus)
    return acc2, bonus2


def test_cheat_a_unverified_draft_tokens(cell, monkeypatch):
    from specpilot.forcing import force

    monkeypatch.setitem(ACCEPT_RULES, "one_unverified", one_unverified)
    cand = serve(EngineSpec("stock", BLOCK, {"accept": "one_unverified"}), Deployment.of(cell.target, cell.drafter), cell.rows, N, 1, META, ServeOptions(progress=False, warmup=False))
    verdict = force(cand, {"ar": cell.ar}, cell.prompts, cell.target, 1e-3, reexecution_for(cell))
    assert not verdict["passed"]
    tokens = by_check(verdict, "token")
    # every unverified token is caught, not only the first per request: each cheat step adds one
    assert set(verdict["violations_by_check"]) == {"token"} and len(tokens) > len(cand)
    for v in tokens:
        assert v["candidate_token"] != v["top1"] and v["margin"] >= 1e-3
        rec = next(r for r in cand if r.request_id == v["request_id"])
        assert rec.output_ids[v["position"]] == v["candidate_token"]
    assert verdict["coverage"] == 1.0 and verdict["tokens_checked"] == 2 * N
    assert verdict["replay"]["reproduced"] == 2  # the rule is registered: the records are the engine's own
    assert_table_fails(table_row(cell, cand, verdict))


# ---------------------------------------------------------------------------------------------
# (b) a genuine near-tie flipped early, garbage after it


def test_cheat_b_near_tie_then_garbage(cell):
    # the smallest top-2 margin of the target at the early positions 1..7 (a cache-free forward)
    best = None
    for i, a in enumerate(cell.ar):
        prompt = cell.prompts[a.request_id]
        with torch.inference_mode():
            logits, _ = cell.target.forward_causal(torch.tensor([prompt + a.output_ids]))
        top = logits[0, len(prompt) - 1: len(prompt) - 1 + N].topk(2, -1)
        for p in range(1, 8):
            m = float(top.values[p, 0] - top.values[p, 1])
            assert int(top.indices[p, 0]) == a.output_ids[p]
            if best is None or m < best[0]:
                best = (m, i, p, int(top.indices[p, 1]))
    margin, i, p, second = best
    tol = 2 * margin
    a = cell.ar[i]
    prompt = cell.prompts[a.request_id]
    garbage = a.output_ids[:p] + [second] + [0] * (N - p - 1)
    # garbage that is clearly wrong at every later position, whatever the build: left to right, the
    # token the target scores lowest given the garbage so far (the context the check sees there)
    for j in range(p + 1, N):
        with torch.inference_mode():
            logits, _ = cell.target.forward_causal(torch.tensor([prompt + garbage[:j]]))
        garbage[j] = int(logits[0, -1].argmin())
    cand = [dataclasses.replace(s, output_ids=garbage if k == i else list(s.output_ids))
            for k, s in enumerate(cell.stock)]

    verdict = check(cand, cell.ar, cell.prompts, cell.target, tolerance=tol)
    assert not verdict["passed"] and verdict["violations"] > 0
    # the flip itself is a near-tie, with its margin reported ...
    ties = [t for t in verdict["near_tie_list"] if t["request_id"] == a.request_id]
    assert [t["position"] for t in ties] == [p] and ties[0]["margin"] == pytest.approx(margin, abs=1e-4)
    assert verdict["near_ties"] == 1 and verdict["max_near_tie_margin"] == pytest.approx(margin, abs=1e-4)
    # ... and every garbage token after it is checked and caught
    tokens = by_check(verdict, "token")
    assert {v["request_id"] for v in tokens} == {a.request_id}
    assert all(v["position"] > p for v in tokens) and len(tokens) >= (N - p - 1) // 2
    assert verdict["tokens_checked"] == verdict["tokens_generated"] == 2 * N and verdict["coverage"] == 1.0
    div = verdict["references"]["reference"]["divergences"]
    assert [(d["request_id"], d["position"], d["class"]) for d in div] == [(a.request_id, p, "near_tie")]
    assert verdict["references"]["reference"]["exact_match_rate"] == 0.5
    assert_table_fails(table_row(cell, cand, verdict))


# ---------------------------------------------------------------------------------------------
# (c) a request dropped, another truncated


def truncated(r: Record, n: int) -> Record:
    steps, total = [], 0
    for c in r.committed_per_step:
        if total + c > n - 1:
            if n - 1 - total:
                steps.append(n - 1 - total)
            break
        steps.append(c)
        total += c
    return dataclasses.replace(r, output_ids=r.output_ids[:n], new_tokens=n, committed_per_step=steps,
                               verify_steps=len(steps))


def test_cheat_c_dropped_and_truncated_requests(cell):
    short = truncated(cell.stock[1], 20)
    assert sum(short.committed_per_step) == 19
    verdict, rc = force_cli(cell, [short], "--report-only")
    assert rc == 0 and not verdict["passed"]
    missing, length = by_check(verdict, "missing_request"), by_check(verdict, "length")
    assert [v["request_id"] for v in missing] == [cell.stock[0].request_id]
    assert [(v["request_id"], v["candidate_tokens"], v["reference_tokens"]) for v in length] == \
        [(short.request_id, 20, N)]
    assert set(verdict["violations_by_check"]) == {"missing_request", "length"}
    assert verdict["coverage"] == 1.0 and verdict["tokens_checked"] == 20  # what is there is greedy
    _, rc = force_cli(cell, [short])  # without --report-only the job fails
    assert rc == 1
    assert_table_fails(table_row(cell, [short]))


# ---------------------------------------------------------------------------------------------
# (d) no KV rollback after a rejected draft (stale cache)


@pytest.fixture(scope="module")
def sensitive(cell):
    """A random target whose greedy choice depends on the whole context (weights N(0, 0.2)), with
    its AR records of the cell's prompts: a trained tiny target may settle into a loop that ignores
    its context, and then a stale cache changes nothing (and nothing is wrong)."""
    from specpilot.models.random_checkpoint import build_target

    target = build_target("tiny", dtype=torch.float32, seed=3)
    with torch.no_grad():
        for name, w in target.named_parameters():
            if w.dim() == 2:
                w.mul_(10.0)
    rows = [dict(r, prompt_ids=[i % target.config.vocab_size for i in r["prompt_ids"]]) for r in cell.rows]
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), rows, N, 1, META, ServeOptions(progress=False, warmup=False))
    return SimpleNamespace(target=target, rows=rows, ar=ar, prompts={r["request_id"]: r["prompt_ids"] for r in rows})


def test_cheat_d_stale_kv_cache(cell, sensitive, monkeypatch):
    commit = TargetRunner.commit

    def no_rollback(self, counts, path_slots=None):
        """Cheat: commits every verified block entry, so rejected drafts stay in the context."""
        return commit(self, torch.where(counts > 0, torch.full_like(counts, self._pending), counts), path_slots)

    s = sensitive
    honest = serve(EngineSpec("lookup", BLOCK), Deployment.of(s.target, None), s.rows, N, 1, META, ServeOptions(progress=False, warmup=False))
    assert check(honest, s.ar, s.prompts, s.target, tolerance=1e-3)["passed"]  # the control: no cheat, no violation
    longest = max(len(r["prompt_ids"]) for r in s.rows)
    with monkeypatch.context() as m:
        m.setattr(TargetRunner, "commit", no_rollback)
        cand = serve(EngineSpec("lookup", BLOCK), Deployment.of(s.target, None), s.rows, N, 1, META, ServeOptions(progress=False, warmup=False, max_seq=longest + N * BLOCK + 16))
    verdict = check(cand, s.ar, s.prompts, s.target, tolerance=1e-3)
    assert not verdict["passed"]
    tokens = by_check(verdict, "token")
    assert tokens and all(v["margin"] >= 1e-3 and v["top1"] != v["candidate_token"] for v in tokens)
    div = verdict["references"]["reference"]["divergences"]
    assert div and div[0]["class"] == "violation"
    # every token up to the first step with a rejected draft is still right: the stale entries
    # only enter the context after it
    for v in tokens:
        steps = next(r for r in cand if r.request_id == v["request_id"]).committed_per_step
        j = next(j for j, c in enumerate(steps) if c < BLOCK)
        assert v["position"] >= 1 + sum(steps[: j + 1])
    assert verdict["coverage"] == 1.0
    assert_table_fails(table_row(cell, [dataclasses.replace(r, engine="stock") for r in cand], verdict))


# ---------------------------------------------------------------------------------------------
# (e) a "speedup" that reuses AR's output without running the engine


def test_cheat_e_records_not_produced_by_the_engine(cell):
    from specpilot.forcing import REEXECUTION_TOKENS

    honest = cell.stock[1]
    window = []
    for c in honest.committed_per_step:  # the engine's real steps inside the re-executed window
        if sum(window) + c > REEXECUTION_TOKENS:
            break
        window.append(c)
    assert max(window) > 1, "premise: the drafter commits more than one token early on this request"
    fake = dataclasses.replace(cell.ar[1], engine="stock", drafter="dflash", engine_config=dict(honest.engine_config),
                               decode_s=honest.decode_s / 3)  # AR's record, relabelled and "faster"
    verdict, rc = force_cli(cell, [cell.stock[0], fake], "--report-only")
    assert not verdict["passed"]
    # tokens, structure and request set are all fine: only the re-execution shows the engine never ran
    assert verdict["violations_by_check"] == {"replay": 1}
    v = by_check(verdict, "replay")[0]
    assert v["request_id"] == fake.request_id
    assert v["recorded_committed"] == [1] * len(v["recorded_committed"]) and v["rerun_committed"][:len(window)] == window
    assert verdict["replay"]["reproduced"] == 1 and verdict["coverage"] == 1.0
    assert_table_fails(table_row(cell, [cell.stock[0], fake]))

    # invented but consistent step counts (sum = new_tokens - 1): also not what the engine does
    from specpilot.forcing import force

    invented = dataclasses.replace(fake, committed_per_step=[4] * 7 + [3], verify_steps=8)
    verdict = force([cell.stock[0], invented], {"ar": cell.ar}, cell.prompts, cell.target, 1e-3, reexecution_for(cell))
    assert verdict["violations_by_check"] == {"replay": 1}
    # and inconsistent ones fail on the record's own evidence
    broken = dataclasses.replace(fake, committed_per_step=[4] * 8, verify_steps=4)
    verdict = force([broken], {}, cell.prompts, cell.target, 1e-3)
    fields = {v["field"] for v in by_check(verdict, "structure")}
    assert fields == {"verify_steps", "committed_per_step"} and not verdict["passed"]


# ---------------------------------------------------------------------------------------------
# pure parts


def rec(**kw) -> Record:
    base = dict(request_id="gsm8k/0000", benchmark="gsm8k", deployment="quick", target="t", drafter="dflash",
                gpu="cpu", engine="stock", concurrency=1, prompt_tokens=3, new_tokens=5, prefill_s=0.0,
                decode_s=1.0, verify_steps=2, committed_per_step=[3, 1], output_ids=[1, 2, 3, 4, 5],
                engine_config={"block_size": 4})
    return Record(**{**base, **kw})


def test_structure_problems_name_each_field():
    from specpilot.forcing import structure_problems

    assert structure_problems(rec(), 3, 10) == []
    assert [p["field"] for p in structure_problems(rec(new_tokens=6), 3, 10)] == ["new_tokens", "committed_per_step"]
    assert [p["field"] for p in structure_problems(rec(verify_steps=3), 3, 10)] == ["verify_steps"]
    over = structure_problems(rec(committed_per_step=[5, -1]), 3, 10)
    assert [p["field"] for p in over] == ["committed_per_step"] and "1..4" in over[0]["detail"]
    assert [p["field"] for p in structure_problems(rec(), 4, 10)] == ["prompt_tokens"]
    assert [p["field"] for p in structure_problems(rec(output_ids=[1, 2, 3, 4, 10]), 3, 10)] == ["output_ids"]
    assert [p["field"] for p in structure_problems(rec(engine_config={}), 3, 10)] == ["engine_config"]


def test_verdict_word_needs_full_coverage_of_the_cell():
    from specpilot.forcing import verdict_word

    recs = [rec(), rec(request_id="gsm8k/0001")]
    ok = {"passed": True, "violations": 0, "coverage": 1.0, "tokens_checked": 10, "tokens_generated": 10,
          "requests": 2}
    assert verdict_word(ok, recs) == ("pass", "")
    assert verdict_word(None) == ("not run", "no verdict")
    assert verdict_word({"passed": True, "violations": 0, "tokens_checked": 4})[0] == "FAIL"  # older checker
    assert verdict_word({**ok, "coverage": 0.5, "tokens_checked": 5}, recs) == ("FAIL", "coverage 50.0%")
    assert verdict_word({**ok, "passed": False, "violations": 3}, recs) == ("FAIL", "3 violations")
    assert verdict_word(ok, recs[:1])[0] == "FAIL"  # the verdict is about other records


def test_tolerance_per_dtype():
    from specpilot.errors import SpecpilotError
    from specpilot.forcing import tolerance_for

    assert tolerance_for({"fp32": 0.001, "bf16": 0.1}, "bf16") == 0.1
    assert tolerance_for({"fp32": 0.001, "bf16": 0.1}, "fp32") == 0.001
    assert tolerance_for(0.05, "bf16") == 0.05
    with pytest.raises(SpecpilotError, match="fp16"):
        tolerance_for({"fp32": 0.001}, "fp16")

"""Agent loop: cost model, directions, memory, LLM policy over real HTTP, token-forcing gate."""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from specpilot.agent import directions as dirs
from specpilot.agent import memory
from specpilot.errors import SpecpilotError
from specpilot.agent.costmodel import analyze, report_text, step_floors
from specpilot.agent.policies import LLMPolicy, OfflinePolicy, make_policy
from specpilot.agent.trial import Evaluator
from specpilot.engine.verify import ACCEPT_RULES, accept_greedy
from specpilot.models.config import TargetConfig
from specpilot.deployment import Deployment
from specpilot.models.loading import load_drafter, load_target
from specpilot.records import Record

CFG = TargetConfig(vocab_size=1000, hidden_size=100, intermediate_size=300, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=25)
CEIL = {"memory_bandwidth_bytes_per_s": 1e9, "matmul_flop_per_s": 1e12}


def _rec(i, draft_s, verify_s, decode_s, steps):
    return Record(request_id=f"x/{i:04d}", benchmark="x", deployment="d", target="t", drafter="dflash",
                  gpu="cpu", engine="stock", concurrency=1, prompt_tokens=50, new_tokens=sum(steps) + 1,
                  prefill_s=0.0, decode_s=decode_s, verify_steps=len(steps), committed_per_step=steps,
                  output_ids=[0] * (sum(steps) + 1), draft_s=draft_s, verify_s=verify_s)


def test_floors_follow_bytes_over_bandwidth():
    fl = step_floors(CFG, None, CEIL, batch=1, block=1, context=0, dtype_bytes=4)
    linear = 2 * (100 * 100 * 2 + 100 * 50 * 2 + 3 * 100 * 300)
    assert fl["verify"] == pytest.approx((linear + 100 * 1000) * 4 / 1e9)


def test_cost_model_ranks_terms_per_committed_token():
    # 10 steps, tau 4; per step draft 1 ms, verify 2 ms, decode 4 ms -> host 1 ms
    recs = [_rec(0, 0.010, 0.020, 0.040, [4] * 10)]
    a = analyze(recs, CFG, None, CEIL, 4, block_size=8)
    assert a["tau"] == 4
    terms = {t["term"]: t for t in a["terms"]}
    assert terms["host"]["gap_s_per_token"] == pytest.approx(0.001 / 4)
    assert terms["acceptance"]["gap_s_per_token"] == pytest.approx(0.004 / 4 - 0.004 / 8)
    assert terms["verify"]["measured_s_per_token"] == pytest.approx(0.002 / 4)
    assert terms["weight_bytes"]["gap_s_per_token"] == 0  # fp32 weights: a 12-bit format does not apply
    gaps = [t["gap_s_per_token"] for t in a["terms"]]
    assert gaps == sorted(gaps, reverse=True)
    assert "acceptance" in report_text(a, "t")


def test_cost_model_holds_steps_to_ceilings_of_their_thread_count():
    """A step timed with 1 thread is held to the 1-thread ceilings (half the 2-thread matmul rate and
    bandwidth here: its floors twice as long, its ratio half), the thread counts named in the report;
    records without ``threads`` and GPU ceilings keep the top-level (every-thread) measurement."""
    per = {"1": {"memory_bandwidth_bytes_per_s": 0.5e9, "matmul_flop_per_s": 0.5e12},
           "2": {"memory_bandwidth_bytes_per_s": 1e9, "matmul_flop_per_s": 1e12}}
    ceil = {**CEIL, "device": "cpu", "threads": 2, "per_threads": per}
    one = [_rec(0, 0.010, 0.020, 0.040, [4] * 10)]
    one[0].threads = 1
    a1 = analyze(one, CFG, None, ceil, 4, block_size=8)
    old = analyze([_rec(0, 0.010, 0.020, 0.040, [4] * 10)], CFG, None, ceil, 4, block_size=8)
    assert (a1["step_threads"], a1["floor_threads"]) == (1, 1)
    assert (old["step_threads"], old["floor_threads"]) == (None, 2)
    assert a1["floor_step_s"]["verify"] == pytest.approx(2 * old["floor_step_s"]["verify"])
    v1 = next(t for t in a1["terms"] if t["term"] == "verify")["ratio_to_floor"]
    v2 = next(t for t in old["terms"] if t["term"] == "verify")["ratio_to_floor"]
    assert v1 == pytest.approx(v2 / 2)
    assert "ceilings measured with 1 thread(s), as the steps were timed" in report_text(a1, "t")
    assert "2 thread(s); the steps' thread count not recorded" in report_text(old, "t")
    three = [_rec(0, 0.010, 0.020, 0.040, [4] * 10)]
    three[0].threads = 3  # not measured: the every-thread ceilings, the mismatch stated
    a3 = analyze(three, CFG, None, ceil, 4, block_size=8)
    assert a3["floor_threads"] == 2 and a3["floor_step_s"] == old["floor_step_s"]
    assert "none with the steps' 3" in report_text(a3, "t")
    gpu = analyze(one, CFG, None, {**ceil, "device": "cuda"}, 4, block_size=8)
    assert gpu["floor_step_s"] == old["floor_step_s"] and "GPU" in report_text(gpu, "t")


def test_direction_schema_and_grid():
    d = dirs.REGISTRY["tree_verify"]
    assert len(d.candidates()) == 4 * 3
    import jsonschema

    jsonschema.validate({"tree_branch": 2, "tree_depth": 1}, d.schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tree_branch": 9, "tree_depth": 1}, d.schema())
    assert not dirs.REGISTRY["w12_weights"].applies({"dtype": "fp32", "gpu": "cpu"})
    assert dirs.REGISTRY["w12_weights"].applies({"dtype": "bf16", "gpu": "h200"})


def test_memory_upsert_invalidate_and_transfer(tmp_path):
    base = {"direction": "block_size", "deployment": "a", "gpu": "cpu", "target": "t1", "drafter": "dflash",
            "round": 1, "evidence": []}
    m = memory.record([], {**base, "params": {"block_size": 6}, "gain": 1.10})
    e1 = m[0]
    m = memory.record(m, {**base, "params": {"block_size": 6}, "gain": 1.20})  # same key: updated
    m = memory.record(m, {**base, "deployment": "b", "params": {"block_size": 10}, "gain": 1.50})
    e3 = m[-1]
    assert len(m) == 2 and e1["id"] != e3["id"]
    assert [e["gain"] for e in m if e["id"] == e1["id"]] == [1.20]
    # a new deployment with the same drafter inherits the best entry; its own deployment ranks first
    assert memory.best_known(m, {"deployment": "c", "gpu": "h100", "drafter": "dflash"})["block_size"]["gain"] == 1.5
    assert memory.best_known(m, {"deployment": "a", "gpu": "cpu", "drafter": "dflash"})["block_size"]["gain"] == 1.2
    m2 = memory.invalidate(m, e3["id"], "failed token forcing")
    assert m[-1]["status"] == "valid"  # pure: the input snapshot is unchanged
    inv = [e for e in m2 if e["id"] == e3["id"]][0]
    assert len(m2) == 2 and inv["status"] == "invalidated" and inv["reason"]
    assert memory.best_known(m2, {"deployment": "c", "gpu": "h100", "drafter": "dflash"})["block_size"]["gain"] == 1.2
    with pytest.raises(SpecpilotError, match="nope"):
        memory.invalidate(m, "nope", "x")
    # snapshots on disk: canonical (sorted) files, so equal memories are equal bytes
    memory.write(tmp_path / "a.jsonl", m2)
    memory.write(tmp_path / "b.jsonl", list(reversed(m2)))
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert memory.read(tmp_path / "a.jsonl") == sorted(m2, key=lambda e: e["id"])
    (tmp_path / "bad.jsonl").write_text('{"direction": "block_size"}\n')
    with pytest.raises(SpecpilotError, match="lacks"):
        memory.read(tmp_path / "bad.jsonl")


def test_memory_merge_is_order_free_and_keeps_invalidations():
    base = {"direction": "block_size", "gpu": "cpu", "target": "t", "drafter": "dflash", "round": 1, "evidence": []}
    a = memory.record([], {**base, "deployment": "a", "params": {"block_size": 6}, "gain": 1.3})
    b = memory.record(a, {**base, "deployment": "b", "params": {"block_size": 5}, "gain": 1.1})  # b learned from a
    b = memory.invalidate(b, a[0]["id"], "failed token forcing on b/cpu")
    merged = memory.merge([a, b])
    assert merged == memory.merge([b, a]) == memory.merge([b, a, a])
    assert len(merged) == 2
    by_dep = {e["deployment"]: e for e in merged}
    assert by_dep["a"]["status"] == "invalidated" and "b/cpu" in by_dep["a"]["reason"]
    assert by_dep["b"]["status"] == "valid"
    assert memory.merge([]) == []


class _Chat(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible chat completions endpoint answering a fixed content."""

    content = "not json"
    calls = 0

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        self.rfile.read(n)
        type(self).calls += 1
        body = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": type(self).content}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def chat_server():
    def start(content):
        handler = type("H", (_Chat,), {"content": content, "calls": 0})
        srv = HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_port}/v1", handler

    servers = []
    yield start
    for s in servers:
        s.shutdown()


def _fake_trial(calls):
    def trial(params, full):
        calls.append((params, full))
        return {"gain": 1.0 + params["block_size"] / 100, "gate": {"passed": True}, "evidence": None}
    return trial


def test_llm_valid_proposal_is_trialled(chat_server):
    url, handler = chat_server('{"params": {"block_size": 5}, "rationale": "shorter verify"}')
    calls = []
    res = LLMPolicy(url, "m", None).search(dirs.REGISTRY["block_size"], {"block_size": 8}, 2, _fake_trial(calls), [], {})
    assert calls[0] == ({"block_size": 5}, True) and res[0]["policy"] == "llm"
    assert handler.calls == 2  # the repeated proposal is not trialled twice


def test_llm_malformed_json_falls_back_to_offline(chat_server, caplog):
    url, handler = chat_server("Sure! block size 5 looks good")
    calls = []
    with caplog.at_level(logging.INFO, logger="specpilot.agent"):
        res = LLMPolicy(url, "m", None).search(dirs.REGISTRY["block_size"], {"block_size": 8}, 3, _fake_trial(calls), [], {})
    assert handler.calls == 3
    assert "malformed JSON" in caplog.text and "falling back to the offline policy" in caplog.text
    assert res and all(r["policy"] == "offline-fallback" for r in res) and calls


def test_llm_out_of_space_proposal_is_rejected(chat_server, caplog):
    url, _ = chat_server('{"params": {"block_size": 7}}')  # 7 is not in the grid
    with caplog.at_level(logging.INFO, logger="specpilot.agent"):
        res = LLMPolicy(url, "m", None).search(dirs.REGISTRY["block_size"], {"block_size": 8}, 1, _fake_trial([]), [], {})
    assert "outside the direction's space" in caplog.text and res[0]["policy"] == "offline-fallback"


def test_llm_refused_connection_retries_then_offline(caplog):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    calls = []
    with caplog.at_level(logging.INFO, logger="specpilot.agent"):
        res = LLMPolicy(f"http://127.0.0.1:{port}/v1", "m", None, retries=3, backoff_s=0.01).search(
            dirs.REGISTRY["block_size"], {"block_size": 8}, 2, _fake_trial(calls), [], {})
    assert caplog.text.count("transport error") == 3
    assert "falling back to the offline policy" in caplog.text and res and calls


def test_no_key_means_offline(monkeypatch, caplog):
    monkeypatch.delenv("SPECPILOT_TEST_KEY", raising=False)
    with caplog.at_level(logging.INFO, logger="specpilot.agent"):
        assert isinstance(make_policy({"base_url": "http://x/v1", "model": "m", "api_key_env": "SPECPILOT_TEST_KEY"}),
                          OfflinePolicy)
        assert isinstance(make_policy(None), OfflinePolicy)
    assert "SPECPILOT_TEST_KEY is not set" in caplog.text


def test_key_never_logged(monkeypatch, chat_server, caplog):
    monkeypatch.setenv("SPECPILOT_TEST_KEY", "sk-secret-123")
    url, _ = chat_server("garbage")
    with caplog.at_level(logging.DEBUG):
        pol = make_policy({"base_url": url, "model": "m", "api_key_env": "SPECPILOT_TEST_KEY"})
        pol.search(dirs.REGISTRY["block_size"], {"block_size": 8}, 1, _fake_trial([]), [], {})
    assert isinstance(pol, LLMPolicy) and "sk-secret-123" not in caplog.text


def skip_last_verify(drafts, logits):
    """Cheat: once every draft but the last is accepted, accept the last one unverified."""
    acc, bonus = accept_greedy(drafts, logits)
    k = drafts.shape[1]
    cheat = acc == k - 1
    acc = torch.where(cheat, torch.full_like(acc, k), acc)
    bonus = torch.where(cheat, logits.argmax(-1)[:, k], bonus)
    return acc, bonus


def test_gate_rejects_a_planted_cheating_direction(quick_deployment, quick_prompts, monkeypatch):
    monkeypatch.setitem(ACCEPT_RULES, "skip_last", skip_last_verify)
    cheat = dirs.Direction("cheat_skip_last", "verify", {"accept": ["skip_last"], "block_size": [2]})
    monkeypatch.setitem(dirs.REGISTRY, cheat.name, cheat)
    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    ev = Evaluator(Deployment.of(target, drafter), quick_prompts[:4], 24, 1, meta, stock_block=4, tolerance=1e-3, repeats=1)
    results = OfflinePolicy().search(cheat, {"block_size": 4}, 1, lambda p, full: ev.trial(
        cheat.apply({"block_size": 4}, p), {"block_size": 4}), [], {})
    assert len(results) == 1
    r = results[0]
    assert not r["gate"]["passed"] and r["gate"]["violations"] > 0 and r["gain"] is None
    assert r["gate"]["mismatches"][0]["kind"] == "violation"
    # an honest candidate of the same search passes
    honest = ev.trial({"block_size": 3}, {"block_size": 4})
    assert honest["gate"]["passed"] and honest["gain"] is not None


def test_trial_gain_comes_with_an_interval_over_requests_and_repeats(quick_deployment, quick_prompts):
    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    ev = Evaluator(Deployment.of(target, drafter), quick_prompts[:3], 16, 1, meta, stock_block=4, tolerance=1e-3, repeats=2)
    cand, base = ev.measure({"block_size": 3}, {"block_size": 4})
    assert all(len(r.decode_s_repeats) == 2 and r.decode_s == min(r.decode_s_repeats) for r in cand + base)
    r = ev.trial({"block_size": 3}, {"block_size": 4})
    assert r["gate"]["passed"]
    assert 0 < r["gain_lo"] <= r["gain"] <= r["gain_hi"]


def test_grid_order_of_a_base_off_the_grid():
    """DSpark's own block (11, off the block_size grid) is searched from its neighbours, not from the
    grid's start (issue 45: the rounds tried blocks 3, 4, 5 first)."""
    from specpilot.agent.policies import grid_order

    order = grid_order(dirs.REGISTRY["block_size"], {"block_size": 11}, [])
    assert {c["block_size"] for c in order[:2]} == {10, 12} and order[-1] == {"block_size": 3}
    assert grid_order(dirs.REGISTRY["block_size"], {"block_size": 12}, [])[1] in ({"block_size": 10},
                                                                                   {"block_size": 16})
    # a mechanism two deployments validated is hinted twice: tried once
    twice = grid_order(dirs.REGISTRY["block_size"], {"block_size": 12}, [{"block_size": 10}, {"block_size": 10}])
    assert twice[0] == {"block_size": 10} and twice.count({"block_size": 10}) == 1

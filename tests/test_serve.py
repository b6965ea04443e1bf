"""``specpilot serve`` against the ``openai`` client: one server per module on the tiny deployment.

The server runs the specpilot engine (the drafter with an engine config) at 2 slots and a queue
of 6. Checked: 8 concurrent chat requests equal ``specpilot run --engine ar`` token for token
(records and text), streaming equals non-streaming, token forcing passes on the server's records,
a client that disconnects mid-stream frees its slot, a full queue answers 429, and every bad
request gets a 4xx naming the field while the server keeps serving.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from specpilot.cli import main as specpilot_main
from specpilot.engine.online import OnlineScheduler, Submission
from specpilot.engine.scheduler import Request, Scheduler
from specpilot.engine.serve import continuous_engine
from specpilot.errors import SpecpilotError
from specpilot.prompts import BENCHMARKS, load_tokenizer, write_prompt_file
from specpilot.records import read_records
from specpilot.server.engine import EngineFiles, ServedEngine
from specpilot.server.lookup import best_deployment, deployment_files
from specpilot.server.text import TextStream

REPO = Path(__file__).resolve().parents[1]
NEW = 24  # tokens per request
MAX_SEQ = 1024
SLOTS, QUEUE = 2, 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, tiny_deployment, data_dir) -> tuple[Path, list[dict]]:
    """Two prompts of each of four benchmarks for the tiny tokenizer (a prompt file)."""
    out = tmp_path_factory.mktemp("serve-prompts")
    rows = []
    for b in BENCHMARKS[:4]:
        rows += write_prompt_file(b, tiny_deployment / "target", out / f"{b}.jsonl", 2, data_dir=data_dir)
    path = out / "all.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_deployment):
    """A running ``specpilot serve`` (specpilot engine, DFlash drafter, block 8, chain tree off)."""
    tmp = tmp_path_factory.mktemp("serve")
    config = tmp / "specpilot.json"
    config.write_text(json.dumps({"block_size": 8}))
    port = _free_port()
    cmd = [sys.executable, "-m", "specpilot", "serve", "--target", str(tiny_deployment / "target"),
           "--drafter", str(tiny_deployment / "drafter-dflash"), "--engine-config", str(config),
           "--deployment", "tiny", "--max-concurrency", str(SLOTS), "--max-queue", str(QUEUE),
           "--max-seq", str(MAX_SEQ), "--record", str(tmp / "served"), "--port", str(port), "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield {"base": base, "client": OpenAI(base_url=base + "/v1", api_key="none", max_retries=0),
           "record": tmp / "served", "config": config, "proc": proc}
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _chat(client, text: str, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                          temperature=0, **kw)


def _ok(server) -> None:
    """The server still serves a short request."""
    r = server["client"].completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_concurrent_chat_equals_ar(server, prompts, tiny_deployment, tmp_path):
    """8 concurrent chat requests (the benchmark prompts' first turns) return exactly the tokens
    ``specpilot run --engine ar`` decodes from the prompt file; then token forcing passes on
    the server's records."""
    path, rows = prompts
    ar = tmp_path / "ar.jsonl"
    assert specpilot_main(["run", "--engine", "ar", "--target", str(tiny_deployment / "target"), "--prompts",
                           str(path), "--out", str(ar), "--max-new-tokens", str(NEW), "--threads", "1"]) == 0
    want = {r.request_id: r.output_ids for r in read_records(ar)}
    results: dict[str, object] = {}

    def ask(row):
        results[row["request_id"]] = _chat(server["client"], row["turns"][0], max_tokens=NEW,
                                           extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=ask, args=(row,)) for row in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tok = load_tokenizer(tiny_deployment / "target")
    served = {tuple(json.loads(x)["prompt_ids"]): json.loads(x)["request_id"]
              for x in (server["record"] / "prompts.jsonl").read_text().splitlines()}
    records = {r.request_id: r for r in read_records(server["record"] / "records.jsonl")}
    assert len(rows) == 8
    for row in rows:
        reply = results[row["request_id"]]
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == NEW and reply.usage.prompt_tokens == len(row["prompt_ids"])
        assert reply.choices[0].message.content == tok.decode(want[row["request_id"]], skip_special_tokens=True)
        rec = records[served[tuple(row["prompt_ids"])]]  # the chat template gave the prompt file's ids
        assert rec.output_ids == want[row["request_id"]]
        assert rec.engine == "specpilot" and rec.concurrency == SLOTS and rec.max_new_tokens == NEW
    taus = [r.tau for r in records.values()]
    assert max(taus) > 1.0  # the drafter's tokens were accepted: the engine was speculative
    verdict = tmp_path / "verdict.json"
    assert specpilot_main(["force", "--candidate", str(server["record"] / "records.jsonl"),
                           "--target", str(tiny_deployment / "target"), "--drafter", str(tiny_deployment / "drafter-dflash"),
                           "--prompts", str(server["record"] / "prompts.jsonl"), "--engine-config",
                           str(server["config"]), "--out", str(verdict), "--threads", "1"]) == 0
    v = json.loads(verdict.read_text())
    assert v["passed"] and v["tokens_checked"] == v["tokens_generated"] >= 8 * NEW
    assert v["replay"]["reproduced"] == v["replay"]["requests"] >= 8


def test_stream_equals_non_stream(server, prompts):
    """The streamed deltas join to the non-streamed text, with the same finish reason and usage;
    with a stop string taken from the middle of that text, both are cut where it begins, the
    usage counts the tokens up to it, and the record says where the response was cut."""
    row = prompts[1][0]

    def both(**kw):
        whole = _chat(server["client"], row["turns"][0], max_tokens=NEW, **kw)
        chunks = list(_chat(server["client"], row["turns"][0], max_tokens=NEW, stream=True,
                            stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [whole.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        return whole

    full = both(extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and len(text) >= 8
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = both(stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < NEW
    rec = read_records(server["record"] / "records.jsonl")[-1]
    assert rec.served["stop"] == {"string": stop, "tokens": cut.usage.completion_tokens}
    assert rec.served["finish_reason"] == "stop" and rec.new_tokens >= cut.usage.completion_tokens
    assert rec.output_ids == full_ids(server, rec)[: rec.new_tokens]  # the step's tokens, AR's own


def full_ids(server, rec) -> list[int]:
    """The output of the first record of the same prompt that decoded its whole budget."""
    prompts = {json.loads(x)["request_id"]: json.loads(x)["prompt_ids"]
               for x in (server["record"] / "prompts.jsonl").read_text().splitlines()}
    for r in read_records(server["record"] / "records.jsonl"):
        if prompts[r.request_id] == prompts[rec.request_id] and r.new_tokens == NEW:
            return r.output_ids
    raise AssertionError("no full record of the prompt")


def test_disconnect_frees_slot_and_full_queue_429(server):
    """Clients that hang up mid-stream free their slots (the next request is served at once,
    not after their long budgets); more requests than slots + queue get 429."""
    client = server["client"]
    streams = [client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=800, stream=True)
               for _ in range(SLOTS)]
    for s in streams:
        next(iter(s))  # one chunk: the request runs
        s.close()
    t0 = time.time()
    _ok(server)
    assert time.time() - t0 < 30
    assert _gauge(server, 'requests_total{reason="cancelled"}') >= SLOTS
    codes: list[int] = []
    held = []

    def ask():
        try:
            s = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=800, stream=True)
            held.append(s)
            codes.append(200)
        except openai.RateLimitError:
            codes.append(429)

    threads = [threading.Thread(target=ask) for _ in range(SLOTS + QUEUE + 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in held:
        s.close()
    assert sorted(codes) == [200] * (SLOTS + QUEUE) + [429] * 3
    deadline = time.time() + 30  # the hang-ups reach the engine between its steps
    while _gauge(server, "queue_length") + _gauge(server, "running_requests") > 0 and time.time() < deadline:
        time.sleep(0.2)
    _ok(server)


def _gauge(server, name: str) -> float:
    metrics = urllib.request.urlopen(server["base"] + "/metrics").read().decode()
    return float(metrics.split(f"\nspecpilot_{name} ")[1].split()[0])


def _post(base: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "Hi", "max_tokens": 2}, 404, "model"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0.7}, 400, "temperature"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 2, "n": 2}, 400, "n"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": MAX_SEQ}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": [5] * (MAX_SEQ + 1), "max_tokens": 2}, 400, "prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * (MAX_SEQ + 10)}], "max_tokens": 2}, 400,
     "messages"),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": ', 400, "body"),
])
def test_bad_requests(server, body, status, param):
    """Each bad request: its 4xx and OpenAI's error object naming the field; the server keeps serving."""
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    code, reply = _post(server["base"], path, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert code == status, reply
    assert reply["error"]["param"] == param, reply
    _ok(server)


# Bodies whose text cannot be decoded (issue 59): (path, raw body, the field the 400 names)
_C, _CHAT = "/v1/completions", "/v1/chat/completions"
BAD_TEXT = [
    (_C, b'{"model": "tiny", "prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}', "prompt"),  # Latin-1, not UTF-8
    (_C, b'{"model": "tiny", "prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt"),  # an encoded surrogate (CESU-8)
    (_C, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),  # a lone surrogate escape
    (_C, b'{"model": "tiny", "prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    (_C, b'{"model": "tiny", "prompt": ["x\\ud83d"], "max_tokens": 2}', "prompt.0"),  # half of a pair
    (_C, b'{"model": "tiny", "prompt": "a\x00b", "max_tokens": 2}', "prompt"),  # a raw NUL
    (_C, b'{"model": "tiny", "prompt": "a\x1bb", "max_tokens": 2}', "prompt"),  # a raw control character
    (_C, b'{"model": "tiny", "prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop.0"),
    (_C, b'{"model": "ti\\udc80ny", "prompt": "Hi", "max_tokens": 2}', "model"),
    (_C, b'\xff\xfe{\x00}\x00', "body"),  # UTF-16 with its BOM
    (_CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
     "messages.0.content"),
    (_CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\xc3("}]}], '
            b'"max_tokens": 2}', "messages.0.content.0.text"),
    (_CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
            b'"chat_template_kwargs": {"enable_thinking": "\\ud800"}}', "chat_template_kwargs.enable_thinking"),
    (_CHAT, b'{"model": "tiny", "messages": [{"role": "user\x07", "content": "Hi"}], "max_tokens": 2}',
     "messages.0.role"),
]


def test_undecodable_text_is_a_4xx_naming_the_field(server):
    """Every body whose text cannot be decoded (not UTF-8, lone surrogates, raw control
    characters, UTF-16): a 400 with OpenAI's error object naming the field, never a 500; escaped
    NUL and control characters are text and served; the server keeps serving after each."""
    for path, raw, param in BAD_TEXT:
        code, reply = _post(server["base"], path, raw)
        assert code == 400 and reply["error"]["param"] == param, (raw, code, reply)
    for text in (r"a\u0000b", r"\u0007\u001b[31m"):  # escaped: valid text, the tokenizer takes it
        code, reply = _post(server["base"], _C, b'{"model": "tiny", "prompt": "' + text.encode() + b'", "max_tokens": 3}')
        assert code == 200 and reply["usage"]["completion_tokens"] == 3, reply
    _ok(server)


def test_text_the_tokenizer_refuses_is_a_400():
    """A tokenizer that refuses a text (e.g. a control character its normalizer rejects): a 400
    naming the field, with its message; text it takes gives its ids."""
    from specpilot.server.protocol import ApiError, encode_text

    class Strict:
        def __call__(self, text, add_special_tokens=False):
            if any(ord(c) < 0x20 for c in text):
                raise ValueError("control character")
            return {"input_ids": [ord(c) for c in text]}

    with pytest.raises(ApiError) as e:
        encode_text(Strict(), "a\x01", "messages")
    assert e.value.status == 400 and e.value.param == "messages" and "control character" in e.value.message
    assert encode_text(Strict(), "ab", "prompt") == [97, 98]


class _ByteTokenizer:
    """One token per UTF-8 byte (the tiny tokenizer's shape), to test character splitting."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_whole_characters_and_stop_inside_a_step():
    """Deltas are whole characters (a 2-byte character split across steps waits); a stop string
    ending inside a multi-token step cuts the text before it and counts the tokens up to it."""
    ids = list("aé|b".encode())  # a, é (2 bytes), |, b
    ts = TextStream(_ByteTokenizer(), stops=["|b"])
    assert ts.feed(ids[:2]) == ("a", False)  # é incomplete: held back
    assert ts.feed(ids[2:4]) == ("é", False)  # '|' may begin the stop string: held back
    assert ts.feed(ids[4:] + list(b"zz")) == ("", True)
    assert ts.text == "aé" and ts.stop == "|b" and ts.stop_tokens == 5
    plain = TextStream(_ByteTokenizer())
    assert "".join(plain.feed([i])[0] for i in ids) + plain.flush() == "aé|b"


def _run_layout(tmp_path) -> Path:
    """A finished run's per-regime layout (rules/common.smk): two regimes, single (c1) and batched
    (tuned at c16, cells 16 and 20), the engine config and kernel agent of each."""
    (tmp_path / "config.yaml").write_text("deployments:\n  tiny-dflash2: {target: tiny, drafter: dflash2, "
                                          "weight_format: fp32, block_size: auto}\n")
    res = tmp_path / "run" / "results" / "cpu"
    for p in ("run/resources/deployments/tiny/target", "run/resources/deployments/tiny/drafter-dflash2"):
        (tmp_path / p).mkdir(parents=True)
    (res / "kernels").mkdir(parents=True)
    (res / "kernels" / "manifest.json").write_text("{}")
    for regime, tune in (("single", 1), ("batched", 16)):
        (res / "kernels" / "tiny-dflash2" / regime).mkdir(parents=True)
        (res / "kernels" / "tiny-dflash2" / regime / "kernel-agent.json").write_text("{}")
        (res / "tiny-dflash2" / regime).mkdir(parents=True)
        (res / "tiny-dflash2" / regime / "specpilot.json").write_text(json.dumps(
            {"block_size": 8, "regime": regime, "tuned_concurrency": tune}))
    (res / "table.csv").write_text(
        "deployment,benchmark,regime,concurrency,specpilot_speedup\n"
        "tiny,gsm8k,single,1,9.0\ntiny,geomean,single,1,2.5\ntiny-dflash2,geomean,single,1,2.75\n"
        "tiny-dspark,geomean,single,1,\ntiny,geomean,batched,16,1.0\ntiny-dflash2,geomean,batched,16,1.5\n"
        "tiny,geomean,batched,20,3.0\ntiny-dflash2,geomean,batched,20,1.2\nall,geomean,single,1,2.6\n")
    return res


def _serve_args(*argv: str):
    import argparse

    from specpilot.server.cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_deployment_files_by_name_per_regime(tmp_path):
    """Name-based lookup in the per-regime layout: the regime serving --max-concurrency (a cell of
    it, else the nearest tune, said), its engine config and kernel agent; best over that regime's
    rows; explicit paths replace the found ones before anything is checked; a missing file is named."""
    from specpilot.server.cli import engine_files
    from specpilot.server.lookup import run_regimes, serving_regime

    res = _run_layout(tmp_path)
    cfg = str(tmp_path / "config.yaml")
    regimes, source = run_regimes(res, cfg)
    assert regimes == {"single": {"tune": 1, "cells": [1]}, "batched": {"tune": 16, "cells": [16, 20]}}
    assert "table.csv" in source
    assert serving_regime(regimes, 20) == ("batched", None)
    assert serving_regime(regimes, 1) == ("single", None)
    name, note = serving_regime(regimes, 4)
    assert name == "single" and "nearest tune" in note and "c1" in note
    assert serving_regime(regimes, 12)[0] == "batched"
    f = deployment_files("tiny-dflash2", res, cfg, "batched")
    assert f.target.endswith("deployments/tiny/target") and f.drafter.endswith("tiny/drafter-dflash2")
    assert f.dtype == "fp32" and f.drafter_name == "dflash2" and f.regime == "batched"
    assert f.engine_config == str(res / "tiny-dflash2" / "batched" / "specpilot.json")
    assert f.kernel_agent == str(res / "kernels" / "tiny-dflash2" / "batched" / "kernel-agent.json")
    with pytest.raises(SpecpilotError, match="'tiny-b' is not in"):
        deployment_files("tiny-b", res, cfg)
    assert best_deployment(res, "single", 1) == "tiny-dflash2"  # a cell row, an empty value and 'all' do not count
    assert best_deployment(res, "batched", 16) == "tiny-dflash2"
    assert best_deployment(res, "batched", 20) == "tiny"
    assert best_deployment(res, "batched", 24) == "tiny-dflash2"  # not a cell: the regime's smallest concurrency
    files, notes = engine_files(_serve_args("--deployment", "best", "--results", str(res), "--config", cfg,
                                            "--max-concurrency", "16"))
    assert files.deployment == "tiny-dflash2" and files.regime == "batched"
    assert any("best: 'tiny-dflash2'" in n for n in notes)
    (res / "tiny-dflash2" / "batched" / "specpilot.json").unlink()
    with pytest.raises(SpecpilotError, match="batched/specpilot.json not found"):
        engine_files(_serve_args("--deployment", "tiny-dflash2", "--results", str(res), "--config", cfg,
                                 "--max-concurrency", "20"))
    own = tmp_path / "mine.json"
    own.write_text("{}")
    files, notes = engine_files(_serve_args("--deployment", "tiny-dflash2", "--results", str(res), "--config", cfg,
                                            "--max-concurrency", "20", "--engine-config", str(own)))
    assert files.engine_config == str(own) and any("replaces regime 'batched'" in n for n in notes)
    files, _ = engine_files(_serve_args("--deployment", "tiny-dflash2", "--results", str(res), "--config", cfg,
                                        "--max-concurrency", "20", "--engine", "stock"))  # stock needs no engine config
    assert files.regime == "batched"
    (res / "table.csv").unlink()  # a run not finished to its table: the config's regimes (single only here)
    regimes, source = run_regimes(res, cfg)
    assert regimes == {"single": {"tune": 1, "cells": [1]}} and source.startswith("config")
    with pytest.raises(SpecpilotError, match="table.csv not found"):
        best_deployment(res)


def test_force_passes_on_every_served_record(server, tiny_deployment, tmp_path):
    """Last: token forcing on everything the server recorded (3-token requests, stop strings,
    cancelled streams), each request re-executed with its own budget and EOS."""
    records = read_records(server["record"] / "records.jsonl")
    assert {r.served["finish_reason"] for r in records} >= {"length", "stop", "cancelled"}
    assert min(r.max_new_tokens for r in records) == 3
    verdict = tmp_path / "verdict.json"
    assert specpilot_main(["force", "--candidate", str(server["record"] / "records.jsonl"),
                           "--target", str(tiny_deployment / "target"), "--drafter", str(tiny_deployment / "drafter-dflash"),
                           "--prompts", str(server["record"] / "prompts.jsonl"), "--out", str(verdict),
                           "--threads", "1"]) == 0
    v = json.loads(verdict.read_text())
    assert v["passed"] and v["replay"]["reproduced"] == v["replay"]["requests"] == len(records)


@pytest.mark.parametrize("config", [{"block_size": 8, "tree_branch": 2, "tree_depth": 2},
                                    {"block_size": 8, "verify_path": "fused", "draft_path": "fused"}])
def test_online_scheduler_equals_closed_loop(tiny_deployment, prompts, config, tmp_path):
    """In process: the online scheduler (requests submitted from another thread, 2 slots) commits
    exactly the closed-loop scheduler's tokens and steps, with the engine's mechanisms on."""
    (tmp_path / "c.json").write_text(json.dumps(config))
    files = EngineFiles("tiny", str(tiny_deployment / "target"), str(tiny_deployment / "drafter-dflash"),
                        engine_config=str(tmp_path / "c.json"))
    eng = ServedEngine(files, "specpilot", slots=2, max_seq=MAX_SEQ, device="cpu", threads=1, graphs="off")
    rows = prompts[1][:4]
    proposer, runner = continuous_engine(eng.spec, eng.dep, 2, MAX_SEQ)
    closed = Scheduler(runner, proposer, accept=eng.spec.accept, overlap=eng.spec.overlap)
    want = closed.run([Request(r["prompt_ids"], 16) for r in rows])
    eng.start()
    assert isinstance(eng.scheduler, OnlineScheduler)
    got, done = {}, threading.Semaphore(0)
    for k, r in enumerate(rows):
        def fin(res, reason, k=k):
            got[k] = (list(res.output_ids), list(res.committed_per_step), reason)
            done.release()
        eng.scheduler.submit(Submission(r["prompt_ids"], 16, ignore_eos=True, on_finish=fin))
    for _ in rows:
        assert done.acquire(timeout=120)
    eng.scheduler.stop()
    for k, w in enumerate(want):
        assert got[k] == (w.output_ids, w.committed_per_step, "length")
    assert (eng.scheduler.runner.fused is not None) == (config.get("verify_path") == "fused")


def test_text_stream_incremental_equals_whole_decode(tiny_deployment, prompts):
    """Fed step by step (steps of 1..5 tokens), the deltas join to the tokenizer's decoding of all
    tokens at once: the incremental decoding loses and adds nothing."""
    tok = load_tokenizer(tiny_deployment / "target")
    for row in prompts[1][:4]:
        ids = row["prompt_ids"][: 120]
        ts, k, out, n = TextStream(tok), 0, "", 1
        while k < len(ids):
            out += ts.feed(ids[k:k + n])[0]
            k, n = k + n, n % 5 + 1
        assert out + ts.flush() == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow  # AR, serve-vs-run's four servers and run, a server by name, the client, forcing: ~2-3 min on 2 cores
def test_gpu_serve_script_dry_run(tmp_path):
    """``DRY=1 python scripts/gpu_serve.py``: its plumbing on the CPU, every figure line printed: the
    77bc289 stand-in configs written as a run's per-regime layout, found / stock served at c1 and
    c2 with intervals, served / run, the engine found by name (regime batched, named at start-up),
    the client's figures, every served record equal to AR, forcing."""
    env = dict(os.environ, DRY="1", OUT=str(tmp_path / "out"), PYTHONPATH=str(REPO / "src"))
    env.pop("STUDY", None)
    proc = subprocess.run([sys.executable, "scripts/gpu_serve.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "rc=" not in out and "SKIPPED" not in out, out
    label = "configs as found by the 77bc289 study (not re-run)"
    for c in ("c1", "c2"):
        assert f"found engine served / stock served {c} ({label}):" in out, out
        assert f"bench client, found engine served by name (regime batched) {c}:" in out, out
    assert "served / specpilot run c1" in out and "regime batched and its config named at start-up" in out, out
    assert "served records equal to AR token for token: 24/24" in out, out
    assert "token forcing on the found engine's served records (by name c2): pass" in out, out
    layout = tmp_path / "out" / "study" / "results" / "cpu" / "qwen3-8b"
    assert json.loads((layout / "batched" / "specpilot.json").read_text())["engine_config"]["overlap"] is True
    r = json.loads((tmp_path / "out" / "serve_vs_run.json").read_text())  # serve-vs-run's JSON (its dry run's path)
    assert r["errors"] == []
    (rnd,), (rnd_high,) = r["rounds"], r["rounds_high"]
    assert rnd["run"]["tokens"] == 4 * 8 and rnd["c1"]["requests"] == rnd["stock-c1"]["requests"] == 4
    assert rnd_high["c2"]["requests"] == rnd_high["stock-c2"]["requests"] == 4
    s = r["summary"]
    for c in ("", "_c2"):
        assert s[f"specpilot_over_stock_served{c}_lo"] <= s[f"specpilot_over_stock_served{c}"] <= \
            s[f"specpilot_over_stock_served{c}_hi"]
    assert s["served_over_run_c1"] > 0 and r["engine_config_high"].endswith("batched/specpilot.json")

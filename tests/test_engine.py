"""Engine core: runner vs transformers, KV rollback, AR == stock, tree verify, records (token forcing: test_forcing.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.drafters.dflash import DFlashProposer
from specpilot.drafters.lookup import LookupProposer
from specpilot.engine.verify import accept_greedy
from specpilot.engine.loop import generate, generate_ar
from specpilot.engine.runner import TargetRunner
from specpilot.engine.config import EngineSpec
from specpilot.engine.serve import serve
from specpilot.errors import SpecpilotError
from specpilot.forcing import check
from specpilot.models.layers import chain_ancestors
from specpilot.models.loading import load_drafter, load_target


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_runner_matches_transformers_qwen3(quick_deployment, quick_prompts):
    from transformers import AutoModelForCausalLM

    tdir = quick_deployment / "target"
    hf = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    ours = load_target(tdir)
    prompt = quick_prompts[0]["prompt_ids"]
    ours.setup_cache(1, 256)
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf(x).logits
        out, _ = ours(x, torch.zeros(1, dtype=torch.long), chain_ancestors(1, len(prompt), "cpu"))
    assert _max_rel(out, ref) < 1e-4
    # greedy tokens identical for 64 steps
    with torch.no_grad():
        hf_ids = hf.generate(x, max_new_tokens=64, do_sample=False, min_new_tokens=64)[0, len(prompt):].tolist()
    rows = generate_ar(TargetRunner(ours, 1, len(prompt) + 70), [prompt], 64)
    assert rows[0].output_ids == hf_ids


def test_runner_matches_transformers_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_target(tmp_path)
    ours.setup_cache(2, 64)
    x = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        out, _ = ours(x, torch.zeros(2, dtype=torch.long), chain_ancestors(2, 30, "cpu"))
        assert _max_rel(out, hf(x).logits) < 1e-4


def test_rollback_then_decode_equals_never_drafted(quick_deployment, quick_prompts):
    model = load_target(quick_deployment / "target")
    prompt = quick_prompts[1]["prompt_ids"]
    nxt = torch.tensor([7])
    # never drafted: prefill, decode one token
    r1 = TargetRunner(model, 1, len(prompt) + 20)
    r1.prefill([prompt])
    clean = r1.decode(nxt).clone()
    # drafted a block of 6 junk tokens, rolled everything back, decoded the same token
    r2 = TargetRunner(model, 1, len(prompt) + 20)
    r2.prefill([prompt])
    length = r2.length.clone()
    r2.verify(torch.tensor([[5, 9, 11, 13, 17, 19]]))
    r2.rollback(length)
    assert torch.equal(r2.decode(nxt), clean)


def test_tree_verify_matches_chain_on_each_path(quick_deployment, quick_prompts):
    model = load_target(quick_deployment / "target")
    prompt = quick_prompts[2]["prompt_ids"]
    # tree: root 0 -> {1, 2}; 1 -> 3; 2 -> 4
    tokens = torch.tensor([[4, 8, 9, 15, 16]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    r = TargetRunner(model, 1, len(prompt) + 20)
    r.prefill([prompt])
    tree_logits, _ = r.verify(tokens, parents)
    for path in ([0, 1, 3], [0, 2, 4]):
        c = TargetRunner(model, 1, len(prompt) + 20)
        c.prefill([prompt])
        chain_logits, _ = c.verify(tokens[:, path])
        assert _max_rel(tree_logits[:, path], chain_logits) < 1e-5
    # accepting the second branch compacts its K/V: decoding after it equals the chain run
    r.commit(torch.tensor([3]), path_slots=torch.tensor([[0, 2, 4]]))
    c = TargetRunner(model, 1, len(prompt) + 20)
    c.prefill([prompt])
    c.verify(tokens[:, [0, 2, 4]])
    c.commit(torch.tensor([3]))
    assert _max_rel(r.decode(torch.tensor([3])), c.decode(torch.tensor([3]))) < 1e-5


@pytest.mark.parametrize("block_size,concurrency", [(2, 1), (4, 3), (8, 2), (12, 1)])
def test_stock_equals_ar_token_for_token(quick_deployment, quick_prompts, block_size, concurrency):
    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), quick_prompts, 40, concurrency, meta, ServeOptions(progress=False))
    st = serve(EngineSpec("stock", block_size), Deployment.of(target, drafter), quick_prompts, 40, concurrency, meta, ServeOptions(progress=False))
    lk = serve(EngineSpec("lookup", block_size), Deployment.of(target, None), quick_prompts, 40, concurrency, meta, ServeOptions(progress=False))
    for a, s, l in zip(ar, st, lk):
        assert a.request_id == s.request_id == l.request_id
        assert s.output_ids == a.output_ids
        assert l.output_ids == a.output_ids
        for rec in (a, s, l):
            assert rec.new_tokens == len(rec.output_ids) == 40
            assert sum(rec.committed_per_step) == rec.new_tokens - 1
            assert rec.verify_steps == len(rec.committed_per_step)
            assert max(rec.committed_per_step) <= (1 if rec.engine == "ar" else block_size)
        assert a.committed_per_step == [1] * 39
    prompts = {p["request_id"]: p["prompt_ids"] for p in quick_prompts}
    assert check(st, ar, prompts, target)["passed"] and check(lk, ar, prompts, target)["violations"] == 0


def test_eos_option_stops_at_eos(quick_deployment, quick_prompts):
    target = load_target(quick_deployment / "target")
    prompt = quick_prompts[0]["prompt_ids"]
    full = generate_ar(TargetRunner(target, 1, len(prompt) + 50), [prompt], 40)[0].output_ids
    eos = full[5]  # pretend the sixth generated token is EOS
    stopped = generate_ar(TargetRunner(target, 1, len(prompt) + 50), [prompt], 40, eos_id=eos)[0].output_ids
    assert stopped == full[: full.index(eos) + 1]
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    spec = generate(TargetRunner(target, 1, len(prompt) + 60, drafter.config.target_layer_ids),
                    DFlashProposer(drafter, block_size=6), [prompt], 40, eos_id=eos)[0].output_ids
    assert spec == stopped


def test_lookup_proposer_finds_the_latest_ngram():
    lp = LookupProposer(max_ngram=2)
    assert lp._lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert lp._lookup([7, 8], 3) == [8, 8, 8]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "specpilot.cli", *args], capture_output=True, text=True)


def test_cli_bad_inputs_give_one_line_and_no_records(quick_deployment, quick_prompts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in quick_prompts[:2]))
    out = tmp_path / "r.jsonl"
    t, d = str(quick_deployment / "target"), str(quick_deployment / "drafter-dflash")
    base = ["run", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((quick_deployment / "target" / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {
        "checkpoint directory not found": ["--engine", "ar", "--target", str(tmp_path / "missing")],
        "corrupt weights file": ["--engine", "ar", "--target", str(corrupt)],
        "unsupported architecture 'GPT2LMHeadModel'": ["--engine", "ar", "--target", str(gpt2)],
        "block size must be >= 2, got 1": ["--engine", "stock", "--target", t, "--drafter", d, "--block-size", "1"],
    }
    for needle, extra in cases.items():
        res = _cli(*base, *extra)
        assert res.returncode == 2, (needle, res.stderr)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not out.exists()
    res = _cli("run", "--prompts", str(empty), "--out", str(out), "--engine", "ar", "--target", t)
    assert res.returncode == 2 and "no prompts" in res.stderr and not out.exists()
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"request_id": "x/0001", "benchmark": "x", "prompt_ids": [5] * 5000}) + "\n")
    res = _cli("run", "--prompts", str(long), "--out", str(out), "--engine", "ar", "--target", t)
    assert res.returncode == 2 and "x/0001" in res.stderr and "KV cache" in res.stderr and not out.exists()


def test_cli_run_and_force_roundtrip(quick_deployment, quick_prompts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in quick_prompts[:3]))
    t, d = str(quick_deployment / "target"), str(quick_deployment / "drafter-dflash")
    for eng in ("ar", "stock"):
        res = _cli("run", "--engine", eng, "--target", t, "--drafter", d, "--prompts", str(prompts),
                   "--out", str(tmp_path / f"{eng}.jsonl"), "--max-new-tokens", "16", "--block-size", "4",
                   "--block-reason", "a short block keeps the test fast")
        assert res.returncode == 0, res.stderr
    res = _cli("force", "--candidate", str(tmp_path / "stock.jsonl"), "--reference", str(tmp_path / "ar.jsonl"),
               "--target", t, "--drafter", d, "--max-new-tokens", "16", "--prompts", str(prompts),
               "--out", str(tmp_path / "f.json"))
    assert res.returncode == 0, res.stderr
    verdict = json.loads((tmp_path / "f.json").read_text())
    assert verdict["passed"] and verdict["tokens_checked"] == 3 * 16


@pytest.mark.parametrize("concurrency", [1, 2])
def test_cli_run_interleaved_cell_equals_separate_runs(quick_deployment, quick_prompts, tmp_path, concurrency):
    """One job times ar, stock and specpilot interleaved (request by request at c1, pass by pass
    batched): each engine's tokens equal its own separate run, the engine config reaches
    specpilot only, and each engine's timestamps read as its own closed loop."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in quick_prompts[:3]))
    cfg = tmp_path / "specpilot.json"
    cfg.write_text(json.dumps({"block_size": 5, "tree_branch": 2, "tree_depth": 2}))
    t, d = str(quick_deployment / "target"), str(quick_deployment / "drafter-dflash")
    common = ["--target", t, "--drafter", d, "--prompts", str(prompts), "--max-new-tokens", "12",
              "--block-size", "4", "--block-reason", "a short block keeps the test fast", "--concurrency",
              str(concurrency)]
    engines = ("ar", "stock", "specpilot")
    outs = [str(tmp_path / f"cell-{e}.jsonl") for e in engines]
    repeats = 1 if concurrency == 1 else 2  # one run: its timestamps are not mixed by merge_repeats
    res = _cli("run", "--engine", ",".join(engines), "--out", ",".join(outs), "--engine-config", str(cfg),
               "--timing-repeats", str(repeats), *common)
    assert res.returncode == 0, res.stderr
    for e, out in zip(engines, outs):
        alone = tmp_path / f"alone-{e}.jsonl"
        extra = ["--engine-config", str(cfg)] if e == "specpilot" else []
        assert _cli("run", "--engine", e, "--out", str(alone), *extra, *common).returncode == 0
        cell = [json.loads(x) for x in Path(out).read_text().splitlines()]
        ref = [json.loads(x) for x in alone.read_text().splitlines()]
        assert [r["output_ids"] for r in cell] == [r["output_ids"] for r in ref], e
        assert [r["engine_config"] for r in cell] == [r["engine_config"] for r in ref], e
        assert all(len(r["decode_s_repeats"] or [0]) == repeats for r in cell)
        if concurrency == 1:  # requests one after another on the engine's own clock
            assert all(a["finish_s"] <= b["arrival_s"] + 1e-9 for a, b in zip(cell, cell[1:])), e
    assert json.loads(Path(outs[2]).read_text().splitlines()[0])["engine_config"]["tree_branch"] == 2
    assert "tree_branch" not in json.loads(Path(outs[1]).read_text().splitlines()[0])["engine_config"]
    bad = _cli("run", "--engine", "ar,stock", "--out", outs[0], *common)
    assert bad.returncode == 2 and "--out names 1 file(s) for 2 engine(s)" in bad.stderr


def test_tree_verification_engine_equals_ar(quick_deployment, quick_prompts):
    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    ar = serve(EngineSpec("ar"), Deployment.of(target, None), quick_prompts, 40, 2, meta, ServeOptions(progress=False))
    chain = serve(EngineSpec("stock", 6), Deployment.of(target, drafter), quick_prompts, 40, 2, meta, ServeOptions(progress=False))
    tree = serve(EngineSpec("specpilot", 6, {"tree_branch": 2, "tree_depth": 2}), Deployment.of(target, drafter), quick_prompts, 40, 2, meta, ServeOptions(progress=False))
    assert [t.output_ids for t in tree] == [a.output_ids for a in ar]
    assert all(sum(t.committed_per_step) == 39 for t in tree)
    steps_tree = sum(t.verify_steps for t in tree)
    steps_chain = sum(c.verify_steps for c in chain)
    assert steps_tree <= steps_chain  # side branches only ever add accepted tokens
    assert tree[0].engine_config == {"block_size": 6, "tree_branch": 2, "tree_depth": 2, "path": "eager"}


def test_multi_turn_chaining_equal_across_engines(quick_deployment, data_dir, tmp_path):
    from transformers import AutoTokenizer

    from specpilot.prompts import write_prompt_file
    from specpilot.engine.serve import serve_turns

    prompts = write_prompt_file("mt-bench", quick_deployment / "target", tmp_path / "mt.jsonl", 2, data_dir=data_dir)
    tok = AutoTokenizer.from_pretrained(quick_deployment / "target")
    target = load_target(quick_deployment / "target")
    drafter = load_drafter(quick_deployment / "drafter-dflash")
    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    out = {}
    for eng, d in (("ar", None), ("stock", drafter)):
        out[eng] = serve_turns(lambda rows, e=eng, d=d: serve(EngineSpec(e, 4), Deployment.of(target, d), rows, 16, 1, meta, ServeOptions(progress=False)), prompts, tok)
    ids = [r.request_id for r in out["ar"]]
    assert ids == [p["request_id"] for p in prompts] + [f"{p['request_id']}/turn2" for p in prompts]
    for a, s in zip(out["ar"], out["stock"]):
        assert a.output_ids == s.output_ids and a.prompt_ids == s.prompt_ids
    turn2 = out["ar"][2]
    assert turn2.prompt_ids is not None and turn2.prompt_tokens == len(turn2.prompt_ids)
    assert tok.decode(turn2.prompt_ids).count("<|im_start|>user") == 2
    assert check(out["stock"], out["ar"], {p["request_id"]: p["prompt_ids"] for p in prompts}, target)["passed"]

"""Engine traps (issue 12): the KV-capacity check reserves exactly what an engine needs, positions
beyond the target's limit are refused, every turn of a conversation uses the recorded template
settings, the replay drafter draws per request, `specpilot run` explains every option and times
cells repeatedly."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.engine.config import EngineSpec

from specpilot.engine.serve import serve, serve_turns
from specpilot.errors import SpecpilotError
from specpilot.models.loading import load_drafter, load_target
from specpilot.records import Record

META = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}


@pytest.fixture(scope="module")
def models(quick_deployment):
    return load_target(quick_deployment / "target"), load_drafter(quick_deployment / "drafter-dflash")


@pytest.mark.parametrize("engine,config,concurrency", [
    ("ar", {}, 1), ("stock", {}, 1), ("stock", {"tree_branch": 2, "tree_depth": 2}, 1), ("stock", {}, 2),
])
def test_prompt_that_fits_exactly_runs(models, quick_prompts, engine, config, concurrency):
    target, drafter = models
    spec = EngineSpec(engine, 4, config)
    rows = quick_prompts[:concurrency]
    new = 12
    # derived here, not taken from the engine: the last verify starts after new - 2 cached new
    # tokens and writes verify_width slots; in a batch a finished row is verified once more
    width = spec.verify_width
    need = max(len(p["prompt_ids"]) for p in rows) + new - 2 + width + (1 if concurrency > 1 and width > 1 else 0)
    roomy = serve(spec, Deployment.of(target, drafter), rows, new, concurrency, META, ServeOptions(max_seq=need + 40, progress=False, warmup=False))
    exact = serve(spec, Deployment.of(target, drafter), rows, new, concurrency, META, ServeOptions(max_seq=need, progress=False, warmup=False))
    assert [r.output_ids for r in exact] == [r.output_ids for r in roomy]
    assert all(r.new_tokens == new for r in exact)
    with pytest.raises(SpecpilotError, match=f"needs {need} KV cache slots, more than the KV cache of {need - 1} slots"):
        serve(spec, Deployment.of(target, drafter), rows, new, concurrency, META, ServeOptions(max_seq=need - 1, progress=False, warmup=False))


def test_kv_slots_needed_counts():
    from specpilot.engine.serve import kv_slots_needed

    assert kv_slots_needed(10, 1, 8, False) == 10          # nothing decoded
    assert kv_slots_needed(10, 5, 1, False) == 14          # AR: 4 decode steps after prefill
    assert kv_slots_needed(10, 5, 8, False) == 10 + 3 + 8  # last verify from 13 cached tokens
    assert kv_slots_needed(10, 5, 8, True) == 10 + 4 + 8   # a finished row is verified again in a batch


def test_max_seq_beyond_the_targets_positions_is_refused(models, quick_prompts):
    target, drafter = models
    limit = target.config.max_position_embeddings
    with pytest.raises(SpecpilotError, match=f"--max-seq {limit + 1} exceeds the target's max_position_embeddings {limit}"):
        serve(EngineSpec("ar"), Deployment.of(target, None), quick_prompts[:1], 4, 1, META, ServeOptions(max_seq=limit + 1, progress=False))
    long = [{**quick_prompts[0], "prompt_ids": quick_prompts[0]["prompt_ids"] * (limit // len(quick_prompts[0]["prompt_ids"]) + 1)}]
    with pytest.raises(SpecpilotError, match=f"more than the target's max_position_embeddings {limit}"):
        serve(EngineSpec("ar"), Deployment.of(target, None), long, 4, 1, META, ServeOptions(progress=False))


QWEN3_LIKE = (  # Qwen3's switch: with enable_thinking false the reply starts with an empty think block
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}")


def test_every_turn_rendered_with_the_recorded_template_settings(data_dir, tmp_path):
    from specpilot.prompts import load_rows, write_prompt_file
    from specpilot.tiny.tokenizer import build_tokenizer

    texts = [t for r in load_rows("mt-bench", data_dir)[:20] for t in r["turns"]] + ["fine"]
    tok = build_tokenizer(texts, 600, tmp_path / "base")
    tok.chat_template = QWEN3_LIKE
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    prompts = write_prompt_file("mt-bench", tok_dir, tmp_path / "mt.jsonl", 2, data_dir=data_dir)
    assert all(p["prompt_text"].endswith("<think>\n\n</think>\n\n") for p in prompts)
    seen = []

    def fake_serve(rows):  # an engine that answers "fine" to everything
        seen.append(rows)
        ids = tok("fine", add_special_tokens=False)["input_ids"]
        return [Record(request_id=r["request_id"], benchmark=r["benchmark"], deployment="d", target="t",
                       drafter="none", gpu="cpu", engine="ar", concurrency=1, prompt_tokens=len(r["prompt_ids"]),
                       new_tokens=len(ids), prefill_s=0.0, decode_s=0.0, verify_steps=len(ids) - 1,
                       committed_per_step=[1] * (len(ids) - 1), output_ids=list(ids)) for r in rows]

    records = serve_turns(fake_serve, prompts, tok)
    turn2 = seen[1]
    assert len(turn2) == 2
    for row in turn2:
        text = tok.decode(row["prompt_ids"])
        assert text.count("<|im_start|>user") == 2 and text.endswith("<think>\n\n</think>\n\n"), text[-80:]
    assert all(p["chat_template_kwargs"] == {"enable_thinking": False} for p in prompts)
    assert all(r.chat_template_kwargs == {"enable_thinking": False} for r in records)
    # a prompt file that asks for thinking gets it on every turn
    thinking = [{**p, "chat_template_kwargs": {"enable_thinking": True}} for p in prompts]
    seen.clear()
    serve_turns(fake_serve, thinking, tok)
    assert not any("<think>" in tok.decode(r["prompt_ids"]) for r in seen[1])


def test_replay_drafter_draws_per_request():
    from specpilot.drafters.replay import ReplayProposer, load_profile

    profile = load_profile("study_stock")
    refs = [list(range(100, 160)), list(range(200, 260))]

    def planted(rows, keys=None, steps=6, k=5):
        kw = {} if keys is None else {"row_keys": keys}
        prop = ReplayProposer([refs[i] for i in rows], profile, 1000, seed=0, block_size=k + 1, **kw)
        prop.start(None, [[7, 8, 9 + i] for i in rows], None, torch.zeros(len(rows), dtype=torch.long))
        per_row = [[] for _ in rows]
        for _ in range(steps):
            prop.propose(torch.zeros(len(rows), dtype=torch.long), torch.zeros(len(rows), dtype=torch.long))
            drawn = prop.planted[-len(rows):]
            for b, a in enumerate(drawn):
                per_row[b].append(a)
            prop.observe(None, None, None, [list(range(a + 1)) for a in drawn])
        return per_row

    # concurrency 1: each request alone in its batch, the proposer made anew for each
    assert planted([0]) != planted([1])             # different requests, different sequences
    both = planted([0, 1])
    assert both[0] != both[1]
    assert planted([0, 1]) == both                  # deterministic
    assert planted([0]) == [both[0]] and planted([1]) == [both[1]]  # independent of batch mates
    assert planted([0, 1], keys=["gsm8k/0001", "gsm8k/0002"]) != both  # keyed by request id when given


def test_run_options_all_have_help():
    from specpilot.engine.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    missing = [a.option_strings[0] for a in p._actions if a.option_strings and a.dest != "help"
               and not (a.help or "").strip()]
    assert not missing, f"options without help: {missing}"


def test_run_cli_times_repeats(quick_deployment, quick_prompts, tmp_path):
    from specpilot.cli import main
    from specpilot.io import write_jsonl
    from specpilot.records import read_records

    write_jsonl(tmp_path / "p.jsonl", quick_prompts[:2])
    out = tmp_path / "stock.jsonl"
    rc = main(["run", "--engine", "stock", "--target", str(quick_deployment / "target"), "--drafter",
               str(quick_deployment / "drafter-dflash"), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out),
               "--max-new-tokens", "8", "--block-size", "4", "--block-reason", "a short block keeps the test fast", "--timing-repeats", "3",
               "--device", "cpu"])
    assert rc == 0
    recs = read_records(out)
    assert len(recs) == 2
    for r in recs:
        assert len(r.decode_s_repeats) == 3 and r.decode_s == min(r.decode_s_repeats)


def test_tiny_build_progress_reaches_its_log_as_it_goes(tmp_path, data_dir):
    """`specpilot tiny-stage target > log` (what the workflow runs, rules/build.smk): lines appear
    while it runs, not at its end. Stopped once the first line is there (the build runs to its end
    in CI's quick build step and the workflow tests)."""
    import os
    import subprocess
    import sys
    import time

    log = tmp_path / "build.log"
    out = tmp_path / "dep"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "specpilot", "tiny-stage", "target", "--quick", "--out", str(out),
                                 "--data-dir", str(data_dir)], stdout=f, stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    seen_early = False
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if "tokenizer: vocab" in log.read_text():
                seen_early = proc.poll() is None and not (out / "stages" / "target.json").exists()
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert seen_early, "nothing reached the log while the build ran: " + log.read_text()[-2000:]

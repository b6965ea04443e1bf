"""Serving regimes (issue 53), fast parts: the config's regimes and their planning-time checks, the
batched directions and the cost term that ranks the speculation gate, the goodput gate itself (its
decisions, and outputs equal to AR through the engine), memory entries per regime, the table's
regime column and the speedup figure's panel per regime. The workflow with two regimes end to end
is tests/test_regimes_workflow.py (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import yaml

from specpilot.agent import directions as dirs
from specpilot.agent import memory
from specpilot.agent.costmodel import analyze
from specpilot.aggregate import with_regimes
from specpilot.capacity import plan_problems
from specpilot.configcheck import check_config
from specpilot.drafters.goodput_gate import GoodputGate
from specpilot.drafters.proposal import chain
from specpilot.errors import SpecpilotError
from specpilot.figures import _panels
from specpilot.models.random_checkpoint import target_config
from specpilot.regimes import calibration_count, parse_table_option, regime_of, resolve, table_option

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "config" / "schema.yaml"
BASE = {"deployments": {"t": {"target": "tiny", "drafter": "dflash", "weight_format": "fp32", "block_size": 8}},
        "benchmarks": ["gsm8k", "mbpp"], "n_prompts": 2, "max_new_tokens": 8, "concurrency": [1],
        "engines": ["ar", "stock", "specpilot"]}


def test_regimes_derived_and_given():
    """Old configs are one single regime (concurrency, rounds.concurrency); given regimes follow it."""
    assert resolve({**BASE, "concurrency": [1, 2], "rounds": {"concurrency": 1}}) == {"single": {"tune": 1, "cells": [1, 2]}}
    cfg = check_config({**BASE, "regimes": {"batched": {"tune": 16, "cells": [16, 20, 24]}}}, SCHEMA)
    assert list(cfg["regimes"]) == ["single", "batched"]
    assert cfg["regimes"]["batched"] == {"tune": 16, "cells": [16, 20, 24]}
    assert regime_of(cfg["regimes"]) == {1: "single", 16: "batched", 20: "batched", 24: "batched"}
    assert parse_table_option(table_option(cfg["regimes"])) == regime_of(cfg["regimes"])
    # calibration: 2 x tune requests over the benchmarks for a batched regime, the config's count at one request
    assert calibration_count(cfg["regimes"]["batched"], 1, 2) == 16 and calibration_count(cfg["regimes"]["single"], 1, 2) == 1
    assert check_config(dict(cfg), SCHEMA)["regimes"] == cfg["regimes"]  # resolving twice changes nothing


@pytest.mark.parametrize("regimes, words", [
    ({"Batched": {"tune": 4, "cells": [4]}}, "config regimes"),
    ({"batched": {"tune": 4, "cels": [4]}}, "config regimes.batched: unknown key 'cels'"),
    ({"batched": {"cells": [4]}}, "config regimes.batched: 'tune' is a required property"),
    ({"batched": {"tune": 0, "cells": [4]}}, "config regimes.batched.tune"),
    ({"batched": {"tune": 4, "cells": [1]}}, "config regimes.batched.cells: concurrency 1 is already a cell of regime 'single'"),
    ({"single": {"tune": 8, "cells": [8]}, "batched": {"tune": 4, "cells": [4]}}, "config regimes.batched.tune: 4 does not rise"),
])
def test_bad_regimes_are_named(regimes, words):
    with pytest.raises(SpecpilotError) as e:
        check_config({**BASE, "regimes": regimes}, SCHEMA)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def _smk_dry(tmp_path, extra: dict, *args: str) -> subprocess.CompletedProcess:
    f = tmp_path / "extra.yaml"
    f.write_text(yaml.safe_dump(extra))
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(work), "--snakefile",
                           str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config" / "config.yaml"), str(f), *args],
                          text=True, capture_output=True, timeout=300)


def test_dry_run_refuses_a_malformed_regime_and_one_that_does_not_fit(tmp_path):
    """`snakemake -n` stops with one line naming the setting: an unknown key in a regime; a batched
    regime whose verify rows (tune x width) need more memory than the deployment's GPU has."""
    r = _smk_dry(tmp_path, {"regimes": {"batched": {"tune": 4, "cels": [4]}}})
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "regimes.batched" in ln]
    assert r.returncode != 0 and len(lines) == 1 and "unknown key 'cels'" in lines[0], (r.stdout + r.stderr)[-2000:]
    gpu = yaml.safe_load((ROOT / "config" / "gpu.yaml").read_text())
    big = {**gpu, "regimes": {"batched": {"tune": 8192, "cells": [16]}}}
    problems = plan_problems({"qwen3-8b": gpu["deployments"]["qwen3-8b"]}, check_config(big, SCHEMA), ROOT, ["h100"])
    assert len(problems) == 1 and "regimes.batched: tune 8192" in problems[0], problems
    assert plan_problems({"qwen3-8b": gpu["deployments"]["qwen3-8b"]}, check_config(dict(gpu), SCHEMA), ROOT,
                         ["h100"]) == []
    r = _smk_dry(tmp_path, {**gpu, "regimes": {"batched": {"tune": 8192, "cells": [16]}}}, "--config", "gpu=h100")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("specpilot: deployment")]
    assert r.returncode != 0 and lines and all("regimes.batched: tune 8192" in ln for ln in lines), \
        (r.stdout + r.stderr)[-2000:]


def test_directions_per_regime():
    """At one request the acceptance directions; under batching the block per concurrency (verify
    term) and the speculation gate (speculation term); the plan ranks them by the measured gaps."""
    one = {"gpu": "cpu", "drafter": "dflash", "dtype": "fp32", "concurrency": 1}
    four = {**one, "concurrency": 4}
    names = lambda ctx: {d.name for d in dirs.applicable(ctx)}  # noqa: E731
    assert "block_size" in names(one) and not {"batch_block", "spec_gate"} & names(one)
    assert {"batch_block", "spec_gate"} <= names(four) and "block_size" not in names(four)
    base = {"block_size": 16}
    assert dirs.plan_directions(four, {"speculation": 2.0, "verify": 1.0}, base, 2)[:1] == ["spec_gate"]
    assert dirs.plan_directions(four, {"speculation": 1.0, "verify": 2.0}, base, 1) in (["batch_block"], ["verify_budget"])
    assert dirs.REGISTRY["spec_gate"].apply(base, {"verify_budget": "goodput"}) == {"block_size": 16,
                                                                                     "verify_budget": "goodput"}


def _rec(decode_s, tokens, steps, conc=4, draft=0.0, verify=0.0):
    per = [tokens // steps] * steps
    return SimpleNamespace(verify_steps=steps, draft_s=draft, verify_s=verify, decode_s=decode_s,
                           committed_per_step=per, concurrency=conc, prompt_tokens=10, new_tokens=tokens, threads=1)


def test_speculation_term_from_ar_at_the_same_concurrency():
    """gap = speculative seconds per token above AR's: positive when speculating loses at this load."""
    cfg = target_config("tiny")
    ceil = {"memory_bandwidth_bytes_per_s": 1e10, "matmul_flop_per_s": 1e11, "device": "cpu"}
    spec = [_rec(1.2, 12, 6, draft=0.4, verify=0.6)]  # 0.1 s per token
    slow_ar = [_rec(2.4, 12, 12)]  # 0.2 s per token: speculating wins, no gap
    fast_ar = [_rec(0.6, 12, 12)]  # 0.05 s per token: AR wins by 0.05 s per token
    term = lambda ar: next(t for t in analyze(spec, cfg, None, ceil, 4, 4, ar=ar)["terms"] if t["term"] == "speculation")  # noqa: E731
    assert term(slow_ar)["gap_s_per_token"] == 0.0
    assert term(fast_ar)["gap_s_per_token"] == pytest.approx(0.05)
    assert "speculation" not in {t["term"] for t in analyze(spec, cfg, None, ceil, 4, 4)["terms"]}


class _Inner:
    kind, block_size, verify_width = "fake", 4, 4

    def __init__(self):
        self.calls = 0

    def propose(self, last, start):
        self.calls += 1
        return chain(last, torch.stack([last + 1, last + 2, last + 3], 1))

    def observe(self, *a):
        pass


def test_goodput_gate_decides_per_step():
    """Speculate while tau_hat / (draft + cost[N]) >= 1 / cost[1]; else AR steps (width 1, no draft)
    with a probe every probe_every steps; a better tau switches speculation back on."""
    inner = _Inner()
    gate = GoodputGate(inner, probe_every=3)
    gate.cost, gate.cost_batch = {1: 1.0, 4: 2.0}, 2
    last = torch.tensor([5, 7])
    p = gate.propose(last, None)
    assert p.width == 4 and inner.calls == 1
    gate.draft_s = 0.0  # measured draft time replaced: the decision depends on tau and cost only
    gate.observe(None, None, None, [[1], [1, 2]])  # tau 1.5 < cost[4] / cost[1] = 2: AR wins
    widths = [gate.propose(last, None).width for _ in range(6)]
    for w in widths:
        gate.draft_s = 0.0
        gate.observe(None, None, None, [[1], [1, 2]] if w > 1 else [[1], [1]])
    assert widths == [1, 1, 4, 1, 1, 4], widths  # the third off-step probes
    assert inner.calls == 3
    gate.draft_s = 0.0
    gate.tau_hat = 3.0  # the text got easier: speculation wins again
    assert gate.speculate() and gate.propose(last, None).width == 4


def test_goodput_gate_through_the_engine(tmp_path):
    """`run --engine ar,specpilot` with verify_budget goodput at c2: outputs equal AR's token for
    token, the records name the gate (the replay drafter, as the GPU study runs it)."""
    from specpilot.cli import main as cli_main
    from specpilot.deployment_random import write_random_deployment
    from specpilot.records import read_records

    dep = tmp_path / "dep"
    write_random_deployment(dep, "tiny", seed=1, block_size=6, weight_format="fp32", name="r", replay_profile="study_stock")
    g = torch.Generator().manual_seed(0)
    rows = [{"request_id": f"p{i}", "benchmark": "gsm8k",
             "prompt_ids": torch.randint(4, 260, (12 + 2 * i,), generator=g).tolist()} for i in range(3)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "spec.json"
    cfg.write_text(json.dumps({"engine_config": {"verify_budget": "goodput"}}))
    outs = [tmp_path / "ar.jsonl", tmp_path / "spec.jsonl"]
    rc = cli_main(["run", "--engine", "ar,specpilot", "--target", str(dep / "target"), "--drafter",
                   str(dep / "drafter-dflash"), "--prompts", str(prompts), "--out", ",".join(map(str, outs)),
                   "--max-new-tokens", "10", "--concurrency", "2", "--block-size", "6", "--device", "cpu",
                   "--dtype", "fp32", "--replay-profile", "study_stock", "--engine-config", str(cfg), "--threads", "1"])
    assert rc == 0
    ar, spec = (read_records(o) for o in outs)
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert {r.engine_config.get("verify_budget") for r in spec} == {"goodput"}


def test_memory_entries_carry_their_regime():
    """The regime is part of an entry's identity (old entries keep their ids); best_known prefers the
    context's regime within a tier."""
    e = {"direction": "overlap", "params": {"overlap": True}, "deployment": "d", "gpu": "h100", "gain": 1.2, "round": 1}
    old = memory.record([], e)[0]
    single = memory.record([], {**e, "regime": "single"})[0]
    batched = memory.record([], {**e, "regime": "batched", "gain": 1.1})[0]
    assert len({old["id"], single["id"], batched["id"]}) == 3
    assert old["id"] == memory.entry_id({k: v for k, v in e.items()})
    both = memory.merge([[single], [batched]])
    assert memory.best_known(both, {"deployment": "d", "gpu": "h100", "regime": "batched"})["overlap"]["id"] == batched["id"]
    assert memory.best_known(both, {"deployment": "d", "gpu": "h100", "regime": "single"})["overlap"]["id"] == single["id"]


def test_table_regime_column_and_figure_panels():
    df = pd.DataFrame({"deployment": ["d", "d", "d", "all"], "benchmark": ["gsm8k", "gsm8k", "gsm8k", "geomean"],
                       "concurrency": [1, 16, 20, 1]})
    out = with_regimes(df, {1: "single", 16: "batched", 20: "batched"})
    assert list(out.columns) == ["deployment", "benchmark", "regime", "concurrency"]
    assert list(out["regime"]) == ["single", "batched", "batched", "single"]
    _, panels = _panels(out)
    assert panels == [("d", "single", 1), ("d", "batched", 16)]  # a panel per regime, at its lowest cell
    with pytest.raises(SpecpilotError, match="concurrency \\[20\\]"):
        with_regimes(df, {1: "single", 16: "batched"})

"""Issue 61: the GPU study measures the study's workload -- the table's prefill share per engine,
the rounds' per-regime token count, the kept config's calibration gain over stock, each GPU job's
device-held seconds (also of a run the time guard stopped), and the round's base timed once.
Cheap (no model): fabricated records and logs; the workflow itself runs in CI's GPU-study step
(.test/config/gpu-tiny.yaml)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from specpilot.agent.final import final_config, gain_over_stock
from specpilot.agent.trial import Evaluator, Evidence
from specpilot.aggregate import build_table, prefill_share
from specpilot.configcheck import check_config
from specpilot.errors import SpecpilotError
from specpilot.joblog import gpu_seconds, gpu_seconds_lines, merge_gpu_seconds
from specpilot.records import Record
from specpilot.regimes import calibration_tokens, resolve

ROOT = Path(__file__).resolve().parents[1]


def _rec(rid: str, engine: str, prefill: float, decode: float, stall: float = 0.0, new: int = 8, conc: int = 1,
         gpu: str = "cpu", repeats=None) -> Record:
    return Record(request_id=rid, benchmark="gsm8k", deployment="d", target="t",
                  drafter="none" if engine == "ar" else "dflash", gpu=gpu, engine=engine, concurrency=conc,
                  prompt_tokens=4, new_tokens=new, prefill_s=prefill, decode_s=decode,
                  verify_steps=new - 1, committed_per_step=[1] * (new - 1), output_ids=list(range(new)),
                  prefill_stall_s=stall, decode_s_repeats=repeats)


def test_prefill_share_per_engine_in_the_table():
    """(prefill + stalls) / (prefill + decode) per request, the mean over the cell's requests, per
    engine; the summary row the mean over its cells."""
    recs = []
    for i, (p, d, st) in enumerate([(1.0, 3.0, 0.0), (1.0, 1.0, 0.5)]):
        recs += [_rec(f"r{i}", "ar", p, d, st, conc=2), _rec(f"r{i}", "stock", p, d / 2, 0.0, conc=2),
                 _rec(f"r{i}", "specpilot", 0.5, d / 4, st / 2, conc=2)]
    assert prefill_share(recs[:1]) == pytest.approx(0.25)
    df = build_table(recs)
    cell = df[(df["benchmark"] == "gsm8k")].iloc[0]
    assert cell["ar_prefill_share"] == pytest.approx((0.25 + 0.75) / 2)
    assert cell["stock_prefill_share"] == pytest.approx((1 / 2.5 + 1 / 1.5) / 2)
    assert cell["specpilot_prefill_share"] == pytest.approx((0.5 / 1.25 + 0.75 / 0.75) / 2)
    summary = df[(df["benchmark"] == "geomean") & (df["deployment"] == "d")].iloc[0]
    assert summary["ar_prefill_share"] == pytest.approx(cell["ar_prefill_share"])
    assert math.isnan(prefill_share([]))


def test_per_regime_calibration_tokens():
    """regimes.<name>.max_new_tokens overrides rounds.max_new_tokens for that regime's rounds; the GPU
    study's rounds are decode-dominated (>= 256) and its cells generate >= 512 tokens."""
    dep = {"target": "random", "shape": "qwen3-8b", "drafter": "dflash", "weight_format": "bf16", "block_size": 16}
    base = {"deployments": {"syn": dep}, "benchmarks": ["gsm8k"], "n_prompts": 8, "max_new_tokens": 8,
            "concurrency": [1], "engines": ["ar"], "rounds": {"max_new_tokens": 12},
            "regimes": {"batched": {"tune": 4, "cells": [4], "max_new_tokens": 24}}}
    cfg = check_config(json.loads(json.dumps(base)), ROOT / "config" / "schema.yaml")
    regimes = resolve(cfg)
    assert calibration_tokens(regimes["single"], cfg["rounds"]) == 12
    assert calibration_tokens(regimes["batched"], cfg["rounds"]) == 24
    bad = json.loads(json.dumps(base))
    bad["regimes"]["batched"]["max_new_tokens"] = 1
    with pytest.raises(SpecpilotError, match="regimes.batched.max_new_tokens"):
        check_config(bad, ROOT / "config" / "schema.yaml")
    gpu = yaml.safe_load((ROOT / "config" / "gpu.yaml").read_text())
    assert gpu["max_new_tokens"] >= 512
    gpu_regimes = resolve({**gpu, "regimes": gpu["regimes"]})
    assert all(calibration_tokens(r, gpu["rounds"]) >= 256 for r in gpu_regimes.values())
    tiny = yaml.safe_load((ROOT / ".test" / "config" / "gpu-tiny.yaml").read_text())
    assert tiny["regimes"]["batched"]["max_new_tokens"] != tiny["rounds"]["max_new_tokens"]  # CI runs both
    assert gpu["rounds"]["reuse_base"] is True and tiny["rounds"]["reuse_base"] is True


def test_calibration_gain_over_stock():
    """The kept config's gain over stock, not over the round's base: speedup_vs_ar / stock's."""
    integrated = {"config": {"overlap": True}, "round": 1, "speedup_vs_ar": 3.3, "stock_speedup_vs_ar": 3.0,
                  "tau": 4.0, "gate": {"passed": True}, "gain_vs_base": 1.0}
    assert gain_over_stock(integrated) == pytest.approx(1.1)
    assert final_config(integrated)["gain_over_stock_calibration"] == pytest.approx(1.1)
    assert gain_over_stock({"speedup_vs_ar": 3.3}) is None


def _taken(at: str) -> str:
    return f"specpilot: device 0 (GPU-1234, NVIDIA H100 80GB HBM3) taken at {at} by pid 7 on box\n"


def test_gpu_seconds_of_a_stopped_run(tmp_path):
    """A finished job's held seconds from its release line; a job the time guard stopped (no release
    line) until its log's last write; kept across calls in one file (a rerun's log is overwritten)."""
    logs = tmp_path / "logs"
    (logs / "h100" / "d" / "single" / "rounds" / "round-1").mkdir(parents=True)
    done = logs / "h100" / "d" / "gsm8k" / "cell-c1.log"
    done.parent.mkdir(parents=True)
    done.write_text(_taken("2026-12-07T10:00:00.000+00:00") + "INFO work\n"
                    "specpilot: device 0 (GPU-1234) released at 2026-12-07T10:00:42.500+00:00 after 42.5 s (exit 0)\n")
    stopped = logs / "h100" / "d" / "single" / "rounds" / "round-1" / "plan.log"
    stopped.write_text(_taken("2026-12-07T10:01:00.000+00:00") + "INFO timing specpilot ...\n")
    t0 = 1796637660.0  # 2026-12-07T10:01:00Z
    os.utime(stopped, (t0 + 75, t0 + 75))
    (logs / "cpu-job.log").write_text("no device here\n")
    rows = gpu_seconds(logs)
    by = {r["job"]: r for r in rows}
    assert set(by) == {"h100/d/gsm8k/cell-c1", "h100/d/single/rounds/round-1/plan"}
    assert by["h100/d/gsm8k/cell-c1"]["seconds"] == 42.5 and by["h100/d/gsm8k/cell-c1"]["status"] == "finished"
    assert by["h100/d/single/rounds/round-1/plan"]["status"] == "stopped"
    assert by["h100/d/single/rounds/round-1/plan"]["seconds"] == pytest.approx(75.0)
    tsv = logs / "gpu-seconds.tsv"
    merge_gpu_seconds(tsv, rows)
    # the next call reruns the stopped plan: its log is overwritten; the file keeps both holds
    stopped.write_text(_taken("2026-12-07T11:00:00.000+00:00")
                       + "specpilot: device 0 (GPU-1234) released at 2026-12-07T11:00:30.000+00:00 after 30.0 s (exit 0)\n")
    allrows = merge_gpu_seconds(tsv, gpu_seconds(logs))
    assert [(r["job"].rsplit("/", 1)[-1], r["seconds"], r["status"]) for r in allrows] == \
        [("cell-c1", 42.5, "finished"), ("plan", 75.0, "stopped"), ("plan", 30.0, "finished")]
    lines = gpu_seconds_lines(allrows)
    assert lines[0].startswith("GPU-held seconds: 148 s over 3 job(s)") and "stopped 75 s" in lines[0]


class _Counting(Evaluator):
    """An evaluator without a model: ``run`` returns records whose decode time is the config's
    ``cost`` (a fixed per-config speed), counting the timing passes per config."""

    def __init__(self, prompts, reuse: bool, stock_config: dict | None = None):
        stock = [_rec(p["request_id"], "stock", 0.1, 2.0, new=6, repeats=[2.0, 2.1]) for p in prompts]
        for r in stock:
            r.engine_config = dict(stock_config or {})
        refs = ([_rec(p["request_id"], "ar", 0.1, 4.0, new=6) for p in prompts], stock)
        super().__init__(None, prompts, 6, 1, {"gpu": "cpu"}, 16, 1e-3, repeats=2, references=refs,
                         reuse_base=reuse)
        self.passes: dict[str, int] = {}

    def run(self, engine, config, prompts=None, max_seq=None, warmup=True):
        key = json.dumps(config, sort_keys=True)
        self.passes[key] = self.passes.get(key, 0) + 1
        return [_rec(p["request_id"], engine, 0.1, config.get("cost", 1.0), new=6)
                for p in (prompts or self.prompts)]


def test_the_base_is_timed_once_per_round(tmp_path):
    """With reuse_base the plan times the round's base once (``repeats`` passes); its records, read
    back from the plan's evidence by an agent's evaluator, are every trial's base there: only the
    candidates run. Without it each trial re-times the base beside its candidate (as before)."""
    prompts = [{"request_id": f"p{i}", "prompt_ids": [1, 2, 3]} for i in range(3)]
    base, cands = {"block_size": 16, "cost": 1.0}, [{"block_size": 12, "cost": 0.8}, {"block_size": 8, "cost": 1.25}]
    plan = _Counting(prompts, reuse=True)
    base_recs = plan.time_config(base)
    ev = Evidence(tmp_path / "plan-trials.jsonl")
    ev.add("base", base_recs)
    ev.write()
    agent = _Counting(prompts, reuse=True)  # another job: the base comes from the plan's evidence
    assert agent.keep(base, Evidence.read(tmp_path / "plan-trials.jsonl", "base")) == 3
    gains = [agent.measure(c, base)[0] for c in cands]
    assert plan.passes == {json.dumps(base, sort_keys=True): 2}
    assert agent.passes.get(json.dumps(base, sort_keys=True)) is None
    assert all(agent.passes[json.dumps(c, sort_keys=True)] == 2 for c in cands)
    cand, b = agent.measure(cands[0], base)
    assert [r.decode_s for r in b] == [1.0] * 3 and [r.decode_s for r in cand] == [0.8] * 3
    assert b[0].decode_s_repeats == [1.0, 1.0] and len(gains) == 2
    # records that do not fit this step (another token count) are not reused: the base is timed again
    other = _Counting(prompts, reuse=True)
    assert other.keep(base, [_rec(p["request_id"], "specpilot", 0.1, 1.0, new=9, repeats=[1.0]) for p in prompts]) == 0
    old = _Counting(prompts, reuse=False)
    for c in cands:
        old.measure(c, base)
    assert old.passes[json.dumps(base, sort_keys=True)] == 4  # re-timed beside every candidate
    # round 1's base is stock's config: the stock references ran exactly it, so they are its timings
    plan1 = _Counting(prompts, reuse=True, stock_config={"block_size": 16, "kernels": {"any": 1}, "path": "eager"})
    assert [r.decode_s for r in plan1.time_config({"block_size": 16})] == [2.0] * 3 and plan1.passes == {}
    plan1.measure({"block_size": 12}, {"block_size": 16})
    assert list(plan1.passes.values()) == [2]
    other_cfg = _Counting(prompts, reuse=True, stock_config={"block_size": 16, "overlap": True})
    other_cfg.time_config({"block_size": 16})
    assert other_cfg.passes == {json.dumps({"block_size": 16}): 2}


"""Agent decisions above timing noise (issue 34 item 4), with a synthetic timing source: the real
Evaluator.measure / trial (the table's bootstrap interval) over records whose decode times are a
known gain per config times seeded log-normal noise; token forcing passes (there is no model).

- a gain noise could explain (true gain below min_gain) keeps the base in every re-run, although
  the point estimate alone would have kept a candidate in some of them;
- a winner clear of min_gain is kept in every re-run, and the same one, although two candidates
  the measurement cannot tell apart swap places by point estimate between re-runs;
- the integration confirms on fresh repeats and records the interval.
"""

from __future__ import annotations

import math
import random

import pytest

from specpilot.agent import directions as dirs
from specpilot.agent.decide import choose, clears, rank
from specpilot.agent.policies import OfflinePolicy
from specpilot.agent.rounds import decide, search
from specpilot.agent.trial import Evaluator
from specpilot.records import Record

MIN_GAIN = 1.02
N_REQUESTS = 5  # one calibration prompt per benchmark, as the embedded default
SEEDS = range(12)


def record(rid: str, engine: str, decode_s: float) -> Record:
    return Record(request_id=rid, benchmark=rid.split("/")[0], deployment="synthetic", target="t", drafter="dflash",
                  gpu="cpu", engine=engine, concurrency=1, prompt_tokens=4, new_tokens=3, prefill_s=0.01,
                  decode_s=decode_s, verify_steps=1, committed_per_step=[2], output_ids=[5, 6, 7])


class SyntheticTiming(Evaluator):
    """An Evaluator whose timing source is synthetic: request i decodes in ``base_s[i] / gain(config)``
    seconds times exp(noise x N(0, 1)) per run (seeded); token forcing always passes."""

    def __init__(self, gain, seed: int, noise: float = 0.05, repeats: int = 2):
        self.gain, self.rng, self.noise = gain, random.Random(seed), noise
        prompts = [{"request_id": f"b{i}/{i:04d}", "prompt_ids": [1, 2, 3, 4]} for i in range(N_REQUESTS)]
        self.base_s = {p["request_id"]: 0.5 + 0.25 * i for i, p in enumerate(prompts)}
        ar = [record(p["request_id"], "ar", 2 * self.base_s[p["request_id"]]) for p in prompts]
        stock = [record(p["request_id"], "stock", self.base_s[p["request_id"]]) for p in prompts]
        super().__init__(None, prompts, 3, 1, {}, 8, 1e-3, repeats=repeats, references=(ar, stock))

    def run(self, engine, config, prompts=None):
        g = self.gain(config)
        return [record(p["request_id"], engine, self.base_s[p["request_id"]] / g * math.exp(self.noise * self.rng.gauss(0, 1)))
                for p in (prompts or self.prompts)]

    def gate(self, records, prompts=None):
        return {"passed": True, "violations": 0}


def block_gain(gains: dict[int, float]):
    return lambda config: gains.get(config.get("block_size", 8), 1.0)


def agent_run(gains: dict[int, float], seed: int) -> dict:
    ev = SyntheticTiming(block_gain(gains), seed)
    return search(ev, dirs.REGISTRY["block_size"], {"block_size": 8}, 6, OfflinePolicy(), [], {}, None, MIN_GAIN)


def round_run(gains: dict[int, float], seed: int) -> tuple[dict, dict, dict, str]:
    """One round of the block_size direction: the agent's search, then the integration (a separate
    job, so its own timings) -> (agent file, chosen config, its trial, why)."""
    a = agent_run(gains, seed)
    winners = [("block_size", a["best"])] if a["best"] else []
    ev = SyntheticTiming(block_gain(gains), 1000 + seed)
    return (a, *decide(ev, {"block_size": 8}, winners, MIN_GAIN, 0.98, None))


def test_a_gain_noise_could_explain_keeps_the_base_in_every_rerun():
    # blocks 10 and 6 are barely faster (1 %); min_gain asks for 2 %
    runs = [round_run({10: 1.01, 6: 1.01}, seed) for seed in SEEDS]
    assert [chosen for _, chosen, _, _ in runs] == [{"block_size": 8}] * len(runs)
    full = [t for a, *_ in runs for t in a["trials"] if t["rung"] == 1]
    # the point estimate alone (today's rule) would have kept a candidate in some re-runs
    assert sum(any(t["gain"] >= MIN_GAIN for t in a["trials"] if t["rung"] == 1) for a, *_ in runs) >= 3
    # an agent's winner that cleared min_gain by luck does not clear it again on the integration's
    # own measurement
    assert all(not why.startswith("confirmed") for a, _, _, why in runs if a["best"])
    assert all(t["gain_lo"] <= t["gain"] <= t["gain_hi"] for t in full)


def test_a_clear_winner_is_kept_in_every_rerun_and_always_the_same():
    # blocks 10 and 12 are both 20 % faster: the measurement cannot tell them apart
    gains = {10: 1.20, 12: 1.205, 6: 0.95, 5: 0.9}
    runs = [round_run(gains, seed) for seed in SEEDS]
    assert [chosen for _, chosen, _, _ in runs] == [{"block_size": 10}] * len(runs)
    for a, _, result, why in runs:
        assert a["best"]["params"] == {"block_size": 10} and a["best"]["gain_lo"] >= MIN_GAIN
        assert why.startswith("confirmed") and MIN_GAIN <= result["gain_lo"] <= result["gain"] <= result["gain_hi"]
    # by point estimate alone the two swap places between re-runs (today's rule flips)
    by_point = [max((t for t in a["trials"] if t["rung"] == 1), key=lambda t: t["gain"])["params"]
                for a, *_ in runs]
    assert {"block_size": 12} in by_point and {"block_size": 10} in by_point


def test_the_confirmation_is_a_fresh_measurement_with_one_more_repeat():
    seen = []

    class Counting(SyntheticTiming):
        def measure(self, config, base, prompts=None):
            seen.append((dict(config), self.repeats))
            return super().measure(config, base, prompts)

    ev = Counting(block_gain({10: 1.3}), 0)
    winner = dict(ev.trial({"block_size": 10}, {"block_size": 8}), params={"block_size": 10})
    seen.clear()
    chosen, result, _ = decide(ev, {"block_size": 8}, [("block_size", winner)], MIN_GAIN, 0.98, None)
    assert chosen == {"block_size": 10}
    assert seen == [({"block_size": 10}, 2), ({"block_size": 10}, 3)]  # integration, then confirmation
    assert len(result["gate"]) and result is not winner


def test_rank_and_choose_are_stable_and_need_the_interval():
    t = lambda g, lo, hi, p, passed=True: {"gain": g, "gain_lo": lo, "gain_hi": hi, "params": p,  # noqa: E731
                                           "gate": {"passed": passed}}
    a, b, c = t(1.10, 1.05, 1.15, "a"), t(1.12, 1.06, 1.18, "b"), t(1.50, 1.45, 1.55, "c")
    order = {"a": 0, "b": 1, "c": 2}
    assert [r["params"] for r in rank([b, a], lambda r: order[r["params"]])] == ["a", "b"]  # tied: fixed order
    assert [r["params"] for r in rank([a, b, c], lambda r: order[r["params"]])] == ["c", "b", "a"]
    assert choose([t(1.05, 1.01, 1.09, "x")], lambda r: 0, MIN_GAIN) is None  # point above, interval not
    assert choose([t(1.30, 1.2, 1.4, "y", passed=False)], lambda r: 0, MIN_GAIN) is None
    assert clears(t(1.05, 1.02, 1.09, "z"), MIN_GAIN) and not clears(t(1.05, 1.019, 1.09, "z"), MIN_GAIN)


@pytest.mark.parametrize("seed", [0, 1])
def test_agent_file_records_the_interval(seed):
    r = agent_run({10: 1.2}, seed)
    assert r["min_gain"] == MIN_GAIN
    assert all({"gain_lo", "gain_hi"} <= set(t) for t in r["trials"])


def test_a_direction_the_memory_trials_measured_whole_gets_no_agent():
    """The 27B hybrid round on the H200 (2026-12-05) re-timed overlap in an agent after its memory
    trial had measured the same config: such a direction is covered, the next one is planned."""
    ctx = {"drafter": "dflash", "gpu": "h200", "dense": True, "directions": ["overlap", "block_size"]}
    gaps = {"host": 2e-4, "acceptance": 1e-4}
    base = {"block_size": 16}
    assert dirs.plan_directions(ctx, gaps, base, 1) == ["overlap"]
    tried = [{"direction": "overlap", "params": {"overlap": True}, "merged": False, "gain": 1.013}]
    assert dirs.covered(dirs.REGISTRY["overlap"], base, tried)
    assert dirs.plan_directions(ctx, gaps, base, 1, ["overlap"]) == ["block_size"]
    # a merged trial measured something else (with other entries): not a cover
    merged = [dict(tried[0], merged=True)]
    assert not dirs.covered(dirs.REGISTRY["overlap"], base, merged)
    # a grid of many points is not covered by one trial of it
    one = [{"direction": "block_size", "params": {"block_size": 8}, "merged": False}]
    assert not dirs.covered(dirs.REGISTRY["block_size"], base, one)


def test_final_config_copies_the_last_round_and_refuses_other_files(tmp_path):
    """`specpilot final` (no torch: on the GPU study's critical path) writes the round's config,
    its calibration figures and the cost model lines; a file that is not an integration is refused."""
    import json
    import subprocess
    import sys

    from specpilot.agent.final import final_config
    from specpilot.errors import SpecpilotError

    integrated = {"config": {"block_size": 16, "overlap": True}, "round": 2, "speedup_vs_ar": 3.4, "tau": 4.2,
                  "gate": {"passed": True}}
    out = final_config(integrated, "cost model\nverify 1.0x\n")
    assert out["engine_config"] == {"block_size": 16, "overlap": True} and out["round"] == 2
    assert out["validated_by_token_forcing"] is True and out["costmodel"] == ["cost model", "verify 1.0x"]
    with pytest.raises(SpecpilotError, match="no gate"):
        final_config({k: v for k, v in integrated.items() if k != "gate"})
    (tmp_path / "i.json").write_text(json.dumps(integrated))
    code = ("import sys; from specpilot.cli import main; rc = main(['final', '--integrated', sys.argv[1], "
            "'--out', sys.argv[2]]); assert 'torch' not in sys.modules, 'final imported torch'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "i.json"), str(tmp_path / "s.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "s.json").read_text())["tau_calibration"] == 4.2

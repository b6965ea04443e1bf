"""Two runs of the agent rounds keep the same decisions (issue 60, slow).

The rounds of one deployment of the quick build run twice, in two fresh copies of the workflow
(the calibration prompts, references and every timing measured anew), up to the round's engine
config. The directions planned and the integrated config (the engine the specpilot cells serve)
must agree. Sequential trials (config ``rounds.calibration_cap``) are on, as in the
embedded default, and each trial's rungs are recorded in the agent and integration files.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from test_workflow_rerun import RUN_TIMEOUT, make_workdir, snakemake_cmd

# A comparison of two timed runs (targets live in benchmarks, not in timed unit tests): under CI's two
# test workers the other worker's interpreted tests share the 2 cores, and on 2026-12-07 one such CI
# run kept {"verify_path": "fused"} in the first run and stopped it as futile on its 2-request rung
# 0 (gain 0.90 [0.57, 1.42]) in the second. It runs on an idle machine with SPECPILOT_REPLICATION=1;
# the embedded default twice on the same machine is the replication record (BENCHMARKS.md).
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("SPECPILOT_REPLICATION"),
                                 reason="two timed runs compared: set SPECPILOT_REPLICATION=1 on an idle machine")]

TARGET = "results/cpu/tiny/single/specpilot.json"


def decisions(work: Path) -> dict:
    """What a run's round decided: directions, each agent's kept params, the integrated config;
    with the trials' rungs (for the assertions on what the files record)."""
    r1 = work / "results/cpu/tiny/single/rounds/round-1"
    plan = json.loads((r1 / "plan.json").read_text())
    agents = {p.stem: json.loads(p.read_text()) for p in sorted(r1.glob("agent-*.json"))}
    integrated = json.loads((r1 / "integrated.json").read_text())
    return {"directions": plan["directions"],
            "kept": {name: (a["best"] or {}).get("params") for name, a in agents.items()},
            "config": integrated["config"],
            "rungs": [t.get("rungs") for a in agents.values() for t in a["trials"]] +
                     [t.get("rungs") for t in integrated["trials"]]}


def test_two_runs_of_the_rounds_keep_the_same_decisions(tmp_path, quick_deployment):
    runs = []
    for i in range(2):
        work = make_workdir(tmp_path / f"run{i}", quick_deployment)  # the quick build copied in: no build job
        cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
        cfg["engines"] = ["ar", "stock", "specpilot"]
        cfg["rounds"].update(count=1, agents_per_round=2, budget=2, calibration_prompts=1, calibration_cap=4,
                             max_new_tokens=16)
        (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        log = tmp_path / f"run{i}.log"
        with open(log, "w") as f:
            r = subprocess.run(snakemake_cmd(TARGET), cwd=work, stdout=f, stderr=subprocess.STDOUT,
                               timeout=RUN_TIMEOUT)
        assert r.returncode == 0, log.read_text()[-5000:]
        runs.append(decisions(work))
    a, b = runs
    assert a["directions"] and a["directions"] == b["directions"]
    # the engine each run keeps (what the table's specpilot cells serve); the agents' own picks are
    # in the message when it differs
    assert a["config"] == b["config"], f"the two runs kept different engines: {a} / {b}"
    for run in runs:  # every sequential trial's rungs are in the files: rising request counts, <= the cap
        full = [r for r in run["rungs"] if r]
        assert full and all([x["requests"] for x in r] == sorted({x["requests"] for x in r}) for r in full)
        assert all(r[-1]["requests"] <= 4 * 2 for r in full)  # cap 4 x the 2 benchmarks

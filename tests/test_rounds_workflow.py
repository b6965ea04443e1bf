"""Agent rounds in the workflow (slow): two rounds on a reduced embedded default; a run killed
during round 1 after an agent finished resumes without rerunning that agent; the table shows
specpilot with token forcing passed on 100% of its outputs; the memory lists validated mechanisms
with their gains; the rounds figure is drawn.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from test_workflow_rerun import RUN_TIMEOUT, kill_group, make_workdir, run_to_end, snakemake_cmd

pytestmark = pytest.mark.slow


def rounds_workdir(path: Path, build: Path) -> Path:
    work = make_workdir(path, build)
    cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
    cfg["engines"] = ["ar", "stock", "specpilot"]
    cfg["rounds"].update(count=2, agents_per_round=2, budget=2, calibration_prompts=1, max_new_tokens=32,
                         calibration_cap=None)  # one measurement per trial (sequential: test_replication.py)
    (work / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return work


def test_rounds_resume_and_feed_the_specpilot_column(tmp_path, quick_deployment):
    work = rounds_workdir(tmp_path / "wf", quick_deployment)  # the quick build copied in: no build job
    log = tmp_path / "run.log"
    r1 = work / "results" / "cpu" / "tiny" / "single" / "rounds" / "round-1"
    with open(log, "w") as f:
        proc = subprocess.Popen(snakemake_cmd(), cwd=work, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT
    agents: list[Path] = []
    while time.monotonic() < deadline and proc.poll() is None:
        agents = sorted(r1.glob("agent-*.json"))
        if agents and not (r1 / "integrated.json").exists():
            break
        time.sleep(0.2)
    assert proc.poll() is None and agents, "the run ended before an agent finished"
    kill_group(proc)
    done = {p: p.stat().st_mtime_ns for p in r1.glob("agent-*.json")}
    assert done and not (r1 / "integrated.json").exists()

    subprocess.run(snakemake_cmd("--unlock"), cwd=work, capture_output=True, timeout=300)
    with open(log, "a") as f:
        f.write("\n===== resumed =====\n")
    run_to_end(work, log)
    resumed = log.read_text().split("===== resumed =====")[1]
    for p, mtime in done.items():
        assert p.stat().st_mtime_ns == mtime, f"{p.name} was rerun after the resume"
        assert f"output: results/cpu/tiny/single/rounds/round-1/{p.name}" not in resumed

    # round 2 planned from round 1's integrated config
    plan2 = json.loads((work / "results/cpu/tiny/single/rounds/round-2/plan.json").read_text())
    integ1 = json.loads((r1 / "integrated.json").read_text())
    assert plan2["base_config"] == integ1["config"]
    final = json.loads((work / "results/cpu/tiny/single/specpilot.json").read_text())
    integ2 = json.loads((work / "results/cpu/tiny/single/rounds/round-2/integrated.json").read_text())
    assert final["engine_config"] == integ2["config"] and final["validated_by_token_forcing"]

    table = pd.read_csv(work / "results" / "cpu" / "table.csv", keep_default_na=False)
    cells = table[table["benchmark"] != "geomean"]
    assert (cells["specpilot_forcing"] == "pass").all()
    assert all(float(x) > 0 for x in cells["specpilot_speedup"])
    for f in work.glob("results/cpu/tiny/*/specpilot-c1.forcing.json"):
        v = json.loads(f.read_text())
        assert v["passed"] and v["tokens_checked"] > 0
    # memory: round k's snapshot = round k-1's plus exactly the winners integrated in round k, each
    # with its gain and evidence; results/memory.jsonl is the merge of the last snapshot
    rounds = work / "results/cpu/tiny/single/rounds"
    snaps = [[json.loads(line) for line in (rounds / f"round-{k}/memory.jsonl").read_text().splitlines()]
             for k in range(3)]
    assert snaps[0] == []  # the only deployment starts from no memory
    for k, integ in ((1, integ1), (2, integ2)):
        new = [e for e in snaps[k] if e["id"] not in {p["id"] for p in snaps[k - 1]}]
        kept = [w for w in integ["winners"] if all(integ["config"].get(p) == v for p, v in w["params"].items())]
        assert sorted((e["direction"], json.dumps(e["params"])) for e in new) == \
            sorted((w["direction"], json.dumps(w["params"])) for w in kept), (k, new, kept)
        assert all(e["round"] == k and e["gain"] >= 1.02 and e["evidence"] and e["status"] == "valid" for e in new)
    shared = [json.loads(line) for line in (work / "results" / "memory.jsonl").read_text().splitlines()]
    assert shared == sorted(snaps[2], key=lambda e: e["id"])
    assert (work / "results" / "cpu" / "figures" / "rounds.png").stat().st_size > 0
    assert json.loads((work / "results/cpu/kernels/tiny/single/kernel-agent.json").read_text())["applies"] is False
    for f in work.glob("results/cpu/tiny/*/*-c1.jsonl"):  # every cell recorded the kernels it used
        assert json.loads(f.read_text().splitlines()[0])["engine_config"]["kernels"]["applies"] is False

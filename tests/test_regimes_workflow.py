"""Two serving regimes through the workflow (issue 53; slow: two runs of the tiny deployment, a few
minutes on 2 cores). `.test/config/regimes.yaml` without its batched regime runs first (the single
regime alone, as an old config); then the batched regime is added:

- its dry run plans none of the finished single regime's jobs (only the batched regime's, and the
  shared table, figures and merged memory), and the run leaves the single regime's files untouched;
- each regime has its own calibration prompts (at least 2 x its tuned concurrency), rounds, plan,
  engine config and cells; the batched plan ranks its directions from a cost model measured at c4
  and chooses what :func:`~specpilot.agent.directions.plan_directions` chooses from those gaps;
- the batched round starts from the single regime's memory (never the other way), its memory
  entries carry their regime, and the table has rows of both regimes, forcing passed everywhere.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from specpilot.agent import directions as dirs
from test_memory_workflow import jobs_of
from test_workflow_rerun import RUN_TIMEOUT, WORKFLOW_FILES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".test" / "config" / "regimes.yaml"
SHARED = {"all", "table", "figures", "rounds_figure", "memory"}
pytestmark = pytest.mark.slow


def smk(work: Path, config: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", config, *args],
                       cwd=work, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    return r.stdout + r.stderr


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_deployment, data_dir):
    """(work folder, the dry run that added the batched regime, result mtimes before it ran)."""
    work = tmp_path_factory.mktemp("regimes")
    for name in WORKFLOW_FILES + ["config/config.yaml"]:
        src, dst = ROOT / name, work / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    cfg = {**yaml.safe_load(CONFIG.read_text()), "data_dir": str(data_dir)}
    single = {k: v for k, v in cfg.items() if k != "regimes"}
    (work / "config" / "single.yaml").write_text(yaml.safe_dump(single, sort_keys=False))
    (work / "config" / "test.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copytree(tiny_deployment, work / "resources" / "deployments" / "tiny")  # the build, reused
    smk(work, "config/single.yaml")
    dry = smk(work, "config/test.yaml", "-n")
    before = {p: p.stat().st_mtime_ns for p in (work / "results").rglob("*") if p.is_file()}
    smk(work, "config/test.yaml")
    return work, dry, before


def test_adding_a_regime_reruns_none_of_the_finished_ones(finished):
    work, dry, before = finished
    jobs = jobs_of(dry)
    assert {("round_plan", "gpu=cpu, deployment=tiny, regime=batched, k=1")} <= set(jobs), jobs
    stale = [(r, w) for r, w in jobs if r not in SHARED and "regime=batched" not in w and "concurrency=4" not in w]
    assert not stale, stale
    rewritten = sorted(str(p.relative_to(work)) for p, t in before.items() if p.stat().st_mtime_ns != t)
    assert all(p.startswith(("results/cpu/table.csv", "results/cpu/figures/", "results/memory.jsonl"))
               for p in rewritten), rewritten


def test_each_regime_has_its_rounds_config_and_calibration(finished):
    work = finished[0]
    cfg = yaml.safe_load(CONFIG.read_text())
    for regime, tune in (("single", 1), ("batched", cfg["regimes"]["batched"]["tune"])):
        spec = json.loads((work / f"results/cpu/tiny/{regime}/specpilot.json").read_text())
        assert spec["regime"] == regime and spec["tuned_concurrency"] == tune
        plan = json.loads((work / f"results/cpu/tiny/{regime}/rounds/round-1/plan.json").read_text())
        assert plan["regime"] == regime and plan["concurrency"] == tune and plan["costmodel_batch"] == tune
        calibration = _lines(work / f"results/prompts/tiny/{regime}/calibration.jsonl")
        assert len(calibration) >= (2 * tune if tune > 1 else 1), len(calibration)
        refs = _lines(work / f"results/cpu/tiny/{regime}/rounds/references/stock.jsonl")
        assert {r["concurrency"] for r in refs} == {tune}


def test_batched_plan_ranked_by_the_c4_cost_model(finished):
    """The ranking is the cost model's at c4 (its gaps, largest first), not a fixed order; the chosen
    directions are plan_directions' on those gaps; they are the batched regime's directions."""
    work = finished[0]
    rd = work / "results/cpu/tiny/batched/rounds/round-1"
    cm = json.loads((rd / "costmodel.json").read_text())
    plan = json.loads((rd / "plan.json").read_text())
    assert cm["batch"] == 4 and plan["ranked_terms"] == [t["term"] for t in cm["terms"]]
    gaps = {t["term"]: t["gap_s_per_token"] for t in cm["terms"]}
    assert "speculation" in gaps  # measured against AR at c4
    ranked = plan["ranked_directions"]
    assert [r["gap_s_per_token"] for r in ranked] == sorted((r["gap_s_per_token"] for r in ranked), reverse=True)
    assert all(r["gap_s_per_token"] == gaps.get(r["cost_term"], 0.0) for r in ranked)
    names = {r["direction"] for r in ranked}
    assert {"batch_block", "spec_gate"} <= names and "block_size" not in names
    ctx = plan["context"]
    assert ctx["concurrency"] == 4 and ctx["regime"] == "batched"
    agents = yaml.safe_load(CONFIG.read_text())["rounds"]["agents_per_round"]
    assert plan["directions"] == dirs.plan_directions(ctx, gaps, plan["base_config"], agents, plan["covered_by_memory"])


def test_memory_flows_from_the_earlier_regime(finished):
    work = finished[0]
    single_last = {e["id"] for e in _lines(work / "results/cpu/tiny/single/rounds/round-1/memory.jsonl")}
    batched_start = {e["id"] for e in _lines(work / "results/cpu/tiny/batched/rounds/round-0/memory.jsonl")}
    assert single_last == batched_start  # the batched round starts from the single regime's memory
    batched_last = _lines(work / "results/cpu/tiny/batched/rounds/round-1/memory.jsonl")
    new = [e for e in batched_last if e["id"] not in single_last]
    assert all(e["regime"] == "batched" and e["concurrency"] == 4 for e in new), new
    shared = _lines(work / "results/memory.jsonl")
    assert all(e.get("regime") in ("single", "batched") for e in shared), shared
    assert {e["id"] for e in shared} == single_last | {e["id"] for e in batched_last}
    plan = json.loads((work / "results/cpu/tiny/batched/rounds/round-1/plan.json").read_text())
    applicable = {d.name for d in dirs.applicable(plan["context"])}
    carried = {e["direction"] for e in _lines(work / "results/cpu/tiny/single/rounds/round-1/memory.jsonl")
               if e["status"] == "valid" and e["gain"] > 1.0 and e["direction"] in applicable}
    assert {t["direction"] for t in plan["memory_tried"]} == carried  # re-measured at c4, listed in the plan


def test_table_rows_of_both_regimes(finished):
    work = finished[0]
    cfg = yaml.safe_load(CONFIG.read_text())
    table = pd.read_csv(work / "results/cpu/table.csv")
    cells = table[(table["benchmark"] != "geomean")]
    want = sorted([("tiny", "single", 1, b) for b in cfg["benchmarks"]] + [("tiny", "batched", 4, b) for b in cfg["benchmarks"]])
    assert sorted(zip(cells["deployment"], cells["regime"], cells["concurrency"], cells["benchmark"])) == want
    assert set(cells["forcing"]) == {"pass"}
    assert (cells.loc[cells["regime"] == "batched", "n_requests"] >= 4).all()

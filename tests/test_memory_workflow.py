"""The data flow of the agent rounds as Snakemake sees it (slow, a few minutes on 2 cores).

One run of `.test/config/rounds.yaml` (two quick tiny deployments, one round each, the second
starting from the first's memory) in a copy of the workflow, the quick deployment copied in for
both so no build runs. Then:

- every file under results/ is a declared output of the run (`snakemake --summary` lists it, or it
  lies inside a declared directory output): nothing written behind Snakemake's back;
- every declared intermediate output is an input of some job: nothing written that nobody reads;
- after one deployment's memory snapshot changes, a dry run schedules exactly the jobs downstream
  of it (the second deployment's rounds and specpilot cells, the table, the merged memory), the
  rerun leaves every other file untouched, and the second deployment's plan tried the new entry.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_workflow_rerun import RUN_TIMEOUT, WORKFLOW_FILES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".test" / "config" / "rounds.yaml"
pytestmark = pytest.mark.slow


def smk(work: Path, *args: str, timeout: int = RUN_TIMEOUT) -> str:
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "config/test.yaml", *args],
                       cwd=work, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    return r.stdout + r.stderr


def job_blocks(dry_run: str):
    """(rule, body) of every job in a dry run's listing."""
    return [(m[1], m[2]) for m in re.finditer(r"^(?:local)?(?:rule|checkpoint) (\w+):\n((?:    .*\n)+)", dry_run, re.M)]


def field(body: str, name: str) -> list[str]:
    m = re.search(rf"^    {name}: (.*)$", body, re.M)
    return [x.strip() for x in m[1].split(",")] if m else []


def jobs_of(dry_run: str) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job in a dry run's listing."""
    return [(rule, ", ".join(field(body, "wildcards"))) for rule, body in job_blocks(dry_run)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, quick_deployment, data_dir):
    work = tmp_path_factory.mktemp("memwf")
    for name in WORKFLOW_FILES:
        src, dst = ROOT / name, work / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    cfg = yaml.safe_load(CONFIG.read_text())
    (work / "config" / "test.yaml").write_text(yaml.safe_dump({**cfg, "data_dir": str(data_dir)}, sort_keys=False))
    for dep in cfg["deployments"]:  # the quick build, reused: build.json exists, no build job runs
        shutil.copytree(quick_deployment, work / "resources" / "deployments" / dep)
    (work / "first-run.log").write_text(smk(work))  # every job of the run, with its inputs and outputs
    return work


def test_no_undeclared_file_under_results(finished):
    summary = smk(finished, "--summary", timeout=600)
    declared = {line.split("\t")[0] for line in summary.splitlines()[1:] if line.startswith("results/")}
    dirs = [d for d in declared if (finished / d).is_dir()]
    on_disk = {str(p.relative_to(finished)) for p in (finished / "results").rglob("*") if p.is_file()}
    undeclared = {f for f in on_disk - declared if not any(f.startswith(d + "/") for d in dirs)}
    assert not undeclared, sorted(undeclared)
    assert {"results/memory.jsonl", "results/cpu/tiny/single/rounds/round-1/memory.jsonl",
            "results/cpu/tiny-b/single/rounds/round-0/memory.jsonl"} <= declared

    # every declared output under results/ is an input of a job of the run (its log lists them all,
    # the agents the plan checkpoints chose included), but for the end products and the trial
    # records kept as evidence (named by the memory entries)
    inputs, outputs = set(), set()
    for _, body in job_blocks((finished / "first-run.log").read_text()):
        inputs.update(field(body, "input"))
        outputs.update(o for o in field(body, "output") if o.startswith("results/"))
    end = re.compile(r"results/(memory\.jsonl|cpu/table\.csv|cpu/figures/.*\.png)$")
    evidence = re.compile(r".*/round-\d+/(plan-trials\.jsonl|agent-[a-z0-9_]+\.trials\.jsonl|integrated\.jsonl)$")
    unread = {o for o in outputs - inputs if not end.match(o) and not evidence.match(o)}
    assert not unread, sorted(unread)
    assert {"results/cpu/tiny/single/rounds/round-1/costmodel.json", "results/cpu/tiny/single/rounds/round-1/costmodel.txt",
            "results/cpu/tiny/single/rounds/references/ar.jsonl", "results/cpu/kernels/tiny-b/single/kernel-agent.json",
            "results/cpu/kernels/manifest.json"} <= inputs


def test_list_untracked_names_nothing_under_results(finished):
    """Every file the run wrote under results/ is a file of the DAG (issue 34 item 5): agent files
    and trial records of every deployment's rounds included (no directory() outputs)."""
    out = smk(finished, "--list-untracked", timeout=600)
    assert not [ln for ln in out.splitlines() if ln.startswith("results/")], out[-3000:]
    # the agents the plan chose (which ones depends on the measured cost terms): each one's trial records
    round1 = finished / "results/cpu/tiny-b/single/rounds/round-1"
    chosen = json.loads((round1 / "plan.json").read_text())["directions"]
    assert chosen and all((round1 / f"agent-{d}.trials.jsonl").is_file() for d in chosen), chosen


def test_an_added_deployment_plans_only_its_own_jobs(finished):
    """A deployment added with --configfile to the finished run (a name that sorts first) joins the
    end of the memory chain: the dry run plans its jobs, the table, figures and merged memory, and
    no job of the finished deployments (issue 34 item 3)."""
    added = {"deployments": {"aaa-added": {"target": "tiny", "drafter": "dflash", "weight_format": "fp32",
                                           "block_size": 6, "block_reason": "an added deployment", "quick": True}}}
    (finished / "config" / "added.yaml").write_text(yaml.safe_dump(added))
    jobs = jobs_of(smk(finished, "-n", "--configfile", "config/test.yaml", "config/added.yaml"))
    assert jobs
    shared = {"all", "table", "figures", "rounds_figure", "memory"}
    assert not [(r, w) for r, w in jobs if r not in shared and "deployment=aaa-added" not in w], jobs
    assert {"round_memory_start", "round_plan", "run_engine", "force", "table", "memory"} <= {r for r, _ in jobs}


def test_changed_memory_reruns_only_what_depends_on_it(finished):
    snap = finished / "results/cpu/tiny/single/rounds/round-1/memory.jsonl"
    entries = [json.loads(line) for line in snap.read_text().splitlines()]
    planted = {"direction": "block_size", "params": {"block_size": 3}, "deployment": "tiny", "gpu": "cpu",
               "target": "tiny", "drafter": "dflash", "gain": 1.5, "round": 1, "evidence": ["planted by the test"],
               "status": "valid", "reason": ""}
    from specpilot.agent import memory

    changed = memory.record(entries, planted)
    new_id = next(e["id"] for e in changed if e["evidence"] == ["planted by the test"])
    memory.write(snap, changed)
    before = {p: p.stat().st_mtime_ns for p in (finished / "results").rglob("*") if p.is_file()}

    jobs = jobs_of(smk(finished, "-n"))
    rules = {r for r, _ in jobs}
    # the first deployment's own jobs are untouched; tiny-b's cells rerun whole (ar and stock are
    # timed interleaved with specpilot in one job, so they are re-timed with it)
    assert not [j for j in jobs if "deployment=tiny," in j[1] + "," and "tiny-b" not in j[1]], jobs
    assert not rules & {"kernel_agent", "round_references", "calibration_prompts", "prompts", "ceilings", "kernels"}
    assert {"round_memory_start", "round_plan", "specpilot_config", "run_engine", "table", "memory"} <= rules
    assert all("tiny-b" in w for r, w in jobs if r in ("round_memory_start", "round_plan", "run_engine")), jobs

    smk(finished)
    rerun = {p for p, t in before.items() if p.exists() and p.stat().st_mtime_ns != t}
    rel = sorted(str(p.relative_to(finished)) for p in rerun)
    assert all("/tiny-b/" in p or p.startswith(("results/cpu/table.csv", "results/cpu/figures/", "results/memory"))
               for p in rel), rel
    start = [json.loads(line) for line in (finished / "results/cpu/tiny-b/single/rounds/round-0/memory.jsonl").read_text().splitlines()]
    assert new_id in {e["id"] for e in start}  # tiny-b learned it from tiny
    plan = json.loads((finished / "results/cpu/tiny-b/single/rounds/round-1/plan.json").read_text())
    assert new_id in {t["entry"] for t in plan["memory_tried"]}, plan["memory_tried"]
    shared = {e["id"] for e in (json.loads(line) for line in (finished / "results/memory.jsonl").read_text().splitlines())}
    assert new_id in shared

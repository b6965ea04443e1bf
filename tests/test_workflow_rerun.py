"""Rerun safety (issue item 9): an interrupted run, resumed, recomputes nothing it had finished and
ends with the same table as an uninterrupted run.

Slow: it runs the real workflow twice on a reduced config (tiny deployment built with --quick by
the first run and copied into the second, 2 benchmarks x 2 prompts x 32 new tokens, engines ar +
stock), in copies of the workflow under tmp_path. Needs the benchmark data: $SPECPILOT_DATA_DIR or ../shared/data/benchmarks.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ["Snakefile", "rules", "envs", "report", "profiles", "config/schema.yaml"]
BENCHMARKS = ["gsm8k", "mbpp"]
RUN_TIMEOUT = 1800

pytestmark = pytest.mark.slow


def data_dir() -> Path:
    d = os.environ.get("SPECPILOT_DATA_DIR") or ROOT.parent / "shared" / "data" / "benchmarks"
    if not Path(d).is_dir():
        pytest.skip("benchmark data not found (set SPECPILOT_DATA_DIR)")
    return Path(d).resolve()


def make_workdir(path: Path, build: Path | None = None) -> Path:
    """A copy of the workflow with the reduced config as its config/config.yaml; ``build``: a
    finished quick tiny build copied in as its resources/deployments/tiny (no build job runs)."""
    path.mkdir(parents=True)
    if build is not None:
        shutil.copytree(build, path / "resources" / "deployments" / "tiny")
    for name in WORKFLOW_FILES:
        src, dst = ROOT / name, path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg.update(
        gpu="cpu",
        deployments={"tiny": {**cfg["deployments"]["tiny"], "quick": True}},
        benchmarks=BENCHMARKS, n_prompts=2, max_new_tokens=32, concurrency=[1],
        engines=["ar", "stock"], data_dir=str(data_dir()),
    )
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def snakemake_cmd(*args):
    return [sys.executable, "-m", "snakemake", "--cores", "2", *args]


def run_to_end(workdir: Path, log: Path) -> None:
    with open(log, "a") as f:
        r = subprocess.run(snakemake_cmd(), cwd=workdir, stdout=f, stderr=subprocess.STDOUT,
                           timeout=RUN_TIMEOUT)
    assert r.returncode == 0, log.read_text()[-5000:]


def records_files(workdir: Path) -> list[Path]:
    return sorted((workdir / "results" / "cpu").glob("*/*/*-c*.jsonl"))


def finished_outputs(log_text: str) -> set[str]:
    """Outputs of the jobs Snakemake reported as finished (jobid -> output from the job header)."""
    outputs: dict[str, str] = {}
    for block in re.finditer(r"^(?:local)?rule \w+:\n(?P<body>(?:    .*\n)+)", log_text, re.M):
        body = block["body"]
        out = re.search(r"^    output: (.*)$", body, re.M)
        jid = re.search(r"^    jobid: (\d+)$", body, re.M)
        if out and jid:
            outputs[jid[1]] = out[1]
    done = set()
    for jid in re.findall(r"Finished jobid: (\d+)", log_text):
        done.update(p.strip() for p in outputs.get(jid, "").split(",") if p.strip())
    return done


def kill_group(proc: subprocess.Popen) -> None:
    """SIGINT to Snakemake's process group, then SIGKILL whatever is left (a hard stop)."""
    for sig, wait in [(signal.SIGINT, 3.0), (signal.SIGKILL, 10.0)]:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived Snakemake
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def comparable(table: Path) -> pd.DataFrame:
    """The table without timing-dependent columns, sorted by its key."""
    df = pd.read_csv(table, keep_default_na=False)
    keep = ["deployment", "target", "drafter", "benchmark", "concurrency", "n_requests",
            "stock_tau", "specpilot_tau", "forcing", "synthetic"]
    return df[keep].sort_values(["deployment", "benchmark", "concurrency"]).reset_index(drop=True)


def test_interrupted_run_resumes_without_recomputing(tmp_path):
    # the reference: one uninterrupted run, the quick tiny build included (the build's jobs)
    ref = make_workdir(tmp_path / "uninterrupted")
    run_to_end(ref, tmp_path / "uninterrupted.log")
    assert "rule tiny_drafter:" in (tmp_path / "uninterrupted.log").read_text()

    # the interrupted run, on a copy of that build (the same models, so the same table): stopped
    # once some records are finished and before the table
    work = make_workdir(tmp_path / "interrupted", build=ref / "resources" / "deployments" / "tiny")
    log = tmp_path / "interrupted.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(snakemake_cmd(), cwd=work, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    table = work / "results" / "cpu" / "table.csv"
    deadline = time.monotonic() + RUN_TIMEOUT
    finished: set[str] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        finished = {p for p in finished_outputs(log.read_text()) if p.endswith(".jsonl")
                    and "/prompts/" not in p}
        if finished and not table.exists():
            break
        time.sleep(0.2)
    assert proc.poll() is None and not table.exists(), "the run ended before it could be interrupted"
    kill_group(proc)
    # what Snakemake reported finished (by the time it died), with modification times
    finished = {p for p in finished_outputs(log.read_text()) if p.endswith(".jsonl")
                and "/prompts/" not in p}
    assert finished, "no records file was finished before the interrupt"
    before = {p: (work / p).stat().st_mtime_ns for p in finished if (work / p).exists()}
    assert before.keys() == finished, "a finished records file disappeared"
    assert not table.exists()

    # resume: a stale lock from the hard kill is cleared first, as a user would
    subprocess.run(snakemake_cmd("--unlock"), cwd=work, capture_output=True, timeout=300)
    with open(log, "a") as f:
        f.write("\n===== resumed =====\n")
    run_to_end(work, log)

    after = {p: (work / p).stat().st_mtime_ns for p in finished}
    assert after == before, "finished records files were recomputed on resume"
    assert len(records_files(work)) == len(records_files(ref)) == len(BENCHMARKS) * 2
    pd.testing.assert_frame_equal(comparable(table), comparable(ref / "results" / "cpu" / "table.csv"))
    for png in ["speedup", "tau", "concurrency"]:
        assert (work / "results" / "cpu" / "figures" / f"{png}.png").stat().st_size > 0

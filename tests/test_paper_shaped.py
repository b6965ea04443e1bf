"""The study config's shape end to end (issue 12): a config laid out like config/paper.yaml
(several deployments, some unavailable, real-checkpoint deployments given as local folders,
n_prompts: all, a list of concurrencies, the three engines with the agent rounds on, forcing
tolerance set) builds its table with `snakemake`. The checkpoints are tiny stand-ins written in the
Qwen3 + DFlash layout (tests/conftest.py quick_deployment); the data is a reduced copy of the
benchmark folder, so `all` means 2 prompts per benchmark; nothing comes from the environment
(SPECPILOT_DATA_DIR is unset: the config's data_dir is the only source).

Before the calibration prompts had a source of their own, this run stopped at
`specpilot prompts --role calibration` ("... exceed its rows; they would overlap").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ["Snakefile", "rules", "envs", "report", "profiles", "config"]

pytestmark = pytest.mark.slow


def reduced_data(src: Path, dest: Path) -> Path:
    """gsm8k: 2 test + 3 train rows; humaneval: 3 test rows (1 reserved for calibration)."""
    for rel, n in (("gsm8k/test.jsonl", 2), ("gsm8k/train.jsonl", 3), ("humaneval/test.jsonl", 3)):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        lines = (src / rel).read_text(encoding="utf-8").splitlines(keepends=True)[:n]
        (dest / rel).write_text("".join(lines), encoding="utf-8")
    return dest


def paper_shaped(stand_in: Path, data: Path) -> dict:
    paper = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
    real = {"target": str(stand_in / "target"), "drafter": "dflash",
            "drafter_id": str(stand_in / "drafter-dflash"), "weight_format": "fp32", "block_size": 4,
            "block_reason": "a short block for the stand-in"}  # its drafter trained at 8: a reason is needed
    return {
        "gpu": paper["gpu"],
        "deployments": {
            # the default's tiny deployments, switched off as paper.yaml does (Snakemake merges a
            # --configfile into config/config.yaml, so every default deployment must be named)
            **{name: spec for name, spec in paper["deployments"].items() if name.startswith("tiny")},
            "qwen3-8b_dflash": real,
            "qwen3-8b_dflash2": paper["deployments"]["qwen3-8b_dflash2"],
        },
        "benchmarks": ["gsm8k", "humaneval"],
        "n_prompts": paper["n_prompts"],
        "max_new_tokens": 8,
        "concurrency": [1, 2],
        "engines": paper["engines"],
        "forcing": paper["forcing"],
        "data_dir": str(data),
        "timing": {"repeats": 1},
        "rounds": {"count": 1, "agents_per_round": 1, "budget": 1, "calibration_prompts": 1, "calibration_cap": None},
    }


def test_paper_shaped_config_builds_its_table(tmp_path, quick_deployment, data_dir):
    assert yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())["n_prompts"] == "all"
    work = tmp_path / "wf"
    work.mkdir()
    for name in WORKFLOW_FILES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, work / name)
    data = reduced_data(data_dir, tmp_path / "data")
    (work / "study.yaml").write_text(yaml.safe_dump(paper_shaped(quick_deployment, data), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "SPECPILOT_DATA_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "snakemake", "results/cpu/table.csv", "--cores", "2",
                            "--configfile", "study.yaml"], cwd=work, env=env, stdout=f,
                           stderr=subprocess.STDOUT, timeout=1500)
    out = log.read_text()
    assert r.returncode == 0, out[-6000:]
    assert "skipping deployment qwen3-8b_dflash2" in out

    table = pd.read_csv(work / "results" / "cpu" / "table.csv", keep_default_na=False, na_values=[""])
    cells = table[table.benchmark != "geomean"]
    assert sorted(zip(cells.deployment, cells.benchmark, cells.concurrency)) == [
        ("qwen3-8b_dflash", b, c) for b in ("gsm8k", "humaneval") for c in (1, 2)]
    assert (cells.n_requests == 2).all()  # n_prompts: all = every evaluation row of the reduced data
    assert (cells.stock_forcing == "pass").all() and (cells.specpilot_forcing == "pass").all()
    assert (cells.stock_speedup > 0).all() and (cells.specpilot_speedup > 0).all()
    assert (cells.stock_tau >= 1).all() and (cells.specpilot_tau >= 1).all()
    assert cells.note.str.contains("stock block: a short block for the stand-in (stock block 4; the drafter was "
                                   "trained at 8)", regex=False).all()
    summary = table[(table.benchmark == "geomean") & (table.deployment == "all")]
    assert sorted(summary.concurrency) == [1, 2] and summary.stock_speedup.notna().all()

    prompts = work / "results" / "prompts" / "qwen3-8b_dflash" / "single"
    calib = [json.loads(line) for line in (prompts / "calibration.jsonl").read_text().splitlines()]
    evals = {json.loads(line)["request_id"] for b in ("gsm8k", "humaneval")
             for line in (prompts.parent / f"{b}.jsonl").read_text().splitlines()}
    assert [c["request_id"].split("/")[0] for c in calib] == ["gsm8k", "humaneval"]
    assert calib[0]["request_id"].startswith("gsm8k/train-")  # gsm8k calibrates on its train split
    assert not {c["request_id"] for c in calib} & evals and len(evals) == 4
    spec = json.loads((work / "results" / "cpu" / "qwen3-8b_dflash" / "single" / "specpilot.json").read_text())
    assert spec["validated_by_token_forcing"] is True

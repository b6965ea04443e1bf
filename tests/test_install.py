"""A non-editable install runs the CLI end to end (slow: builds the package, ~1 min).

``pip install --no-deps --target`` of a copy of the package sources (no repository beside it), then
every step the workflow runs after the deployment build, from a working directory outside the
repository with only the installed copy importable, on the quick tiny deployment (the session's
fixture): prompts, the kernel manifest and sub-agent, AR and stock cells with the kernel outputs,
token forcing, a replay run with a packaged acceptance profile, the table; and the w12 Triton
module and tuned tables found as package data (no climb into a checkout).
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

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_non_editable_install_runs_the_cli(tmp_path, data_dir, quick_deployment):
    src = tmp_path / "sdist"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(src)  # nothing of the sources is left to fall back on

    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "SPECPILOT_DATA_DIR": str(data_dir)}

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "specpilot", *map(str, args)], cwd=work, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (args, r.stdout[-3000:], r.stderr[-3000:])
        return r.stdout

    where = subprocess.run([sys.executable, "-c", "import specpilot, specpilot.kernels as k; "
                            "print(specpilot.__file__); print(k.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    assert (site / "specpilot" / "kernels" / "tuned" / "w12_h200.json").is_file()
    assert (site / "specpilot" / "kernels" / "w12_triton.py").is_file()

    dep = quick_deployment
    assert "--quick" in cli("build-tiny", "--help")
    cli("prompts", "--tokenizer", dep / "target", "--benchmark", "gsm8k", "--n-prompts", 2, "--role", "eval",
        "--data-dir", data_dir, "--out", work / "p.jsonl")
    cli("kernels", "--gpu", "cpu", "--out-dir", work / "kernels")
    cli("round", "kernels", "--target", dep / "target", "--gpu", "cpu", "--ceilings", work / "none.json",
        "--kernels-manifest", work / "kernels" / "manifest.json", "--out", work / "kernels" / "kernel-agent.json")
    cell = work / "results" / "cpu" / "quick" / "gsm8k"  # the workflow's layout (the table reads it)
    base = ["run", "--target", dep / "target", "--drafter", dep / "drafter-dflash", "--prompts", work / "p.jsonl",
            "--max-new-tokens", 12, "--gpu", "cpu", "--deployment", "quick", "--block-size", 4,
            "--block-reason", "a short block keeps the test fast",
            "--kernels-manifest", work / "kernels" / "manifest.json",
            "--kernel-agent", work / "kernels" / "kernel-agent.json"]
    cli(*base, "--engine", "ar", "--out", cell / "ar-c1.jsonl")
    cli(*base, "--engine", "stock", "--out", cell / "stock-c1.jsonl")
    cli("force", "--candidate", cell / "stock-c1.jsonl", "--reference", cell / "ar-c1.jsonl", "--target", dep / "target",
        "--drafter", dep / "drafter-dflash", "--max-new-tokens", 12, "--prompts", work / "p.jsonl",
        "--out", cell / "stock-c1.forcing.json")
    verdict = json.loads((cell / "stock-c1.forcing.json").read_text())
    assert verdict["passed"] and verdict["tokens_checked"] > 0
    cli(*base, "--engine", "stock", "--replay-profile", "study_stock", "--replay-reference", cell / "ar-c1.jsonl",
        "--out", work / "replay.jsonl")
    rows = [json.loads(line) for line in (work / "replay.jsonl").read_text().splitlines()]
    assert all(r["synthetic"] and r["engine_config"]["replay_profile"] == "study_stock" for r in rows)
    stock = [json.loads(line) for line in (cell / "stock-c1.jsonl").read_text().splitlines()]
    assert all(r["engine_config"]["kernels"] == {"applies": False, "reason": stock[0]["engine_config"]["kernels"]["reason"]}
               and "cpu" in r["engine_config"]["kernels"]["reason"] for r in stock)
    cli("table", "--records", cell / "ar-c1.jsonl", cell / "stock-c1.jsonl", "--forcing", cell / "stock-c1.forcing.json",
        "--out", work / "table.csv")
    table = pd.read_csv(work / "table.csv", keep_default_na=False)
    row = table[table["benchmark"] == "gsm8k"].iloc[0]
    assert row["n_requests"] == 2 and float(row["stock_speedup"]) > 0 and row["stock_forcing"] == "pass"

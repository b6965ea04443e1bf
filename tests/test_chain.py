"""The rounds' memory chain is stable (issue 34 item 3): a deployment added with --configfile joins
the end of the chain (whatever its name) and starts from the memory of those before it, so the
deployments before it keep their inputs; config rounds.chain orders it explicitly. Dry runs only;
tests/test_memory_workflow.py adds a deployment to a finished run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
NEW = {"target": "tiny", "drafter": "dflash", "weight_format": "fp32", "block_size": 4}


def dry_run(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(work), "--snakefile",
                           str(ROOT / "Snakefile"), *args], text=True, capture_output=True, timeout=300)


def chain_sources(out: str) -> dict[str, list[str]]:
    """deployment -> the deployments whose memory its round 0 starts from (from the dry run's jobs)."""
    found = {}
    for m in re.finditer(r"^rule round_memory_start:\n((?:    .*\n)+)", out, re.M):
        body = m[1]
        dep = re.search(r"^    output: results/cpu/([^/]+)/single/rounds/round-0/memory.jsonl$", body, re.M)[1]
        inputs = re.search(r"^    input: (.*)$", body, re.M)[1].split(", ")
        found[dep] = [re.match(r"results/cpu/([^/]+)/single/rounds/", i)[1] for i in inputs if i.startswith("results/")]
    return found


def test_an_added_deployment_joins_the_end_of_the_chain(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump({"deployments": {"aaa-first-by-name": NEW}}))
    r = dry_run(tmp_path, "--configfile", str(ROOT / "config" / "config.yaml"), str(extra))
    assert r.returncode == 0, r.stderr[-3000:]
    assert chain_sources(r.stdout) == {"tiny": [], "tiny-dflash2": ["tiny"], "tiny-dspark": ["tiny-dflash2"],
                                       "aaa-first-by-name": ["tiny-dspark"]}


def test_rounds_chain_orders_the_chain(tmp_path):
    r = dry_run(tmp_path, "--configfile", str(ROOT / "config" / "config.yaml"),
                "--config", "rounds={chain: [tiny-dspark, tiny]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert chain_sources(r.stdout) == {"tiny-dspark": [], "tiny": ["tiny-dspark"], "tiny-dflash2": ["tiny"]}


def test_rounds_chain_naming_no_deployment_is_one_error(tmp_path):
    r = dry_run(tmp_path, "--configfile", str(ROOT / "config" / "config.yaml"),
                "--config", "rounds={chain: [tiny, tiny-typo]}")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "config rounds.chain names 'tiny-typo', which config deployments does not define" in out, out

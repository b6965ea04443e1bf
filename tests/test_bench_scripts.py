"""The GPU benchmark scripts' CPU dry runs: the scripts behind BENCHMARKS.md must keep running.

On the CPU they measure nothing; they exercise the same code paths (model build, correctness
checks, the w12 kernels under the Triton interpreter, the JSON they write).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args, timeout=1200):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


@pytest.mark.slow
def test_bench_engine_quick_dry_run(tmp_path):
    _run(["gpu_bench/bench_engine.py", "--dry-run", "--quick", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "engine.json").read_text())
    assert r["errors"] == [], r["errors"]
    assert set(r["ar"]) == {"b1_ctx48", "b4_ctx48"}
    assert all(d["step_s"] > 0 and d["weight_bytes"] > 0 for d in r["ar"].values())
    row = r["verify"]["torch"]
    assert row["1"]["x_ar"] == 1.0 and all(v["s"] > 0 for v in row.values())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bench_w12_quick_dry_run(tmp_path):
    out = tmp_path / "w12.json"
    _run(["gpu_bench/bench_w12.py", "--dry-run", "--quick", "--no-step", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["shapes"] and all(s["decode_exact"] for s in r["shapes"])
    for s in r["shapes"]:
        for row in (s["per_m"].values() if isinstance(s["per_m"], dict) else s["per_m"]):
            assert row["w12_cfg"] and row["w12_us"] > 0
            # every decode twin (old "base" decode, PRMT) gives the raw decode's bits
            assert row["decode_compare"] and all(c["bits_equal"] for c in row["decode_compare"])


@pytest.mark.slow
def test_bench_targets_quick_dry_run(tmp_path):
    """gpu_bench/bench_targets.py --quick on the CPU: tiny hybrid and Muse shapes, every phase runs,
    the replay-drafter stock run equals AR, and the state-memory accounting is there."""
    _run(["gpu_bench/bench_targets.py", "--quick", "--out-dir", str(tmp_path)], timeout=3000)
    r = json.loads((tmp_path / "targets.json").read_text())
    assert r["errors"] == [], r["errors"]
    for shape in ("tiny-hybrid", "tiny-muse"):
        s = r["shapes"][shape]
        assert s["correctness"]["prefill_decode_vs_block_rel_err"] < 1e-4
        assert s["ar_b1"]["step_s"] > 0 and s["verify16"]["x_ar"] > 0
        e = s["e2e"]["study_stock"]
        assert e["outputs_equal_ar"] and e["tau"] > 1
    assert r["shapes"]["tiny-hybrid"]["state_memory_per_request"]["gdn"] > 0

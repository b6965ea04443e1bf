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
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bench_tree_verify_dry_run(tmp_path):
    """gpu_bench/bench_tree_verify.py --dry-run: the engine's spine + side-branch trees and chains run
    through the Triton step under the interpreter, every step is timed against the AR step, and
    each tree's spine logits are compared with a chain verify of the spine alone."""
    _run(["gpu_bench/bench_tree_verify.py", "--dry-run", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "tree_verify.json").read_text())
    assert r["errors"] == [], r["errors"]
    assert set(r["step_ms"]) >= {"ar", "chain4", "chain8", "chain16", "tree8_s4", "tree16_s8"}
    assert r["ratio_to_ar"]["ar"] == 1.0 and all(v["ms"] > 0 for v in r["step_ms"].values())
    t = r["trees"]["tree16_s8"]  # the engine's tree: spine of the block, then branch leaves per position
    assert t["nodes"] == 16 and t["parents"] == [-1, 0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 1, 2, 2, 3, 3]
    for name in ("tree8_s4", "tree16_s8"):
        c = r["checks"][name]
        # fp32 under the interpreter: numpy's dot may round differently per row count, so near, not bits
        assert c["tree_logits_finite"] and c["spine_max_abs_diff"] < 1e-4, c
        assert set(c["per_start"]) == {"48", "59"}, c  # the context, and a block across the 64-key tile
        assert c["leaves_checked"] == 4 and c["leaf_max_abs_diff"] < 1e-4, c
    assert (tmp_path / "tree_verify_table.txt").exists()


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


def test_profile_serving_cpu_run(tmp_path):
    """gpu_bench/profile_serving.py on the CPU (tiny shape): the closed-loop scheduler serves AR, stock
    and stock with overlap asked for, every stock output equal to AR's, and the JSON behind
    BENCHMARKS.md."""
    _run(["gpu_bench/profile_serving.py", "--shape", "tiny", "--concurrency", "2", "--requests", "4",
          "--prompt-len", "32", "--new", "16", "--block", "8", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "profile_serving.json").read_text())
    assert set(r["engines"]) == {"ar", "stock", "stock+overlap"}
    for name in ("stock", "stock+overlap"):
        e = r["engines"][name]
        assert e["equal_ar"] == 4 and e["tau"] > 1.0 and e["steps"] < r["engines"]["ar"]["steps"], (name, e)
    assert not r["engines"]["stock"]["overlapped"]  # (overlap needs the CUDA-graph draft: off on the CPU)


def test_drafter_ranks_writes_a_tree_profile(tmp_path, quick_deployment, data_dir):
    """gpu_bench/drafter_ranks.py on the quick deployment: the speculative loop equals AR, and the
    profile it writes loads as a replay profile whose rank recall agrees with its own counts."""
    from specpilot.drafters.replay import expected_tau, load_profile

    out = tmp_path / "ranks.json"
    _run(["gpu_bench/drafter_ranks.py", "--deployment", str(quick_deployment), "--drafter", "dflash2", "--n", "2",
          "--new", "24", "--width", "6", "--ranks", "4", "--threads", "1", "--tree", "2,5", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["outputs_equal_ar"] == "2/2"
    t = d["tree_checks"]["branch2_depth5"]  # the drafter's own tree, beside the profile's prediction
    assert t["outputs_equal_ar"] == "2/2" and t["measured_tau"] >= 1.0 and t["predicted_tau"] >= d["expected_tau"]
    prof = load_profile(out)  # a valid profile: recall non-decreasing, first column = acceptance
    assert prof.block_size == 6 and len(prof.rates) == 5 and len(prof.recall[0]) == 4
    counts = d["rank_counts"]
    assert d["samples_per_position"][0] > 0 and [sum(c) for c in counts] == d["samples_per_position"]
    n0 = sum(counts[0])
    assert prof.recall[0][1] == pytest.approx((counts[0][0] + counts[0][1]) / n0, abs=1e-6)
    assert d["expected_tau"] == pytest.approx(expected_tau(prof, 6), abs=1e-4)

"""The benchmark suite (``specpilot bench``): its listing, and every benchmark's CPU dry run.

A dry run uses tiny shapes on the CPU (Triton kernels under the interpreter) and measures
nothing; it runs the benchmark's code, its correctness checks and the JSON it writes. Each runs
in its own process (``TRITON_INTERPRET`` must be set before Triton is imported, and a benchmark
sets torch's global state), and each test checks values its checks computed, not that a file exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.bench import BENCHMARKS

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def bench(tmp_path: Path, name: str, *options: str, rc: int = 0) -> dict:
    """Run ``specpilot bench NAME --dry-run OPTIONS`` in a subprocess; its result JSON."""
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, "-m", "specpilot", "bench", name, "--dry-run", "--out", str(out), *options],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == rc, (proc.stdout[-3000:], proc.stderr[-3000:])
    r = json.loads(out.read_text())
    assert r["benchmark"] == name and r["dry_run"] and r["command"].startswith(f"specpilot bench {name} --dry-run")
    assert r["table"] and proc.stdout.rstrip().endswith(r["table"][-1])  # the table is printed last
    return r


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """One tiny random target and DFlash drafter, written once for the module."""
    from specpilot.cli import main

    d = tmp_path_factory.mktemp("ckpt")
    assert main(["random-checkpoint", "--shape", "tiny", "--out", str(d / "target"), "--drafter-out",
                 str(d / "drafter")]) == 0
    return d / "target", d / "drafter"


def test_list_names_every_benchmark_once():
    for args in (["bench"], ["bench", "--list"]):
        out = subprocess.run([sys.executable, "-m", "specpilot", *args], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
        assert out.returncode == 0, out.stderr
        names = [ln.split()[0] for ln in out.stdout.splitlines()[1:]]
        assert names == list(BENCHMARKS)
    bad = subprocess.run([sys.executable, "-m", "specpilot", "bench", "nope"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert bad.returncode == 2 and "unknown benchmark 'nope'" in bad.stderr and "Traceback" not in bad.stderr


# benchmarks whose dry run is checked by another file's test (the script that drives them): the name
# of that test, which must exist there
ELSEWHERE = {"serve-vs-run": ("test_serve.py", "def test_gpu_serve_script_dry_run(")}


def test_every_benchmark_has_a_test():
    tested = {n.removeprefix("test_").removesuffix("_dry_run").replace("_", "-") for n in globals()
              if n.startswith("test_") and n.endswith("_dry_run")}
    for name, (path, test) in ELSEWHERE.items():
        assert test in (REPO / "tests" / path).read_text(), f"{name}: {path} has no {test}"
    assert tested | set(ELSEWHERE) == set(BENCHMARKS) and not tested & set(ELSEWHERE)


@needs_triton
def test_engine_dry_run(tmp_path):
    r = bench(tmp_path, "engine", "--peer")
    assert r["errors"] == []
    c = r["correctness"]  # the Triton step under the interpreter: row independence, against eager
    assert c["ok"] and all(c["row_independent"].values()) and c["rel_err_vs_eager"] < 1e-4
    assert set(r["ar"]) == {"b1_ctx48", "b2_ctx48"}
    assert all(d["step_s"] > 0 and d["weight_bytes"] > 0 and d["kv_bytes"] > 0 for d in r["ar"].values())
    v = r["verify"]["steps"]
    assert set(v) == {"1", "4", "4_capture"} and v["1"]["x_ar"] == 1.0
    e = r["e2e"]["profiles"]["study_stock"]  # the replay drafter proposes AR's tokens: outputs equal AR
    assert e["outputs_equal_ar"] and 1.0 < e["tau"] <= 4 and e["verify_steps"] < r["e2e"]["new_tokens"]
    assert r["peer"]["dynamic_eager"]["decode_tok_s"] > 0


@needs_triton
def test_verify_dry_run(tmp_path):
    r = bench(tmp_path, "verify")
    assert r["errors"] == []
    inv = r["widths"]["invariance"]["default"]
    assert inv["subset_T4"] and inv["verify_prefixes"] and inv["decode_chain"] and inv["rel_err_vs_eager"] < 1e-4
    assert set(r["widths"]["step_ms"]["default"]) == {"1x1", "2x4"}
    t = r["trees"]
    assert t["trees"]["tree8_s4"]["parents"] == [-1, 0, 1, 2, 0, 0, 1, 1]  # spine of 4, 2 leaves on 2 positions
    assert t["x_ar"]["ar"] == 1.0 and set(t["step_ms"]) >= {"ar", "chain4", "tree8_s4", "compact_path_P16"}
    c = t["checks"]["tree8_s4"]  # fp32 under the interpreter: near, not necessarily bits
    assert c["tree_logits_finite"] and c["spine_max_abs_diff"] < 1e-4
    assert c["leaves_checked"] == 1 and c["leaf_max_abs_diff"] < 1e-4 and set(c["per_start"]) == {"59"}
    lat = t["trees"]["lattice20"]  # a lattice tree in the measured profile's geometry: its nodes against their paths
    assert lat["nodes"] == 21 and lat["lattice"] and lat["parents"][lat["spine"][0]] == 0
    c = t["checks"]["lattice20"]
    assert c["tree_logits_finite"] and c["leaves_checked"] == 1 and c["leaf_max_abs_diff"] < 1e-4  # --max-leaves 1
    assert t["x_chain"]["lattice20"] == t["step_ms"]["lattice20"]["ms"] / t["step_ms"]["chain4"]["ms"]  # issue 54's ratio
    assert set(t["host_side_ms"]["lattice20"]) == {"tree_inputs", "accept_tree", "accept_chain"}


def test_host_dry_run(tmp_path):
    r = bench(tmp_path, "host")
    assert r["errors"] == [] and r["clock"] == "cpu"
    c = r["cells"]
    assert list(c) == ["ar_c1", "ar_c16", "chain_c1", "tree63_c1", "chain_c16", "tree63_dynamic_c1",  # AR first
                       "ar_c16_hybrid", "chain_c16_hybrid", "ar_c16_muse", "chain_c16_muse"]
    for name, cell in c.items():  # the stand-in's logits drive the replay acceptance: outputs = the references
        assert cell["outputs_equal_reference"] and cell["host_ms_per_step"] > 0, (name, cell)
        assert set(cell["parts_ms_per_step"]) == {"propose", "verify_inputs", "accept", "commit", "bookkeeping"}
    assert c["ar_c1"]["tau"] == 1.0 and c["ar_c1"]["steps"] == 23 and c["ar_c1"]["parts_ms_per_step"]["propose"] == 0
    assert 1.5 < c["chain_c1"]["tau"] <= 16 and 1.5 < c["tree63_c1"]["tau"] <= 12  # block 16 / the lattice's 12
    assert c["tree63_c1"]["nodes"] == 63 and c["chain_c16"]["batch"] == 16 and c["chain_c1"]["bar_ms"] == 0.10
    assert c["chain_c16"]["x_ar"] == c["chain_c16"]["host_ms_per_step"] / c["ar_c16"]["host_ms_per_step"]
    for fam in ("hybrid", "muse"):  # the batched step per family, against AR of the same family
        f = c[f"chain_c16_{fam}"]
        assert f["family"] == fam and f["batch"] == 16 and 1.5 < f["tau"] <= 16
        assert f["x_ar"] == f["host_ms_per_step"] / c[f"ar_c16_{fam}"]["host_ms_per_step"]
    # the hybrid's runner commits its recurrent state every step (prefill and decode steps excepted)
    assert c["chain_c16_hybrid"]["recurrent_commits"] == c["chain_c16_hybrid"]["steps"]
    assert c["chain_c16_muse"]["recurrent_commits"] == 0 == c["chain_c16"]["recurrent_commits"]


@needs_triton
def test_batched_dry_run(tmp_path):
    from specpilot.bench.batched import accepted_counts, group_of, table
    from specpilot.drafters.replay import expected_tau, load_profile

    r = bench(tmp_path, "batched", "--shapes", "qwen3.8-27b")  # the hybrid (its commit): tiny-hybrid, c2, block 4
    assert r["errors"] == [] and list(r["shapes"]) == ["tiny-hybrid"]
    s = r["shapes"]["tiny-hybrid"]
    f, st, lp = s["floors"], s["steps"], s["loop"]
    assert f["rows"] == 8 and f["verify_ms"] >= f["ar_c16_ms"] > 0 and f["ar_c16_ms"] >= f["c1_ms"] > 0
    cb = f["commit"]  # today: the state read and written again plus the verify's tape; floor: written once
    assert cb["today_bytes"] == 2 * cb["floor_bytes"] + 2 * 4 * cb["tape_bytes_per_token"]
    assert cb["floor_bytes"] == 2 * cb["state_bytes_per_row"] and cb["keep_states_bytes"] > cb["floor_bytes"]
    assert st["commit_ms"] == st["verify_commit_ms"] - st["verify_ms"] and st["draft_ms"] > 0
    assert lp["outputs_equal_ar"] and 1 < lp["tau"] <= 4 and lp["steps"] < 8
    assert abs(lp["rest_ms"] - (lp["step_ms"] - lp["verify_ms"] - lp["draft_ms"])) < 1e-9
    assert s["host"]["functions"] and all(x["own_ms_per_step"] >= 0 for x in s["host"]["functions"])
    counts = accepted_counts(load_profile("study_stock"), 16, 16)  # the profile's tau over 16 rows
    assert all(1 <= c <= 16 for c in counts) and abs(sum(counts) / 16 - expected_tau(load_profile("study_stock"), 16)) <= 1 / 32
    assert [group_of(k) for k in ("_linear_kernel", "_attn_partial_kernel", "_gdn_recurrent_kernel",
                                  "_gdn_conv_commit_kernel", "_add_rmsnorm_kernel", "Memcpy DtoD", "foo")] == \
        ["gemm", "attention", "gdn_recurrent", "gdn_conv", "norm_elementwise", "copy", "other"]
    k = {p: {"kernel_sum_ms": 2.0, "groups": {"gemm": 1.5, "attention": 0.5}} for p in ("verify", "commit", "draft", "c1")}
    k["ar_c16"] = {"kernel_sum_ms": 1.0, "groups": {"gemm": 0.75, "attention": 0.25}}
    lines = table({"shapes": {"x": {**s, "kernels": k}}})  # the GPU-only kernel lines
    assert "x kernels verify: 2.000 ms: gemm 1.500 (2.00x AR c2), attention 0.500 (2.00x AR c2)" in lines
    assert any(ln.startswith("x verify GEMM 1.500 ms") for ln in lines)


@needs_triton
def test_draft_dry_run(tmp_path):
    r = bench(tmp_path, "draft")
    assert r["errors"] == []
    cell = r["draft"]["cells"][0]
    assert cell["batch"] == 2 and set(cell["impl"]) == {"triton", "torch"}
    f = cell["floor_ms"]
    assert f["step"] == pytest.approx(f["draft"] + f["add_context"]) and f["add_context"] > 0
    for v in cell["impl"].values():
        assert v["step_ms"] > 0 and v["step_over_floor"] == pytest.approx(v["step_ms"] / f["step"])
    assert cell["triton_drafts_equal_eager"] >= 0.8  # fp32: the Triton step's drafts are the network's
    assert set(cell["rounds"]) == {"triton", "torch"}


def test_serving_dry_run(tmp_path, checkpoint):
    target, drafter = checkpoint
    r = bench(tmp_path, "serving", "--target", str(target), "--drafter", str(drafter), "--variant", "b3@2={\"block_size\": 3}")
    assert r["errors"] == []
    assert all(c["rc"] == 0 for c in r["commands"]), r["commands"]
    for c, n in (("c2", 4), ("c1", 2)):
        cell = r["cells"][c]
        assert cell["n_requests"] == n
        for name in ("stock", "b3") if c == "c2" else ("stock",):
            s = cell[name]
            assert s["equal_outputs"] == n and 1.0 < s["tau"] <= (3 if name == "b3" else 4)
            assert s["forcing"]["passed"] and s["forcing"]["violations"] == 0 and s["forcing"]["tokens_checked"] == n * 12
    assert "b3" not in r["cells"]["c1"]  # the variant ran at c2 only
    eq = r["ar_equality"]["c1_vs_c2"]
    assert eq["common"] == 2 and eq["equal"] == 2 and eq["forcing"]["passed"]


@needs_triton
def test_families_dry_run(tmp_path):
    r = bench(tmp_path, "families")
    assert r["errors"] == []
    for shape in ("tiny-hybrid", "tiny-muse"):
        for c, n in (("c1", 2), ("c3", 3)):
            cell = r["shapes"][shape]["cells"][c]
            assert cell["ar"]["forcing"]["passed"] and cell["ar"]["n"] == n
            for name in ("stock", "tree7", "tree12"):
                v = cell[name]
                assert v["equal"] == n and v["forcing"]["passed"] and v["forcing"]["tokens_checked"] == n * 12, v
                assert v["tau"] > 1 and v["path"] == "eager"
    t = r["shapes"]["tiny-muse"]["teacher"]  # the Triton family step under the interpreter
    assert t["path"] == "triton-family" and t["prefill_piece"] == 64
    assert t["teacher"]["first_difference"] is None and t["teacher"]["max_margin"] == 0.0
    assert "teacher" not in r["shapes"]["tiny-hybrid"]  # the dry run diagnoses one shape


def test_targets_dry_run(tmp_path):
    r = bench(tmp_path, "targets")
    assert r["errors"] == []
    for shape in ("tiny-hybrid", "tiny-muse"):
        s = r["shapes"][shape]
        assert s["correctness"]["prefill_decode_vs_block_rel_err"] < 1e-4
        assert s["ar_b1"]["step_s"] > 0 and s["verify4"]["x_ar"] > 0
        e = s["e2e"]["study_stock"]
        assert e["outputs_equal_ar"] and e["tau"] > 1
    mem = r["shapes"]["tiny-hybrid"]["state_memory"]
    assert mem["gdn"] > 0 and mem["per_position_snapshots_bytes"] == 4 * mem["recurrent_bytes"]


@needs_triton
def test_w12_dry_run(tmp_path):
    """Under the interpreter: every role of the tiny shape through both loaders bit-equal at each M,
    the tiny step's prefill and verify logits bit-equal after the model is converted in place; the
    machine code of both loaders compiled for sm_90 on this machine (same dot operand layout)."""
    r = bench(tmp_path, "w12")
    assert r["errors"] == []
    assert "skipped" in r["choice"]  # timed on a GPU only
    roles = r["roles"]
    assert roles["all_bit_equal"] and {d["role"] for d in roles["rows"]} == {"qkv", "o", "gate_up", "down"}
    assert {d["M"] for d in roles["rows"]} == {1, 4}
    assert all(d["bytes_w12"] < 0.8 * d["bytes_bf16"] for d in roles["rows"])
    st = r["step"]
    assert st["prefill_bit_equal"] and [d["M"] for d in st["steps"]] == [1, 4] and all(d["bit_equal"] for d in st["steps"])
    assert st["w12_choice"] == {"qkv": "w12", "o": "w12", "gate_up": "w12", "down": "w12"}
    code = {(d["role"], d["M"], d["loader"]): d for d in r["code"]["rows"]}
    assert len(code) == 16
    for role in ("qkv", "o", "gate_up", "down"):
        b, w = code[(role, 1, "bf16")], code[(role, 1, "w12")]
        assert b["mma"] == w["mma"] and (b["kwidth"] in ("", w["kwidth"]))  # the same MMA and operand layout
        assert b["thread_instructions_per_weight"] < w["thread_instructions_per_weight"] < 6.0


def test_ranks_dry_run(tmp_path):
    from specpilot.drafters.replay import expected_tau, load_profile

    prof = tmp_path / "dry_ranks.json"
    r = bench(tmp_path, "ranks", "--tree", "2,2", "--profile-out", str(prof))
    assert r["errors"] == []
    d = r["profile"]
    assert d["outputs_equal_ar"] == "2/2" and d["tree_checks"]["branch2_depth2"]["outputs_equal_ar"] == "2/2"
    p = load_profile(prof)  # a valid profile: recall non-decreasing, first column = acceptance
    assert p.name == "dry_ranks" and p.block_size == 4 and len(p.rates) == 3 and len(p.recall[0]) == 64
    counts = d["rank_counts"]
    assert d["samples_per_position"][0] > 0 and [sum(c) for c in counts] == d["samples_per_position"]
    n0, hits = sum(counts[0]), sum(counts[0][:64])
    assert 0 < hits < n0 and p.recall[0][-1] == pytest.approx(hits / n0, abs=1e-6)
    assert all(a <= b for a, b in zip(p.recall[0], p.recall[0][1:]))
    assert d["expected_tau"] == pytest.approx(expected_tau(p, 4), abs=1e-4)


def test_tree_bound_dry_run(tmp_path):
    from specpilot.drafters.replay import expected_tau, load_profile

    r = bench(tmp_path, "tree-bound")
    b = r["bound"]
    assert b["stock_tau"] == pytest.approx(expected_tau(load_profile("study_stock"), 16))
    for depth in (15, 31):  # more nodes never lower the best tree's tau
        taus = [x["tau"] for x in b["rows"] if x["depth"] == depth]
        assert all(x <= y + 1e-9 for x, y in zip(taus, taus[1:])) and taus[0] >= b["stock_tau"] - 1e-9
    # issue 16 under study_stock: no tree of up to 4,095 nodes doubles tau or reaches 1.5x stock
    assert max(x["tau_vs_stock"] for x in b["rows"]) < 2.0 and 1.0 < b["bound"]["speedup_vs_stock_bound"] < 1.5


def test_trees_dry_run(tmp_path):
    prof = tmp_path / "lattice_profile.json"
    r = bench(tmp_path, "trees", "--profile-out", str(prof))
    assert r["errors"] == []
    t = r["trees"]
    assert t["forcing_violations_ar"] == 0 and set(t["drafters"]) == {"dflash", "dflash2"}
    d2 = t["drafters"]["dflash2"]
    assert set(d2["curves"]) == {"chain", "static", "spine", "lattice"}
    for curve in d2["curves"].values():  # every output of every builder equals AR, forcing passes
        assert all(c["outputs_equal_ar"] == "4/4" and c["forcing_violations"] == 0 for c in curve)
    lat = d2["curves"]["lattice"]
    assert [c["nodes"] for c in lat] == [3, 9] and all(c["tau"] for c in lat)
    assert d2["lattice"]["max_fit_error"] < 0.2 and d2["lattice"]["profile"]["samples"] > 0
    p = json.loads(prof.read_text())  # a replay profile the replay drafter loads, with its lattice
    from specpilot.drafters.replay import load_profile
    from specpilot.drafters.lattice_profile import lattice_of
    lp = lattice_of(load_profile(prof))
    assert lp.depth == d2["block"] - 1 == len(p["conditional_acceptance"])
    assert lp.expected_tau(9) == pytest.approx(d2["lattice"]["fit"]["9"]["predicted"], abs=1e-3)


def test_cpu_step_dry_run(tmp_path):
    """The CPU step paths' bench: every path timed, the fused steps' logits those of the plain forward."""
    r = bench(tmp_path, "cpu-step")
    m = r["measure"]
    assert "aten" in m["kernels"] and set(m["max_logit_diff"]) == set(m["kernels"])
    assert all(d < 1e-4 for d in m["max_logit_diff"].values()), m["max_logit_diff"]
    assert {f"{s}_{p}" for s in ("verify", "decode") for p in ["plain"] + [f"fused_{k}" for k in m["kernels"]]} \
        == set(m["target_ms"])
    assert {"draft_plain", "context_plain", "draft_fused_aten", "context_fused_aten"} <= set(m["drafter_ms"])


def test_client_dry_run(tmp_path):
    """The client drives a real ``specpilot serve`` (random tiny deployment) at c1 and c4."""
    r = bench(tmp_path, "client")
    assert r["errors"] == []
    for c in (1, 4):
        cell = r[f"c{c}"]
        assert cell["concurrency"] == c and cell["requests"] == 4 and cell["tokens_per_request"] == 8
        assert cell["output_tok_s"] > 0 and cell["ttft_ms_p50"] > 0


# serve-vs-run --dry-run's path (two phases, four servers, --record-dir, the summary) is run by
# tests/test_serve.py::test_gpu_serve_script_dry_run (scripts/gpu_serve.py with DRY=1), which checks its JSON.

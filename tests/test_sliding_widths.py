"""Sliding-window targets at any verify width (issue 44), eager on the CPU (the Triton family step's
trees under the interpreter: tests/test_family_fast.py).

- The rings are sized from the engine's verify width: a tiny Muse-Glimmer target (window 16 and 64,
  prompts + outputs longer than window + the widest verify, so the ring wraps) serves static trees
  of 84 and 127 nodes and a spine tree of branch 4 x depth 16 at c1 and c3 (the replay drafter
  ``study_stock``, block 16) with every output equal to AR and token forcing passing. Before, a
  block wider than the ring's fixed reserve of 64 stopped the run mid-way.
- A path that refuses a step never hands it to a path that computes something else: a planted
  refusal of trees in the Triton step, with the eager tree forward computing different logits,
  must stop the run (or leave the outputs equal to AR).
- The engine and token forcing's teacher pass prefill a prompt in the same pieces (on a GPU a
  prefill matmul's bits depend on its rows): the cause of the Muse-Glimmer-30B forcing failures.
- A width that cannot fit is refused before any work by ``specpilot run`` and when the workflow is
  planned (``snakemake -n``), one line naming the setting and the limit.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specpilot.capacity import plan_problems, rounds_widest, width_problem
from specpilot.cli import main as specpilot_main
from specpilot.deployment import Deployment
from specpilot.drafters.replay import load_profile
from specpilot.engine.backend import Backend
from specpilot.engine.config import EngineSpec
from specpilot.engine.runner import TargetRunner
from specpilot.engine.serve import ServeOptions, serve
from specpilot.errors import SpecpilotError
from specpilot.fastpath.graphs import StepGraphs
from specpilot.forcing import force, teacher
from specpilot.models.random_checkpoint import materialize_target, target_config
from specpilot.models.target import PREFILL_PIECE

ROOT = Path(__file__).resolve().parents[1]
META = {"deployment": "t", "target": "tiny-muse", "drafter": "replay", "gpu": "cpu"}
TREES = {"t84": {"tree_nodes": 84}, "t127": {"tree_nodes": 127}, "spine4x16": {"tree_branch": 4, "tree_depth": 16}}


def muse(window: int, seed: int = 5):
    """The tiny-muse shape (8 layers, 6 sliding + 2 global NoPE) with sliding window ``window``, fp32."""
    return materialize_target(dataclasses.replace(target_config("tiny-muse"), sliding_window=window), "cpu",
                              torch.float32, seed)


def requests(P: int) -> list[dict]:
    return [{"request_id": f"r/{i}", "benchmark": "r", "prompt_ids": [(37 * j + 11 * i + 5) % 1024
                                                                      for j in range(P + 7 * i)]} for i in range(3)]


@pytest.mark.parametrize("window,P,new,cells", [
    (16, 100, 60, [("t84", 1), ("t84", 3), ("t127", 1), ("t127", 3), ("spine4x16", 1), ("spine4x16", 3)]),
    (64, 150, 60, [("t127", 3), ("spine4x16", 1)]),
])
def test_wide_trees_equal_ar_and_pass_forcing(window, P, new, cells):
    torch.set_num_threads(1)
    dep = Deployment.of(muse(window))
    rows = requests(P)
    prompts = {r["request_id"]: r["prompt_ids"] for r in rows}
    ar = serve(EngineSpec("ar"), dep, rows, new, 1, META, ServeOptions(progress=False, warmup=False))
    refs = {r.request_id: r.output_ids for r in ar}
    opts = ServeOptions(progress=False, warmup=False, replay=load_profile("study_stock"), references=refs)
    for name, c in cells:
        spec = EngineSpec("stock", 16, TREES[name])
        recs = serve(spec, dep, rows, new, c, META, opts)
        ring = dep.target.state.ring
        assert ring.reserve >= spec.verify_width > 64 and ring.R < P + new, (name, ring.R)  # sized, and it wraps
        assert [r.output_ids for r in recs] == [refs[r.request_id] for r in recs], (name, c)
        assert sum(len(r.committed_per_step) for r in recs) < 3 * (new - 1) / 2, (name, c)  # drafts were accepted
        v = force(recs, {"ar": ar}, prompts, dep.backend, 1e-3)
        assert v["passed"] and v["violations"] == 0 and v["coverage"] == 1.0, (name, c, v["violation_list"][:2])
        assert all(r.engine_config["path"] == "eager" for r in recs)


def test_rings_follow_the_runner_width_and_a_wider_block_names_the_settings():
    m = muse(16)
    assert TargetRunner(m, 1, 400).model.state.ring.reserve == 64  # never below the prefill piece
    r = TargetRunner(m, 2, 400, verify_width=128)
    assert m.state.ring.reserve == 128 and m.state.ring.R == 16 + 128 and r.max_block == 128
    r.prefill([[1, 2, 3], [4, 5]])
    with pytest.raises(SpecpilotError, match="tree_nodes, tree_branch x tree_depth"):
        r.verify(torch.zeros(2, 129, dtype=torch.long))


# ---- a refusal stops the run; it never hands the step to a path that computes something else ----

class _RefusingStep(StepGraphs):
    """A Triton-path step that runs chains (through the eager forward, exactly) and refuses trees,
    as a fast path that cannot take a configuration does; no CUDA graphs."""

    def run(self, tokens, start, capture=(), tree=None, write=False):
        return self.step(tokens, start, capture, tree, write)  # a tree raises: "tree steps ... need Triton"


def test_a_planted_refusal_stops_the_run_instead_of_changing_outputs(monkeypatch):
    m = muse(16)
    rows = requests(40)
    eager = Deployment.of(m)
    ar = serve(EngineSpec("ar"), eager, rows, 24, 1, META, ServeOptions(progress=False, warmup=False))
    refs = {r.request_id: r.output_ids for r in ar}
    planted = Deployment(m, None, None, Backend(m, "triton-family", "planted refusal", False, "triton", _RefusingStep(m)))
    forward = type(m).forward

    def other_arithmetic(self, tokens, start, ancestors, depth=None, *a, **kw):
        """The eager forward of a tree computes other logits than the Triton step would (as bf16
        eager kernels do on a GPU): any token tree that lands here changes the outputs."""
        logits, feats = forward(self, tokens, start, ancestors, depth, *a, **kw)
        if depth is not None:
            logits = logits + 3.0 * torch.sin(torch.arange(logits.shape[-1], dtype=logits.dtype))
        return logits, feats

    monkeypatch.setattr(type(m), "forward", other_arithmetic)
    opts = ServeOptions(progress=False, warmup=False, replay=load_profile("study_stock"), references=refs)
    for c in (1, 3):
        try:
            recs = serve(EngineSpec("stock", 16, {"tree_nodes": 84}), planted, rows, 24, c, META, opts)
        except SpecpilotError as e:  # the run stops, naming what refused
            assert "tree" in str(e), e
            continue
        assert [r.output_ids for r in recs] == [refs[r.request_id] for r in recs], f"c{c}: outputs changed"
    # the planted arithmetic does change a tree's tokens (the check above can fail)
    changed = serve(EngineSpec("stock", 16, {"tree_nodes": 84}), eager, rows, 24, 1, META, opts)
    assert [r.output_ids for r in changed] != [refs[r.request_id] for r in changed]


# ---- the engine and the teacher pass prefill a prompt in the same pieces ----

class _RecordingStep:
    """A stand-in for the family Triton step that records every prefill call (row, start, tokens)
    and returns zero logits (the pieces, not the values, are under test)."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.configs, self.attn_rows = {}, 0

    def forward(self, tokens, start, capture=(), tree=None, rows=None, last_only=False, write=False):
        B, T = tokens.shape
        if last_only:
            self.calls.append((rows.start, int(start[0]), T))
        return torch.zeros(B, 1 if last_only else T, self.model.config.vocab_size), None


@pytest.mark.parametrize("window", [512, 16])  # a ring that never wraps here, and one that does
def test_engine_and_teacher_pass_prefill_in_the_same_pieces(monkeypatch, window):
    m = muse(window)
    rows = requests(150)
    step = _RecordingStep(m)
    dep = Deployment(m, None, None, Backend(m, "triton-family", "recorded", False, "triton", _RefusingStep(m, step)))
    pieces = {}
    for c in (1, 3):  # c1: every prompt through row 0 in turn; c3: rows 0, 1, 2
        step.calls.clear()
        serve(EngineSpec("ar"), dep, rows, 4, c, META, ServeOptions(progress=False, warmup=False))
        pieces[c] = [(start, T) for _, start, T in step.calls]
    monkeypatch.setattr(teacher, "_fast_target", lambda backend, kernel_configs=None: step)
    step.calls.clear()
    teacher.teacher_forced_engine(dep.backend, [r["prompt_ids"] for r in rows], [[1, 2, 3, 4]] * 3)
    taught = [(start, T) for _, start, T in step.calls]
    want = [(s, min(PREFILL_PIECE, len(r["prompt_ids"]) - s)) for r in rows
            for s in range(0, len(r["prompt_ids"]), PREFILL_PIECE)]
    assert pieces[1] == pieces[3] == taught == want, (pieces, taught)


# ---- a width that cannot fit is refused before any work ----

def _lazy_muse(tmp_path: Path) -> tuple[Path, Path]:
    t, d = tmp_path / "muse-target", tmp_path / "muse-drafter"
    assert specpilot_main(["random-checkpoint", "--shape", "tiny-muse", "--out", str(t), "--drafter-out", str(d),
                           "--lazy"]) == 0
    return t, d


def _run(tmp_path, target, engine_config: dict, new: int = 16, extra=()) -> tuple[int, str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"request_id": "a/0", "benchmark": "a", "prompt_ids": list(range(1, 40))}) + "\n")
    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps(engine_config))
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "specpilot.cli", "run", "--engine", "stock", "--target", str(target),
                        "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", str(new), "--block-size", "16",
                        "--replay-profile", "study_stock", "--engine-config", str(cfg), *extra],
                       capture_output=True, text=True, timeout=300)
    assert not out.exists()
    return r.returncode, r.stderr


def test_run_refuses_a_width_beyond_the_positions_before_loading(tmp_path):
    """The lazy checkpoint holds config.json only: a run that got as far as loading would fail
    elsewhere; the refusal names the engine config's setting and the target's limit."""
    target, _ = _lazy_muse(tmp_path)
    rc, err = _run(tmp_path, target, {"tree_nodes": 5000})
    lines = [ln for ln in err.splitlines() if "max_position_embeddings" in ln]
    assert rc != 0 and len(lines) == 1, err[-2000:]
    assert "verify width 5001 (tree_nodes 5000)" in lines[0] and "max_position_embeddings 4096" in lines[0]


def test_run_and_plan_refuse_a_width_beyond_the_device_memory(tmp_path, monkeypatch):
    cfg = target_config("tiny-muse")
    # 16 requests x 516 KV slots: a 127-node tree needs 39 MiB (rings of 16 + 128 slots, logits of
    # 16 x 128 positions), more than a 32 MiB device; a 31-node tree 24 MiB
    line = width_problem(cfg, 128, "tree_nodes 127", 516, 16, 4, 32 * 2 ** 20, "a 32 MiB device")
    assert line == ("verify width 128 (tree_nodes 127) at 16 request(s) x 516 KV cache slots needs 39.1 MiB "
                    "(weights 6.0 MiB), more than the 32.0 MiB of a 32 MiB device"), line
    assert width_problem(cfg, 32, "tree_nodes 31", 516, 16, 4, 32 * 2 ** 20, "a 32 MiB device") is None
    target, _ = _lazy_muse(tmp_path)
    monkeypatch.setattr("specpilot.engine.cli.host_memory_bytes", lambda: 32 * 2 ** 20)
    args = ["run", "--engine", "stock", "--target", str(target), "--max-new-tokens", "300", "--block-size", "16",
            "--concurrency", "16", "--replay-profile", "study_stock"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"request_id": f"a/{i}", "benchmark": "a", "prompt_ids": list(range(1, 90))})
                               + "\n" for i in range(16)))
    cfg_file = tmp_path / "engine.json"
    cfg_file.write_text(json.dumps({"tree_nodes": 127}))
    with pytest.raises(SpecpilotError, match=r"engine stock: request a/0 \(prompt of 89 tokens \+ 300 new tokens\): verify width 128 \(tree_nodes 127\) at 16 request"):
        from specpilot.engine.cli import add_arguments, run
        import argparse

        p = argparse.ArgumentParser()
        add_arguments(p)
        run(p.parse_args(args[1:] + ["--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                                     "--engine-config", str(cfg_file)]))


def test_plan_refuses_a_width_beyond_the_positions(tmp_path):
    target, drafter = _lazy_muse(tmp_path)
    dep = {"target": str(target), "drafter": "dflash", "drafter_id": str(drafter), "weight_format": "bf16",
           "block_size": 16}
    base = {"max_new_tokens": 64, "concurrency": [1, 3], "engines": ["ar", "stock", "specpilot"], "rounds": {}}
    assert plan_problems({"muse": dep}, base, tmp_path, ["cpu"]) == []
    width, what = rounds_widest(16)
    assert width == 64 and "tree_nodes 63" in what  # the rounds' static-tree grid
    long = {**base, "max_new_tokens": 4096 - 40}
    assert plan_problems({"muse": dep}, {**long, "engines": ["ar", "stock"]}, tmp_path, ["cpu"]) == []
    lines = plan_problems({"muse": dep}, long, tmp_path, ["cpu"])
    assert len(lines) == 1 and lines[0].startswith("deployment muse: verify width 64 (the rounds' widest candidate: "
                                                   "tree_nodes 63) needs 4120 KV cache positions"), lines
    # the workflow's dry run stops on it, one line, nothing written
    work = tmp_path / "work"
    work.mkdir()
    extra = tmp_path / "muse.yaml"
    extra.write_text(yaml.safe_dump({"deployments": {"muse": dep}, "max_new_tokens": 4056}))
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(work), "--snakefile",
                        str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config" / "config.yaml"), str(extra)],
                       text=True, capture_output=True, timeout=300)
    out = r.stdout + r.stderr
    hits = [ln for ln in out.splitlines() if ln.startswith("specpilot: deployment muse:")]
    assert r.returncode != 0 and len(hits) == 1 and "max_position_embeddings 4096" in hits[0], out[-3000:]
    assert not (work / "results").exists()

"""The tiny build as workflow jobs (issue 56, rules/build.smk): each drafter's recipe hash, the
drafters' thread counts, and what the workflow replans when one drafter's recipe changes.

The replan test is a dry run on a copy of the workflow with the quick build copied in (no
training): Snakemake's recorded parameters come from a `--touch` pass, then the QUICK recipe's
DFlash step count is changed in the Snakemake process that plans.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specpilot.tiny.recipe import FULL, QUICK, drafter_recipe_hash, target_recipe_hash
from specpilot.tiny.stages import choose_threads, makespan, thread_candidates
from test_memory_workflow import field, job_blocks, jobs_of
from test_workflow_rerun import WORKFLOW_FILES

ROOT = Path(__file__).resolve().parents[1]


def test_one_drafters_recipe_changes_only_its_hash():
    changed = dataclasses.replace(FULL, dflash_steps=FULL.dflash_steps + 1)
    assert drafter_recipe_hash("dflash", changed) != drafter_recipe_hash("dflash", FULL)
    assert drafter_recipe_hash("dflash2", changed) == drafter_recipe_hash("dflash2", FULL)
    assert drafter_recipe_hash("dspark", changed) == drafter_recipe_hash("dspark", FULL)
    assert target_recipe_hash(changed) == target_recipe_hash(FULL)
    # a field every drafter shares changes every drafter's hash; a target field only the target's
    shared = dataclasses.replace(FULL, anchors=FULL.anchors + 1)
    assert all(drafter_recipe_hash(k, shared) != drafter_recipe_hash(k, FULL) for k in ("dflash", "dflash2", "dspark"))
    target = dataclasses.replace(FULL, target_steps=FULL.target_steps + 1)
    assert target_recipe_hash(target) != target_recipe_hash(FULL)
    assert drafter_recipe_hash("dspark", target) == drafter_recipe_hash("dspark", FULL)


def test_makespan_and_the_chosen_thread_counts():
    # three jobs of 100 s at one thread on two cores: two side by side, then the third
    assert makespan({"a": 100.0, "b": 100.0, "c": 100.0}, {"a": 1, "b": 1, "c": 1}, 2) == 200.0
    # a two-thread job waits for both cores
    assert makespan({"a": 60.0, "b": 100.0}, {"a": 2, "b": 1}, 2) == 160.0
    steps = {"dflash": 360, "dflash2": 240, "dspark": 240}
    # 2 threads 1.2x faster than 1 (a poor fit for small shapes): one thread each, side by side
    poor = {k: {1: 1.2, 2: 1.0} for k in steps}
    assert choose_threads(poor, steps, 2) == {"dflash": 1, "dflash2": 1, "dspark": 1}
    # 2 threads twice as fast: one after another at two threads beats side by side at one
    ideal = {k: {1: 1.0, 2: 0.5} for k in steps}
    chosen = choose_threads(ideal, steps, 2)
    assert makespan({k: ideal[k][chosen[k]] * steps[k] for k in steps}, chosen, 2) == pytest.approx(420.0)
    assert thread_candidates(2) == [1, 2] and thread_candidates(6) == [1, 2, 4, 6] and thread_candidates(1) == [1]


def _smk(work: Path, *args: str, patch: str = "") -> str:
    code = f"import sys, dataclasses\n{patch}\nfrom snakemake.cli import main\nsys.argv = ['snakemake', *sys.argv[1:]]\nmain()"
    r = subprocess.run([sys.executable, "-c", code, "--cores", "2", "--configfile", "config/test.yaml", *args],
                       cwd=work, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout + r.stderr


def test_a_changed_drafter_recipe_replans_only_that_drafter(tmp_path, quick_deployment, data_dir):
    work = tmp_path / "wf"
    for name in WORKFLOW_FILES:
        src, dst = ROOT / name, work / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    deps = {name: {**spec, "quick": True} for name, spec in base["deployments"].items()}
    cfg = {**base, "deployments": deps, "benchmarks": ["gsm8k"], "n_prompts": 1, "max_new_tokens": 8,
           "engines": ["ar", "stock"], "data_dir": str(data_dir)}
    (work / "config" / "test.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copytree(quick_deployment, work / "resources" / "deployments" / "tiny")  # every stage finished
    assert not [j for j in jobs_of(_smk(work, "-n", "resources/deployments/tiny/build.json"))], \
        "a copied finished build replans build jobs"
    build = ["resources/deployments/tiny/build.json"]
    _smk(work, "--touch", "--forcerun", "tiny_target", "tiny_teacher", "tiny_drafter", "build_tiny", "--", *build)
    patch = ("import specpilot.tiny.recipe as r\n"
             "r.QUICK = dataclasses.replace(r.QUICK, dflash_steps=r.QUICK.dflash_steps + 1)")
    jobs = jobs_of(_smk(work, "-n", *build, patch=patch))  # the recorded parameters: every job's
    assert sorted(jobs) == [("build_tiny", "deployment=tiny"), ("tiny_drafter", "deployment=tiny, kind=dflash")], jobs
    assert not jobs_of(_smk(work, "-n", *build)), "an unchanged recipe replans build jobs"
    # and downstream: every output of the run made (empty files, then --touch in the DAG's order,
    # recording each job), the changed recipe replans the dflash deployment's jobs and the shared
    # table and figures, nothing of the other drafters' deployments
    for _, body in job_blocks(_smk(work, "-n")):
        for out in field(body, "output"):
            (work / out).parent.mkdir(parents=True, exist_ok=True)
            (work / out).touch(exist_ok=True)
    _smk(work, "--touch")
    assert not jobs_of(_smk(work, "-n")), "a touched run replans jobs"
    jobs = jobs_of(_smk(work, "-n", patch=patch))
    assert ("run_engine", "gpu=cpu, deployment=tiny, benchmark=gsm8k, concurrency=1") in jobs \
        or any(r == "run_engine" and "deployment=tiny," in w + "," for r, w in jobs), jobs
    assert not [(r, w) for r, w in jobs if "tiny-dflash2" in w or "tiny-dspark" in w], jobs
    assert not {r for r, _ in jobs} & {"tiny_target", "tiny_teacher", "ceilings", "kernels"}, jobs
    assert json.loads((work / "resources/deployments/tiny/stages/threads.json").read_text())["threads"]


def test_persisted_teacher_outputs_are_the_targets(quick_deployment):
    """The teacher outputs every drafter job loads (stages/teacher.pt) are the target's own
    features and logits of the distillation sequences: recomputed here for a few of them."""
    import torch

    from specpilot.models.loading import load_target
    from specpilot.tiny.train import TeacherCache

    teacher, seqs = TeacherCache.load(quick_deployment / "stages" / "teacher.pt")
    info = json.loads((quick_deployment / "stages" / "teacher.json").read_text())
    assert len(seqs) == len(teacher.feats) == info["sequences"] == QUICK.distill_prompts
    assert teacher.has_logits and all(len(s) - p == QUICK.distill_tokens for p, s in seqs)
    again = TeacherCache(load_target(quick_deployment / "target"), seqs[:3], teacher.layer_ids, logits=True)
    for i in range(3):
        assert torch.allclose(again.feats[i], teacher.feats[i], atol=1e-4), i
        assert torch.allclose(again.logits[i], teacher.logits[i], atol=1e-4), i

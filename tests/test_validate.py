"""Deployments that cannot run stop the plan (issue 34 item 1): specpilot.validate on its own, the
workflow's dry run with such a deployment (non-zero, one line naming deployment and value, nothing
under results/), the link step's check of a downloaded checkpoint, and a failed job's one line on
the console (specpilot.joblog). Fast: dry runs and config.json files only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specpilot.errors import SpecpilotError
from specpilot.validate import check_deployments, deployment_problems, hub_id_problem

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16}
DFLASH = {"architectures": ["DFlashDraftModel"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "dflash_config": {"block_size": 8, "mask_token_id": 3, "target_layer_ids": [1]}}


def folder(tmp_path: Path, name: str, cfg: dict | None) -> Path:
    d = tmp_path / name
    d.mkdir()
    if cfg is not None:
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def dep(target, drafter_id, drafter="dflash", block=8) -> dict:
    return {"target": str(target), "drafter": drafter, "drafter_id": str(drafter_id), "weight_format": "bf16",
            "block_size": block}


@pytest.fixture
def ckpts(tmp_path):
    return folder(tmp_path, "target", QWEN3), folder(tmp_path, "drafter", DFLASH)


def test_a_runnable_local_deployment_and_hub_ids_pass(tmp_path, ckpts):
    target, drafter = ckpts
    assert deployment_problems("ok", dep(target, drafter), tmp_path) == []
    assert deployment_problems("hub", dep("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"), tmp_path) == []
    # relative folders are read from the working directory
    assert deployment_problems("rel", dep("target", "drafter"), tmp_path) == []


def test_missing_target_folder_is_named(tmp_path, ckpts):
    _, drafter = ckpts
    [line] = deployment_problems("mine", dep(tmp_path / "no-such-dir", drafter), tmp_path)
    assert line.startswith("deployment mine: target ") and str(tmp_path / "no-such-dir") in line
    assert "no such folder" in line and "\n" not in line


def test_folder_without_config_and_unsupported_target_are_named(tmp_path, ckpts):
    _, drafter = ckpts
    empty = folder(tmp_path, "empty", None)
    [line] = deployment_problems("e", dep(empty, drafter), tmp_path)
    assert "target" in line and "holds no config.json" in line
    mamba = folder(tmp_path, "mamba", {**QWEN3, "layer_types": ["full_attention", "mamba", "full_attention",
                                                                   "full_attention"]})
    [line] = deployment_problems("m", dep(mamba, drafter), tmp_path)
    assert line.startswith("deployment m: target") and "unsupported layer type 'mamba'" in line
    gpt2 = folder(tmp_path, "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    [line] = deployment_problems("g", dep(gpt2, drafter), tmp_path)
    assert "unsupported architecture 'GPT2LMHeadModel'" in line


def test_unsupported_drafter_architecture_and_kind_mismatch(tmp_path, ckpts):
    target, _ = ckpts
    eagle = folder(tmp_path, "eagle", {**DFLASH, "architectures": ["EagleDraftModel"]})
    [line] = deployment_problems("e", dep(target, eagle), tmp_path)
    assert line.startswith("deployment e: drafter_id") and "unsupported drafter architecture 'EagleDraftModel'" in line
    dspark = folder(tmp_path, "dspark", {**DFLASH, "architectures": ["Qwen3DSparkModel"]})
    [line] = deployment_problems("k", dep(target, dspark, drafter="dflash"), tmp_path)
    assert "holds a dspark drafter" in line and "'dflash'" in line
    sliding_ssm = folder(tmp_path, "ssm", {**DFLASH, "layer_types": ["linear_attention"]})
    [line] = deployment_problems("l", dep(target, sliding_ssm), tmp_path)
    assert "unsupported layer type" in line


def test_block_size_must_fit_the_drafter(tmp_path, ckpts):
    target, drafter = ckpts
    [line] = deployment_problems("big", dep(target, drafter, block=16), tmp_path)
    assert "block_size 16 exceeds the block the drafter was trained for (8" in line
    [line] = deployment_problems("small", dep(target, drafter, block=1), tmp_path)
    assert line.startswith("deployment small: block_size 1") and "at least 2" in line
    assert deployment_problems("auto", dep(target, drafter, block="auto"), tmp_path) == []
    tiny = {"target": "tiny", "drafter": "dspark", "weight_format": "fp32", "block_size": 1}
    assert deployment_problems("tiny-dspark", tiny, tmp_path) == []  # DSpark counts drafts: 1 fits


@pytest.mark.parametrize("value", ["bad--name/x", "owner/name.", "a/b/c", "justaname"])
def test_malformed_hub_id_is_named(tmp_path, ckpts, value):
    target, _ = ckpts
    [line] = deployment_problems("h", dep(target, value), tmp_path)
    assert line.startswith(f"deployment h: drafter_id {value!r}") and "Hub id" in line
    assert hub_id_problem(value) is not None and hub_id_problem("Qwen/Qwen3-8B") is None


def test_tiny_rules_and_one_recipe_per_build(tmp_path, ckpts):
    t = {"target": "tiny", "drafter": "dflash", "weight_format": "fp32", "block_size": 8}
    deps = {"a": {**t, "quick": True}, "b": {**t}, "c": {**t, "drafter": "dflash", "quick": True}}
    build = tmp_path / "tiny"
    problems = check_deployments(deps, tmp_path, tiny_dirs={n: build for n in deps})
    assert problems == [f"deployments a, c (quick: true) and b (quick: false) share the tiny build {build}: "
                        f"give them the same quick"]
    assert check_deployments({"a": {**t, "quick": True}, "c": deps["c"]}, tmp_path,
                             tiny_dirs={"a": build, "c": build}) == []
    no_drafter = {"target": str(ckpts[0]), "drafter": "dflash", "weight_format": "bf16", "block_size": 8}
    [line] = check_deployments({"x": no_drafter}, tmp_path)
    assert line.startswith("deployment x: drafter_id None: a real target needs drafter_id")


def test_every_problem_is_listed_one_line_each(tmp_path, ckpts):
    _, drafter = ckpts
    eagle = folder(tmp_path, "eagle", {**DFLASH, "architectures": ["EagleDraftModel"]})
    problems = check_deployments({"one": dep(tmp_path / "gone", drafter), "two": dep("Qwen/Qwen3-8B", eagle)},
                                 tmp_path)
    assert [p.split(":")[0] for p in problems] == ["deployment one", "deployment two"]
    assert all("\n" not in p for p in problems)


# ---- the workflow: `snakemake -n` stops, naming the deployment and the value ----

def dry_run(work: Path, *configfiles: Path):
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--directory", str(work), "--snakefile",
                           str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config" / "config.yaml"),
                           *map(str, configfiles)], text=True, capture_output=True, timeout=300)


def added(tmp_path: Path, name: str, settings: dict) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump({"deployments": {name: settings}}))
    return f


def test_dry_run_stops_on_a_missing_target_folder(tmp_path, ckpts):
    _, drafter = ckpts
    work = tmp_path / "work"
    work.mkdir()
    missing = tmp_path / "qwen3-8b-not-downloaded"
    r = dry_run(work, added(tmp_path, "real-8b", dep(missing, drafter)))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    lines = [ln for ln in out.splitlines() if "real-8b" in ln]
    assert lines == [f"specpilot: deployment real-8b: target '{missing}': no such folder {missing}"], out
    assert not (work / "results").exists()


def test_dry_run_stops_on_an_unsupported_drafter_architecture(tmp_path, ckpts):
    target, _ = ckpts
    eagle = folder(tmp_path, "eagle", {**DFLASH, "architectures": ["EagleDraftModel"]})
    work = tmp_path / "work"
    work.mkdir()
    r = dry_run(work, added(tmp_path, "eagle-dep", dep(target, eagle)))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    lines = [ln for ln in out.splitlines() if "eagle-dep" in ln]
    assert len(lines) == 1 and "EagleDraftModel" in lines[0] and str(eagle) in lines[0], out
    assert not (work / "results").exists()


# ---- the link step checks what it downloaded ----

def test_link_refuses_an_unsupported_drafter_before_linking(tmp_path, ckpts, capsys):
    from specpilot.deployment_link import main

    target, _ = ckpts
    eagle = folder(tmp_path, "eagle", {**DFLASH, "architectures": ["EagleDraftModel"]})
    out = tmp_path / "dep"
    rc = main(["--name", "d", "--target", str(target), "--drafter", str(eagle), "--drafter-name", "dflash",
               "--block-size", "8", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("specpilot: error: deployment d: ") and "EagleDraftModel" in err
    assert not (out / "build.json").exists() and not (out / "target").exists()


def test_link_bad_block_size_is_one_error():
    from specpilot.deployment_link import _block

    assert _block("8") == 8 and _block("auto") == "auto" and _block(None) is None
    with pytest.raises(SpecpilotError, match="--block-size must be an integer or 'auto', got 'eight'"):
        _block("eight")


# ---- a failed job's one clear line ----

SNAKEMAKE_LOG = """\
[Thu Dec  3 20:10:42 2026]
Error in rule link_deployment:
    message: None
    jobid: 0
    output: resources/deployments/d/build.json
    log: logs/deployments/d.log (check log file(s) for error details)
    shell:
        python -m specpilot.deployment_link ...
        (command exited with non-zero exit code)
Error in rule run_engine:
    jobid: 7
    log: logs/cpu/d/gsm8k/cell-c1.log (check log file(s) for error details)
Error in rule table:
    jobid: 9
    log: logs/cpu/table.log (check log file(s) for error details)
Shutting down, this might take some time.
"""


def test_failed_jobs_reach_the_console_as_their_one_line(tmp_path):
    from specpilot.joblog import failed_job_lines

    logs = tmp_path / "logs"
    (logs / "deployments").mkdir(parents=True)
    (logs / "cpu" / "d" / "gsm8k").mkdir(parents=True)
    (logs / "deployments" / "d.log").write_text("resolving\nspecpilot: error: deployment d: target gone\n")
    (logs / "cpu" / "d" / "gsm8k" / "cell-c1.log").write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: CUDA out of memory\n")
    (tmp_path / "run.log").write_text(SNAKEMAKE_LOG)
    assert failed_job_lines([tmp_path / "run.log"], tmp_path) == [
        "rule link_deployment failed (logs/deployments/d.log): deployment d: target gone",
        "rule run_engine failed (logs/cpu/d/gsm8k/cell-c1.log): RuntimeError: CUDA out of memory",
        "rule table failed (logs/cpu/table.log): see logs/cpu/table.log",
    ]
    assert failed_job_lines(tmp_path / "absent.log", tmp_path) == []


RUN_LOG = """Select jobs to execute...
Execute 2 jobs...
[Sun Dec  6 03:59:57 2026]
localrule ceilings:
    output: results/cpu/ceilings.json
    jobid: 7
    reason: Missing output files: results/cpu/ceilings.json
    resources: tmpdir=/tmp, timing_slots=2

[Sun Dec  6 03:59:58 2026]
rule tiny_drafter:
    output: resources/deployments/tiny/stages/drafter-dflash.json
    jobid: 3
    wildcards: deployment=tiny, kind=dflash
    threads: 1

[Sun Dec  6 04:00:03 2026]
Finished jobid: 7 (Rule: ceilings)
1 of 3 steps (33%) done
[Sun Dec  6 04:00:03 2026]
checkpoint tiny_teacher:
    jobid: 5
[Sun Dec  6 04:02:01 2026]
Finished jobid: 3 (Rule: tiny_drafter)
[Sun Dec  6 04:02:03 2026]
rule tiny_drafter:
    jobid: 4
[Sun Dec  6 04:03:03 2026]
Finished jobid: 4 (Rule: tiny_drafter)
"""


def test_each_rules_time_on_the_run(tmp_path):
    """The run summary's times (issue 56): each job from its start stamp to its finish stamp, by
    rule; a job that never finished (the checkpoint here) is left out."""
    from specpilot.joblog import rule_times, times_lines

    (tmp_path / "run.log").write_text(RUN_LOG)
    times = rule_times([tmp_path / "run.log"])
    assert times == {"ceilings": [6.0], "tiny_drafter": [123.0, 60.0]}
    lines = times_lines(times)
    assert lines[0].split()[:2] == ["tiny_drafter", "183"] and "2 jobs, longest 123 s" in lines[0]
    assert lines[1].split()[:2] == ["ceilings", "6"] and lines[-1].split()[:4] == ["all", "jobs", "189", "s"]
    assert rule_times(tmp_path / "absent.log") == {}


def test_a_real_run_stops_before_writing_anything(tmp_path, ckpts):
    """Not only the dry run: `snakemake --cores 1` with a missing target folder stops while planning."""
    _, drafter = ckpts
    work = tmp_path / "work"
    work.mkdir()
    extra = added(tmp_path, "real-8b", dep(tmp_path / "gone", drafter))
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--directory", str(work), "--snakefile",
                        str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config" / "config.yaml"), str(extra)],
                       text=True, capture_output=True, timeout=300)
    assert r.returncode != 0 and "deployment real-8b: target" in r.stdout + r.stderr
    assert not (work / "results").exists() and not (work / "resources").exists()


def test_a_failed_download_reaches_the_console_as_one_line(tmp_path, ckpts):
    """A Hub drafter that cannot be downloaded (offline): link_deployment fails first, the console
    names the rule and the reason, and no other job wrote results/."""
    target, _ = ckpts
    work = tmp_path / "work"
    work.mkdir()
    off = {n: {"available": False, "reason": "test"} for n in ("tiny", "tiny-dflash2", "tiny-dspark")}
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(yaml.safe_dump({"gpu": "cpu", "engines": ["ar", "stock"], "benchmarks": ["gsm8k"], "deployments": {
        **off, "hubdep": {**dep(target, "nosuch-org/nosuch-drafter"), "weight_format": "fp32"}}}))
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub-cache")}
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--directory", str(work), "--snakefile",
                        str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config" / "config.yaml"), str(cfg)],
                       text=True, capture_output=True, timeout=600, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    [line] = [ln for ln in out.splitlines() if ln.startswith("specpilot: rule link_deployment failed")]
    assert line.startswith("specpilot: rule link_deployment failed (logs/deployments/hubdep.log): could not "
                           "download nosuch-org/nosuch-drafter from the Hugging Face Hub"), out[-3000:]
    assert not (work / "results").exists()


def test_a_tiny_deployment_refuses_a_drafter_id(tmp_path, ckpts):
    """A drafter_id on a tiny target was silently ignored (issue 45): now one line naming it."""
    t = {"target": "tiny", "drafter": "dflash", "weight_format": "fp32", "block_size": "auto",
         "drafter_id": str(ckpts[1])}
    [line] = deployment_problems("tiny", t, tmp_path)
    assert line.startswith(f"deployment tiny: drafter_id '{ckpts[1]}'") and "drop drafter_id" in line


def test_a_stock_block_off_the_trained_one_needs_a_reason(tmp_path, ckpts):
    """Stock runs the drafter as released (issue 45): an integer block_size other than the drafter's
    trained block (8 here) needs block_reason, and block_reason with the trained block is refused."""
    target, drafter = ckpts
    [line] = deployment_problems("d", dep(target, drafter, block=6), tmp_path)
    assert "block_size 6 is not the block the drafter was trained for (8" in line and "block_reason" in line
    assert deployment_problems("d", {**dep(target, drafter, block=6), "block_reason": "the paper's block"},
                               tmp_path) == []
    for block in (8, "auto"):
        [line] = deployment_problems("d", {**dep(target, drafter, block=block), "block_reason": "x"}, tmp_path)
        assert "block_reason is set, but stock runs at the drafter's trained block 8" in line

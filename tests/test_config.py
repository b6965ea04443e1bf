"""Config schema, the shipped configs, and the workflow DAG (dry runs and lint; nothing executed)."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from specpilot.regimes import regime_of, resolve

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())
DEFAULT = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
PAPER = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
TEST_CONFIGS = sorted((ROOT / ".test" / "config").glob("*.yaml"))


def merged(base, over):
    """Snakemake's --configfile semantics: nested mappings merged key by key, the rest replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def validate(cfg):
    jsonschema.Draft202012Validator(SCHEMA).validate(cfg)


def snakemake(*args, timeout=300, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


def fresh_dry_run(tmp_path, *args):
    """`snakemake -n` in an empty working directory (--directory): the whole DAG is pending, whatever
    results/ the checkout holds."""
    return snakemake("-n", "--quiet", "rules", "--directory", str(tmp_path), "--snakefile",
                     str(ROOT / "Snakefile"), *args)


def job_counts(output: str) -> dict[str, int]:
    stats = output[output.index("Job stats:"):]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}


def test_schema_is_valid():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_shipped_configs_validate():
    validate(DEFAULT)
    validate(merged(DEFAULT, PAPER))


@pytest.mark.parametrize("path", [[], ["deployments", "tiny"], ["rounds"], ["rounds", "llm"],
                                  ["forcing"]])
def test_typo_key_is_rejected_and_named(path):
    cfg = copy.deepcopy(DEFAULT)
    node = cfg
    for k in path:
        node = node[k]
    node["n_promts"] = 3
    with pytest.raises(jsonschema.ValidationError, match="n_promts"):
        validate(cfg)


@pytest.mark.parametrize("key, value", [
    ("n_prompts", "four"), ("n_prompts", 0), ("max_new_tokens", "128"), ("concurrency", 1),
    ("concurrency", [0]), ("engines", ["ar", "eagle"]), ("engines", ["stock"]),
    ("benchmarks", ["gsm8k", "aime"]), ("gpu", "H100"), ("data_dir", 3),
])
def test_wrong_type_or_value_is_rejected(key, value):
    cfg = copy.deepcopy(DEFAULT)
    cfg[key] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(cfg)


def test_deployment_needs_fields_unless_unavailable():
    cfg = copy.deepcopy(DEFAULT)
    cfg["deployments"]["x"] = {"target": "Qwen/Qwen3-8B", "drafter": "dflash"}
    with pytest.raises(jsonschema.ValidationError, match="block_size|weight_format"):
        validate(cfg)
    cfg["deployments"]["x"] = {"available": False}
    with pytest.raises(jsonschema.ValidationError, match="reason"):
        validate(cfg)
    cfg["deployments"]["x"] = {"available": False, "reason": "no drafter"}
    validate(cfg)


def test_workflow_rejects_typo_naming_it():
    r = snakemake("-n", "--config", "n_promts=3")
    assert r.returncode != 0
    assert "n_promts" in r.stdout + r.stderr


def test_dry_run_default(tmp_path):
    r = fresh_dry_run(tmp_path, "--configfile", str(ROOT / "config" / "config.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = job_counts(r.stdout + r.stderr)
    n_cells = len(DEFAULT["deployments"]) * len(DEFAULT["benchmarks"]) * len(DEFAULT["concurrency"])
    assert jobs["run_engine"] == n_cells  # one job per cell times its engines interleaved
    assert jobs["force"] == n_cells  # one forcing job per cell checks stock and specpilot
    assert jobs["table"] == 1 and jobs["figures"] == 1 and jobs["memory"] == 1
    # rounds, per deployment: references once, round 0's memory, plan and integrate per round
    # (agents follow the plan)
    n_dep = len(DEFAULT["deployments"])
    assert n_dep == 3 and {d["drafter"] for d in DEFAULT["deployments"].values()} == {"dflash", "dflash2", "dspark"}
    assert jobs["round_references"] == jobs["round_memory_start"] == n_dep
    assert jobs["round_plan"] == jobs["round_integrate"] == DEFAULT["rounds"]["count"] * n_dep
    assert jobs["build_tiny"] == 1  # the three drafters share one tiny build
    # prompt files: one job per deployment writes every benchmark's (the tokenizer loaded once)
    assert jobs["prompts"] == jobs["calibration_prompts"] == jobs["calibration_gather"] == n_dep


@pytest.mark.parametrize("cfg", TEST_CONFIGS, ids=lambda p: p.stem)
def test_test_configs_lint_and_dry_run(tmp_path, cfg):
    """The .test/ configs CI runs: they validate, lint clean and dry-run with the expected jobs."""
    spec = yaml.safe_load(cfg.read_text())
    full = merged(DEFAULT, spec)
    validate(full)
    full["deployments"] = {k: v for k, v in full["deployments"].items() if v.get("available", True)}
    r = fresh_dry_run(tmp_path, "--configfile", str(cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = job_counts(r.stdout + r.stderr)
    regimes = resolve(full)  # the cells of every serving regime (issue 53)
    n_cells = len(full["deployments"]) * len(full["benchmarks"]) * len(regime_of(regimes))
    assert jobs["run_engine"] == n_cells
    if "specpilot" in full["engines"] and full["rounds"]["count"] > 0:  # rounds per (deployment, regime)
        assert jobs["round_plan"] == len(full["deployments"]) * len(regimes) * full["rounds"]["count"]
    # one tiny build per tiny target family, shared by the drafters paired with it
    assert jobs.get("build_tiny", 0) == len({d.get("tiny_kind", "dense") for d in full["deployments"].values()
                                             if d["target"] == "tiny"})
    # synthetic deployments (target random): one random_deployment job each
    assert jobs.get("random_deployment", 0) == sum(d["target"] == "random" for d in full["deployments"].values())
    assert ("round_plan" in jobs) == ("specpilot" in full["engines"] and full["rounds"]["count"] > 0)
    lint = snakemake("--lint", "--configfile", str(cfg))
    assert lint.returncode == 0 and "Lints for" not in lint.stdout + lint.stderr, lint.stdout + lint.stderr


def test_test_configs_cover_rounds_and_concurrency():
    specs = [merged(DEFAULT, yaml.safe_load(p.read_text())) for p in TEST_CONFIGS]
    assert any("specpilot" in s["engines"] and s["rounds"]["count"] > 0 and len(s["deployments"]) > 1 for s in specs)
    assert any(max(s["concurrency"]) > 1 for s in specs)
    assert any(len(resolve(s)) > 1 and s["rounds"]["count"] > 0 for s in specs)  # two serving regimes (issue 53)
    def available(s):
        return {k: v for k, v in s["deployments"].items() if v.get("available", True)}

    assert any(available(s) == {"tiny": {**DEFAULT["deployments"]["tiny"], "quick": True}} for s in specs)


def test_dry_run_paper_h100():
    # (the target goes before --configfile: that option takes several files)
    r = snakemake("results/h100/table.csv", "-n", "--quiet", "rules",
                  "--configfile", "config/paper.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    cfg = merged(DEFAULT, PAPER)
    available = [d for d, v in cfg["deployments"].items() if v.get("available", True)]
    assert len(available) == 8
    n_engines = 3
    jobs = job_counts(out)
    assert jobs["run_engine"] == len(available) * 5 * 4
    assert jobs["force"] == len(available) * 5 * 4
    assert jobs["link_deployment"] == 8 and jobs["prompts"] == 8
    assert "build_tiny" not in jobs
    for d, v in cfg["deployments"].items():
        if not v.get("available", True):
            assert f"skipping deployment {d}: {v['reason']}" in out


def test_dry_run_paper_shell_commands():
    r = snakemake("-n", "-p", "results/h100/qwen3-8b_dspark/gsm8k/stock-c16.forcing.json",
                  "--configfile", "config/paper.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert ("python -m specpilot run --engine ar,stock,specpilot --target resources/deployments/qwen3-8b_dspark/target"
            " --target-name Qwen/Qwen3-8B --drafter resources/deployments/qwen3-8b_dspark/drafter-dspark") in out
    cell = "results/h100/qwen3-8b_dspark/gsm8k/"
    assert f"--out {cell}ar-c16.jsonl,{cell}stock-c16.jsonl,{cell}specpilot-c16.jsonl" in out
    assert "--gpu h100 --max-new-tokens 2048 --concurrency 16 --block-size 7" in out
    assert "--engine-config results/h100/qwen3-8b_dspark/batched/specpilot.json --device cuda --dtype bf16" in out
    assert "--dtype bf16  --kernels-manifest results/h100/kernels/manifest.json" in out
    assert "--kernel-agent results/h100/kernels/qwen3-8b_dspark/batched/kernel-agent.json --threads" in out
    assert "gpu=1, gpu_model=h100" in out
    assert (f"force --candidate {cell}stock-c16.jsonl,{cell}specpilot-c16.jsonl --reference {cell}ar-c16.jsonl"
            " --target resources/deployments/qwen3-8b_dspark/target --prompts results/prompts/qwen3-8b_dspark/gsm8k.jsonl"
            " --tolerance 0.1 --device cuda --dtype bf16") in out
    assert f"--out {cell}stock-c16.forcing.json,{cell}specpilot-c16.forcing.json --report-only" in out
    assert "--target Qwen/Qwen3-8B --drafter deepseek-ai/dspark_qwen3_8b_block7" in out


def test_lint_is_clean():
    r = snakemake("--lint")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Lints for" not in out


def _pins(env: Path) -> dict[str, str]:
    spec = yaml.safe_load(env.read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    out = {}
    for p in pip:
        name, sep, version = p.partition("==")
        assert sep and version, f"{env.name}: {p!r} is not pinned (name==version)"
        out[name.lower().replace("_", "-")] = version
    return out


def test_envs_are_pinned_within_pyproject_and_ci():
    """Every env pin satisfies pyproject.toml's requirement of that package; the engine env pins
    the torch CI installs; the report env has no torch."""
    import tomllib

    from packaging.requirements import Requirement

    reqs = {Requirement(d).name.lower().replace("_", "-"): Requirement(d)
            for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    engine, report = _pins(ROOT / "envs" / "engine.yaml"), _pins(ROOT / "envs" / "report.yaml")
    for env, pins in (("engine", engine), ("report", report)):
        for name, version in pins.items():
            assert name in reqs, f"envs/{env}.yaml pins {name}, which pyproject.toml does not require"
            assert reqs[name].specifier.contains(version), f"envs/{env}.yaml: {name}=={version} outside {reqs[name]}"
    ci_torch = re.search(r"pip install torch==(\S+)", (ROOT / ".ci" / "run").read_text())[1]
    assert engine["torch"] == ci_torch
    assert "torch" not in report and {"pandas", "matplotlib"} <= set(report)
    # the engine env carries every runtime requirement but the workflow manager and plotting
    assert set(reqs) - {"snakemake", "matplotlib"} <= set(engine), set(reqs) - set(engine)


def test_every_rule_names_an_existing_env():
    for smk in (ROOT / "rules").glob("*.smk"):
        for env in re.findall(r'"\.\./envs/([\w.-]+)"', smk.read_text()):
            assert (ROOT / "envs" / env).is_file(), (smk.name, env)


def test_model_jobs_ask_for_memory_sized_from_the_deployment():
    """mem_mb of every model-loading rule follows the target: Qwen3-8B bf16 = 8.2e9 params x 2 bytes
    x 1.25 + 4 GB; a 30B target asks for more; the round steps of a bf16 GPU deployment hold two
    copies (the w12 direction keeps a 12-bit copy beside the bf16 one)."""
    r = snakemake("-n", "results/h100/table.csv", "--configfile", "config/paper.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    mem: dict[tuple[str, str], int] = {}
    for m in re.finditer(r"^(?:local)?(?:rule|checkpoint) (\w+):\n((?:    .*\n)+)", r.stdout, re.M):
        dep = re.search(r"deployment=([^,\s]+)", m[2])
        res = re.search(r"mem_mb=(\d+)", m[2])
        if dep and res:
            mem[(m[1], dep[1])] = int(res[1])
    one_copy = int((8.2 * 2 * 1.25 + 4) * 1024)
    for rule in ("run_engine", "force", "kernel_agent", "round_references"):
        assert mem[(rule, "qwen3-8b_dspark")] == one_copy, rule
        assert mem[(rule, "muse-glimmer-30b_dflash")] > 3 * mem[(rule, "qwen3-8b_dspark")] // 2 > 0, rule
    assert mem[("round_plan", "qwen3-8b_dspark")] == int((8.2 * 2 * 1.25 * 2 + 4) * 1024)


def test_report_steps_run_without_torch(tmp_path):
    """The rules on envs/report.yaml (table, figures, memory merge) never import torch."""
    import os

    snap = tmp_path / "a.jsonl"
    snap.write_text('{"id": "m1", "direction": "block_size", "params": {"block_size": 6}, "deployment": "d", '
                    '"gpu": "cpu", "gain": 1.1, "round": 1, "status": "valid", "reason": ""}\n')
    code = ("import sys; sys.modules['torch'] = None\n"
            "import specpilot.aggregate, specpilot.figures\n"
            "from specpilot.cli import main\n"
            f"sys.exit(main(['memory', '--snapshots', {str(snap)!r}, {str(snap)!r}, '--out', {str(tmp_path / 'm.jsonl')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("scaling,slots", [(1.95, "1"), (1.1, "2")])
def test_timed_jobs_one_at_a_time_where_the_ceilings_do_not_scale(tmp_path, scaling, slots):
    """Issue 56: an earlier run's CPU ceilings decide, when the workflow is planned, whether two
    timed CPU jobs run side by side (one timing slot each) or one at a time (every slot): copy
    bandwidth and matmul rate from 1 to 2 threads scaling 1.95x pass, 1.1x (two vCPUs of one
    physical core) does not."""
    one = {"memory_bandwidth_bytes_per_s": 1e10, "matmul_flop_per_s": 1e11}
    (tmp_path / "results" / "cpu").mkdir(parents=True)
    (tmp_path / "results" / "cpu" / "ceilings.json").write_text(json.dumps(
        {"per_threads": {"1": one, "2": {k: v * scaling for k, v in one.items()}}}))
    r = snakemake("results/cpu/tiny/gsm8k/ar-c1.jsonl", "-n", "--directory", str(tmp_path), "--snakefile",
                  str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config" / "config.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    cell = r.stdout[r.stdout.index("rule run_engine:"):]
    assert re.search(rf"^    resources: .*timing_slots={slots}\b", cell[:cell.index("\n\n")], re.M), cell[:1500]

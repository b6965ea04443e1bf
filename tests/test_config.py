"""Config schema, the shipped configs, and the workflow DAG (dry runs and lint; nothing executed)."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())
DEFAULT = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
PAPER = yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())
HAS_ROUNDS = (ROOT / "rules" / "rounds.smk").is_file()


def merged(base, over):
    """Snakemake's --configfile semantics: nested mappings merged key by key, the rest replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def validate(cfg):
    jsonschema.Draft202012Validator(SCHEMA).validate(cfg)


def snakemake(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


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


def test_dry_run_default():
    r = snakemake("-n", "--quiet", "rules")
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = job_counts(r.stdout + r.stderr)
    n_engines = len([e for e in DEFAULT["engines"] if e != "specpilot" or HAS_ROUNDS])
    n_cells = len(DEFAULT["deployments"]) * len(DEFAULT["benchmarks"]) * len(DEFAULT["concurrency"])
    if not Path(ROOT, "results").exists():  # a fresh checkout: the whole DAG is pending
        assert jobs["run_engine"] == n_cells * n_engines
        assert jobs["table"] == 1 and jobs["figures"] == 1


def test_dry_run_paper_h100():
    # (the target goes before --configfile: that option takes several files)
    r = snakemake("results/h100/table.csv", "-n", "--quiet", "rules",
                  "--configfile", "config/paper.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    cfg = merged(DEFAULT, PAPER)
    available = [d for d, v in cfg["deployments"].items() if v.get("available", True)]
    assert len(available) == 8
    n_engines = 3 if HAS_ROUNDS else 2
    jobs = job_counts(out)
    assert jobs["run_engine"] == len(available) * 5 * 4 * n_engines
    assert jobs["force"] == len(available) * 5 * 4 * (n_engines - 1)
    assert jobs["link_deployment"] == 8 and jobs["prompts"] == 8 * 5
    assert "build_tiny" not in jobs
    for d, v in cfg["deployments"].items():
        if not v.get("available", True):
            assert f"skipping deployment {d}: {v['reason']}" in out


def test_dry_run_paper_shell_commands():
    r = snakemake("-n", "-p", "results/h100/qwen3-8b_dspark/gsm8k/stock-c16.forcing.json",
                  "--configfile", "config/paper.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert ("python -m specpilot run --engine stock --target resources/deployments/qwen3-8b_dspark/target"
            " --target-name Qwen/Qwen3-8B --drafter resources/deployments/qwen3-8b_dspark/drafter-dspark") in out
    assert "--gpu h100 --max-new-tokens 2048 --concurrency 16 --block-size 7" in out
    assert "--device cuda --dtype bf16 --threads" in out
    assert "gpu=1, gpu_model=h100" in out
    assert ("--reference results/h100/qwen3-8b_dspark/gsm8k/ar-c16.jsonl --target "
            "resources/deployments/qwen3-8b_dspark/target --prompts results/prompts/qwen3-8b_dspark/gsm8k.jsonl"
            " --tolerance 0.1 --device cuda --dtype bf16") in out
    assert "--target Qwen/Qwen3-8B --drafter deepseek-ai/dspark_qwen3_8b_block7" in out


def test_lint_is_clean():
    r = snakemake("--lint")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Lints for" not in out


def test_envs_match_pyproject():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d)[0].lower().replace("_", "-") for d in deps}
    for env in (ROOT / "envs").glob("*.yaml"):
        spec = yaml.safe_load(env.read_text())
        pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
        assert "torch==2.13.0" in pip, env
        env_names = {re.split(r"[<>=!~ \[]", p)[0].lower().replace("_", "-") for p in pip}
        assert env_names <= names, (env, env_names - names)
        assert names - {"snakemake"} <= env_names, (env, names - env_names)

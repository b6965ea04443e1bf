"""Config traps (issue 12): --config values for nested keys, --config max_new_tokens reaching the
rounds, a typo named in one short message, the data location independent of the shell, the EOS key.
Dry runs only (nothing executed) except where noted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specpilot.errors import SpecpilotError

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "config" / "schema.yaml"
DEFAULT = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
WORKFLOW_FILES = ["Snakefile", "rules", "envs", "report", "profiles", "config", "src"]


def snakemake(*args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, text=True, env=env,
                          capture_output=True, timeout=timeout)


def check_config(cfg, schema):
    from specpilot.configcheck import check_config as check

    return check(cfg, schema)


def snakemake_config(*entries) -> dict:
    """The config as Snakemake builds it from --config entries (its own parser), merged over the default."""
    from snakemake.cli import parse_config
    from snakemake.utils import update_config

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    update_config(cfg, parse_config(list(entries)))
    return cfg


def test_nested_config_values_arrive_as_strings_and_are_parsed():
    cfg = snakemake_config("rounds={count: 1, budget: 3, llm: {model: m}}", "concurrency=[1, 16]",
                           "forcing={tolerance: 0.1}", "multi_turn=true", "n_prompts=all")
    assert cfg["rounds"]["count"] == "1" and cfg["concurrency"] == ["1", "16"]  # what Snakemake hands over
    check_config(cfg, SCHEMA_PATH)
    assert cfg["rounds"]["count"] == 1 and cfg["rounds"]["budget"] == 3 and cfg["rounds"]["llm"]["model"] == "m"
    assert cfg["rounds"]["agents_per_round"] == DEFAULT["rounds"]["agents_per_round"]  # the rest kept
    assert cfg["concurrency"] == [1, 16] and cfg["forcing"]["tolerance"] == 0.1
    assert cfg["multi_turn"] is True and cfg["n_prompts"] == "all"


def test_coerce_keeps_strings_where_strings_belong():
    from specpilot.configcheck import coerce, load_schema

    schema = load_schema(SCHEMA_PATH)
    cfg = coerce({"data_dir": "123", "deployments": {"d": {"target": "1", "block_size": "16", "drafter": "dflash",
                                                            "weight_format": "bf16", "available": "false",
                                                            "reason": "no"}},
                  "n_prompts": "8", "gpu": "h100"}, schema)
    assert cfg["data_dir"] == "123" and cfg["deployments"]["d"]["target"] == "1"
    assert cfg["deployments"]["d"]["block_size"] == 16 and cfg["deployments"]["d"]["available"] is False
    assert cfg["n_prompts"] == 8 and cfg["gpu"] == "h100"


def test_top_level_max_new_tokens_reaches_the_rounds():
    cfg = snakemake_config("max_new_tokens=48")
    del cfg["rounds"]["max_new_tokens"]  # a config whose rounds set no token count of their own
    check_config(cfg, SCHEMA_PATH)
    assert cfg["rounds"]["max_new_tokens"] == 48
    cfg = snakemake_config("max_new_tokens=48")  # the embedded default's rounds set their own (64)
    check_config(cfg, SCHEMA_PATH)
    assert cfg["rounds"]["max_new_tokens"] == DEFAULT["rounds"]["max_new_tokens"] != 48
    cfg = snakemake_config("max_new_tokens=48", "rounds={max_new_tokens: 20}")
    check_config(cfg, SCHEMA_PATH)
    assert cfg["rounds"]["max_new_tokens"] == 20


@pytest.mark.parametrize("entries,match", [
    (["n_promts=3"], r"^config: unknown key 'n_promts' \(did you mean 'n_prompts'\?\)"),
    (["rounds={cont: 1}"], r"^config rounds: unknown key 'cont' \(did you mean 'count'\?\)"),
    (["rounds={count: x}"], r"^config rounds\.count: 'x' is not of type 'integer'"),
    (["n_prompts=lots"], r"^config n_prompts: 'lots' is not an allowed value"),
])
def test_config_mistake_is_one_short_line(entries, match):
    cfg = snakemake_config(*entries)
    with pytest.raises(SpecpilotError, match=match) as info:
        check_config(cfg, SCHEMA_PATH)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_workflow_typo_message_is_short_and_names_the_key():
    r = snakemake("-n", "--config", "n_promts=3")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "unknown key 'n_promts' (did you mean 'n_prompts'?)" in out
    assert "$schema" not in out and "additionalProperties" not in out and len(out.splitlines()) < 15, out


def test_workflow_nested_override_and_max_new_tokens_reach_the_jobs():
    r = snakemake("-n", "-p", "--config", "rounds={count: 1, budget: 3, max_new_tokens: 24}", "max_new_tokens=16",
                  "stop_at_eos=true")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "round plan --round 1 " in out and "round plan --round 2 " not in out
    plans = [line for line in out.splitlines() if "specpilot round plan " in line]
    # the nested override arrived typed (count 1: no round 2 above) and the rounds' own token count
    # reaches the rounds, the top-level one the cells (agent jobs appear only after the plan
    # checkpoint ran, so the plan's line is checked)
    assert plans and all("--max-new-tokens 24 " in line and "--tolerance 0.001 " in line for line in plans)
    runs = [line for line in out.splitlines() if "python -m specpilot run " in line]
    assert runs and all("--stop-at-eos" in line and "--max-new-tokens 16" in line for line in runs)
    r = snakemake("-n", "-p")
    assert not any("--stop-at-eos" in line for line in (r.stdout + r.stderr).splitlines()
                   if "python -m specpilot run " in line)


def _copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in WORKFLOW_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("SPECPILOT_DATA_DIR",)}
    env.update(extra)
    return env


def test_dag_params_do_not_depend_on_the_shell(tmp_path, data_dir):
    """The same data found through $SPECPILOT_DATA_DIR or beside the repository gives the same job
    params; the jobs are told the folder through the environment, not through params."""
    repo = _copy_workflow(tmp_path / "repo")
    beside = tmp_path / "shared" / "data" / "benchmarks"
    beside.parent.mkdir(parents=True)
    beside.symlink_to(data_dir, target_is_directory=True)

    def prompt_cmds(env):
        r = snakemake("-n", "-p", "results/prompts/tiny/gsm8k.jsonl", cwd=repo, env=env)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return [line for line in r.stdout.splitlines() if "specpilot prompts" in line]

    with_env = prompt_cmds(_env(SPECPILOT_DATA_DIR=str(data_dir)))
    without = prompt_cmds(_env())
    assert with_env and with_env == without
    assert str(data_dir) not in "".join(with_env) and "--data-id " in with_env[0]


def test_no_data_and_no_hub_client_is_one_message(tmp_path):
    """A new user without the data folder, the variable or the Hub's client: one message naming both."""
    repo = _copy_workflow(tmp_path / "repo")
    shim = tmp_path / "shim"
    (shim / "datasets").mkdir(parents=True)  # a 'datasets' that cannot be found: hide the real one
    script = ("import sys, importlib.util as u; real = u.find_spec; "
              "u.find_spec = lambda n, *a, **k: None if n == 'datasets' else real(n, *a, **k); "
              "from snakemake.cli import main; sys.argv = ['snakemake', '-n']; main()")
    r = subprocess.run([sys.executable, "-c", script], cwd=repo, env=_env(), capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "no benchmark data found: set config data_dir" in out and "SPECPILOT_DATA_DIR" in out, out[-2000:]

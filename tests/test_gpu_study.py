"""The GPU study's pieces (issue 46) on the CPU: synthetic deployments (lazy random checkpoints of a
named shape, byte-level tokenizer) and their planning-time checks, the replay drafter through the
engine cells and the round trials, the config keys of config/gpu.yaml, the wheel folder's closure
check, the table's note, and the dry run of config/gpu.yaml for a GPU. The whole DAG on the CPU
with tiny shapes is .ci/run's step (scripts/gpu_study.sh with .test/config/gpu-tiny.yaml)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specpilot.agent import directions as dirs
from specpilot.aggregate import mechanisms
from specpilot.cli import main as cli_main
from specpilot.configcheck import check_config
from specpilot.deployment_random import write_random_deployment
from specpilot.errors import SpecpilotError
from specpilot.models.loading import load_target
from specpilot.models.shapes import SHAPES, target_params_b
from specpilot.records import read_records
from specpilot.validate import check_deployments
from specpilot.wheels import closure_problems, is_pure, manylinux_tags, target_environment

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "config" / "schema.yaml"


@pytest.fixture(scope="module")
def random_dep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("random") / "dep"
    write_random_deployment(out, "tiny", seed=3, block_size=8, weight_format="fp32", name="r",
                            replay_profile="study_stock")
    return out


def test_random_deployment_folder(random_dep):
    """config.json files only (lazy), the drafter's block the deployment's, a byte-level tokenizer, and
    the same weights whenever a job loads it."""
    build = json.loads((random_dep / "build.json").read_text())
    assert build["kind"] == "random" and build["shape"] == "tiny" and build["seed"] == 3
    assert not list(random_dep.rglob("*.safetensors"))
    tcfg = json.loads((random_dep / "target" / "config.json").read_text())
    dcfg = json.loads((random_dep / "drafter-dflash" / "config.json").read_text())
    assert tcfg["specpilot_random"] == {"shape": "tiny", "seed": 3, "std": 0.02, "lazy": True}
    assert dcfg["dflash_config"]["block_size"] == 8 if "dflash_config" in dcfg else dcfg["block_size"] == 8
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_dep / "target")
    text = "Natalia sold 48 clips — é"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and max(ids) < 260 and tok.decode(ids) == text
    a, b = (load_target(random_dep / "target", torch.float32, "cpu") for _ in range(2))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    other = write_random_deployment(random_dep.parent / "other", "tiny", seed=4, block_size=8, weight_format="fp32")
    c = load_target(Path(other["target_path"]), torch.float32, "cpu")
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)  # the seed decides the weights


def test_shape_parameter_counts_match_the_models():
    """target_params_b (torch-free, for the planner's job memory) against the built models' counts."""
    from specpilot.models.qwen3 import Transformer
    from specpilot.models.random_checkpoint import target_config

    for shape in ("qwen3-8b", "qwen3.8-27b", "muse-glimmer-30b"):
        with torch.device("meta"):
            n = sum(p.numel() for p in Transformer(target_config(shape)).parameters()) / 1e9
        assert abs(target_params_b(shape) - n) / n < 1e-3, shape


def _dep(**kw):
    d = {"target": "random", "shape": "qwen3.8-27b", "drafter": "dflash", "weight_format": "bf16",
         "block_size": 16, "replay_profile": "study_stock"}
    return {k: v for k, v in {**d, **kw}.items() if v is not None}


@pytest.mark.parametrize("change, words", [
    ({}, None),
    ({"shape": None}, "shape None: a random target needs shape"),
    ({"shape": "qwen3-70b"}, "shape 'qwen3-70b'"),
    ({"drafter": "dflash2"}, "drafter 'dflash2': a random target's drafter is a random dflash network"),
    ({"replay_profile": None}, "replay_profile missing"),
    ({"replay_profile": "no_such_profile"}, "replay_profile 'no_such_profile': acceptance profile not found"),
    ({"block_size": "auto"}, "block_size 'auto': a random target needs an integer"),
    ({"weight_format": "w12"}, "weight_format 'w12'"),
])
def test_planning_checks_of_a_random_deployment(change, words):
    problems = check_deployments({"syn": _dep(**change)}, ROOT)
    if words is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith("deployment syn: ") and words in problems[0], problems


def test_config_keys_of_the_gpu_study():
    """cell_requests with YAML's integer keys, rounds.directions, kernel_agent; wrong values named."""
    base = {"deployments": {"syn": _dep()}, "benchmarks": ["gsm8k"], "n_prompts": 16, "max_new_tokens": 8,
            "concurrency": [1, 16], "engines": ["ar", "stock", "specpilot"]}
    cfg = check_config({**base, "cell_requests": {1: 6}, "rounds": {"directions": ["overlap"]},
                        "kernel_agent": {"sections": ["engine"], "engine_rows": [16]}}, SCHEMA)
    assert cfg["cell_requests"] == {"1": 6}
    for bad, key in (({"cell_requests": {0: 2}}, "cell_requests"), ({"cell_requests": {1: 0}}, "cell_requests.1"),
                     ({"kernel_agent": {"sections": ["w13"]}}, "kernel_agent.sections"),
                     ({"rounds": {"directions": []}}, "rounds.directions")):
        with pytest.raises(SpecpilotError, match=re.escape(f"config {key}")):
            check_config({**base, **bad}, SCHEMA)


def _prompts(path: Path, n: int) -> Path:
    g = torch.Generator().manual_seed(0)
    rows = [{"request_id": f"p{i}", "benchmark": "gsm8k", "prompt_ids": torch.randint(4, 260, (20 + 3 * i,),
                                                                                       generator=g).tolist()}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("concurrency", [1, 2])
def test_engine_cell_with_the_replay_drafter(random_dep, tmp_path, concurrency):
    """`run --engine ar,stock,specpilot --replay-profile`: AR's outputs of the same run are the replay
    drafter's references; stock and specpilot equal AR token for token, are synthetic, name the
    profile; AR is not; --limit serves the first N prompts."""
    prompts = _prompts(tmp_path / "p.jsonl", 4)
    outs = [tmp_path / f"{e}.jsonl" for e in ("ar", "stock", "specpilot")]
    cfg = tmp_path / "spec.json"
    cfg.write_text(json.dumps({"engine_config": {"block_size": 6}}))
    rc = cli_main(["run", "--engine", "ar,stock,specpilot", "--target", str(random_dep / "target"),
                   "--drafter", str(random_dep / "drafter-dflash"), "--prompts", str(prompts), "--limit", "3",
                   "--out", ",".join(map(str, outs)), "--max-new-tokens", "10", "--concurrency", str(concurrency),
                   "--block-size", "8", "--device", "cpu", "--dtype", "fp32", "--replay-profile", "study_stock",
                   "--engine-config", str(cfg), "--threads", "1"])
    assert rc == 0
    ar, stock, spec = (read_records(o) for o in outs)
    assert [r.request_id for r in ar] == ["p0", "p1", "p2"]
    for recs in (stock, spec):
        assert [r.output_ids for r in recs] == [r.output_ids for r in ar]
        assert all(r.synthetic and r.drafter.startswith("replay:") for r in recs)
        assert all(r.engine_config["replay_profile"] == "study_stock" for r in recs)
        assert max(max(r.committed_per_step) for r in recs) > 1  # the replay drafter's drafts were accepted
    assert not any(r.synthetic for r in ar)
    assert {r.engine_config["block_size"] for r in stock} == {8} and {r.engine_config["block_size"] for r in spec} == {6}


def test_replay_drafter_refused_with_lookup(random_dep, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 1)
    rc = cli_main(["run", "--engine", "ar,lookup", "--target", str(random_dep / "target"), "--prompts", str(prompts),
                   "--out", f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", "--device", "cpu", "--replay-profile",
                   "study_stock"])
    assert rc == 2


def test_round_trials_with_the_replay_drafter(random_dep, tmp_path):
    """The rounds' evaluator drafts with the replay drafter over its AR references; a candidate the
    engine refuses (the replay drafter does not model a second level) is a rejected trial with the
    reason, not a failed job; a runnable one is measured and gated."""
    from specpilot.agent.trial import Evaluator
    from specpilot.deployment import load_deployment
    from specpilot.drafters.replay import load_profile

    dep = load_deployment(random_dep / "target", random_dep / "drafter-dflash", torch.device("cpu"), torch.float32)
    prompts = [{**json.loads(line), "benchmark": "gsm8k"} for line in _prompts(tmp_path / "c.jsonl", 2).read_text().splitlines()]
    ev = Evaluator(dep, prompts, 8, 1, {"deployment": "r", "target": "t", "drafter": "dflash", "gpu": "cpu"}, 8, 1e-3,
                   repeats=1, replay=load_profile("study_stock"))
    assert all(r.synthetic for r in ev.stock) and not any(r.synthetic for r in ev.ar)
    assert [r.output_ids for r in ev.stock] == [r.output_ids for r in ev.ar]
    refused = ev.trial({"block_size": 8, "second_level": 2}, {"block_size": 8})
    assert not refused["gate"]["passed"] and "second_level is not modeled" in refused["gate"]["refused"] and refused["gain"] is None
    ok = ev.trial({"block_size": 6}, {"block_size": 8})
    assert ok["gate"]["passed"] and ok["gain"] is not None and ok["tau"] > 1


def test_directions_the_plan_may_choose():
    """rounds.directions restricts the registry; w12 needs a GPU and room for the 12-bit copy (any
    target family: the Triton step's 12-bit loader); the replay drafter rules out two-level drafting."""
    gpu = {"gpu": "h200", "dtype": "bf16", "drafter": "dflash", "concurrency": 1}
    names = lambda ctx: [d.name for d in dirs.applicable(ctx)]  # noqa: E731
    assert names({**gpu, "directions": ["overlap", "w12_weights"]}) == ["w12_weights", "overlap"]
    assert "two_level" in names(gpu) and "two_level" not in names({**gpu, "replay": "study_stock"})
    assert "w12_weights" in names({**gpu, "dense": True, "target_gb": 16.4, "device_gb": 85.0})
    assert "w12_weights" not in names({**gpu, "dense": True, "target_gb": 55.7, "device_gb": 85.0})  # 30B on an H100
    assert "w12_weights" in names({**gpu, "dense": False, "target_gb": 55.7, "device_gb": 150.0})  # 30B on an H200
    assert "w12_weights" not in names({**gpu, "dtype": "fp32", "target_gb": 1.0, "device_gb": 150.0})
    with pytest.raises(SpecpilotError, match="rounds.directions names 'overlapp'"):
        dirs.applicable({**gpu, "directions": ["overlapp"]})


def test_the_tables_note_when_specpilot_runs_stocks_config():
    rec = lambda cfg: SimpleNamespace(engine_config=cfg)  # noqa: E731
    stock = rec({"block_size": 16, "replay_profile": "study_stock", "kernels": {"a": 1}})
    assert mechanisms(rec({"block_size": 16, "overlap": False, "kernels": {"b": 2}})) == mechanisms(stock)
    assert mechanisms(rec({"block_size": 16, "overlap": True})) != mechanisms(stock)


def _wheel(folder: Path, name: str, ver: str, requires: list[str], tag: str = "py3-none-any") -> Path:
    path = folder / f"{name}-{ver}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, ver, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{ver}.dist-info/METADATA", meta)
    return path


def test_wheel_folder_closure_and_tags(tmp_path):
    """Every requirement (markers for the target) in the folder, allowed by its specifier, or left
    out as the target's; manylinux tags expand to the older ones a machine of that glibc runs."""
    env = target_environment("3.12", "manylinux2014_x86_64")
    a = _wheel(tmp_path, "a", "1.0", ["b>=2", "c; python_version < '3.0'", "d; extra == 'x'", "e"])
    b_old = _wheel(tmp_path, "b", "1.5", [])
    problems = closure_problems([a, b_old], env, excluded={"e"})
    assert len(problems) == 1 and "needs b>=2, the folder has b 1.5" in problems[0]
    problems = closure_problems([a], env, excluded=set())
    assert {p.split(" needs ")[1].split(",")[0] for p in problems} == {"b>=2", "e"}
    b_new = _wheel(tmp_path, "b", "2.1", [])
    assert closure_problems([a, b_new], env, excluded={"e"}) == []
    assert is_pure(b_new) and not is_pure(_wheel(tmp_path, "f", "1", [], "cp312-cp312-manylinux2014_x86_64"))
    tags = manylinux_tags("manylinux2014_x86_64")
    assert tags[:2] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"] and "manylinux1_x86_64" in tags
    assert "manylinux_2_28_x86_64" in manylinux_tags("manylinux_2_28_x86_64")
    assert "manylinux_2_28_x86_64" not in tags
    assert env["python_version"] == "3.12" and env["platform_machine"] == "x86_64"


def _plan(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_the_gpu_config_plans_every_cell_for_a_gpu(data_dir):
    """`snakemake -n --configfile config/gpu.yaml --config gpu=h200`: every deployment's cells (c1 and
    c16, every engine in one job), forcing jobs, the kernels rule, the rounds of both regimes."""
    counts = dict(re.findall(r"(?m)^(\w+)\s+(\d+)$", _plan("--configfile", "config/gpu.yaml", "--config", "gpu=h200")))
    import yaml

    cfg = yaml.safe_load((ROOT / "config" / "gpu.yaml").read_text())
    deps = [d for d, v in cfg["deployments"].items() if v.get("available", True)]
    assert len(deps) == 3 and all(cfg["deployments"][d]["shape"] in SHAPES for d in deps)
    from specpilot.regimes import regime_of, resolve

    regimes = resolve(cfg)  # single (c1) and batched (c16): rounds and kernel sub-agent per regime
    assert [(n, r["tune"], r["cells"]) for n, r in regimes.items()] == [("single", 1, [1]), ("batched", 16, [16])]
    cells = len(deps) * len(cfg["benchmarks"]) * len(regime_of(regimes))
    assert counts["run_engine"] == str(cells) and counts["force"] == str(cells)
    assert counts["kernels"] == "1" and counts["random_deployment"] == str(len(deps))
    per = str(len(deps) * len(regimes))
    assert counts["round_plan"] == per and counts["kernel_agent"] == per and counts["calibration_prompts"] == per
    assert "link_deployment" not in counts and "build_tiny" not in counts


def test_the_tiny_overlay_is_the_gpu_study_with_tiny_shapes():
    """.test/config/gpu-tiny.yaml (CI runs it end to end) differs from config/gpu.yaml only in what
    it substitutes: shapes of the same families, fp32, sizes, and block_size among the directions."""
    import yaml

    gpu = yaml.safe_load((ROOT / "config" / "gpu.yaml").read_text())
    tiny = yaml.safe_load((ROOT / ".test" / "config" / "gpu-tiny.yaml").read_text())
    family = {"qwen3-8b": "tiny", "qwen3.8-27b": "tiny-hybrid", "muse-glimmer-30b": "tiny-muse"}
    assert list(tiny["deployments"]) == list(gpu["deployments"])
    for name, dep in gpu["deployments"].items():
        other = tiny["deployments"][name]
        if dep.get("available", True) is False:
            assert other.get("available") is False
            continue
        assert other["shape"] == family[dep["shape"]] and other["weight_format"] == "fp32"
        assert {k: v for k, v in other.items() if k not in ("shape", "weight_format")} == \
            {k: v for k, v in dep.items() if k not in ("shape", "weight_format")}
    for key in ("benchmarks", "concurrency", "engines"):
        assert tiny[key] == gpu[key], key
    assert sorted(tiny["cell_requests"]) == sorted(gpu["cell_requests"])
    for key in ("count", "agents_per_round", "transfer"):
        assert tiny["rounds"][key] == gpu["rounds"][key], key
    # the same serving regimes (issue 53) and directions; the batched one at a smaller concurrency on the CPU
    assert list(tiny["regimes"]) == list(gpu["regimes"])
    for name, regime in gpu["regimes"].items():
        small = tiny["regimes"][name]
        assert small["directions"] == regime["directions"] and 1 < small["tune"] <= regime["tune"]
        assert small["cells"] == [small["tune"]] and regime["cells"] == [regime["tune"]]
    assert set(gpu["rounds"]["directions"]) < set(tiny["rounds"]["directions"])
    assert tiny["kernel_agent"] == gpu["kernel_agent"]

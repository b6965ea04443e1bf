"""The SLURM profile (profiles/slurm) against a real SLURM cluster.

Needs a cluster that answers ``sinfo`` -- in CI the one-node cluster on localhost that
``.ci/slurm-cluster.sh up`` starts (typed placeholder GPUs gpu:h100 and gpu:rtx_pro_6000) -- and
``snakemake-executor-plugin-slurm`` (``pip install -e '.[slurm]'``). Without them these tests are
skipped, except under CI=true, where they fail: CI must never pass without having run them.

1. The embedded default, reduced (tests/configs/slurm.yaml: 2 benchmarks x 2 prompts x 32 new
   tokens, engines ar + stock), runs through ``--workflow-profile profiles/slurm``: every job is
   a SLURM job (ids from Snakemake's SLURM logs, state COMPLETED in ``scontrol show job``), and
   results/cpu/table.csv has the same rows as a local run of the same config.
2. GPU rules of the study matrix are submitted with ``--gpus=<gpu_model>:1`` and accepted by
   sbatch; the job runs on the node holding that GPU type (``TresPerJob=gres:gpu:h100:1``).
3. The dry run of config/paper.yaml for results/h100/table.csv: every GPU job carries gpu=1,
   gpu_model=h100, which the executor turns into ``--gpus=h100:1``; CPU rules ask for no GPU.

The tiny deployment is reused from resources/deployments/tiny when it is built (CI builds it
first with ``snakemake --cores all``); otherwise a --quick one is built by the local run and
copied, so SLURM never rebuilds it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ["Snakefile", "rules", "envs", "report", "profiles", "config"]
REDUCED_CONFIG = ROOT / "tests" / "configs" / "slurm.yaml"
TINY = Path(os.environ.get("SPECPILOT_TINY_DIR") or ROOT / "resources" / "deployments" / "tiny")
RUN_TIMEOUT = 1500
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# What the test cluster (2 cores, ~24 GB) can hold: the profile's per-rule memory (sized for 30B
# targets) and 8 threads do not fit, so they are overridden here as a small site would.
SMALL_NODE = [
    "--set-threads", "run_engine=2", "force=2", "ceilings=1", "tiny_target=2", "tiny_teacher=2",
    "--set-resources", "run_engine:mem_mb=4000", "force:mem_mb=4000",
    # first status check after 5 s instead of 40 s (MinJobAge on the test cluster is far above 15 s)
    "--slurm-init-seconds-before-status-checks", "5",
    "--slurm-keep-successful-logs",
]

pytestmark = pytest.mark.slurm


def _unavailable(reason: str):
    if IN_CI:
        diag = ""
        script = ROOT / ".ci" / "slurm-cluster.sh"
        if script.is_file():
            r = subprocess.run(["bash", str(script), "logs"], capture_output=True, text=True)
            diag = "\n" + r.stdout[-6000:] + r.stderr[-2000:]
        pytest.fail(f"CI=true but {reason} (bring it up with .ci/slurm-cluster.sh up){diag}",
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def plugin() -> None:
    """snakemake-executor-plugin-slurm, which profiles/slurm names as its executor."""
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        _unavailable("snakemake-executor-plugin-slurm is not installed (pip install -e '.[slurm]')")


@pytest.fixture(scope="module")
def cluster(plugin) -> str:
    """The partition/node summary of a SLURM cluster that answers sinfo (skip/fail otherwise)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        _unavailable("no SLURM client commands (sinfo, sbatch) on PATH")
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P %T %G"], capture_output=True, text=True,
                           timeout=20)
    except subprocess.TimeoutExpired:
        _unavailable("sinfo did not answer within 20 s")
    if r.returncode != 0 or not re.search(r"\b(idle|mixed|allocated)\b", r.stdout):
        _unavailable(f"no usable SLURM node: sinfo rc={r.returncode} {r.stdout.strip()} "
                     f"{r.stderr.strip()}")
    return r.stdout


def data_dir() -> Path:
    d = Path(os.environ.get("SPECPILOT_DATA_DIR") or ROOT.parent / "shared" / "data" / "benchmarks")
    if not d.is_dir():
        _unavailable(f"benchmark data not found at {d} (set SPECPILOT_DATA_DIR)")
    return d.resolve()


def copy_workflow(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in WORKFLOW_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name)
        else:
            shutil.copy2(src, dst / name)
    return dst


def snakemake(workdir: Path, *args: str, log: Path, timeout: int = RUN_TIMEOUT) -> int:
    with open(log, "a") as f:
        f.write(f"\n$ snakemake {' '.join(args)}\n")
        f.flush()
        r = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, stdout=f,
                           stderr=subprocess.STDOUT, timeout=timeout)
    return r.returncode


def scontrol_job(jobid: str) -> dict[str, str]:
    """`scontrol show job -o ID` as key -> value (empty when SLURM no longer knows the job)."""
    r = subprocess.run(["scontrol", "-o", "show", "job", jobid], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        return {}
    return dict(m.groups() for m in re.finditer(r"(\w+(?:/\w+)?)=(\S*)", r.stdout))


def submitted_jobs(log_text: str) -> dict[str, str]:
    """SLURM job id -> Snakemake's SLURM log file, from 'submitted with SLURM jobid' lines."""
    return dict(re.findall(r"has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", log_text))


def finished_rules(log_text: str) -> list[str]:
    """The rule of each finished job (Snakemake may report the last one twice)."""
    return list(dict(re.findall(r"Finished jobid: (\d+) \(Rule: (\w+)\)", log_text)).values())


def diagnostics(workdir: Path, log: Path) -> str:
    parts = [f"--- {log.name} (tail) ---", log.read_text()[-6000:]]
    q = subprocess.run(["squeue", "--states=all", "-o", "%i %T %r %k"], capture_output=True,
                       text=True)
    parts += ["--- squeue --states=all ---", q.stdout[-3000:]]
    for f in sorted((workdir / ".snakemake" / "slurm_logs").rglob("*.log"))[-4:]:
        parts += [f"--- {f.relative_to(workdir)} ---", f.read_text()[-2000:]]
    return "\n".join(parts)


def comparable(table: Path) -> pd.DataFrame:
    """The table without timing-dependent columns, sorted by its key."""
    df = pd.read_csv(table, keep_default_na=False)
    keep = ["deployment", "target", "drafter", "benchmark", "concurrency", "n_requests",
            "stock_tau", "forcing", "synthetic"]
    return df[keep].sort_values(["deployment", "benchmark", "concurrency"]).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------
# 1. the reduced embedded default through SLURM, against a local run


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, cluster):
    """A local run of the reduced config; returns (its workdir, the config file, the deployment)."""
    base = tmp_path_factory.mktemp("slurm-e2e")
    cfg = yaml.safe_load(REDUCED_CONFIG.read_text())
    tiny = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["deployments"]["tiny"]
    prebuilt = (TINY / "build.json").is_file()
    cfg["deployments"]["tiny"] = {**tiny, "quick": tiny.get("quick", False) if prebuilt else True}  # the others stay off
    cfg["data_dir"] = str(data_dir())
    config = base / "slurm-test.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))

    local = copy_workflow(base / "local")
    if prebuilt:
        shutil.copytree(TINY, local / "resources" / "deployments" / "tiny")
    log = base / "local.log"
    t0 = time.monotonic()
    rc = snakemake(local, "results/cpu/table.csv", "--cores", "2", f"--configfile={config}",
                   log=log)
    assert rc == 0, diagnostics(local, log)
    print(f"local run: {time.monotonic() - t0:.0f} s (deployment "
          f"{'reused from ' + str(TINY) if prebuilt else 'built with --quick'})")
    return local, config


def test_reduced_default_runs_through_slurm(tmp_path_factory, local_run, capsys):
    local, config = local_run
    work = copy_workflow(tmp_path_factory.mktemp("slurm-e2e-cluster") / "work")
    # the deployment the local run used, so SLURM does not rebuild it
    shutil.copytree(local / "resources" / "deployments" / "tiny",
                    work / "resources" / "deployments" / "tiny")
    log = work.parent / "slurm.log"
    t0 = time.monotonic()
    rc = snakemake(work, "results/cpu/table.csv", "--workflow-profile", "profiles/slurm",
                   f"--configfile={config}", *SMALL_NODE, log=log)
    elapsed = time.monotonic() - t0
    text = log.read_text()
    assert rc == 0, diagnostics(work, log)

    # every job went through SLURM: one SLURM job per finished Snakemake job
    jobs = submitted_jobs(text)
    done = finished_rules(text)
    build_rules = {"build_tiny", "tiny_target", "tiny_teacher", "tiny_drafter"}
    assert not build_rules & set(done), "SLURM rebuilt the tiny deployment instead of reusing it"
    expected = sorted(r for r in finished_rules((local.parent / "local.log").read_text())
                      if r not in build_rules)
    assert sorted(done) == expected, f"SLURM run finished {sorted(done)}, local run {expected}"
    assert len(jobs) == len(done), f"{len(jobs)} SLURM jobs for {len(done)} finished jobs"
    rules = []
    for jobid, slurm_log in jobs.items():
        slurm_log = Path(slurm_log)
        assert slurm_log.is_file() and slurm_log.stem == jobid, f"no SLURM log {slurm_log}"
        assert slurm_log.is_relative_to(work / ".snakemake" / "slurm_logs")
        info = scontrol_job(jobid)
        assert info.get("JobState") == "COMPLETED", f"SLURM job {jobid}: {info or 'unknown'}"
        assert Path(info["WorkDir"]) == work
        rules.append(re.match(r"rule_(\w+?)(?:_wildcards_|$)", info["Comment"])[1])
    assert sorted(rules) == expected

    # the same table as the local run
    table = work / "results" / "cpu" / "table.csv"
    pd.testing.assert_frame_equal(comparable(table), comparable(local / "results" / "cpu" / "table.csv"))
    cfg = yaml.safe_load(config.read_text())
    assert set(cfg["benchmarks"]) <= set(pd.read_csv(table)["benchmark"])
    with capsys.disabled():
        print(f"\nSLURM run: {len(jobs)} SLURM jobs ({', '.join(sorted(set(rules)))}), "
              f"{elapsed:.0f} s; job ids {', '.join(sorted(jobs, key=int))}")


# ---------------------------------------------------------------------------------------------
# 2. GPU rules of the study matrix: sbatch --gpus=<model>:1 accepted, the job runs there


def test_gpu_rules_are_submitted_with_typed_gpus(tmp_path, cluster, capsys):
    gpus = {"h100", "rtx_pro_6000"}
    advertised = set(re.findall(r"gpu:([A-Za-z0-9_.]+):\d+", cluster))
    if not gpus <= advertised:
        _unavailable(f"the cluster advertises GPU types {sorted(advertised)}, not {sorted(gpus)} "
                     "(.ci/slurm-cluster.sh sets up placeholder gpu:h100 and gpu:rtx_pro_6000)")
    work = copy_workflow(tmp_path / "work")
    log = tmp_path / "gpu.log"
    # ceilings: a GPU rule with no inputs. On this CPU-only node it fails after starting (torch
    # sees no CUDA device) -- what matters here is that sbatch accepted the GPU request and the
    # scheduler ran the job on the node holding that GPU type.
    snakemake(work, "results/h100/ceilings.json", "results/rtx_pro_6000/ceilings.json",
              "--workflow-profile", "profiles/slurm", "--configfile=config/paper.yaml",
              "--retries", "0", "--verbose", *SMALL_NODE, log=log, timeout=600)
    text = log.read_text()
    assert "SLURM sbatch failed" not in text, diagnostics(work, log)
    calls = re.findall(r"^sbatch call: (sbatch .*)$", text, re.MULTILINE)
    jobs = submitted_jobs(text)
    assert len(calls) == len(jobs) == 2, diagnostics(work, log)
    shown = []
    for gpu in sorted(gpus):
        call = next(c for c in calls if f"--comment rule_ceilings_wildcards_{gpu} " in c)
        assert f" --gpus={gpu}:1 " in call, call
        jobid = next(j for j, p in jobs.items() if f"/rule_ceilings/{gpu}/" in p)
        info = scontrol_job(jobid)
        assert info.get("TresPerJob") == f"gres:gpu:{gpu}:1", info
        # it ran: the node executed the rule, whose log says why it stopped
        assert info.get("JobState") in ("COMPLETED", "FAILED"), info
        assert (work / "logs" / gpu / "ceilings.log").is_file(), diagnostics(work, log)
        shown.append(f"{gpu}: job {jobid} {info['JobState']} TresPerJob={info['TresPerJob']}; "
                     f"{call.split(' --wrap=')[0]}")
    with capsys.disabled():
        print("\n" + "\n".join(shown))


# ---------------------------------------------------------------------------------------------
# 3. the study matrix's dry run: GPU jobs carry the h100 request


class _Resources(dict):
    __getattr__ = dict.__getitem__


class _Job:
    def __init__(self, resources: dict):
        self.resources = _Resources(resources)


def dry_run_jobs(workdir: Path, *args: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, resources) of every job in `snakemake -n ...` output."""
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", *args], cwd=workdir,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    jobs = []
    for m in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)+)", r.stdout, re.MULTILINE):
        res = re.search(r"^    resources: (.*)$", m[2], re.MULTILINE)
        kv = dict(p.split("=", 1) for p in res[1].split(", ")) if res else {}
        jobs.append((m[1], kv))
    assert jobs, r.stdout[-4000:]
    return jobs


def sbatch_gpu_args(resources: dict[str, str]) -> str:
    """The GPU part of the sbatch call the SLURM executor builds from these resources."""
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    res = {k: (int(v) if v.isdigit() else v) for k, v in resources.items() if v != ""}
    return set_gres_string(_Job(res)).strip()


GPU_RULES = {"run_engine", "force", "ceilings", "kernels", "kernel_agent", "round_references", "round_plan",
             "round_agent", "round_integrate"}
CPU_RULES = {"prompts", "table", "figures", "link_deployment", "build_tiny", "tiny_target", "tiny_teacher",
             "tiny_drafter", "all", "calibration_prompts",
             "calibration_gather", "round_memory_start", "specpilot_config", "memory", "rounds_figure"}


def test_paper_dry_run_requests_h100(tmp_path, plugin, capsys):
    # the command; the target goes first (--configfile takes every word after it)
    jobs = dry_run_jobs(copy_workflow(tmp_path / "work"), "results/h100/table.csv",
                        "--workflow-profile", "profiles/slurm", "--configfile", "config/paper.yaml")
    rules = {rule for rule, _ in jobs}
    assert {"run_engine", "force", "prompts", "table"} <= rules
    gpu_rules, cpu_rules = set(), set()
    for rule, res in jobs:
        assert rule not in GPU_RULES or res.get("gpu") == "1", f"GPU rule {rule} asks for no GPU"
        assert rule not in CPU_RULES or res.get("gpu", "0") == "0", f"CPU rule {rule} asks for a GPU"
        if res.get("gpu", "0") != "0":  # any GPU job of the h100 table asks for one h100
            assert res.get("gpu") == "1" and res.get("gpu_model") == "h100", (rule, res)
            assert sbatch_gpu_args(res) == "--gpus=h100:1", (rule, res)
            gpu_rules.add(rule)
        else:
            assert not res.get("gpu_model") and sbatch_gpu_args(res) == "", (rule, res)
            cpu_rules.add(rule)
    gpu_jobs = sum(rule in gpu_rules for rule, _ in jobs)
    with capsys.disabled():
        print(f"\npaper dry run, results/h100/table.csv: {len(jobs)} jobs, {gpu_jobs} GPU jobs "
              f"each with sbatch --gpus=h100:1 (rules {', '.join(sorted(gpu_rules))}); "
              f"rules {', '.join(sorted(cpu_rules))} ask for no GPU")


def test_gpu_models_maps_to_site_gres_names(tmp_path, plugin):
    """A site whose GRES type for the H100 is "H100_80GB" says so in gpu_models."""
    site = tmp_path / "site.yaml"
    site.write_text("gpu_models:\n  h100: H100_80GB\n")
    jobs = dry_run_jobs(copy_workflow(tmp_path / "work"), "results/h100/kernels/manifest.json",
                        "results/h100/ceilings.json", "--workflow-profile", "profiles/slurm",
                        "--configfile", "config/paper.yaml", str(site))
    gpu_jobs = [res for rule, res in jobs if rule in GPU_RULES]
    assert len(gpu_jobs) == 2
    for res in gpu_jobs:
        assert sbatch_gpu_args(res) == "--gpus=H100_80GB:1", res

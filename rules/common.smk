# Helpers shared by the workflow files: config-derived lists, paths, the {gpu} value and the
# resources of GPU and timing jobs. Functions only (snakemake --lint wants them apart from rules).

import functools
import json
import os
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

# The workflow runs `python -m specpilot ...`; putting src/ on PYTHONPATH makes that work in a
# conda environment of a job too, where the package itself is not installed.
_SRC = Path(workflow.basedir) / "src"
if _SRC.is_dir():
    os.environ.update(PYTHONPATH=os.pathsep.join(
        p for p in [str(_SRC), os.environ.get("PYTHONPATH", "")] if p))

BENCHMARK_NAMES = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
ENGINE_NAMES = ["ar", "stock", "specpilot"]
TINY_TARGET = "tiny"
# Every deployment with target "tiny" shares one build, resources/deployments/tiny: one target and
# one drafter of each of these kinds (specpilot build-tiny).
TINY_BUILD = "tiny"
TINY_DRAFTERS = ("dflash", "dflash2", "dspark")

# Agent rounds (rules/rounds.smk) are written separately; until that file exists the workflow runs
# without them and the table says specpilot was not run.
ROUNDS_SMK = Path(workflow.basedir) / "rules" / "rounds.smk"
HAS_ROUNDS = ROUNDS_SMK.is_file()


def _deployments():
    """Available deployments (name -> settings); logs the ones marked available: false."""
    active = {}
    for name, dep in config["deployments"].items():
        if dep.get("available", True) is False:
            logger.info(f"specpilot: skipping deployment {name}: {dep.get('reason', 'no reason given')}")
            continue
        if dep["target"] == TINY_TARGET and dep["drafter"] not in TINY_DRAFTERS:
            raise ValueError(f"deployment {name}: target 'tiny' is built with drafters "
                             f"{', '.join(TINY_DRAFTERS)}, not {dep['drafter']!r}")
        if dep["target"] != TINY_TARGET and not dep.get("drafter_id"):
            raise ValueError(f"deployment {name}: a real target needs drafter_id "
                             f"(a local folder or Hugging Face Hub id of the drafter)")
        active[name] = dep
    return active


DEPLOYMENTS = _deployments()
TINY_DEPLOYMENTS = [d for d, v in DEPLOYMENTS.items() if v["target"] == TINY_TARGET]
LINKED_DEPLOYMENTS = [d for d, v in DEPLOYMENTS.items() if v["target"] != TINY_TARGET]

# Engines whose cells are run: specpilot needs the agent rounds' engine config.
RUN_ENGINES = [e for e in config["engines"] if e != "specpilot" or HAS_ROUNDS]
if "specpilot" not in config["engines"]:
    SPECPILOT_NOTE = "specpilot not run: not in config engines"
elif not HAS_ROUNDS:
    SPECPILOT_NOTE = "specpilot not run: agent rounds (rules/rounds.smk) not available yet"
    logger.info(f"specpilot: {SPECPILOT_NOTE}")
else:
    SPECPILOT_NOTE = "specpilot not run"

# Timing jobs (engine runs, ceilings) take every core the run was given, so nothing else runs
# beside them on this machine; resources: timing_slots=1 (a global limit set in the profile)
# keeps two of them from timing at once.
def _given_cores():
    try:
        return workflow.cores
    except WorkflowError:  # a cluster executor runs without --cores
        return None


TIMING_THREADS = max(1, min(_given_cores() or os.cpu_count() or 1, os.cpu_count() or 1))


def names_regex(names):
    """A wildcard regex matching exactly these names ('(?!)' matches nothing)."""
    return "|".join(re.escape(n) for n in names) or "(?!)"


@functools.cache
def target_gpus():
    """The {gpu} values built by default: config gpu, where "auto" = this machine's device."""
    gpu = config.get("gpu", "auto")
    if gpu == "auto":
        from specpilot.device import detect_gpu

        return [detect_gpu()]
    return [gpu] if isinstance(gpu, str) else list(gpu)


def gpu_count(wildcards):
    """resources: gpu -- one GPU for a GPU cell, none on cpu."""
    return 0 if wildcards.gpu == "cpu" else 1


def gpu_model(wildcards):
    """resources: gpu_model -- the cluster's name for the {gpu} device (config gpu_models)."""
    if wildcards.gpu == "cpu":
        return None
    return config.get("gpu_models", {}).get(wildcards.gpu, wildcards.gpu)


def torch_device(wildcards):
    return "cpu" if wildcards.gpu == "cpu" else "cuda"


def deployment(wildcards):
    return DEPLOYMENTS[wildcards.deployment]


def deployment_dir(name):
    if name in DEPLOYMENTS and DEPLOYMENTS[name]["target"] == TINY_TARGET:
        return f"resources/deployments/{TINY_BUILD}"
    return f"resources/deployments/{name}"


def build_marker(wildcards):
    return f"{deployment_dir(wildcards.deployment)}/build.json"


def target_dir(wildcards):
    return f"{deployment_dir(wildcards.deployment)}/target"


def drafter_dir(wildcards):
    return f"{deployment_dir(wildcards.deployment)}/drafter-{deployment(wildcards)['drafter']}"


def data_dir():
    """Benchmark data folder: config data_dir, else $SPECPILOT_DATA_DIR, else None (the Hub)."""
    return config.get("data_dir") or os.environ.get("SPECPILOT_DATA_DIR") or None


def data_dir_opt():
    d = data_dir()
    return f"--data-dir {shlex.quote(d)}" if d else ""


def prompts_path(deployment_name, benchmark):
    return f"results/prompts/{deployment_name}/{benchmark}.jsonl"


def records_path(gpu, deployment_name, benchmark, engine, concurrency):
    return f"results/{gpu}/{deployment_name}/{benchmark}/{engine}-c{concurrency}.jsonl"


def forcing_path(gpu, deployment_name, benchmark, engine, concurrency):
    return f"results/{gpu}/{deployment_name}/{benchmark}/{engine}-c{concurrency}.forcing.json"


def engine_config_path(gpu, deployment_name):
    """The engine config the last agent round validated (produced by rules/rounds.smk)."""
    return f"results/{gpu}/{deployment_name}/specpilot.json"


def run_inputs(wildcards):
    """Inputs of one engine cell: prompts, the deployment, and for specpilot its engine config."""
    inputs = {"prompts": prompts_path(wildcards.deployment, wildcards.benchmark),
              "build": build_marker(wildcards)}
    if wildcards.engine == "specpilot":
        inputs["engine_config"] = engine_config_path(wildcards.gpu, wildcards.deployment)
    return inputs


def dtype_opt(wildcards):
    """--dtype from the deployment's weight_format (w12 computes in bf16)."""
    fmt = deployment(wildcards)["weight_format"]
    return f"--dtype {'fp32' if fmt == 'fp32' else 'bf16'}"


def weight_opts(wildcards):
    """Engine options for the deployment's weight_format: compute dtype, and w12 weights."""
    fmt = deployment(wildcards)["weight_format"]
    return dtype_opt(wildcards) + (" --weight-format w12" if fmt == "w12" else "")


def drafter_opt(wildcards):
    return "" if wildcards.engine == "ar" else f"--drafter {drafter_dir(wildcards)}"


def engine_config_opt(wildcards, input):
    return f"--engine-config {input.engine_config}" if wildcards.engine == "specpilot" else ""


def forcing_references(wildcards):
    """Reference records of a candidate cell: AR always, and stock too for specpilot."""
    refs = [records_path(wildcards.gpu, wildcards.deployment, wildcards.benchmark, "ar",
                         wildcards.concurrency)]
    if wildcards.engine == "specpilot" and "stock" in config["engines"]:
        refs.append(records_path(wildcards.gpu, wildcards.deployment, wildcards.benchmark, "stock",
                                 wildcards.concurrency))
    return refs


def reference_opts(wildcards, input):
    return " ".join(f"--reference {shlex.quote(r)}" for r in input.references)


def cells():
    """(deployment, benchmark, concurrency) of every cell of the study."""
    return [(d, b, c) for d in DEPLOYMENTS for b in config["benchmarks"]
            for c in config["concurrency"]]


def table_inputs(wildcards):
    """Every records file and forcing verdict of one GPU's table."""
    records, forcing = [], []
    for d, b, c in cells():
        for e in RUN_ENGINES:
            records.append(records_path(wildcards.gpu, d, b, e, c))
            if e != "ar":
                forcing.append(forcing_path(wildcards.gpu, d, b, e, c))
    return {"records": records, "forcing": forcing}


def figure_paths(gpu):
    names = ["speedup", "tau", "concurrency"]
    if HAS_ROUNDS and "specpilot" in config["engines"] and config["rounds"]["count"] > 0:
        names.append("rounds")
    return [f"results/{gpu}/figures/{name}.png" for name in names]


def final_outputs(wildcards):
    """What `snakemake` with no target builds: per target GPU its table, figures, ceilings, kernels."""
    if not DEPLOYMENTS:
        raise ValueError("no available deployment in config deployments")
    out = []
    for gpu in target_gpus():
        out += [f"results/{gpu}/table.csv", f"results/{gpu}/ceilings.json",
                f"results/{gpu}/kernels/manifest.json"] + figure_paths(gpu)
        if HAS_ROUNDS:
            out += [f"results/{gpu}/kernels/{d}/kernel-agent.json" for d in DEPLOYMENTS]
    return out


# ---- agent rounds (rules/rounds.smk) ----

ROUND_DIR = "results/{gpu}/{deployment}/rounds/round-{k}"
MEMORY = "results/memory.jsonl"


def round_common(wildcards):
    """Options shared by every round step of one (gpu, deployment)."""
    dep = deployment(wildcards)
    rc = config["rounds"]
    llm = rc.get("llm") or {}
    opts = [
        f"--target {target_dir(wildcards)} --drafter {drafter_dir(wildcards)}",
        f"--target-name {shlex.quote(dep['target'])} --drafter-name {dep['drafter']}",
        f"--deployment {wildcards.deployment} --gpu {wildcards.gpu} --device {torch_device(wildcards)}",
        dtype_opt(wildcards),
        f"--block-size {dep['block_size']} --max-new-tokens {rc.get('max_new_tokens', config['max_new_tokens'])}",
        f"--concurrency {rc.get('concurrency', 1)} --tolerance {config['forcing']['tolerance']}",
        f"--memory {MEMORY} --agents {rc['agents_per_round']} --budget {rc['budget']}",
    ]
    if llm.get("base_url") and llm.get("model"):
        opts.append(f"--llm {shlex.quote(json.dumps(llm))}")
    return " ".join(opts)


def previous_round(wildcards):
    k = int(wildcards.k)
    if k <= 1:
        return []
    return [f"results/{wildcards.gpu}/{wildcards.deployment}/rounds/round-{k - 1}/integrated.json"]


def agent_files(wildcards):
    """The agents the round's plan chose (re-evaluated after the plan checkpoint ran)."""
    plan = checkpoints.round_plan.get(**wildcards).output.plan
    with open(plan) as f:
        chosen = json.load(f)["directions"]
    round_dir = ROUND_DIR.format(**wildcards)
    return [f"{round_dir}/agent-{d}.json" for d in chosen]


def last_round(wildcards):
    return (f"results/{wildcards.gpu}/{wildcards.deployment}/rounds/"
            f"round-{config['rounds']['count']}/integrated.json")


def rounds_figure_inputs(wildcards):
    return [f"results/{wildcards.gpu}/{d}/rounds/round-{k}/integrated.json"
            for d in DEPLOYMENTS for k in range(1, config["rounds"]["count"] + 1)]

# Helpers shared by the workflow files: config-derived lists, paths, the {gpu} value and the
# resources of GPU, timing and model-loading jobs. Functions only (snakemake --lint wants them apart
# from rules). Every path a rule reads or writes is built here, so the data flow is in one place.

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
# deployments with target "random": a lazy random checkpoint of a named shape (config key shape),
# written by the random_deployment rule (specpilot.deployment_random), run with the replay drafter
RANDOM_TARGET = "random"
# Every deployment with target "tiny" shares one build, resources/deployments/tiny: one target and
# one drafter of each of these kinds (specpilot build-tiny).
TINY_BUILD = "tiny"
TINY_DRAFTERS = ("dflash", "dflash2", "dspark")


def _definition_order():
    """Deployment names in the order the config defines them: the workflow's own config file
    first, then each --configfile in command-line order, then --config entries. Snakemake's merge
    puts the command line's keys first; this order does not depend on it, so a deployment added
    with --configfile comes last."""
    from snakemake.common.configfile import load_configfile

    cli = [Path(f).resolve() for f in workflow.overwrite_configfiles or []]
    files = [Path(f).resolve() for f in workflow.configfiles if Path(f).resolve() not in cli] + cli
    names = []
    for f in files:
        for name in (load_configfile(f) or {}).get("deployments") or {}:
            if name not in names and name in config["deployments"]:
                names.append(name)
    return names + [n for n in config["deployments"] if n not in names]


def _deployments():
    """Available deployments (name -> settings) in definition order; logs the ones marked
    available: false."""
    active = {}
    for name in _definition_order():
        dep = config["deployments"][name]
        if dep.get("available", True) is False:
            logger.info(f"specpilot: skipping deployment {name}: {dep.get('reason', 'no reason given')}")
            continue
        active[name] = dep
    return active


DEPLOYMENTS = _deployments()
TINY_DEPLOYMENTS = [d for d, v in DEPLOYMENTS.items() if v["target"] == TINY_TARGET]
RANDOM_DEPLOYMENTS = [d for d, v in DEPLOYMENTS.items() if v["target"] == RANDOM_TARGET]
LINKED_DEPLOYMENTS = [d for d, v in DEPLOYMENTS.items() if v["target"] not in (TINY_TARGET, RANDOM_TARGET)]

# The agent rounds' settings, with the schema's defaults (config/schema.yaml) for absent keys.
ROUNDS = {"count": 2, "agents_per_round": 2, "budget": 6, "calibration_prompts": 2, "calibration_cap": None,
          "min_gain": 1.02, "confirm_factor": 0.98, "timing_repeats": 2, "transfer": "chain",
          "chain": [], "seed_memory": None, "llm": {}, "directions": None, "reuse_base": False,
          **config.get("rounds", {})}
ROUNDS.setdefault("max_new_tokens", config["max_new_tokens"])

# Serving regimes (specpilot.regimes; resolved by rules/config.smk): name -> {tune, cells}, in memory
# order (single first). Each (deployment, regime) has its own calibration prompts, kernel sub-agent,
# rounds, engine config and cells; a cell concurrency belongs to one regime (REGIME_OF).
from specpilot.regimes import calibration_count, calibration_rungs, calibration_tokens, regime_of, table_option

REGIMES = config["regimes"]
REGIME_OF = regime_of(REGIMES)


def _chain():
    """The rounds' memory chain (rounds.transfer = chain): the deployments config rounds.chain
    lists, in its order, then every other available deployment in definition order. A deployment
    added later joins the end, so the deployments before it keep their inputs (and their results).
    A listed name that no deployment has stops the run; one marked available: false is skipped."""
    listed = list(ROUNDS["chain"])
    unknown = [n for n in listed if n not in config["deployments"]]
    if unknown:
        raise WorkflowError(f"specpilot: config rounds.chain names {', '.join(map(repr, unknown))}, which "
                            f"config deployments does not define (deployments: {', '.join(config['deployments'])})")
    return [n for n in listed if n in DEPLOYMENTS] + [n for n in DEPLOYMENTS if n not in listed]


CHAIN = _chain()

# Engines whose cells are run: specpilot needs the engine config of at least one agent round.
RUN_ENGINES = [e for e in config["engines"] if e != "specpilot" or ROUNDS["count"] > 0]
if "specpilot" not in config["engines"]:
    SPECPILOT_NOTE = "specpilot not run: not in config engines"
elif ROUNDS["count"] == 0:
    SPECPILOT_NOTE = "specpilot not run: config rounds.count is 0"
    logger.info(f"specpilot: {SPECPILOT_NOTE}")
else:
    SPECPILOT_NOTE = "specpilot not run"
RUN_ROUNDS = "specpilot" in RUN_ENGINES
FORCED_ENGINES = [e for e in RUN_ENGINES if e != "ar"]  # checked by token forcing against ar (in this order)

# Timing jobs (engine cells, round steps, the kernel sub-agent): on a GPU each takes its device's
# share of the cores and no timing slot (its device isolates it). On the CPU each takes one core and
# one timing slot; the profile allows two slots (profiles/default), so on a machine of two or more
# cores two timed jobs run side by side, one core each, and nothing else runs beside them. One core
# per CPU cell because the CPU deployments' steps gain nothing from a second thread (the tiny
# target's 12-token verify 2.39 ms at one thread, 2.55 ms at two, both paths alike: `specpilot bench
# cpu-step --threads 1/2`, 2026-12-05, BENCHMARKS.md), and each cell times its engines interleaved,
# request by request, so a neighbour's load slows every engine of the cell alike. The device
# measurements (ceilings) take every core and every slot: nothing runs beside them.
def _given_cores():
    try:
        return workflow.cores
    except WorkflowError:  # a cluster executor runs without --cores
        return None


TIMING_THREADS = max(1, min(_given_cores() or os.cpu_count() or 1, os.cpu_count() or 1))


# ---- devices of a GPU run (specpilot.devices) ----
# Each GPU job runs through the device wrapper, which gives it one device of the host for its
# lifetime (a lock file per device, CUDA_VISIBLE_DEVICES for the job); so on a multi-GPU host the
# GPU jobs run side by side on different devices and a timed cell never shares one. On cpu there is
# no wrapper and nothing changes: timing jobs take every core and the one timing slot.

def _host_devices():
    """The host's CUDA devices (nvidia-smi; SPECPILOT_FAKE_DEVICES in tests) on a local run, else []."""
    from specpilot.devices import host_devices
    from specpilot.errors import SpecpilotError

    if not workflow.local_exec:  # a cluster executor maps GPUs per job (SLURM --gpus)
        return []
    try:
        return host_devices()
    except SpecpilotError as e:
        raise WorkflowError(f"specpilot: {e}") from None


def _device_slots():
    """How many GPU jobs run at once: --resources gpu=N, checked against the host's devices; without
    it, one per device (registered as the gpu limit, so a job waits in Snakemake, not on a lock)."""
    from specpilot.devices import POOL_ENV

    devices = _host_devices()
    os.environ.setdefault(POOL_ENV, ",".join(d.uuid for d in devices))  # a device gone later: one error
    given = workflow.global_resources.get("gpu").value
    if not workflow.is_main_process:  # a job of a cluster run re-reads the workflow: its node decides
        return len(devices)
    if given is not None and workflow.local_exec and int(given) > len(devices):
        listed = ", ".join(f"{d.index}: {d.name} ({d.uuid})" for d in devices) or "none"
        raise WorkflowError(f"specpilot: --resources gpu={given}, but this host has {len(devices)} CUDA "
                            f"device(s) ({listed}); ask for at most {len(devices)}")
    if given is None and devices:
        workflow.register_resource("gpu", len(devices))
    return int(given) if given is not None else len(devices)


DEVICE_SLOTS = _device_slots()


def on_device(wildcards):
    """Shell prefix of a GPU job: the device wrapper (one device of the pool for the job); nothing on cpu."""
    return "" if wildcards.gpu == "cpu" else f"python -m specpilot.devices run --gpu {wildcards.gpu} --"


CPU_TIMED_THREADS = 1  # cores of a timed CPU job (see above)
CPU_TIMING_SLOTS = 2  # the profile's timing_slots: timed CPU jobs side by side (profiles/default)


def timing_threads(wildcards):
    """threads: of a timing job: one core on cpu (two timed jobs side by side, see above); on a GPU
    its device's share, so one timing job per device runs at once."""
    return CPU_TIMED_THREADS if wildcards.gpu == "cpu" else max(1, TIMING_THREADS // max(1, DEVICE_SLOTS))


def _side_by_side():
    """Whether two timed CPU jobs may run side by side (issue 56): decided when the workflow is
    planned, from the CPU ceilings of an earlier run (results/cpu/ceilings.json, `per_threads`):
    when going from one thread to every core scales the copy bandwidth or the matmul rate by less
    than config timing.side_by_side_scaling x the cores (2 vCPUs sharing one physical core, or one
    memory channel), two jobs side by side slow each other, so each timed job takes every slot
    (one at a time). Without that file (a first run): side by side, as before."""
    path = Path("results/cpu/ceilings.json")
    try:
        per = json.loads(path.read_text()).get("per_threads", {})
        one, most = per["1"], per[max(per, key=int)]
        n = int(max(per, key=int))
        scaling = min(most[k] / one[k] for k in ("memory_bandwidth_bytes_per_s", "matmul_flop_per_s")) / n
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        return True
    ok = n < 2 or scaling >= config["timing"].get("side_by_side_scaling", 0.8)
    if not ok:
        logger.info(f"specpilot: timed CPU jobs one at a time: {path} scales {scaling:.0%} of ideal from 1 to {n} "
                    f"threads (< timing.side_by_side_scaling)")
    return ok


CPU_SIDE_BY_SIDE = _side_by_side()


def timing_slot(wildcards):
    """resources: timing_slots -- 1 on cpu (the profile allows CPU_TIMING_SLOTS at a time; every
    slot when timed jobs may not run side by side, see _side_by_side); 0 on a GPU, where the job's
    own device isolates its timing."""
    if wildcards.gpu != "cpu":
        return 0
    return 1 if CPU_SIDE_BY_SIDE else CPU_TIMING_SLOTS


def measure_threads(wildcards):
    """threads: of a device measurement (ceilings): every core given, on cpu and GPU alike."""
    return TIMING_THREADS


def measure_slots(wildcards):
    """resources: timing_slots of a device measurement: every slot on cpu (nothing timed beside it)."""
    return CPU_TIMING_SLOTS if wildcards.gpu == "cpu" else 0


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


def tiny_build(dep):
    """Build folder of a tiny deployment: one per tiny target family (config tiny_kind), shared by
    every drafter paired with it ("tiny" for the dense Qwen3 target, "tiny-hybrid", "tiny-muse")."""
    kind = dep.get("tiny_kind", "dense")
    return TINY_BUILD if kind == "dense" else f"{TINY_BUILD}-{kind}"


def _tiny_builds():
    """Tiny build name -> its target kind, the drafter kinds it trains, and whether it is quick."""
    builds = {}
    for d in TINY_DEPLOYMENTS:
        dep = DEPLOYMENTS[d]
        b = builds.setdefault(tiny_build(dep), {"kind": dep.get("tiny_kind", "dense"), "drafters": set(), "quick": False})
        b["drafters"].add(dep["drafter"])
        b["quick"] = b["quick"] or bool(dep.get("quick"))
    return builds


TINY_BUILDS = _tiny_builds()


# ---- tiny build stages (rules/build.smk) ----


def tiny_quick(wildcards):
    return TINY_BUILDS[wildcards.deployment]["quick"]


def tiny_target_recipe(wildcards):
    """params: the hash of the recipe fields the target and the teacher outputs depend on."""
    from specpilot.tiny.recipe import recipe_of, target_recipe_hash

    return target_recipe_hash(recipe_of(tiny_quick(wildcards)))


def tiny_drafter_recipe(wildcards):
    """params: the hash of the recipe fields drafter {kind} is trained from (a change reruns it only)."""
    from specpilot.tiny.recipe import drafter_recipe_hash, recipe_of

    return drafter_recipe_hash(wildcards.kind, recipe_of(tiny_quick(wildcards)))


def tiny_stage_opts(wildcards):
    """The options every stage of one build shares: data, seed, recipe (--quick)."""
    quick = "--quick" if tiny_quick(wildcards) else ""
    return f"{data_dir_opt()} --out resources/deployments/{wildcards.deployment} --seed {config.get('seed', 0)} {quick}"


def tiny_drafters(wildcards):
    return ",".join(sorted(TINY_BUILDS[wildcards.deployment]["drafters"]))


def drafter_threads(wildcards):
    """threads: of a drafter job, as the teacher job measured (stages/threads.json); every core
    until it has (a dry run before the teacher: the checkpoint replans the jobs after it)."""
    path = Path(f"resources/deployments/{wildcards.deployment}/stages/threads.json")
    if path.is_file():
        chosen = json.loads(path.read_text()).get("threads", {})
        if wildcards.kind in chosen:
            return max(1, min(int(chosen[wildcards.kind]), TIMING_THREADS))
    return TIMING_THREADS


def deployment_dir(name):
    if name in DEPLOYMENTS and DEPLOYMENTS[name]["target"] == TINY_TARGET:
        return f"resources/deployments/{tiny_build(DEPLOYMENTS[name])}"
    return f"resources/deployments/{name}"


def _check_deployments():
    """Stop the plan (``snakemake -n`` included) when a deployment cannot run: one line per
    problem naming the deployment, the key and the value (specpilot.validate), and when its widest
    engine's verify width cannot fit the target's positions or the device's memory
    (specpilot.capacity)."""
    from specpilot.capacity import plan_problems
    from specpilot.validate import check_deployments

    tiny_dirs = {d: Path(deployment_dir(d)) for d in TINY_DEPLOYMENTS}
    problems = check_deployments(DEPLOYMENTS, Path.cwd(), TINY_TARGET, TINY_DRAFTERS, tiny_dirs)
    if not problems:
        problems = plan_problems(DEPLOYMENTS, config, Path.cwd(), target_gpus(), TINY_TARGET, tiny_dirs)
    if problems:
        raise WorkflowError("\n".join(f"specpilot: {p}" for p in problems))


_check_deployments()


def build_marker(wildcards):
    """The files a deployment's jobs wait for: build.json, or for a tiny deployment every drafter
    stage of its build (rules/build.smk: nothing of the deployment runs beside the build's training),
    the other drafters' as ancient(): retraining one drafter reruns only its deployments' jobs."""
    dep = DEPLOYMENTS.get(wildcards.deployment)
    if dep is None or dep["target"] != TINY_TARGET:
        return f"{deployment_dir(wildcards.deployment)}/build.json"
    stage = f"{deployment_dir(wildcards.deployment)}/stages/drafter-{{}}.json"
    others = sorted(TINY_BUILDS[tiny_build(dep)]["drafters"] - {dep["drafter"]})
    return [stage.format(dep["drafter"])] + [ancient(stage.format(k)) for k in others]


def target_dir(wildcards):
    return f"{deployment_dir(wildcards.deployment)}/target"


def drafter_dir(wildcards):
    return f"{deployment_dir(wildcards.deployment)}/drafter-{deployment(wildcards)['drafter']}"


def target_name(wildcards):
    return deployment(wildcards)["target"]


def drafter_name(wildcards):
    return deployment(wildcards)["drafter"]


def block_size(wildcards):
    return deployment(wildcards)["block_size"]


def block_reason_opt(wildcards):
    """``--block-reason ...`` when the deployment runs stock at a block other than its drafter's
    trained one (config key block_reason; the table's note shows it), else nothing."""
    reason = deployment(wildcards).get("block_reason")
    return f"--block-reason {shlex.quote(reason)}" if reason else ""


# ---- memory of a model-loading job (resources: mem_mb; SLURM sizes its jobs from it) ----

# Parameter counts [billions] of the study's targets by Hub id, for the dry run (before the
# deployment is linked); afterwards the target's config.json decides.
_KNOWN_PARAMS_B = {"qwen/qwen3-4b": 4.0, "qwen/qwen3-8b": 8.2}


def _target_params_b(wildcards):
    cfg_path = Path(target_dir(wildcards)) / "config.json"
    if cfg_path.is_file():
        c = json.loads(cfg_path.read_text())
        c = c.get("text_config", c)
        h, i, n, v = (c.get(k, 0) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
        heads, kv = c.get("num_attention_heads", 1), c.get("num_key_value_heads", c.get("num_attention_heads", 1))
        hd = c.get("head_dim") or (h // max(heads, 1))
        per_layer = h * hd * (2 * heads + 2 * kv) + 3 * h * i
        return (n * per_layer + 2 * h * v) / 1e9
    name = deployment(wildcards)["target"]
    if name == TINY_TARGET:
        return 0.01
    if name == RANDOM_TARGET:
        from specpilot.models.shapes import target_params_b

        return target_params_b(deployment(wildcards)["shape"])
    m = re.search(r"(\d+(?:\.\d+)?)b\b", name.lower())
    return _KNOWN_PARAMS_B.get(name.lower(), float(m[1]) if m else 30.0)


def model_mem_mb(copies=1):
    """resources: mem_mb -- host memory for ``copies`` of the deployment's target in its weight
    format (2 bytes a parameter in bf16/w12 loading, 4 in fp32), plus 25% and 4 GB for the drafter,
    the KV cache and the process; doubled on a retry (``attempt``)."""

    def mem_mb(wildcards, attempt):
        bytes_per = 4 if deployment(wildcards)["weight_format"] == "fp32" else 2
        gb = _target_params_b(wildcards) * bytes_per * copies * 1.25 + 4
        return int(gb * 1024) * attempt

    return mem_mb


def round_copies(wildcards):
    """Target copies a round step holds: two for a bf16 deployment on a GPU (the w12 direction
    keeps a 12-bit copy beside the bf16 one), else one."""
    return 2 if wildcards.gpu != "cpu" and deployment(wildcards)["weight_format"] == "bf16" else 1


def round_mem_mb(wildcards, attempt):
    return model_mem_mb(round_copies(wildcards))(wildcards, attempt)


@functools.cache
def data_dir():
    """Benchmark data folder (specpilot.prompts.resolve_data_dir): config data_dir, else
    $SPECPILOT_DATA_DIR, else shared/data/benchmarks beside the repository, else None (the Hub).

    The jobs get the folder through SPECPILOT_DATA_DIR, set here for them, and their params only
    the data's checksum (data_dir_opt): the DAG does not change with the shell's variables or
    with where the same data lies. Without local data and without the `datasets` package (the
    Hub's client) the run stops here with one message naming what to set.
    """
    from specpilot.errors import SpecpilotError
    from specpilot.prompts import DATA_DIR_ENV, resolve_data_dir

    try:
        d = resolve_data_dir(config.get("data_dir"), workflow.basedir)
    except SpecpilotError as e:
        raise WorkflowError(f"specpilot: {e}") from None
    if d is None:
        import importlib.util

        if importlib.util.find_spec("datasets") is None:
            raise WorkflowError(
                "specpilot: no benchmark data found: set config data_dir (e.g. --config data_dir=/path/to/benchmarks) "
                f"or the environment variable {DATA_DIR_ENV} to a folder laid out like shared/data/benchmarks, "
                "or install the 'datasets' package to read the benchmarks from the Hugging Face Hub")
        os.environ.pop(DATA_DIR_ENV, None)
        return None
    os.environ[DATA_DIR_ENV] = str(d.resolve())
    return str(d.resolve())


@functools.cache
def data_id():
    """The benchmark data's identity (checksum of its MANIFEST.json, or "hub")."""
    from specpilot.prompts import data_checksum

    return data_checksum(data_dir())


def data_dir_opt():
    """Job option naming the data by checksum (--data-id); the job reads SPECPILOT_DATA_DIR and
    refuses data with another checksum. A param, so other data means a rerun; a moved folder not."""
    return f"--data-id {data_id()}"


def prompts_path(deployment_name, benchmark):
    return f"results/prompts/{deployment_name}/{benchmark}.jsonl"


def records_path(gpu, deployment_name, benchmark, engine, concurrency):
    return f"results/{gpu}/{deployment_name}/{benchmark}/{engine}-c{concurrency}.jsonl"


def forcing_path(gpu, deployment_name, benchmark, engine, concurrency):
    return f"results/{gpu}/{deployment_name}/{benchmark}/{engine}-c{concurrency}.forcing.json"


def engine_config_path(gpu, deployment_name, regime):
    """The engine config the regime's last agent round validated (produced by rules/rounds.smk)."""
    return f"results/{gpu}/{deployment_name}/{regime}/specpilot.json"


def kernels_manifest(wildcards):
    return f"results/{wildcards.gpu}/kernels/manifest.json"


def kernel_agent_path(gpu, deployment_name, regime):
    return f"results/{gpu}/kernels/{deployment_name}/{regime}/kernel-agent.json"


def regime_wildcard(wildcards):
    """The regime of a job: its {regime} wildcard, else the regime of its cell's {concurrency}."""
    if "regime" in wildcards.keys():
        return wildcards.regime
    return REGIME_OF[int(wildcards.concurrency)]


def kernel_agent(wildcards):
    """The kernel sub-agent's output for this (gpu, deployment, regime): the tuned kernels every
    engine of the regime uses (its rounds and its cells)."""
    return kernel_agent_path(wildcards.gpu, wildcards.deployment, regime_wildcard(wildcards))


def run_inputs(wildcards):
    """Inputs of one engine cell: prompts, the deployment, the per-GPU kernel outputs, and when
    specpilot runs its engine config (the rounds')."""
    inputs = {"prompts": prompts_path(wildcards.deployment, wildcards.benchmark),
              "build": build_marker(wildcards), "kernels_manifest": kernels_manifest(wildcards),
              "kernel_agent": kernel_agent(wildcards)}
    if "specpilot" in RUN_ENGINES:
        inputs["engine_config"] = engine_config_path(wildcards.gpu, wildcards.deployment, regime_wildcard(wildcards))
    return inputs


def limit_opt(wildcards):
    """``--limit N`` for a cell whose concurrency config cell_requests caps (the first N prompts)."""
    n = config.get("cell_requests", {}).get(str(wildcards.concurrency))
    return f"--limit {n}" if n else ""


def replay_opt(wildcards):
    """``--replay-profile P`` for a deployment with config replay_profile (a synthetic deployment: the
    drafting engines run the replay drafter over the AR outputs); nothing otherwise."""
    profile = deployment(wildcards).get("replay_profile")
    return f"--replay-profile {shlex.quote(profile)}" if profile else ""


def directions_opt(wildcards):
    """``--directions a,b`` when config regimes.<regime>.directions (else rounds.directions) restricts
    what the regime's plan may choose."""
    chosen = REGIMES[wildcards.regime].get("directions") or ROUNDS.get("directions")
    return f"--directions {','.join(chosen)}" if chosen else ""


def tune_concurrency(wildcards):
    """The concurrency the regime's rounds tune at (config regimes.<regime>.tune)."""
    return REGIMES[wildcards.regime]["tune"]


def rounds_tokens(wildcards):
    """New tokens per calibration request of the regime's rounds (regimes.<regime>.max_new_tokens,
    else rounds.max_new_tokens: specpilot.regimes.calibration_tokens)."""
    return calibration_tokens(REGIMES[wildcards.regime], ROUNDS)


def base_evidence(wildcards):
    """The plan's evidence (its timing of the round's base) where rounds.reuse_base has the agents
    and the integration reuse it; no input otherwise."""
    w = wildcards
    return ([f"{ROUND_DIR}/plan-trials.jsonl".format(gpu=w.gpu, deployment=w.deployment, regime=w.regime, k=w.k)]
            if ROUNDS["reuse_base"] else [])


def reuse_base_opt(wildcards, input):
    """``--reuse-base --base-evidence PLAN-TRIALS`` under rounds.reuse_base; nothing otherwise."""
    return f"--reuse-base --base-evidence {input.base_evidence}" if ROUNDS["reuse_base"] else ""


def calibration_prompts(wildcards):
    """Calibration prompts per benchmark of the regime (at least 2 x its tune in all: specpilot.regimes)."""
    return calibration_count(REGIMES[wildcards.regime], ROUNDS["calibration_prompts"], len(config["benchmarks"]))


def calibration_rung_counts(wildcards):
    """Calibration prompts per benchmark at each rung of the regime's sequential trials (config
    rounds.calibration_prompts, raised for a batched regime, doubling up to rounds.calibration_cap)."""
    return calibration_rungs(REGIMES[wildcards.regime], ROUNDS["calibration_prompts"], ROUNDS["calibration_cap"],
                             len(config["benchmarks"]))


def calibration_pool_count(wildcards):
    """Calibration prompts per benchmark the regime's pool file holds (its last rung)."""
    return calibration_rung_counts(wildcards)[-1]


def rungs_opt(wildcards):
    """`--calibration-rungs` of the round steps (empty with one rung: every trial measured once)."""
    rungs = calibration_rung_counts(wildcards)
    return f"--calibration-rungs {','.join(map(str, rungs))}" if len(rungs) > 1 else ""


def calibration_file(wildcards):
    """Rung 0's calibration prompts (the kernel sub-agent's; the rounds' first measurement)."""
    return f"results/prompts/{wildcards.deployment}/{wildcards.regime}/calibration.jsonl"


def calibration_pool_file(wildcards):
    """Every rung's calibration prompts (the rounds' steps: a straddling trial measures more of them)."""
    return f"results/prompts/{wildcards.deployment}/{wildcards.regime}/calibration-pool.jsonl"


# The kernel sub-agent's effort (config kernel_agent; specpilot.agent.kernel_agent.tune's defaults)
KERNEL_AGENT = {"sections": ["w12", "engine", "w12_fast"], "top": 3, "max_configs": 16, "engine_rows": [16, 32, 64],
                **config.get("kernel_agent", {})}


def kernel_agent_opts(wildcards):
    """The kernel sub-agent's effort; its engine matmul rows the regime's (regimes.<regime>.engine_rows,
    else kernel_agent.engine_rows)."""
    k = KERNEL_AGENT
    rows = REGIMES[wildcards.regime].get("engine_rows") or k["engine_rows"]
    return (f"--sections {','.join(k['sections']) or shlex.quote('')} --top {k['top']} --max-configs {k['max_configs']}"
            f" --engine-rows {','.join(str(r) for r in rows)}")


def compute_dtype(wildcards):
    """The compute dtype of the deployment's weight_format (w12 weights compute in bf16)."""
    return "fp32" if deployment(wildcards)["weight_format"] == "fp32" else "bf16"


def dtype_opt(wildcards):
    return f"--dtype {compute_dtype(wildcards)}"


def forcing_tolerance(wildcards):
    """Near-tie tolerance of token forcing for the deployment's compute dtype (w12 computes in bf16):
    config forcing.tolerance, a number or {fp32: x, bf16: y}."""
    tol = config["forcing"]["tolerance"]
    dtype = "fp32" if deployment(wildcards)["weight_format"] == "fp32" else "bf16"
    return tol[dtype] if isinstance(tol, dict) else tol


def weight_format_opt(wildcards):
    """``--weight-format w12`` for a w12 deployment; nothing for weights used as stored."""
    return "--weight-format w12" if deployment(wildcards)["weight_format"] == "w12" else ""


def engine_config_opt(wildcards, input):
    """specpilot's engine config (the last round's; the engine CLI applies it to specpilot only)."""
    return f"--engine-config {input.engine_config}" if "specpilot" in RUN_ENGINES else ""


def cells():
    """(deployment, benchmark, concurrency) of every cell of the study: every regime's cell
    concurrencies."""
    return [(d, b, c) for d in DEPLOYMENTS for b in config["benchmarks"]
            for r in REGIMES.values() for c in r["cells"]]


def table_inputs(wildcards):
    """Every records file and forcing verdict of one GPU's table."""
    records, forcing = [], []
    for d, b, c in cells():
        for e in RUN_ENGINES:
            records.append(records_path(wildcards.gpu, d, b, e, c))
            if e != "ar":
                forcing.append(forcing_path(wildcards.gpu, d, b, e, c))
    inputs = {"records": records, "forcing": forcing}
    if wildcards.gpu != "cpu":
        inputs["devices"] = f"results/{wildcards.gpu}/devices.json"
    return inputs


def devices_opt(wildcards, input):
    """``--devices results/{gpu}/devices.json`` for a GPU table (speeds of the devices that timed it)."""
    return f"--devices {input.devices}" if wildcards.gpu != "cpu" else ""


def figure_paths(gpu):
    names = ["speedup", "tau", "concurrency"] + (["rounds"] if RUN_ROUNDS else [])
    return [f"results/{gpu}/figures/{name}.png" for name in names]


def final_outputs(wildcards):
    """What `snakemake` with no target builds: per target GPU its table and figures, and the
    structured memory of the study (with rounds)."""
    if not DEPLOYMENTS:
        raise ValueError("no available deployment in config deployments")
    out = []
    for gpu in target_gpus():
        out += [f"results/{gpu}/table.csv"] + figure_paths(gpu)
    out += [f"resources/deployments/{b}/build.json" for b in TINY_BUILDS]  # each tiny build's marker
    return out + (["results/memory.jsonl"] if RUN_ROUNDS else [])


# ---- agent rounds (rules/rounds.smk) ----

ROUNDS_DIR = "results/{gpu}/{deployment}/{regime}/rounds"
ROUND_DIR = "results/{gpu}/{deployment}/{regime}/rounds/round-{k}"


def calibration_parts(wildcards):
    """Per-benchmark calibration prompt files of one (deployment, regime), gathered into one file."""
    return [f"results/prompts/{wildcards.deployment}/{wildcards.regime}/calibration/{b}.jsonl"
            for b in config["benchmarks"]]


def memory_snapshot(gpu, deployment_name, regime, k):
    """The memory after round k of (gpu, deployment, regime); round 0 = the memory it starts from."""
    return f"results/{gpu}/{deployment_name}/{regime}/rounds/round-{k}/memory.jsonl"


def memory_sources(wildcards):
    """What a (deployment, regime)'s rounds start from (round-0 memory): config rounds.seed_memory if
    set; with rounds.transfer = chain the last memory of the deployment before it in the chain in the
    same regime (CHAIN: each deployment learns from all before it, on the same GPU); and the last
    memory of the same deployment in the regime before this one (REGIMES' order: a later regime
    starts from the earlier regimes' validated entries; an earlier one never reads a later one).
    With transfer = none only the seed and the earlier regime."""
    src = [ROUNDS["seed_memory"]] if ROUNDS["seed_memory"] else []
    i = CHAIN.index(wildcards.deployment)
    if ROUNDS["transfer"] == "chain" and i > 0:
        src.append(memory_snapshot(wildcards.gpu, CHAIN[i - 1], wildcards.regime, ROUNDS["count"]))
    order = list(REGIMES)
    j = order.index(wildcards.regime)
    if j > 0:
        src.append(memory_snapshot(wildcards.gpu, wildcards.deployment, order[j - 1], ROUNDS["count"]))
    return src


def memory_in(wildcards):
    """The snapshot round k starts from: round k-1's."""
    return memory_snapshot(wildcards.gpu, wildcards.deployment, wildcards.regime, int(wildcards.k) - 1)


def final_memories(wildcards):
    """Every (deployment, regime)'s last snapshot on every target GPU (merged into results/memory.jsonl)."""
    return [memory_snapshot(g, d, r, ROUNDS["count"]) for g in target_gpus() for d in DEPLOYMENTS for r in REGIMES]


def references_of(wildcards):
    base = ROUNDS_DIR.format(gpu=wildcards.gpu, deployment=wildcards.deployment, regime=wildcards.regime)
    return {"ar": f"{base}/references/ar.jsonl", "stock": f"{base}/references/stock.jsonl"}


def previous_round(wildcards):
    """Round k-1's integrated config and its cost model (round k plans from them); none for round 1."""
    k = int(wildcards.k)
    if k <= 1:
        return []
    prev = ROUND_DIR.format(gpu=wildcards.gpu, deployment=wildcards.deployment, regime=wildcards.regime, k=k - 1)
    return [f"{prev}/integrated.json", f"{prev}/costmodel-integrated.txt"]


def previous_opt(wildcards, input):
    return f"--previous {input.previous[0]} --previous-costmodel {input.previous[1]}" if input.previous else ""


def last_round_costmodel(wildcards):
    """The cost model of the last round's integrated config (specpilot.json carries it)."""
    return os.path.join(ROUND_DIR.format(k=ROUNDS["count"], **wildcards), "costmodel-integrated.txt")


def llm_opt(wildcards):
    """``--llm JSON`` when config rounds.llm names an endpoint and a model; else the offline policy."""
    llm = ROUNDS.get("llm") or {}
    return f"--llm {shlex.quote(json.dumps(llm))}" if llm.get("base_url") and llm.get("model") else ""


def agent_files(wildcards):
    """The agents the round's plan chose (re-evaluated after the plan checkpoint ran)."""
    plan = checkpoints.round_plan.get(**wildcards).output.plan
    with open(plan) as f:
        chosen = json.load(f)["directions"]
    round_dir = ROUND_DIR.format(**wildcards)
    return [f"{round_dir}/agent-{d}.json" for d in chosen]


def last_round(wildcards):
    return os.path.join(ROUND_DIR.format(k=ROUNDS["count"], **wildcards), "integrated.json")


def rounds_figure_inputs(wildcards):
    return [os.path.join(ROUND_DIR.format(gpu=wildcards.gpu, deployment=d, regime=r, k=k), "integrated.json")
            for d in DEPLOYMENTS for r in REGIMES for k in range(1, ROUNDS["count"] + 1)]


def regimes_opt():
    """``--regimes single=1,batched=16+20`` for the table (the regime column: concurrency -> regime)."""
    return f"--regimes {table_option(REGIMES)}"

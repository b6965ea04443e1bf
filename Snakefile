# specpilot: a reproducible speculative-decoding study (AR, stock block drafters, agent-tuned
# engine). docs/results.md describes the result paths and the table, docs/rounds.md the rounds;
# docs/config.md every config key. One rules/*.smk file per stage, every input and output declared.
#
#   snakemake --cores all                         the embedded default (tiny deployment, CPU)
#   snakemake results/h100/table.csv              one GPU's table
#   snakemake --configfile config/paper.yaml ...  the study matrix

from snakemake.utils import min_version, validate

# 9.17: Snakemake 9.10-9.16 could start jobs beyond --cores and the timing_slots limit (snakemake
# issues #3913/#3815, fixed by #4026), so timed engine cells ran side by side and slowed each other
min_version("9.17")


configfile: "config/config.yaml"


include: "rules/config.smk"


report: "report/workflow.rst"


include: "rules/common.smk"


wildcard_constraints:
    gpu=r"(?!prompts/)[a-z0-9_]+",
    deployment=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    benchmark=names_regex(BENCHMARK_NAMES),
    engine=names_regex(ENGINE_NAMES),
    concurrency=names_regex([str(c) for c in REGIME_OF]),
    regime=names_regex(REGIMES),
    k=r"[1-9]\d*",


include: "rules/deployments.smk"
include: "rules/build.smk"
include: "rules/prompts.smk"
include: "rules/kernels.smk"
include: "rules/engines.smk"
include: "rules/rounds.smk"
include: "rules/forcing.smk"
include: "rules/report.smk"


onstart:
    logger.info(f"specpilot: deployments {', '.join(DEPLOYMENTS)}; engines {', '.join(RUN_ENGINES)}")


onsuccess:
    # each rule's time on this run (specpilot.joblog.rule_times), also in logs/times.txt
    from specpilot.joblog import rule_times, times_lines

    times = times_lines(rule_times(log))
    if len(times) > 1:
        os.makedirs("logs", exist_ok=True)
        with open("logs/times.txt", "w") as f:
            f.write("\n".join(times) + "\n")
        logger.info("specpilot: time per rule on this run (logs/times.txt):\n  " + "\n  ".join(times))
    logger.info("specpilot: done; tables are results/<gpu>/table.csv")


onerror:
    # each failed job's one clear line (its SpecpilotError, else its exception), not only its log
    from specpilot.joblog import failed_job_lines

    for line in failed_job_lines(log):
        logger.error(f"specpilot: {line}")
    logger.error("specpilot: a job failed; its log is named above (logs/...)")


rule all:
    default_target: True
    input:
        final_outputs,

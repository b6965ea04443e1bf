# A deployment = target + drafter, found at resources/deployments/{deployment}/target and
# .../drafter-{drafter}; build.json (written last) marks it ready. Three rules make one: a tiny
# build (target "tiny"), a link to real checkpoints, a synthetic deployment (target "random").


# A tiny build (one per tiny target family, shared by the deployments pairing drafters with it):
# tokenizer, one target and the drafters its deployments use, trained locally on CPU, as the jobs
# of rules/build.smk.


# Real deployments: link a local folder or a Hugging Face Hub download (run on the submitting
# machine, which has network access on a cluster). Both checkpoints were checked when the DAG was
# built (specpilot.validate) where their config.json was at hand; a download is checked here,
# before anything loads it.
localrules:
    link_deployment,


rule link_deployment:
    output:
        "resources/deployments/{deployment}/build.json",
    log:
        "logs/deployments/{deployment}.log",
    wildcard_constraints:
        deployment=names_regex(LINKED_DEPLOYMENTS),
    priority: 100  # first: a download that cannot run stops the run before other jobs write results/
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
        target=lambda wildcards: deployment(wildcards)["target"],
        drafter=lambda wildcards: deployment(wildcards)["drafter_id"],
        drafter_name=lambda wildcards: deployment(wildcards)["drafter"],
        block_size=block_size,
        block_reason=block_reason_opt,
        weight_format=lambda wildcards: deployment(wildcards)["weight_format"],
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot.deployment_link --name {wildcards.deployment} --target {params.target:q}"
        " --drafter {params.drafter:q} --drafter-name {params.drafter_name} --block-size {params.block_size} {params.block_reason}"
        " --weight-format {params.weight_format} --out {params.out_dir} > {log} 2>&1"


# Synthetic deployments (target "random"): a lazy random checkpoint of the config's shape (config.json
# only: every job that loads it draws the weights from the seed on its device), its random DFlash
# drafter at the deployment's block, and a byte-level tokenizer for the prompts (kilobytes, seconds).
rule random_deployment:
    output:
        "resources/deployments/{deployment}/build.json",
    log:
        "logs/deployments/{deployment}.log",
    wildcard_constraints:
        deployment=names_regex(RANDOM_DEPLOYMENTS),
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
        shape=lambda wildcards: deployment(wildcards)["shape"],
        seed=lambda wildcards: deployment(wildcards).get("seed", 0),
        block_size=block_size,
        weight_format=lambda wildcards: deployment(wildcards)["weight_format"],
        replay=replay_opt,
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot.deployment_random --name {wildcards.deployment} --shape {params.shape}"
        " --seed {params.seed} --block-size {params.block_size} --weight-format {params.weight_format}"
        " {params.replay} --out {params.out_dir} > {log} 2>&1"

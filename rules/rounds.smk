# Agent rounds (issue 4): per (gpu, deployment), round k = plan (cost model + directions, a
# checkpoint: the directions chosen decide the agent jobs) -> one agent job per direction ->
# integrate. Round k+1 plans from round k's integrated config; the last one becomes
# results/{gpu}/{deployment}/specpilot.json, the specpilot engine's config. Finished agents are
# files, so a killed round resumes without rerunning them. results/memory.jsonl (structured
# memory) is shared by all deployments and written under a file lock by plan/integrate.

rule calibration_prompts:
    input:
        build=build_marker,
    output:
        "results/prompts/{deployment}/calibration.jsonl",
    log:
        "logs/prompts/{deployment}/calibration.log",
    params:
        tokenizer=target_dir,
        n=config["rounds"]["calibration_prompts"],
        seed=config.get("seed", 0),
        data=data_dir_opt(),
        benchmarks=" ".join(config["benchmarks"]),
        tmp=lambda wildcards, output: output[0] + ".parts",
    conda:
        "../envs/torch.yaml"
    shell:
        "(mkdir -p {params.tmp} && for b in {params.benchmarks}; do"
        " python -m specpilot prompts --tokenizer {params.tokenizer} --benchmark $b --role calibration"
        " --n-prompts {params.n} --seed {params.seed} {params.data}"
        " --out {params.tmp}/$b.jsonl || exit 1; done"
        " && cat {params.tmp}/*.jsonl > {output}.tmp && mv {output}.tmp {output} && rm -r {params.tmp})"
        " > {log} 2>&1"


checkpoint round_plan:
    input:
        build=build_marker,
        prompts="results/prompts/{deployment}/calibration.jsonl",
        ceilings="results/{gpu}/ceilings.json",
        previous=previous_round,
    output:
        plan=f"{ROUND_DIR}/plan.json",
    log:
        "logs/{gpu}/{deployment}/rounds/round-{k}/plan.log",
    params:
        common=round_common,
        previous=lambda wildcards, input: f"--previous {input.previous[0]}" if input.previous else "",
    threads: TIMING_THREADS
    resources:
        timing_slots=1,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot round plan --round {wildcards.k} {params.common} --prompts {input.prompts}"
        " --ceilings {input.ceilings} {params.previous} --threads {threads} --out {output.plan} 2>&1 | tee {log}"


rule round_agent:
    input:
        build=build_marker,
        prompts="results/prompts/{deployment}/calibration.jsonl",
        plan=f"{ROUND_DIR}/plan.json",
    output:
        f"{ROUND_DIR}/agent-{{direction}}.json",
    log:
        "logs/{gpu}/{deployment}/rounds/round-{k}/agent-{direction}.log",
    wildcard_constraints:
        direction=r"[a-z0-9_]+",
    params:
        common=round_common,
    threads: TIMING_THREADS
    resources:
        timing_slots=1,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot round agent --round {wildcards.k} --direction {wildcards.direction}"
        " {params.common} --prompts {input.prompts} --plan {input.plan} --threads {threads}"
        " --out {output} 2>&1 | tee {log}"


rule round_integrate:
    input:
        build=build_marker,
        prompts="results/prompts/{deployment}/calibration.jsonl",
        plan=f"{ROUND_DIR}/plan.json",
        agents=agent_files,
    output:
        f"{ROUND_DIR}/integrated.json",
    log:
        "logs/{gpu}/{deployment}/rounds/round-{k}/integrate.log",
    params:
        common=round_common,
    threads: TIMING_THREADS
    resources:
        timing_slots=1,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot round integrate --round {wildcards.k} {params.common} --prompts {input.prompts}"
        " --plan {input.plan} --agent-files {input.agents} --threads {threads} --out {output} 2>&1 | tee {log}"


rule specpilot_config:
    input:
        last_round,
    output:
        "results/{gpu}/{deployment}/specpilot.json",
    log:
        "logs/{gpu}/{deployment}/specpilot-config.log",
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot round final --integrated {input} --out {output} > {log} 2>&1"


rule rounds_figure:
    input:
        rounds_figure_inputs,
    output:
        report("results/{gpu}/figures/rounds.png", caption="../report/rounds.rst", category="Figures"),
    log:
        "logs/{gpu}/figures-rounds.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m specpilot figures --rounds {input} --out-dir results/{wildcards.gpu}/figures > {log} 2>&1"


# The kernel sub-agent: tunes the kernels furthest from the bandwidth limit on this GPU (on CPU it
# records that nothing applies); winners go to the per-GPU kernel build output.
rule kernel_agent:
    input:
        build=build_marker,
        ceilings="results/{gpu}/ceilings.json",
        manifest="results/{gpu}/kernels/manifest.json",
    output:
        "results/{gpu}/kernels/{deployment}/kernel-agent.json",
    log:
        "logs/{gpu}/{deployment}/kernel-agent.log",
    params:
        target=target_dir,
    resources:
        timing_slots=1,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot round kernels --target {params.target} --gpu {wildcards.gpu}"
        " --ceilings {input.ceilings} --out {output} > {log} 2>&1"

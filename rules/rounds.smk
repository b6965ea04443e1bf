# Stage: agent rounds, per (gpu, deployment, serving regime) (config regimes; specpilot.regimes).
#
#   calibration prompts (per benchmark, gathered; at least 2 x the regime's tuned concurrency)
#                                                          results/prompts/{deployment}/{regime}/calibration.jsonl
#      and every rung's (rounds.calibration_cap: a trial straddling min_gain measures more of them;
#      docs/decisions.md)                                   results/prompts/{deployment}/{regime}/calibration-pool.jsonl
#   -> references: AR and stock on them (once)             rounds/references/{ar,stock}.jsonl
#   -> round-0 memory: merge of what this (deployment, regime) starts from (seed memory, with
#      rounds.transfer = chain the last memory of the deployment before it in the same regime, and
#      the same deployment's last memory of the regime before this one)   rounds/round-0/memory.jsonl
#   round k = plan (cost model + directions; a checkpoint: the directions decide the agent jobs;
#             with rounds.reuse_base it times the round's base once, and the agents and the
#             integration compare against those records, plan-trials.jsonl#base, instead of re-timing it)
#             -> one agent per direction -> integrate (round k's config, its cost model
#                costmodel-integrated.txt, and memory snapshot)
#   -> {regime}/specpilot.json (the last round's config, the specpilot engine's in the regime's
#      cells) and results/memory.jsonl
#      (the merge of every deployment's last snapshot: the study's structured memory).
#
# Every step reads only declared inputs: round k reads round k-1's memory snapshot and integrated
# config, the plan's cost model and the references; finished agents are files, so a killed round
# resumes without rerunning them. Every file a step writes is a declared output (its trial records
# are one evidence file per step, not a folder), so --list-untracked names nothing under results/.
# (paths: rules/common.smk)


rule calibration_prompts:
    input:
        build=build_marker,
    output:
        **{b: f"results/prompts/{{deployment}}/{{regime}}/calibration/{b}.jsonl" for b in config["benchmarks"]},
    log:
        "logs/prompts/{deployment}/{regime}/calibration/prompts.log",
    params:
        tokenizer=target_dir,
        n_prompts=calibration_pool_count,  # the last rung's (clipped to a smaller reserve)
        first=calibration_prompts,
        seed=config.get("seed", 0),
        data=data_dir_opt(),
        benchmarks=",".join(config["benchmarks"]),
        outs=lambda wildcards, output: ",".join(output[b] for b in config["benchmarks"]),
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot prompts --tokenizer {params.tokenizer} --benchmark {params.benchmarks}"
        " --role calibration --n-prompts {params.n_prompts} --at-least {params.first} --seed {params.seed}"
        " {params.data} --out {params.outs} > {log} 2>&1"


rule calibration_gather:
    input:
        calibration_parts,
    output:
        first="results/prompts/{deployment}/{regime}/calibration.jsonl",
        pool="results/prompts/{deployment}/{regime}/calibration-pool.jsonl",
    log:
        "logs/prompts/{deployment}/{regime}/calibration.log",
    params:
        first=calibration_prompts,  # rung 0: the first of each benchmark's (a prefix: specpilot.prompts.select)
    conda:
        "../envs/report.yaml"
    shell:
        "(for f in {input}; do head -n {params.first} $f; done > {output.first}.tmp && cat {input} > {output.pool}.tmp"
        " && mv {output.first}.tmp {output.first} && mv {output.pool}.tmp {output.pool}) > {log} 2>&1"


rule round_references:
    input:
        build=build_marker,
        prompts=calibration_pool_file,
        kernels_manifest=kernels_manifest,
        kernel_agent=kernel_agent,
    output:
        ar=f"{ROUNDS_DIR}/references/ar.jsonl",
        stock=f"{ROUNDS_DIR}/references/stock.jsonl",
    log:
        "logs/{gpu}/{deployment}/{regime}/rounds/references.log",
    params:
        on_device=on_device,
        target=target_dir,
        target_name=target_name,
        drafter=drafter_dir,
        drafter_name=drafter_name,
        device=torch_device,
        dtype=compute_dtype,
        block_size=block_size,
        max_new_tokens=rounds_tokens,
        concurrency=tune_concurrency,
        repeats=ROUNDS["timing_repeats"],
        rungs=rungs_opt,
        replay=replay_opt,
    threads: timing_threads
    resources:
        timing_slots=timing_slot,
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=model_mem_mb(),
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot round references --target {params.target} --target-name {params.target_name:q}"
        " --drafter {params.drafter} --drafter-name {params.drafter_name}"
        " --deployment {wildcards.deployment} --regime {wildcards.regime} --gpu {wildcards.gpu} --device {params.device} --dtype {params.dtype}"
        " --block-size {params.block_size} --max-new-tokens {params.max_new_tokens}"
        " --concurrency {params.concurrency} --repeats {params.repeats} {params.rungs} {params.replay} --prompts {input.prompts}"
        " --kernels-manifest {input.kernels_manifest} --kernel-agent {input.kernel_agent}"
        " --threads {threads} --out {output.ar} --out-stock {output.stock} 2>&1 | tee {log}"


rule round_memory_start:
    input:
        snapshots=memory_sources,
        build=build_marker,  # nothing of a deployment is written before the deployment exists
    output:
        f"{ROUNDS_DIR}/round-0/memory.jsonl",
    log:
        "logs/{gpu}/{deployment}/{regime}/rounds/round-0/memory.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m specpilot memory --snapshots {input.snapshots} --out {output} 2>&1 | tee {log}"


checkpoint round_plan:
    input:
        unpack(references_of),
        build=build_marker,
        prompts=calibration_pool_file,
        ceilings="results/{gpu}/ceilings.json",
        kernels_manifest=kernels_manifest,
        kernel_agent=kernel_agent,
        memory=memory_in,
        previous=previous_round,
    output:
        plan=f"{ROUND_DIR}/plan.json",
        costmodel=f"{ROUND_DIR}/costmodel.json",
        costmodel_text=f"{ROUND_DIR}/costmodel.txt",
        evidence=f"{ROUND_DIR}/plan-trials.jsonl",
    log:
        "logs/{gpu}/{deployment}/{regime}/rounds/round-{k}/plan.log",
    params:
        on_device=on_device,
        target=target_dir,
        target_name=target_name,
        drafter=drafter_dir,
        drafter_name=drafter_name,
        device=torch_device,
        dtype=compute_dtype,
        block_size=block_size,
        max_new_tokens=rounds_tokens,
        concurrency=tune_concurrency,
        tolerance=forcing_tolerance,
        repeats=ROUNDS["timing_repeats"],
        rungs=rungs_opt,
        replay=replay_opt,
        min_gain=ROUNDS["min_gain"],
        agents=ROUNDS["agents_per_round"],
        directions=directions_opt,
        previous=previous_opt,
        reuse="--reuse-base" if ROUNDS["reuse_base"] else "",
    threads: timing_threads
    resources:
        timing_slots=timing_slot,
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=round_mem_mb,
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot round plan --round {wildcards.k} --target {params.target}"
        " --target-name {params.target_name:q} --drafter {params.drafter} --drafter-name {params.drafter_name}"
        " --deployment {wildcards.deployment} --regime {wildcards.regime} --gpu {wildcards.gpu} --device {params.device} --dtype {params.dtype}"
        " --block-size {params.block_size} --max-new-tokens {params.max_new_tokens}"
        " --concurrency {params.concurrency} --tolerance {params.tolerance} --repeats {params.repeats} {params.rungs} {params.replay}"
        " --min-gain {params.min_gain} --agents {params.agents} {params.directions} --prompts {input.prompts}"
        " --references-ar {input.ar} --references-stock {input.stock} --ceilings {input.ceilings}"
        " --kernels-manifest {input.kernels_manifest} --kernel-agent {input.kernel_agent}"
        " --memory {input.memory} {params.previous} {params.reuse} --threads {threads}"
        " --out {output.plan} --costmodel {output.costmodel} --costmodel-text {output.costmodel_text}"
        " --evidence {output.evidence} 2>&1 | tee {log}"


rule round_agent:
    input:
        unpack(references_of),
        build=build_marker,
        prompts=calibration_pool_file,
        kernels_manifest=kernels_manifest,
        kernel_agent=kernel_agent,
        memory=memory_in,
        plan=f"{ROUND_DIR}/plan.json",
        costmodel_text=f"{ROUND_DIR}/costmodel.txt",
        base_evidence=base_evidence,
    output:
        agent=f"{ROUND_DIR}/agent-{{direction}}.json",
        evidence=f"{ROUND_DIR}/agent-{{direction}}.trials.jsonl",
    log:
        "logs/{gpu}/{deployment}/{regime}/rounds/round-{k}/agent-{direction}.log",
    wildcard_constraints:
        direction=r"[a-z0-9_]+",
    params:
        on_device=on_device,
        target=target_dir,
        target_name=target_name,
        drafter=drafter_dir,
        drafter_name=drafter_name,
        device=torch_device,
        dtype=compute_dtype,
        block_size=block_size,
        max_new_tokens=rounds_tokens,
        concurrency=tune_concurrency,
        tolerance=forcing_tolerance,
        repeats=ROUNDS["timing_repeats"],
        rungs=rungs_opt,
        replay=replay_opt,
        min_gain=ROUNDS["min_gain"],
        budget=ROUNDS["budget"],
        llm=llm_opt,
        reuse=reuse_base_opt,
    threads: timing_threads
    resources:
        timing_slots=timing_slot,
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=round_mem_mb,
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot round agent --round {wildcards.k} --direction {wildcards.direction}"
        " --target {params.target} --target-name {params.target_name:q} --drafter {params.drafter}"
        " --drafter-name {params.drafter_name} --deployment {wildcards.deployment} --regime {wildcards.regime} --gpu {wildcards.gpu}"
        " --device {params.device} --dtype {params.dtype} --block-size {params.block_size}"
        " --max-new-tokens {params.max_new_tokens} --concurrency {params.concurrency}"
        " --tolerance {params.tolerance} --repeats {params.repeats} {params.rungs} {params.replay} --min-gain {params.min_gain}"
        " --budget {params.budget} {params.llm} {params.reuse} --prompts {input.prompts}"
        " --references-ar {input.ar} --references-stock {input.stock}"
        " --kernels-manifest {input.kernels_manifest} --kernel-agent {input.kernel_agent}"
        " --memory {input.memory} --plan {input.plan} --costmodel-text {input.costmodel_text}"
        " --threads {threads} --out {output.agent} --evidence {output.evidence} 2>&1 | tee {log}"


rule round_integrate:
    input:
        unpack(references_of),
        build=build_marker,
        prompts=calibration_pool_file,
        kernels_manifest=kernels_manifest,
        kernel_agent=kernel_agent,
        memory=memory_in,
        plan=f"{ROUND_DIR}/plan.json",
        costmodel=f"{ROUND_DIR}/costmodel.json",
        ceilings="results/{gpu}/ceilings.json",
        agents=agent_files,
        base_evidence=base_evidence,
    output:
        integrated=f"{ROUND_DIR}/integrated.json",
        evidence=f"{ROUND_DIR}/integrated.jsonl",
        memory=f"{ROUND_DIR}/memory.jsonl",
        costmodel_text=f"{ROUND_DIR}/costmodel-integrated.txt",
    log:
        "logs/{gpu}/{deployment}/{regime}/rounds/round-{k}/integrate.log",
    params:
        on_device=on_device,
        target=target_dir,
        target_name=target_name,
        drafter=drafter_dir,
        drafter_name=drafter_name,
        device=torch_device,
        dtype=compute_dtype,
        block_size=block_size,
        max_new_tokens=rounds_tokens,
        concurrency=tune_concurrency,
        tolerance=forcing_tolerance,
        repeats=ROUNDS["timing_repeats"],
        rungs=rungs_opt,
        replay=replay_opt,
        min_gain=ROUNDS["min_gain"],
        confirm_factor=ROUNDS["confirm_factor"],
        reuse=reuse_base_opt,
    threads: timing_threads
    resources:
        timing_slots=timing_slot,
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=round_mem_mb,
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot round integrate --round {wildcards.k} --target {params.target}"
        " --target-name {params.target_name:q} --drafter {params.drafter} --drafter-name {params.drafter_name}"
        " --deployment {wildcards.deployment} --regime {wildcards.regime} --gpu {wildcards.gpu} --device {params.device} --dtype {params.dtype}"
        " --block-size {params.block_size} --max-new-tokens {params.max_new_tokens}"
        " --concurrency {params.concurrency} --tolerance {params.tolerance} --repeats {params.repeats} {params.rungs} {params.replay}"
        " --min-gain {params.min_gain} --confirm-factor {params.confirm_factor} {params.reuse} --prompts {input.prompts}"
        " --references-ar {input.ar} --references-stock {input.stock}"
        " --kernels-manifest {input.kernels_manifest} --kernel-agent {input.kernel_agent}"
        " --memory {input.memory} --plan {input.plan} --costmodel {input.costmodel} --ceilings {input.ceilings}"
        " --agent-files {input.agents} --threads {threads} --out {output.integrated}"
        " --evidence {output.evidence} --memory-out {output.memory} --costmodel-text {output.costmodel_text}"
        " 2>&1 | tee {log}"


rule specpilot_config:
    input:
        integrated=last_round,
        costmodel_text=last_round_costmodel,
    output:
        "results/{gpu}/{deployment}/{regime}/specpilot.json",
    log:
        "logs/{gpu}/{deployment}/{regime}/specpilot-config.log",
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot final --integrated {input.integrated} --costmodel-text {input.costmodel_text}"
        " --regime {wildcards.regime} --out {output} > {log} 2>&1"


rule memory:
    input:
        final_memories,
    output:
        "results/memory.jsonl",
    log:
        "logs/memory.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m specpilot memory --snapshots {input} --out {output} > {log} 2>&1"


rule rounds_figure:
    input:
        rounds_figure_inputs,
    output:
        report("results/{gpu}/figures/rounds.png", caption="../report/rounds.rst", category="Figures"),
    log:
        "logs/{gpu}/figures-rounds.log",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    conda:
        "../envs/report.yaml"
    shell:
        "python -m specpilot figures --rounds {input} --out-dir {params.out_dir} > {log} 2>&1"

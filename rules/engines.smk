# Device measurements and engine cells. Timing jobs take every core given to the run and one
# timing slot, so no two cells (or a cell and a measurement) are timed at once on one machine.


rule ceilings:
    output:
        "results/{gpu}/ceilings.json",
    log:
        "logs/{gpu}/ceilings.log",
    params:
        device=torch_device,
    threads: TIMING_THREADS
    resources:
        timing_slots=1,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot ceilings --device {params.device} --expect-gpu {wildcards.gpu}"
        " --threads {threads} --out {output} > {log} 2>&1"


rule kernels:
    output:
        "results/{gpu}/kernels/manifest.json",
    log:
        "logs/{gpu}/kernels.log",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    resources:
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot kernels --gpu {wildcards.gpu} --out-dir {params.out_dir} > {log} 2>&1"


# One cell: one engine over one benchmark's prompts at one concurrency on one device.
rule run_engine:
    input:
        unpack(run_inputs),
    output:
        "results/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.jsonl",
    log:
        "logs/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.log",
    wildcard_constraints:
        engine=names_regex(["ar", "stock", "specpilot"] if HAS_ROUNDS else ["ar", "stock"]),
    params:
        target=target_dir,
        target_name=lambda wildcards: deployment(wildcards)["target"],
        drafter=drafter_opt,
        drafter_name=lambda wildcards: deployment(wildcards)["drafter"],
        block_size=lambda wildcards: deployment(wildcards)["block_size"],
        max_new_tokens=config["max_new_tokens"],
        engine_config=engine_config_opt,
        device=torch_device,
        weights=weight_opts,
        multi_turn="--multi-turn" if config.get("multi_turn") else "",
        eos="--stop-at-eos" if config.get("stop_at_eos") else "",
        repeats=config["timing"]["repeats"],
    threads: TIMING_THREADS
    resources:
        timing_slots=1,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/torch.yaml"
    shell:
        "python -m specpilot run --engine {wildcards.engine} --target {params.target}"
        " --target-name {params.target_name:q} {params.drafter} --prompts {input.prompts} --out {output}"
        " --deployment {wildcards.deployment} --drafter-name {params.drafter_name}"
        " --gpu {wildcards.gpu} --max-new-tokens {params.max_new_tokens}"
        " --concurrency {wildcards.concurrency} --block-size {params.block_size}"
        " {params.engine_config} --device {params.device} {params.weights} --threads {threads}"
        " {params.multi_turn} {params.eos} --timing-repeats {params.repeats}"
        " 2>&1 | tee {log}"

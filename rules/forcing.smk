# Token forcing: every token of a candidate cell checked by a teacher-forced target pass over its
# own output, each record's structure checked, its first tokens' verify steps re-executed with the
# drafter, and its request set / token counts matched against its references (stock against ar;
# specpilot against ar and stock). --report-only: a failed check is a verdict in the table
# (forcing FAIL, speedup withheld), not a failed job.


rule force:
    input:
        candidate="results/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.jsonl",
        references=forcing_references,
        prompts="results/prompts/{deployment}/{benchmark}.jsonl",
        build=build_marker,
        engine_config=lambda wildcards: (engine_config_path(wildcards.gpu, wildcards.deployment)
                                         if wildcards.engine == "specpilot" else []),
    output:
        "results/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.forcing.json",
    log:
        "logs/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.forcing.log",
    wildcard_constraints:
        engine="stock|specpilot",
    params:
        references=reference_opts,
        target=target_dir,
        drafter=drafter_dir,
        engine_config=lambda wildcards, input: (f"--engine-config {input.engine_config}"
                                                if wildcards.engine == "specpilot" else ""),
        tolerance=forcing_tolerance,
        max_new_tokens=config["max_new_tokens"],
        device=torch_device,
        dtype=dtype_opt,
    threads: TIMING_THREADS
    resources:
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=model_mem_mb(),
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot force --candidate {input.candidate} {params.references}"
        " --target {params.target} --prompts {input.prompts} --tolerance {params.tolerance}"
        " --device {params.device} {params.dtype} --drafter {params.drafter}"
        " --max-new-tokens {params.max_new_tokens} {params.engine_config} --threads {threads}"
        " --out {output} --report-only > {log} 2>&1"

# Token forcing: every token of a candidate cell checked against its references under the target
# (stock against ar; specpilot against ar and stock). --report-only: a failed check is a verdict
# in the table (forcing FAIL, speedup withheld), not a failed job.


rule force:
    input:
        candidate="results/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.jsonl",
        references=forcing_references,
        prompts="results/prompts/{deployment}/{benchmark}.jsonl",
        build=build_marker,
    output:
        "results/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.forcing.json",
    log:
        "logs/{gpu}/{deployment}/{benchmark}/{engine}-c{concurrency}.forcing.log",
    wildcard_constraints:
        engine="stock|specpilot",
    params:
        references=reference_opts,
        target=target_dir,
        tolerance=config.get("forcing", {}).get("tolerance", 0.001),
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
        " --device {params.device} {params.dtype} --out {output} --report-only > {log} 2>&1"

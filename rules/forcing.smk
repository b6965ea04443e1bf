# Token forcing, one job per cell for its candidate engines (the target loaded once): every token
# of each checked by a teacher-forced target pass over its own output, each record's structure
# checked, its first tokens' verify steps re-executed with the drafter, and its request set /
# token counts matched against its references (stock against ar; specpilot against ar and stock).
# The teacher-forced pass runs the engine cell's matmul tables: the kernel sub-agent's
# engine_configs (--kernel-agent, as run_engine installs them).
# --report-only: a failed check is a verdict in the table (forcing FAIL, speedup withheld), not a
# failed job.


if FORCED_ENGINES:  # nothing to force when only ar runs

    rule force:
        input:
            candidates=[f"results/{{gpu}}/{{deployment}}/{{benchmark}}/{e}-c{{concurrency}}.jsonl" for e in FORCED_ENGINES],
            references="results/{gpu}/{deployment}/{benchmark}/ar-c{concurrency}.jsonl",
            prompts="results/prompts/{deployment}/{benchmark}.jsonl",
            build=build_marker,
            kernel_agent=kernel_agent,
            engine_config=lambda wildcards: (engine_config_path(wildcards.gpu, wildcards.deployment,
                                                                REGIME_OF[int(wildcards.concurrency)])
                                             if "specpilot" in FORCED_ENGINES else []),
        output:
            **{e: f"results/{{gpu}}/{{deployment}}/{{benchmark}}/{e}-c{{concurrency}}.forcing.json" for e in FORCED_ENGINES},
        log:
            "logs/{gpu}/{deployment}/{benchmark}/forcing-c{concurrency}.log",
        params:
            on_device=on_device,
            candidates=lambda wildcards, input: ",".join(input.candidates),
            outs=lambda wildcards, output: ",".join(output[e] for e in FORCED_ENGINES),
            target=target_dir,
            drafter=drafter_dir,
            engine_config=lambda wildcards, input: (f"--engine-config {input.engine_config}"
                                                    if "specpilot" in FORCED_ENGINES else ""),
            tolerance=forcing_tolerance,
            max_new_tokens=config["max_new_tokens"],
            device=torch_device,
            dtype=dtype_opt,
        threads: timing_threads
        resources:
            gpu=gpu_count,
            gpu_model=gpu_model,
            mem_mb=model_mem_mb(),
        conda:
            "../envs/engine.yaml"
        shell:
            "{params.on_device} python -m specpilot force --candidate {params.candidates} --reference {input.references}"
            " --target {params.target} --prompts {input.prompts} --tolerance {params.tolerance}"
            " --device {params.device} {params.dtype} --drafter {params.drafter}"
            " --max-new-tokens {params.max_new_tokens} {params.engine_config}"
            " --kernel-agent {input.kernel_agent} --threads {threads}"
            " --out {params.outs} --report-only > {log} 2>&1"

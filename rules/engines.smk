# Stage: device measurements and the engine cells. On the CPU a timed job takes one core and one of
# the profile's two timing slots, a device measurement every core and both slots
# (rules/common.smk says why).


rule ceilings:
    output:
        "results/{gpu}/ceilings.json",
    log:
        "logs/{gpu}/ceilings.log",
    params:
        on_device=on_device,
        device=torch_device,
    threads: measure_threads
    resources:
        timing_slots=measure_slots,
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot ceilings --device {params.device} --expect-gpu {wildcards.gpu}"
        " --threads {threads} --out {output} > {log} 2>&1"


# The copy bandwidth of every device of a GPU's pool, measured on each in turn (GPU tables only: the
# table warns when one comparison's cells ran on devices of different speed; specpilot.devices).
rule device_speeds:
    output:
        "results/{gpu}/devices.json",
    log:
        "logs/{gpu}/devices.log",
    wildcard_constraints:
        gpu=r"(?!cpu$)[a-z0-9_]+",
    resources:
        gpu=1,
        gpu_model=gpu_model,
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot.devices bandwidth --gpu {wildcards.gpu} --out {output} > {log} 2>&1"


# One cell: every engine (ar, stock, specpilot) over one benchmark's prompts at one concurrency
# on one device, timed interleaved in one job (concurrency 1 on the CPU: request by request, each engine
# in turn; batched or under CUDA graphs: pass by pass), so drift of a shared machine hits all engines alike; with the
# kernels the per-GPU manifest and the kernel sub-agent chose (recorded in engine_config.kernels;
# on CPU they record that none apply). The engine config (the rounds') applies to specpilot only.
rule run_engine:
    input:
        unpack(run_inputs),
    output:
        **{e: f"results/{{gpu}}/{{deployment}}/{{benchmark}}/{e}-c{{concurrency}}.jsonl" for e in RUN_ENGINES},
    log:
        "logs/{gpu}/{deployment}/{benchmark}/cell-c{concurrency}.log",
    params:
        on_device=on_device,
        target=target_dir,
        target_name=target_name,
        drafter=drafter_dir,
        drafter_name=drafter_name,
        block_size=block_size,
        block_reason=block_reason_opt,
        max_new_tokens=config["max_new_tokens"],
        engines=",".join(RUN_ENGINES),
        outs=lambda wildcards, output: ",".join(output[e] for e in RUN_ENGINES),
        engine_config=engine_config_opt,
        device=torch_device,
        dtype=compute_dtype,
        weight_format=weight_format_opt,
        multi_turn="--multi-turn" if config.get("multi_turn") else "",
        eos="--stop-at-eos" if config.get("stop_at_eos") else "",
        repeats=config["timing"]["repeats"],
        replay=replay_opt,
        limit=limit_opt,
    threads: timing_threads
    resources:
        timing_slots=timing_slot,
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=model_mem_mb(),
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot run --engine {params.engines} --target {params.target}"
        " --target-name {params.target_name:q} --drafter {params.drafter} --drafter-name {params.drafter_name}"
        " --prompts {input.prompts} {params.limit} --out {params.outs} --deployment {wildcards.deployment}"
        " --gpu {wildcards.gpu} --max-new-tokens {params.max_new_tokens}"
        " --concurrency {wildcards.concurrency} --block-size {params.block_size} {params.block_reason}"
        " {params.engine_config} --device {params.device} --dtype {params.dtype} {params.weight_format}"
        " --kernels-manifest {input.kernels_manifest} --kernel-agent {input.kernel_agent}"
        " --threads {threads} {params.multi_turn} {params.eos} --timing-repeats {params.repeats} {params.replay}"
        " 2>&1 | tee {log}"

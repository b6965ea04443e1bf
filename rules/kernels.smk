# Stage: per-GPU kernels. On a GPU the rule builds the w12 tensor-core library with nvcc for the
# device's architecture (beside the manifest), checks every K split of it before anything uses it,
# and the manifest names the device, the library and its checks, and the tuned tables shipped in the
# package for it; the kernel sub-agent tunes, per deployment and on the GPU it runs on, the launch
# configs of the w12 kernels furthest from the bandwidth limit and the bf16 Triton step's matmul
# tables (engine_configs: per role and row bucket up to 64 rows, each candidate checked bit-equal
# to the decode config's rows and against an fp32 reference before it is timed), and which matmul
# roles the fast path runs with that w12 library (w12_choice: one K split per role at every M, so
# rows stay independent of M; chosen where it beats bf16 over the verify width). Both files are
# inputs of every engine cell, token forcing job and round step, which install them and record what
# they used (engine_config.kernels); on CPU no GPU kernel applies, and the sub-agent chooses instead
# which step path the target and the drafter run there (plain or the fused CPU step, each checked
# on the calibration prompts against the plain forward and timed: agent.kernel_cpu), which the
# rounds' verify_path / draft_path directions may try.


rule kernels:
    output:
        "results/{gpu}/kernels/manifest.json",
    log:
        "logs/{gpu}/kernels.log",
    params:
        on_device=on_device,
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    resources:
        gpu=gpu_count,
        gpu_model=gpu_model,
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot kernels --gpu {wildcards.gpu} --out-dir {params.out_dir} > {log} 2>&1"


rule kernel_agent:
    input:
        build=build_marker,
        ceilings="results/{gpu}/ceilings.json",
        manifest="results/{gpu}/kernels/manifest.json",
        prompts=calibration_file,
    output:
        "results/{gpu}/kernels/{deployment}/{regime}/kernel-agent.json",
    log:
        "logs/{gpu}/{deployment}/{regime}/kernel-agent.log",
    params:
        on_device=on_device,
        target=target_dir,
        effort=kernel_agent_opts,
        drafter=drafter_dir,
        block_size=block_size,
        tolerance=forcing_tolerance,
    threads: timing_threads
    resources:
        timing_slots=timing_slot,
        gpu=gpu_count,
        gpu_model=gpu_model,
        mem_mb=model_mem_mb(),
    conda:
        "../envs/engine.yaml"
    shell:
        "{params.on_device} python -m specpilot round kernels --target {params.target} --gpu {wildcards.gpu}"
        " --drafter {params.drafter} --block-size {params.block_size} --prompts {input.prompts}"
        " --tolerance {params.tolerance} --threads {threads}"
        " --ceilings {input.ceilings} --kernels-manifest {input.manifest} {params.effort} --out {output} > {log} 2>&1"

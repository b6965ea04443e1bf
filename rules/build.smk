# The tiny build as jobs of their own (issue 56; specpilot.tiny.stages): the target, the teacher
# outputs every drafter learns from (persisted once), each drafter's training, then build.json.
# Files: resources/deployments/{build}/target/, drafter-{kind}/, build.json (the layout the tests
# and CI reuse) and stages/ (each stage's summary, the teacher outputs, the drafters' threads).
#
# The teacher job is a checkpoint: after it, the drafter jobs are planned with the thread counts it
# measured (stages/threads.json: a few training steps of each drafter at each thread count, the
# counts that finish the drafters soonest side by side), so on 2 cores the drafters train one core
# each, two at a time. Each drafter job's parameter is a hash of the recipe fields it is trained
# from, so a change to one drafter's recipe retrains that drafter only. Every build job takes the
# profile's timing slots it can (the target and teacher all of them, a drafter one): no timed job
# runs beside the build while two drafters train (they come first: priority), and in the default
# every timed job waits for build.json anyway. A deployment's jobs wait for its own drafter only
# (build_marker: stages/drafter-{kind}.json); build.json is asked for by the default target.
# (Its functions: rules/common.smk, "tiny build stages".)


rule tiny_target:
    output:
        "resources/deployments/{deployment}/stages/target.json",
    log:
        "logs/deployments/{deployment}/target.log",
    wildcard_constraints:
        deployment=names_regex(list(TINY_BUILDS)),
    params:
        opts=tiny_stage_opts,
        kind=lambda wildcards: TINY_BUILDS[wildcards.deployment]["kind"],
        recipe=tiny_target_recipe,
    threads: TIMING_THREADS
    resources:
        timing_slots=CPU_TIMING_SLOTS,
    priority: 50
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot tiny-stage target {params.opts} --target-kind {params.kind}"
        " --recipe-hash {params.recipe} --threads {threads} > {log} 2>&1"


checkpoint tiny_teacher:
    input:
        rules.tiny_target.output,
    output:
        teacher="resources/deployments/{deployment}/stages/teacher.pt",
        info="resources/deployments/{deployment}/stages/teacher.json",
        threads="resources/deployments/{deployment}/stages/threads.json",
    log:
        "logs/deployments/{deployment}/teacher.log",
    wildcard_constraints:
        deployment=names_regex(list(TINY_BUILDS)),
    params:
        opts=tiny_stage_opts,
        drafters=tiny_drafters,
        recipe=tiny_target_recipe,
    threads: TIMING_THREADS
    resources:
        timing_slots=CPU_TIMING_SLOTS,
    priority: 50
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot tiny-stage teacher {params.opts} --drafters {params.drafters}"
        " --recipe-hash {params.recipe} --threads {threads} > {log} 2>&1"


rule tiny_drafter:
    input:
        teacher=lambda wildcards: checkpoints.tiny_teacher.get(deployment=wildcards.deployment).output.teacher,
    output:
        "resources/deployments/{deployment}/stages/drafter-{kind}.json",
    log:
        "logs/deployments/{deployment}/drafter-{kind}.log",
    wildcard_constraints:
        deployment=names_regex(list(TINY_BUILDS)),
        kind=names_regex(TINY_DRAFTERS),
    params:
        opts=tiny_stage_opts,
        recipe=tiny_drafter_recipe,
    threads: drafter_threads
    resources:
        timing_slots=lambda wildcards: 1 if CPU_TIMING_SLOTS > 1 else CPU_TIMING_SLOTS,
    priority: 50
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot tiny-stage drafter {params.opts} --kind {wildcards.kind}"
        " --recipe-hash {params.recipe} --threads {threads} > {log} 2>&1"


localrules:
    build_tiny,


# build.json: the stage summaries gathered (the one-process build's fields), written last.
rule build_tiny:
    input:
        target=rules.tiny_target.output,
        drafters=lambda wildcards: [f"resources/deployments/{wildcards.deployment}/stages/drafter-{k}.json"
                                    for k in sorted(TINY_BUILDS[wildcards.deployment]["drafters"])],
    output:
        "resources/deployments/{deployment}/build.json",
    log:
        "logs/deployments/{deployment}.log",
    wildcard_constraints:
        deployment=names_regex(list(TINY_BUILDS)),
    params:
        opts=tiny_stage_opts,
        drafters=tiny_drafters,
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot tiny-stage assemble {params.opts} --drafters {params.drafters} > {log} 2>&1"

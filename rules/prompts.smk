# Formatted, tokenized evaluation prompts per deployment and benchmark (GPU-independent).


rule prompts:
    input:
        build=build_marker,
    output:
        "results/prompts/{deployment}/{benchmark}.jsonl",
    log:
        "logs/prompts/{deployment}/{benchmark}.log",
    params:
        tokenizer=target_dir,
        n_prompts=config["n_prompts"],
        seed=config.get("seed", 0),
        data=data_dir_opt(),
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot prompts --tokenizer {params.tokenizer} --benchmark {wildcards.benchmark}"
        " --n-prompts {params.n_prompts} --seed {params.seed} --role eval {params.data}"
        " --out {output} > {log} 2>&1"

# Formatted, tokenized evaluation prompts per deployment, one file per benchmark (GPU-independent;
# one job per deployment: the tokenizer and the data are read once).


rule prompts:
    input:
        build=build_marker,
    output:
        **{b: f"results/prompts/{{deployment}}/{b}.jsonl" for b in config["benchmarks"]},
    log:
        "logs/prompts/{deployment}/eval.log",
    params:
        tokenizer=target_dir,
        n_prompts=config["n_prompts"],
        seed=config.get("seed", 0),
        data=data_dir_opt(),
        benchmarks=",".join(config["benchmarks"]),
        outs=lambda wildcards, output: ",".join(output[b] for b in config["benchmarks"]),
    conda:
        "../envs/engine.yaml"
    shell:
        "python -m specpilot prompts --tokenizer {params.tokenizer} --benchmark {params.benchmarks}"
        " --n-prompts {params.n_prompts} --seed {params.seed} --role eval {params.data}"
        " --out {params.outs} > {log} 2>&1"

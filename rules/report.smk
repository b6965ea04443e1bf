# The study table and figures of one GPU.


rule table:
    input:
        unpack(table_inputs),
    output:
        report(
            "results/{gpu}/table.csv",
            caption="../report/table.rst",
            category="Table",
        ),
    log:
        "logs/{gpu}/table.log",
    params:
        specpilot_note=SPECPILOT_NOTE,
        max_spread=config["timing"]["max_spread"],
        devices=devices_opt,
        regimes=regimes_opt(),
    conda:
        "../envs/report.yaml"
    shell:
        "python -m specpilot table --records {input.records} --forcing {input.forcing}"
        " --specpilot-note {params.specpilot_note:q} --max-spread {params.max_spread} {params.devices}"
        " {params.regimes}"
        " --out {output} > {log} 2>&1"


rule figures:
    input:
        "results/{gpu}/table.csv",
    output:
        speedup=report(
            "results/{gpu}/figures/speedup.png",
            caption="../report/speedup.rst",
            category="Figures",
        ),
        tau=report(
            "results/{gpu}/figures/tau.png",
            caption="../report/tau.rst",
            category="Figures",
        ),
        concurrency=report(
            "results/{gpu}/figures/concurrency.png",
            caption="../report/concurrency.rst",
            category="Figures",
        ),
    log:
        "logs/{gpu}/figures.log",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.speedup),
    conda:
        "../envs/report.yaml"
    shell:
        "python -m specpilot figures --table {input} --out-dir {params.out_dir} > {log} 2>&1"

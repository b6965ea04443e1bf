"""``specpilot serve``: serve one deployment's engine behind an OpenAI-compatible HTTP API (uvicorn).

Which engine serves which concurrency: a run tunes each deployment per serving regime
(:mod:`specpilot.regimes`; ``results/{gpu}/{deployment}/{regime}/specpilot.json``). By name
(``--deployment NAME|best --results results/{gpu}``) the server loads the engine of the regime
that serves ``--max-concurrency`` (the regime whose cells include it; else the one whose tune is
nearest, said at start-up), with that regime's kernel sub-agent choice; the run's regimes are read
from what it left in ``results`` (:func:`~specpilot.server.lookup.run_regimes`). Explicit paths
(``--engine-config``, ``--kernel-agent``, ...) replace the found ones before any file is checked.
``--engine stock`` or ``ar`` serve the baselines of the same deployment (to measure the found
engine against). The start-up lines name the regime and the engine config file. docs/serving.md.
"""

from __future__ import annotations

import argparse

import uvicorn

from ..errors import SpecpilotError
from .app import create_app
from .engine import RecordWriter, ServedEngine
from .lookup import (EngineFiles, best_deployment, check_files, deployment_files, run_regimes, run_root,
                     serving_regime)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``specpilot serve``."""
    p.add_argument("--deployment", help="deployment name; with --results: load it from a finished workflow run, the "
                   "engine of the regime serving --max-concurrency ('best': the deployment with the highest "
                   "specpilot speedup in that regime's rows of table.csv)")
    p.add_argument("--results", help="results/{gpu} folder of a finished workflow run (e.g. results/cpu); the run's "
                   "folder (resources/, ...) is its parent's parent")
    p.add_argument("--config", "--configfile", dest="config", default="config/config.yaml",
                   help="the run's workflow config (the deployment's target, drafter, block, weight format; the "
                        "regimes when the run's table has no regime column; default config/config.yaml)")
    p.add_argument("--target", help="target checkpoint directory (explicit paths instead of --results)")
    p.add_argument("--drafter", help="drafter checkpoint directory")
    p.add_argument("--drafter-name", default=None, help="drafter name for the records (dflash, dflash2, dspark)")
    p.add_argument("--engine-config", help="engine config JSON (default with --results: the serving regime's "
                   "results/{gpu}/{deployment}/{regime}/specpilot.json); replaces the found one")
    p.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json (default with --results)")
    p.add_argument("--kernel-agent", help="the kernel sub-agent's kernel-agent.json (default with --results: "
                   "results/{gpu}/kernels/{deployment}/{regime}/kernel-agent.json)")
    p.add_argument("--block-size", default=None, help="block size (default: the deployment's, else auto)")
    p.add_argument("--dtype", default=None, help="auto, fp32 or bf16 (default: the deployment's)")
    p.add_argument("--engine", choices=("specpilot", "stock", "ar"), default="specpilot",
                   help="the found engine (default), or the stock / AR baseline of the same deployment")
    p.add_argument("--max-concurrency", type=int, default=1,
                   help="request slots decoded together (continuous batching; default 1). By name, the engine of "
                        "the run's regime whose cells include it, else of the regime whose tune is nearest")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; one more is answered 429 (default 64)")
    p.add_argument("--max-seq", type=int, help="KV-cache slots per request: the context (prompt + max_tokens + "
                   "verify width); default 4096 capped at the target's max_position_embeddings")
    p.add_argument("--prefill-chunk", type=int, help="prefill prompts in chunks of this many tokens")
    p.add_argument("--model-name", help="the model name clients send (default: the deployment name)")
    p.add_argument("--record", help="folder: write served requests as records + prompt file for 'specpilot force'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="CUDA graphs (as specpilot run)")


def engine_files(args) -> tuple[EngineFiles, list[str]]:
    """The files to load and the start-up lines saying where they came from: by name from
    ``--results`` (the regime serving ``--max-concurrency``: :func:`run_regimes`,
    :func:`serving_regime`; ``best``: :func:`best_deployment` over that regime's rows; the files:
    :func:`deployment_files`), explicit flags on top, then every file the engine loads checked
    (:func:`check_files`); or explicit paths alone.

    Raises:
        SpecpilotError: neither names a target; a deployment not in the config; a missing file (named).
    """
    notes: list[str] = []
    if args.results:
        if not args.deployment:
            raise SpecpilotError("--results needs --deployment (a deployment name of the run, or best)")
        regimes, source = run_regimes(args.results, args.config)
        regime, note = serving_regime(regimes, args.max_concurrency)
        notes.append(f"regimes of the run (from {source}): "
                     + "; ".join(f"{n} tuned at c{r['tune']}, cells {', '.join(map(str, r['cells']))}"
                                 for n, r in regimes.items()))
        if note:
            notes.append(note)
        name = args.deployment
        if name == "best":
            name = best_deployment(args.results, regime, args.max_concurrency)
            notes.append(f"best: {name!r}, the highest specpilot speedup in the rows of regime {regime!r} of "
                         f"{args.results}/table.csv")
        files = deployment_files(name, args.results, args.config, regime)
        where = str(run_root(args.results))
    elif args.target:
        files = EngineFiles(deployment=args.deployment or "custom", target=args.target, drafter=args.drafter,
                            drafter_name=args.drafter_name or "dflash")
        where = "this folder"
    else:
        raise SpecpilotError("give --deployment NAME --results results/{gpu} (a finished workflow run), or --target "
                             "(and --drafter, --engine-config) paths")
    for key in ("target", "drafter", "engine_config", "kernels_manifest", "kernel_agent", "block_size", "dtype"):
        value = getattr(args, key)
        if value is not None:
            setattr(files, key, str(value))
            if args.results and key in ("engine_config", "kernel_agent") and files.regime:
                notes.append(f"--{key.replace('_', '-')} {value} replaces regime {files.regime!r}'s file")
    if args.drafter_name:
        files.drafter_name = args.drafter_name
    if args.results:
        check_files(files, args.engine, where)
    return files, notes


def run(args: argparse.Namespace) -> int:
    """Load the engine, warm it up, serve until interrupted."""
    files, notes = engine_files(args)
    for line in notes:
        print(f"specpilot serve: {line}", flush=True)
    engine = ServedEngine(files, args.engine, args.max_concurrency, args.max_seq, args.max_queue, args.device,
                          args.threads, args.graphs, args.prefill_chunk)
    writer = RecordWriter(args.record) if args.record else None
    engine.start()
    app = create_app(engine, args.model_name or files.deployment, writer)
    regime = f"regime {files.regime!r}, " if files.regime else ""
    config = f"engine config {files.engine_config}" if args.engine == "specpilot" else f"{args.engine} baseline"
    print(f"specpilot serve: {files.deployment} ({args.engine}, {regime}{config}; {args.max_concurrency} slot(s), "
          f"context {engine.max_seq}) on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.scheduler.stop()
    return 0

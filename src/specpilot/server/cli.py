"""``specpilot serve``: serve one deployment's engine behind an OpenAI-compatible HTTP API (uvicorn).

Which engine serves which concurrency: the engine config is the one the agent rounds validated for
the deployment (``results/{gpu}/{deployment}/specpilot.json``; the rounds tune at the study's
concurrency, 1 in the embedded default). ``--max-concurrency`` sets the slots the online scheduler
decodes together; a config tuned for another regime can be given explicitly with
``--engine-config`` (e.g. a per-regime config for c16). ``--engine stock`` or ``ar`` serve the
baselines of the same deployment (to measure the found engine against).
"""

from __future__ import annotations

import argparse

import uvicorn

from ..errors import SpecpilotError
from .app import create_app
from .engine import EngineFiles, RecordWriter, ServedEngine, best_deployment, deployment_files


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``specpilot serve``."""
    p.add_argument("--deployment", help="deployment name; with --results: load it from a finished workflow run "
                   "('best': the one with the highest specpilot speedup in its table.csv)")
    p.add_argument("--results", help="results/{gpu} folder of a finished workflow run (e.g. results/cpu)")
    p.add_argument("--config", default="config/config.yaml",
                   help="the run's workflow config (names the deployment's target and drafter; default config/config.yaml)")
    p.add_argument("--target", help="target checkpoint directory (explicit paths instead of --results)")
    p.add_argument("--drafter", help="drafter checkpoint directory")
    p.add_argument("--drafter-name", default=None, help="drafter name for the records (dflash, dflash2, dspark)")
    p.add_argument("--engine-config", help="engine config JSON (default with --results: "
                   "results/{gpu}/{deployment}/specpilot.json); per-regime configs go here")
    p.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json (default with --results)")
    p.add_argument("--kernel-agent", help="the kernel sub-agent's kernel-agent.json (default with --results)")
    p.add_argument("--block-size", default=None, help="block size (default: the deployment's, else auto)")
    p.add_argument("--dtype", default=None, help="auto, fp32 or bf16 (default: the deployment's)")
    p.add_argument("--engine", choices=("specpilot", "stock", "ar"), default="specpilot",
                   help="the found engine (default), or the stock / AR baseline of the same deployment")
    p.add_argument("--max-concurrency", type=int, default=1,
                   help="request slots decoded together (continuous batching; default 1). The engine config by name "
                        "is the rounds' one, tuned at the study's concurrency (1 in the embedded default): "
                        "give a config tuned for another regime with --engine-config")
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


def engine_files(args) -> EngineFiles:
    """The files to load: by name from ``--results`` (:func:`deployment_files`), explicit flags on
    top; or explicit paths alone. Raises SpecpilotError when neither names a target."""
    if args.results:
        if not args.deployment:
            raise SpecpilotError("--results needs --deployment (the deployment to serve)")
        name = best_deployment(args.results) if args.deployment == "best" else args.deployment
        files = deployment_files(name, args.results, args.config)
    elif args.target:
        files = EngineFiles(deployment=args.deployment or "custom", target=args.target, drafter=args.drafter,
                            drafter_name=args.drafter_name or "dflash")
    else:
        raise SpecpilotError("give --deployment NAME --results results/{gpu} (a finished workflow run), or --target "
                             "(and --drafter, --engine-config) paths")
    for name in ("drafter", "engine_config", "kernels_manifest", "kernel_agent", "block_size", "dtype"):
        value = getattr(args, name)
        if value is not None:
            setattr(files, name, str(value))
    if args.drafter_name:
        files.drafter_name = args.drafter_name
    return files


def run(args: argparse.Namespace) -> int:
    """Load the engine, warm it up, serve until interrupted."""
    files = engine_files(args)
    engine = ServedEngine(files, args.engine, args.max_concurrency, args.max_seq, args.max_queue, args.device,
                          args.threads, args.graphs, args.prefill_chunk)
    writer = RecordWriter(args.record) if args.record else None
    engine.start()
    app = create_app(engine, args.model_name or files.deployment, writer)
    print(f"specpilot serve: {files.deployment} ({args.engine}, {args.max_concurrency} slot(s), context "
          f"{engine.max_seq}) on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.scheduler.stop()
    return 0

"""``specpilot run``: one engine over a prompt file into a records file (written atomically)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..errors import SpecpilotError
from ..io import read_json
from ..records import merge_repeats, write_records
from .serve import ENGINES, EngineSpec, pick_device, pick_dtype, read_prompts, serve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, choices=ENGINES,
                   help="ar (autoregressive baseline), stock (block drafter, linear verification), lookup "
                        "(prompt lookup), specpilot (stock + the mechanisms in --engine-config)")
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--drafter", help="drafter checkpoint directory (stock, specpilot)")
    p.add_argument("--prompts", required=True, help="prompt file from 'specpilot prompts'")
    p.add_argument("--out", required=True, help="records file to write (JSON lines)")
    p.add_argument("--deployment", default="custom", help="deployment name recorded with each request")
    p.add_argument("--target-name", help="target name for the records (default: --target)")
    p.add_argument("--drafter-name", default="dflash", help="drafter name recorded with each request (default dflash)")
    p.add_argument("--gpu", default="cpu", help="the {gpu} wildcard value recorded with each request")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop concurrency c: requests in flight, a finished one's slot refilled at once (default 1)")
    p.add_argument("--block-size", default="8",
                   help="block size in the drafter's own counting (dflash/dflash2: verify width, anchor/bonus "
                        "included; dspark: gamma drafts); 'auto' = the drafter config's block_size (default 8; "
                        "the engine config's wins)")
    p.add_argument("--regime", choices=("continuous", "static"), default="continuous",
                   help="continuous batching (default) or the earlier static batches of c in lock step")
    p.add_argument("--prefill-chunk", type=int, help="continuous batching: prefill prompts in chunks of this many "
                   "tokens (fewer KV-cache slots per row; default whole prompts)")
    p.add_argument("--engine-config", help="JSON file with the engine config (specpilot: from the last round)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), fp32 or bf16")
    p.add_argument("--weight-format", default=None, help="bf16 or w12 (overrides the engine config)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop a request at EOS (the study ignores EOS)")
    p.add_argument("--limit", type=int, help="serve only the first N prompts")
    p.add_argument("--multi-turn", action="store_true",
                   help="chain every user turn of multi-turn prompts (mt-bench): turn k+1's prompt is the chat "
                        "so far with the engine's own answers; its records get the request id '<id>/turn<k+1>'")
    p.add_argument("--max-seq", type=int, help="KV-cache slots per request (default: what the prompts need; "
                   "more than the target's max_position_embeddings is refused)")
    p.add_argument("--seed", type=int, default=0, help="torch seed (default 0; greedy decoding does not use it)")
    p.add_argument("--timing-repeats", type=int, default=1,
                   help="decode the prompts this many times (default 1): outputs must be identical, each record "
                        "keeps its fastest run's timings and all decode times as decode_s_repeats (their spread "
                        "shows a loaded machine in the table)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="CUDA graphs for decode/verify/draft steps (auto: on for CUDA devices)")
    p.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                   help="step kernels under CUDA graphs (auto: triton with bf16 weights)")
    p.add_argument("--kernel-configs", help="JSON file {role: config key} of tuned matmul blocks "
                   "(from gpu_bench/bench_engine.py)")
    p.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json: the packaged tuned tables "
                   "that apply to this GPU (recorded in engine_config['kernels'])")
    p.add_argument("--kernel-agent", help="the kernel sub-agent's kernel-agent.json: its tuned w12 configs are "
                   "installed (recorded in engine_config['kernels'])")
    p.add_argument("--no-profile", action="store_true",
                   help="do not synchronize around the draft step (draft_s stays 0; one sync per verify step)")
    p.add_argument("--replay-profile", help="system benchmarks on random weights: replay drafter with this "
                   "acceptance profile (JSON path or name of a packaged profile, specpilot/replay_profiles); records are synthetic")
    p.add_argument("--replay-reference", help="AR records of the same prompts for the replay drafter "
                   "(default: run AR first)")


def run(args) -> int:
    from ..deployment import load_deployment
    from ..kernels_build import use_kernel_outputs

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.max_new_tokens < 1:
        raise SpecpilotError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.timing_repeats < 1:
        raise SpecpilotError(f"--timing-repeats must be >= 1, got {args.timing_repeats}")
    config = dict(read_json(args.engine_config)) if args.engine_config else {}
    if not isinstance(config, dict):
        raise SpecpilotError(f"{args.engine_config} must hold a JSON object")
    config = config.get("engine_config", config)
    if args.weight_format:
        config["weight_format"] = args.weight_format
    block = config.pop("block_size", args.block_size)
    if str(block) == "auto":
        from ..models.config import read_config
        from ..models.loading import drafter_config

        if not args.drafter:
            raise SpecpilotError("--block-size auto needs --drafter (its config.json holds the block size)")
        block = drafter_config(read_config(args.drafter), f"{args.drafter}/config.json").block_size
    try:
        block = int(block)
    except ValueError:
        raise SpecpilotError(f"--block-size must be an integer or 'auto', got {block!r}") from None
    spec = EngineSpec(engine=args.engine, block_size=block, config=config)
    prompts = read_prompts(args.prompts, args.limit)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    replay = references = None
    drafter_name = args.drafter_name if args.engine != "lookup" else "lookup"
    if args.replay_profile:
        from ..records import read_records
        from .replay import load_profile

        if args.engine != "stock":
            raise SpecpilotError("--replay-profile goes with --engine stock")
        replay = load_profile(args.replay_profile)
        spec.config["replay_profile"] = replay.name
        drafter_name = f"replay:{drafter_name}"
        if args.replay_reference:
            references = {r.request_id: r.output_ids for r in read_records(args.replay_reference)}
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    dep = load_deployment(args.target, args.drafter if args.engine in ("stock", "specpilot") else None,
                          device=device, dtype=dtype, config=config)
    kernel_outputs = use_kernel_outputs(args.kernels_manifest, args.kernel_agent)
    if args.kernel_configs:
        from .graphs import step_graphs

        step_graphs(dep.target, "triton", dict(read_json(args.kernel_configs)))
    warm = {"up": True}

    def serve_turn(rows):
        return serve(spec, dep.target, dep.drafter, rows, args.max_new_tokens, args.concurrency,
                     meta={"deployment": args.deployment, "target": args.target_name or args.target,
                           "drafter": drafter_name, "gpu": args.gpu},
                     eos_id=dep.eos_id if args.stop_at_eos else None, max_seq=args.max_seq,
                     graphs=graphs, kernels=args.kernels, replay=replay, references=references,
                     profile=not args.no_profile, warmup=warm["up"], regime=args.regime,
                     prefill_chunk=args.prefill_chunk)

    tokenizer = None
    if args.multi_turn:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
    runs = []
    for rep in range(args.timing_repeats):
        print(f"{args.engine} c{args.concurrency}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
              f"run {rep + 1}/{args.timing_repeats}", file=sys.stderr, flush=True)
        if tokenizer is not None:
            from .serve import serve_turns

            runs.append(serve_turns(serve_turn, prompts, tokenizer))
        else:
            runs.append(serve_turn(prompts))
        warm["up"] = False  # warmed once; later runs are timed as they come
    records = merge_repeats(runs)
    if args.kernels_manifest or args.kernel_agent:
        for r in records:
            r.engine_config["kernels"] = kernel_outputs
    write_records(args.out, records)
    taus = [t for r in records for t in r.committed_per_step]
    print(json.dumps({"engine": args.engine, "requests": len(records),
                      "tau": round(sum(taus) / max(len(taus), 1), 3),
                      "decode_s": round(sum(r.decode_s for r in records), 3),
                      "wall_s": round(max((r.finish_s or 0.0) for r in records), 3)}))
    return 0

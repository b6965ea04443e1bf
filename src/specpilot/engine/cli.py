"""``specpilot run``: engines over a prompt file into records files (each written atomically).

One engine, or several timed interleaved in one process (``--engine ar,stock,specpilot --out
a.jsonl,b.jsonl,c.jsonl``): at concurrency 1 on an eager device (CPU) every request is decoded by
each engine in turn before the next request (the order rotating per request and repeat); batched,
or under CUDA graphs, each timing pass serves all prompts with each engine in turn (rotating per
repeat). Each engine's KV-cache size is the one its own run would allocate. Timing drift of a
shared or throttled machine then hits every engine alike instead of whichever cell ran during
it; the target (and drafter) are loaded once.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..errors import SpecpilotError
from ..io import comma_list, one_out_each, read_json
from ..records import merge_repeats, write_records
from .serve import ENGINES, EngineSpec, default_max_seq, pick_device, pick_dtype, read_prompts, serve, shift_times


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, type=engine_list,
                   help="ar (autoregressive baseline), stock (block drafter, linear verification), lookup "
                        "(prompt lookup), specpilot (stock + the mechanisms in --engine-config); several "
                        "comma-separated (ar,stock,specpilot) are timed interleaved, one --out each")
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--drafter", help="drafter checkpoint directory (stock, specpilot)")
    p.add_argument("--prompts", required=True, help="prompt file from 'specpilot prompts'")
    p.add_argument("--out", required=True, type=comma_list,
                   help="records file to write (JSON lines); comma-separated, one per --engine")
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
    p.add_argument("--prefill-beside", choices=("on", "off"), default="off",
                   help="continuous batching: prefill a refill's prompt on a second CUDA stream beside the running "
                        "requests' steps (on: a GPU's Triton fast path with a dense target only) instead of "
                        "making them wait (off, the default: measured faster on the H200 at c16-24)")
    p.add_argument("--prefill-chunk", type=int, help="continuous batching: prefill prompts in chunks of this many "
                   "tokens (fewer KV-cache slots per row; default whole prompts)")
    p.add_argument("--engine-config", help="JSON file with the engine config (specpilot: from the last round); "
                   "with several engines it applies to specpilot only")
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
    p.add_argument("--kernel-configs", help="JSON file {role: config key or {max_rows: key}} of tuned matmul blocks "
                   "(from gpu_bench/bench_engine.py); on top of the kernel sub-agent's engine_configs")
    p.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json: the packaged tuned tables "
                   "that apply to this GPU (recorded in engine_config['kernels'])")
    p.add_argument("--kernel-agent", help="the kernel sub-agent's kernel-agent.json: its tuned w12 configs and "
                   "engine matmul tables (engine_configs) are installed (recorded in engine_config['kernels'])")
    p.add_argument("--no-profile", action="store_true",
                   help="do not synchronize around the draft step (draft_s stays 0; one sync per verify step)")
    p.add_argument("--replay-profile", help="system benchmarks on random weights: replay drafter with this "
                   "acceptance profile (JSON path or name of a packaged profile, specpilot/replay_profiles); records are synthetic")
    p.add_argument("--replay-reference", help="AR records of the same prompts for the replay drafter "
                   "(default: run AR first)")


def engine_list(value: str) -> list[str]:
    """``--engine`` value -> engine names (comma-separated, each one of ENGINES, no repeats)."""
    names = [v.strip() for v in value.split(",")]
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown engine {bad[0]!r}; choose from {', '.join(ENGINES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"engine listed twice in {value!r}")
    return names


def _block(block, drafter: str | None) -> int:
    if str(block) == "auto":
        from ..models.config import read_config
        from ..models.loading import drafter_config

        if not drafter:
            raise SpecpilotError("--block-size auto needs --drafter (its config.json holds the block size)")
        block = drafter_config(read_config(drafter), f"{drafter}/config.json").block_size
    try:
        return int(block)
    except ValueError:
        raise SpecpilotError(f"--block-size must be an integer or 'auto', got {block!r}") from None


def install_kernel_configs(targets: list, kernel_outputs: dict, explicit: dict | None) -> dict:
    """Install the engine matmul tables in each target's Triton step: the kernel sub-agent's
    ``engine_configs`` (from :func:`~specpilot.kernels_build.use_kernel_outputs`) merged with
    DEFAULT_CONFIGS, then ``explicit`` (a ``--kernel-configs`` file's content) on top
    (:func:`~specpilot.kernels_build.engine_tables`). With ``explicit`` every target must run the
    Triton step (raises SpecpilotError otherwise, as ``--kernel-configs`` always did); the
    sub-agent's tables alone go only to targets that run it (:func:`~specpilot.kernels_build.install_engine_configs`).

    Returns the tables installed (``{}`` when none), also recorded as ``kernel_outputs["engine_tables"]``
    (what ``engine_config["kernels"]`` of the records shows)."""
    from ..kernels_build import engine_tables, install_engine_configs

    tables = engine_tables(kernel_outputs.get("engine_configs"), explicit)
    installed = [install_engine_configs(t, tables, strict=explicit is not None) for t in targets]
    if tables and any(installed):
        kernel_outputs["engine_tables"] = tables
        return tables
    return {}


def interleaved_order(engines: list[str], k: int) -> list[str]:
    """The engines rotated by ``k`` (request or repeat index): each engine leads in turn."""
    k %= len(engines)
    return engines[k:] + engines[:k]


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
    engines = args.engine
    outs = [o for _, o in one_out_each(args.out, engines, f"engine(s) ({','.join(engines)})")]
    config = dict(read_json(args.engine_config)) if args.engine_config else {}
    if not isinstance(config, dict):
        raise SpecpilotError(f"{args.engine_config} must hold a JSON object")
    config = config.get("engine_config", config)
    if args.replay_profile and engines != ["stock"]:
        raise SpecpilotError("--replay-profile goes with --engine stock")
    specs = []
    for e in engines:
        cfg = dict(config) if len(engines) == 1 or e == "specpilot" else {}
        if args.weight_format:
            cfg["weight_format"] = args.weight_format
        block = _block(cfg.pop("block_size", args.block_size), args.drafter)
        specs.append(EngineSpec(engine=e, block_size=block, config=cfg))
    prompts = read_prompts(args.prompts, args.limit)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    replay = references = None
    if args.replay_profile:
        from ..records import read_records
        from .replay import load_profile

        replay = load_profile(args.replay_profile)
        specs[0].config["replay_profile"] = replay.name
        if args.replay_reference:
            references = {r.request_id: r.output_ids for r in read_records(args.replay_reference)}
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    deps = {}  # weight format -> the deployment loaded in it (one load per format, drafter when needed)
    needs_drafter = any(sp.engine in ("stock", "specpilot") for sp in specs)
    for sp in specs:
        fmt = sp.config.get("weight_format", "native")
        if fmt not in deps:
            deps[fmt] = load_deployment(args.target, args.drafter if needs_drafter else None,
                                        device=device, dtype=dtype, config=sp.config)

    def dep_of(sp: EngineSpec):
        return deps[sp.config.get("weight_format", "native")]

    by_name = dict(zip(engines, specs))
    kernel_outputs = use_kernel_outputs(args.kernels_manifest, args.kernel_agent)
    w12_specs = [sp for sp in specs if sp.config.get("weight_format") == "w12" and sp.config.get("w12_fast")]
    if w12_specs and kernel_outputs.get("w12_choice") and device.type == "cuda":
        from ..kernels_build import install_w12  # w12 roles in the fast path, before its matmul tables

        install_w12(deps["w12"].target, kernel_outputs, w12_specs[0].config)
    install_kernel_configs([dep.target for dep in deps.values()], kernel_outputs,
                           dict(read_json(args.kernel_configs)) if args.kernel_configs else None)
    tokenizer = None
    if args.multi_turn:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
    warm = {sp.engine: True for sp in specs}

    def serve_rows(sp: EngineSpec, rows: list[dict], max_seq: int | None) -> list:
        dep = dep_of(sp)
        name = args.drafter_name if sp.engine != "lookup" else "lookup"
        recs = serve(sp, dep.target, dep.drafter, rows, args.max_new_tokens, args.concurrency,
                     meta={"deployment": args.deployment, "target": args.target_name or args.target,
                           "drafter": f"replay:{name}" if replay is not None else name, "gpu": args.gpu},
                     eos_id=dep.eos_id if args.stop_at_eos else None, max_seq=max_seq,
                     graphs=graphs, kernels=args.kernels, replay=replay, references=references,
                     profile=not args.no_profile, warmup=warm[sp.engine], regime=args.regime,
                     prefill_chunk=args.prefill_chunk, progress=len(rows) > 1,
                     prefill_beside=args.prefill_beside == "on")
        warm[sp.engine] = False  # warmed once; later runs are timed as they come
        return recs

    def serve_pass(sp: EngineSpec, rows: list[dict], max_seq: int | None) -> list:
        if tokenizer is not None:
            from .serve import serve_turns

            return serve_turns(lambda r: serve_rows(sp, r, max_seq), rows, tokenizer)
        return serve_rows(sp, rows, max_seq)

    # request-by-request interleaving at concurrency 1 on eager devices (the CPU, where drift is
    # worst); under CUDA graphs an engine switch reallocates the target's state (each engine has
    # the KV-cache size its own run would have, which token forcing's re-execution reproduces)
    # and recaptures its graphs, so there the engines alternate pass by pass
    from .runner import use_graphs

    eager = not use_graphs(graphs, device)
    per_request = len(specs) > 1 and args.concurrency == 1 and tokenizer is None and eager
    if per_request:  # each engine at the KV-cache size its run over the whole prompt file allocates
        sizes = {sp.engine: args.max_seq or default_max_seq(sp, dep_of(sp).target, prompts, args.max_new_tokens, 1,
                                                            graphs, args.regime) for sp in specs}
    runs = {sp.engine: [] for sp in specs}
    for rep in range(args.timing_repeats):
        print(f"{','.join(engines)} c{args.concurrency}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
              f"run {rep + 1}/{args.timing_repeats}" + (", interleaved per request" if per_request else ""),
              file=sys.stderr, flush=True)
        if not per_request:
            for e in interleaved_order(engines, rep):
                runs[e].append(serve_pass(by_name[e], prompts, args.max_seq))
            continue
        # one request at a time: each engine decodes it in turn, timestamps continued across its
        # requests (each engine's records read as its own sequential closed loop)
        done = {e: [] for e in engines}
        clocks = dict.fromkeys(engines, 0.0)  # per engine: seconds served so far in this repeat
        for i, p in enumerate(prompts):
            for e in interleaved_order(engines, i + rep):
                rec = serve_rows(by_name[e], [p], sizes[e])[0]
                shift_times(rec, clocks[e])
                clocks[e] = rec.finish_s if rec.finish_s is not None else clocks[e]
                done[e].append(rec)
        for e in engines:
            runs[e].append(done[e])
    from .graphs import matmul_choices

    summary = []
    for sp, out in zip(specs, outs):
        records = merge_repeats(runs[sp.engine])
        # the checked-cuBLAS selection of the fast steps on this GPU (engine.graphs.FastTarget._select)
        chosen = matmul_choices(dep_of(sp).target)
        if dep_of(sp).drafter is not None:
            chosen.update({f"drafter {k}": v for k, v in matmul_choices(dep_of(sp).drafter).items()})
        if args.kernels_manifest or args.kernel_agent:
            for r in records:
                r.engine_config["kernels"] = dict(kernel_outputs, **({"matmul": chosen} if chosen else {}))
        write_records(out, records)
        taus = [t for r in records for t in r.committed_per_step]
        line = {"engine": sp.engine, "requests": len(records), "tau": round(sum(taus) / max(len(taus), 1), 3),
                "decode_s": round(sum(r.decode_s for r in records), 3),
                "wall_s": round(max((r.finish_s or 0.0) for r in records), 3)}
        if chosen:
            line["matmul"] = chosen
        summary.append(line)
    for line in summary:
        print(json.dumps(line))
    return 0

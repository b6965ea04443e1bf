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

from ..deployment import Deployment, load_deployment
from ..device import pick_device, pick_dtype
from ..devices import device_identity
from ..drafters.replay import load_profile
from ..errors import SpecpilotError
from ..io import comma_list, one_out_each, read_json, read_prompts
from ..kernels_build import engine_tables, use_kernel_outputs, w12_choice_for
from ..capacity import host_memory_bytes, widest_engine, width_problem
from ..models.config import TargetConfig, read_config
from ..models.loading import drafter_config
from ..records import merge_repeats, read_records, write_records
from .config import ENGINES, WEIGHT_FORMATS, EngineConfig, EngineSpec
from .serve import ServeOptions, default_max_seq, kv_slots_needed, serve, serve_turns, shift_times


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
    p.add_argument("--block-size", default="auto",
                   help="block size in the drafter's own counting (dflash/dflash2: verify width, anchor/bonus "
                        "included; dspark: gamma drafts); 'auto' (default) = the drafter config's block_size, the "
                        "block it was trained for (the engine config's wins)")
    p.add_argument("--block-reason",
                   help="why the stock engine runs at a block other than its drafter's trained one (the drafter "
                        "config's block_size); required then, since stock is the drafter as released. Recorded in "
                        "the stock records' engine_config (block_reason) and shown in the table's note")
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
                   "(from specpilot bench engine); on top of the kernel sub-agent's engine_configs")
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


def resolve_block(block, drafter: str | None, where: str = "--block-size") -> int:
    """A block size: an integer, or ``auto`` = the drafter config's ``block_size`` (its own counting).

    Raises SpecpilotError naming ``where`` for anything else, or ``auto`` without a drafter."""
    if block == "auto":
        if not drafter:
            raise SpecpilotError(f"{where} auto needs --drafter (its config.json holds the block size)")
        return drafter_config(read_config(drafter), f"{drafter}/config.json").block_size
    if isinstance(block, int) and not isinstance(block, bool):
        return block
    try:
        return int(str(block))
    except ValueError:
        raise SpecpilotError(f"{where} must be an integer or 'auto', got {block!r}") from None


def interleaved_order(engines: list[str], k: int) -> list[str]:
    """The engines rotated by ``k`` (request or repeat index): each engine leads in turn."""
    k %= len(engines)
    return engines[k:] + engines[:k]


def engine_specs(args) -> list[EngineSpec]:
    """One :class:`EngineSpec` per ``--engine``: the ``--engine-config`` file (a JSON object, or
    ``{"engine_config": {...}}``) parsed strictly (:class:`EngineConfig`; with several engines it
    applies to specpilot only), ``--weight-format`` on top, the block from the config or ``--block-size``.

    Raises SpecpilotError (naming the config key or the flag) before any work."""
    config = EngineConfig()
    if args.engine_config:
        raw = read_json(args.engine_config)
        if isinstance(raw, dict) and "engine_config" in raw:
            raw = raw["engine_config"]
        if raw is None:  # not silently "no mechanisms": an empty config is {}
            raise SpecpilotError(f"{args.engine_config}: the engine config is JSON null; write {{}} for an engine "
                                 f"without mechanisms")
        config = EngineConfig.parse(raw, f"{args.engine_config}")
    if args.replay_profile:
        replay_checks(args)
    if args.weight_format and args.weight_format not in WEIGHT_FORMATS:
        raise SpecpilotError(f"--weight-format must be one of {', '.join(WEIGHT_FORMATS)}, got {args.weight_format!r}")
    specs = []
    for e in args.engine:
        cfg = config if len(args.engine) == 1 or e == "specpilot" else EngineConfig()
        if args.weight_format:
            cfg = cfg.replace(weight_format=args.weight_format)
        if cfg.is_set("block_size"):
            block = resolve_block(cfg.block_size, args.drafter, f"{args.engine_config}: block_size")
        elif e == "ar" and args.block_size == "auto":
            block = EngineSpec.block_size  # AR verifies no block (its records say 1)
        else:
            block = resolve_block(args.block_size, args.drafter)
        specs.append(EngineSpec(engine=e, block_size=block, config=cfg.without("block_size")))
    return specs


def replay_checks(args) -> None:
    """The replay drafter drafts for stock and specpilot (the AR engine of the same run, when listed,
    gives the references); refused with lookup (it drafts from the prompt) and with --multi-turn
    (a later turn's prompt is built from each engine's own answer)."""
    if "lookup" in args.engine or not any(e in ("stock", "specpilot") for e in args.engine):
        raise SpecpilotError(f"--replay-profile drafts for the stock and specpilot engines, not for "
                             f"--engine {','.join(args.engine)}")
    if args.multi_turn:
        raise SpecpilotError("--replay-profile cannot be combined with --multi-turn")


def stock_block_note(args, specs: list[EngineSpec]) -> str | None:
    """The stock records' ``block_reason``: None when stock runs at its drafter's trained block
    (``block_size`` of the drafter's config.json) or is not run; else ``--block-reason`` with the two
    blocks. Raises SpecpilotError when the blocks differ and no reason is given (the stock engine is
    the drafter as released), or when a reason is given for a stock at its own block."""
    stock = next((sp for sp in specs if sp.engine == "stock"), None)
    if stock is None or not args.drafter or args.replay_profile:
        return None
    trained = resolve_block("auto", args.drafter)
    if stock.block_size == trained:
        if args.block_reason:
            raise SpecpilotError(f"--block-reason given, but stock runs at its drafter's trained block {trained}")
        return None
    if not args.block_reason:
        raise SpecpilotError(f"stock block {stock.block_size} is not the block its drafter was trained for "
                             f"({trained}, {args.drafter}/config.json): stock runs the drafter as released, so use "
                             f"block_size auto (--block-size auto), or give the reason (deployment key "
                             f"block_reason, --block-reason)")
    return f"{args.block_reason} (stock block {stock.block_size}; the drafter was trained at {trained})"


def _check_args(args) -> None:
    if args.max_new_tokens < 1:
        raise SpecpilotError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.timing_repeats < 1:
        raise SpecpilotError(f"--timing-repeats must be >= 1, got {args.timing_repeats}")


def check_capacity(args, specs: list[EngineSpec], prompts: list[dict]) -> None:
    """Refuse, before loading anything, an engine whose verify width cannot fit the target's
    positions or the device's memory (:func:`specpilot.capacity.width_problem`: the longest
    prompt's KV slots at this concurrency, the sliding-window rings sized for the width, the
    weights). Raises SpecpilotError: one line naming the engine, its width's settings and the limit."""
    if not prompts:  # serve refuses an empty prompt file, naming it
        return
    cfg = TargetConfig.from_hf_dict(read_config(args.target), f"{args.target}/config.json")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    cuda = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else host_memory_bytes()
    batched = args.concurrency > 1 and len(prompts) > 1
    first = max(prompts, key=lambda p: len(p["prompt_ids"]))
    longest = len(first["prompt_ids"])
    for sp in specs:
        width = sp.verify_width
        what = "ar" if sp.engine == "ar" else \
            widest_engine({**sp.config.to_dict(), "block_size": sp.block_size})[1]
        slots = args.max_seq or kv_slots_needed(longest, args.max_new_tokens, width, batched) + \
            (64 if cuda and args.regime == "continuous" and args.graphs != "off" else 0)
        problem = width_problem(cfg, width, what, slots, min(args.concurrency, len(prompts)), dtype.itemsize,
                                total, str(device), 0.75 if sp.config.weight_format == "w12" else 1.0)
        if problem:
            raise SpecpilotError(f"engine {sp.engine}: request {first['request_id']} (prompt of {longest} tokens + "
                                 f"{args.max_new_tokens} new tokens): {problem}")


def load_deployments(args, specs: list[EngineSpec], kernel_outputs: dict) -> dict[str, Deployment]:
    """One deployment per weight format the specs use (the target loaded once per format, the
    drafter when an engine drafts), its backend chosen at load (w12 roles of the kernel
    sub-agent's choice where the config asks for them), the matmul tables installed."""
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    needs_drafter = any(sp.engine in ("stock", "specpilot") for sp in specs)
    deps: dict[str, Deployment] = {}
    for sp in specs:
        fmt = sp.config.weight_format
        if fmt not in deps:
            choice = w12_choice_for(kernel_outputs, sp.config)
            deps[fmt] = load_deployment(args.target, args.drafter if needs_drafter else None, device=device,
                                        dtype=dtype, weight_format=fmt, graphs=graphs, kernels=args.kernels,
                                        w12_choice=choice)
            if deps[fmt].backend.w12:
                kernel_outputs["w12_fast"] = deps[fmt].backend.w12
    explicit = dict(read_json(args.kernel_configs)) if args.kernel_configs else None
    tables = engine_tables(kernel_outputs.get("engine_configs"), explicit)
    installed = [dep.backend.install_tables(tables, strict=explicit is not None) for dep in deps.values()]
    if tables and any(installed):
        kernel_outputs["engine_tables"] = tables
    drafter_tables = engine_tables(kernel_outputs.get("drafter_engine_configs"))  # the draft step's (issue 62)
    if drafter_tables and any([dep.backend.install_drafter_tables(drafter_tables) for dep in deps.values()]):
        kernel_outputs["drafter_engine_tables"] = drafter_tables
    return deps


class _Cells:
    """Serves the prompt file with each engine as ``run`` times it (see :func:`run`)."""

    def __init__(self, args, specs: list[EngineSpec], deps: dict[str, Deployment], replay, references):
        self.args, self.deps, self.replay, self.references = args, deps, replay, references
        self.by_name = {sp.engine: sp for sp in specs}
        self.warm = {sp.engine: True for sp in specs}
        self.tokenizer = None
        if args.multi_turn:
            from transformers import AutoTokenizer  # optional heavy dependency

            self.tokenizer = AutoTokenizer.from_pretrained(args.target)

    def dep(self, sp: EngineSpec) -> Deployment:
        return self.deps[sp.config.weight_format]

    def serve_rows(self, sp: EngineSpec, rows: list[dict], max_seq: int | None) -> list:
        a = self.args
        name = a.drafter_name if sp.engine != "lookup" else "lookup"
        replay = self.replay if sp.engine != "ar" else None
        opts = ServeOptions(eos_id=self.dep(sp).eos_id if a.stop_at_eos else None, max_seq=max_seq,
                            warmup=self.warm[sp.engine], progress=len(rows) > 1, profile=not a.no_profile,
                            regime=a.regime, prefill_chunk=a.prefill_chunk, prefill_beside=a.prefill_beside == "on",
                            replay=replay, references=self.references if replay is not None else None)
        meta = {"deployment": a.deployment, "target": a.target_name or a.target,
                "drafter": f"replay:{name}" if replay is not None else name, "gpu": a.gpu}
        recs = serve(sp, self.dep(sp), rows, a.max_new_tokens, a.concurrency, meta, opts)
        self.warm[sp.engine] = False  # warmed once; later runs are timed as they come
        if sp.engine == "ar" and self.replay is not None:  # the replay drafter's references: this run's AR outputs
            self.references = {**(self.references or {}), **{r.request_id: r.output_ids for r in recs}}
        return recs

    def needs_ar_first(self, request_ids: list[str]) -> bool:
        """Whether the replay drafter still lacks the AR outputs of these requests (AR then runs first)."""
        return self.replay is not None and "ar" in self.by_name and \
            any(i not in (self.references or {}) for i in request_ids)

    def order(self, engines: list[str], k: int, request_ids: list[str]) -> list[str]:
        """The engines rotated by ``k`` (:func:`interleaved_order`), AR moved first while the replay
        drafter lacks its references (the first pass only: AR's outputs are the same in every run)."""
        order = interleaved_order(engines, k)
        return ["ar"] + [e for e in order if e != "ar"] if self.needs_ar_first(request_ids) else order

    def serve_pass(self, sp: EngineSpec, rows: list[dict], max_seq: int | None) -> list:
        if self.tokenizer is not None:
            return serve_turns(lambda r: self.serve_rows(sp, r, max_seq), rows, self.tokenizer)
        return self.serve_rows(sp, rows, max_seq)

    def per_request(self, prompts: list[dict], engines: list[str], rep: int, sizes: dict) -> dict[str, list]:
        """One request at a time: each engine decodes it in turn, timestamps continued across its
        requests (each engine's records read as its own sequential closed loop)."""
        done = {e: [] for e in engines}
        clocks = dict.fromkeys(engines, 0.0)  # per engine: seconds served so far in this repeat
        for i, p in enumerate(prompts):
            for e in self.order(engines, i + rep, [p["request_id"]]):
                rec = self.serve_rows(self.by_name[e], [p], sizes[e])[0]
                shift_times(rec, clocks[e])
                clocks[e] = rec.finish_s if rec.finish_s is not None else clocks[e]
                done[e].append(rec)
        return done


def _time_engines(args, cells: _Cells, specs: list[EngineSpec], prompts: list[dict]) -> dict[str, list]:
    """Every engine over the prompts, ``--timing-repeats`` times, interleaved: request by request
    at concurrency 1 on an eager device (the CPU, where drift is worst); else pass by pass (under
    CUDA graphs an engine switch reallocates the target's state, each engine at the KV-cache size
    its own run would have, which token forcing's re-execution reproduces, and recaptures graphs).
    Returns engine -> one list of records per repeat."""
    engines = [sp.engine for sp in specs]
    eager = not any(dep.backend.graphs for dep in cells.deps.values())
    per_request = len(specs) > 1 and args.concurrency == 1 and cells.tokenizer is None and eager
    sizes = {}
    if per_request:  # each engine at the KV-cache size its run over the whole prompt file allocates
        sizes = {sp.engine: args.max_seq or default_max_seq(sp, cells.dep(sp), prompts, args.max_new_tokens, 1,
                                                            args.regime) for sp in specs}
    runs = {e: [] for e in engines}
    for rep in range(args.timing_repeats):
        print(f"{','.join(engines)} c{args.concurrency}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
              f"run {rep + 1}/{args.timing_repeats}" + (", interleaved per request" if per_request else ""),
              file=sys.stderr, flush=True)
        if per_request:
            for e, recs in cells.per_request(prompts, engines, rep, sizes).items():
                runs[e].append(recs)
            continue
        for e in cells.order(engines, rep, [p["request_id"] for p in prompts]):
            runs[e].append(cells.serve_pass(cells.by_name[e], prompts, args.max_seq))
    return runs


def stamp_records(records: list, dep: Deployment, kernel_outputs: dict | None) -> dict:
    """Stamp records with the device that timed them (issue 40) and, when ``kernel_outputs`` is
    given (a kernel manifest or sub-agent output was used), the kernels in ``engine_config["kernels"]``
    with the checked-cuBLAS selection of the fast steps on this GPU (:mod:`specpilot.tuning.select`).
    Returns that selection (empty off the fast path)."""
    chosen = dep.backend.matmul_choices()
    device = device_identity()
    for r in records:
        r.device_index, r.device_uuid, r.device_name = device["device_index"], device["device_uuid"], \
            device["device_name"]
        if kernel_outputs is not None:
            r.engine_config["kernels"] = dict(kernel_outputs, **({"matmul": chosen} if chosen else {}))
    return chosen


def _write(args, cells: _Cells, specs: list[EngineSpec], outs: list[str], runs: dict, kernel_outputs: dict,
           block_note: str | None = None) -> list:
    """Write each engine's records (repeats merged, the kernels recorded, stock's ``block_note``);
    returns summary lines."""
    summary = []
    for sp, out in zip(specs, outs):
        records = merge_repeats(runs[sp.engine])
        if block_note and sp.engine == "stock":
            for r in records:
                r.engine_config["block_reason"] = block_note
        chosen = stamp_records(records, cells.dep(sp), kernel_outputs if args.kernels_manifest or args.kernel_agent
                               else None)
        write_records(out, records)
        taus = [t for r in records for t in r.committed_per_step]
        line = {"engine": sp.engine, "requests": len(records), "tau": round(sum(taus) / max(len(taus), 1), 3),
                "decode_s": round(sum(r.decode_s for r in records), 3),
                "wall_s": round(max((r.finish_s or 0.0) for r in records), 3)}
        if chosen:
            line["matmul"] = chosen
        summary.append(line)
    return summary


def run(args) -> int:
    """``specpilot run``: check every argument and the engine config, load the deployment(s) once,
    time the engines (interleaved), write one records file per engine, print a summary line each."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    _check_args(args)
    outs = [o for _, o in one_out_each(args.out, args.engine, f"engine(s) ({','.join(args.engine)})")]
    specs = engine_specs(args)
    block_note = stock_block_note(args, specs)
    prompts = read_prompts(args.prompts, args.limit)
    replay = references = None
    if args.replay_profile:
        replay = load_profile(args.replay_profile)
        for sp in specs:
            if sp.engine != "ar":
                sp.config = sp.config.replace(replay_profile=replay.name)
        if args.replay_reference:
            references = {r.request_id: r.output_ids for r in read_records(args.replay_reference)}
    check_capacity(args, specs, prompts)
    kernel_outputs = use_kernel_outputs(args.kernels_manifest, args.kernel_agent)
    deps = load_deployments(args, specs, kernel_outputs)
    cells = _Cells(args, specs, deps, replay, references)
    runs = _time_engines(args, cells, specs, prompts)
    for line in _write(args, cells, specs, outs, runs, kernel_outputs, block_note):
        print(json.dumps(line))
    return 0

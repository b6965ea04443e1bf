"""Serve a prompt file with one engine and turn the results into per-request records.

:func:`serve` runs one engine (:class:`~specpilot.engine.config.EngineSpec`) over a
:class:`~specpilot.deployment.Deployment` (target, drafter and the backend chosen for them) at a
closed-loop concurrency: continuous batching (:class:`~specpilot.engine.scheduler.Scheduler`) by
default, or the earlier static batches (:func:`generate_batch`). How it serves (EOS, KV-cache size,
warm-up, timing, prefill policy, the replay drafter) is one :class:`ServeOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from ..deployment import Deployment
from ..drafters.replay import AcceptanceProfile
from ..errors import SpecpilotError
from ..prompts import CHAT_TEMPLATE_KWARGS
from ..records import Record
from .config import EngineSpec
from .loop import RowResult, generate, generate_ar
from .proposers import make_engine_proposer
from .runner import TargetRunner
from .scheduler import Request, Scheduler

REGIMES = ("continuous", "static")


@dataclass
class ServeOptions:
    """How :func:`serve` serves (all optional).

    Attributes:
        eos_id: stop a request at this token (None: every request decodes its whole budget, as the study).
        max_seq: KV-cache slots per row; None = what the longest request needs
            (:func:`kv_slots_needed`; + 64 under CUDA graphs in the continuous regime, so prefill
            widths stay on the scheduler's buckets), capped at the target's max_position_embeddings.
        warmup: a short untimed run first (allocation, graph captures); progress: a progress bar.
        profile: synchronize around the draft step to time it (``draft_s``); off = one
            synchronization per verify step only.
        regime: ``continuous`` (default) or ``static`` (batches of c in lock step, a new runner each).
        prefill_chunk: continuous batching prefills prompts in chunks of this many tokens (None: whole).
        prefill_beside: continuous batching prefills a refill's prompt on a second CUDA stream
            beside the running requests' steps (needs
            :meth:`~specpilot.engine.scheduler.Scheduler.can_prefill_beside`).
        replay: the replay drafter's acceptance profile (system benchmarks on random weights;
            records are marked ``synthetic``); references: request_id -> AR output ids (else the AR
            engine runs first).
    """

    eos_id: int | None = None
    max_seq: int | None = None
    warmup: bool = True
    progress: bool = True
    profile: bool = True
    regime: str = "continuous"
    prefill_chunk: int | None = None
    prefill_beside: bool = False
    replay: AcceptanceProfile | None = None
    references: dict[str, list[int]] | None = None


def kv_slots_needed(prompt_tokens: int, max_new_tokens: int, verify_width: int, batched: bool) -> int:
    """KV-cache slots one request needs: prompt + every position a decode/verify step writes.

    Prefill writes ``P`` slots and yields the first new token. A verify step runs when a row has
    ``n < max_new_tokens`` output tokens, of which ``n - 1`` are in the cache, and writes
    ``verify_width`` slots from there, so the last one ends at ``P + max_new_tokens - 2 + W``
    (AR: ``W = 1``, so ``P + max_new_tokens - 1``). In a batch of several rows a finished row is
    verified (or decoded) again with the others, committing nothing, from ``P + max_new_tokens - 1``:
    one slot more. With ``max_new_tokens == 1`` nothing is decoded: ``P``.

    Args:
        prompt_tokens: ``P`` [tokens]; max_new_tokens: per request; verify_width: ``W``, tokens
            per verify forward (:attr:`~specpilot.engine.config.EngineSpec.verify_width`); batched: more than one row per batch.
    Returns:
        The number of slots [int].
    """
    if max_new_tokens <= 1:
        return prompt_tokens
    return prompt_tokens + max_new_tokens - 2 + verify_width + (1 if batched else 0)


def generate_batch(spec: EngineSpec, dep: Deployment, prompts: list[list[int]], max_new_tokens: int, max_seq: int,
                   eos_id: int | None = None, profile: bool = True, replay: AcceptanceProfile | None = None,
                   references: list[list[int]] | None = None) -> list[RowResult]:
    """Run one batch of prompts (decoded together, a new runner over ``dep``'s backend) through the
    engine ``spec``.

    ``replay``: an acceptance profile: the engine then drafts with the replay drafter
    (``references`` = the AR outputs of these prompts; computed here when None), running the
    deployment's drafter for its cost only.
    """
    if spec.engine == "ar":
        return generate_ar(TargetRunner(dep.target, len(prompts), max_seq, (), dep.backend, fused=spec.fused_verify), prompts,
                           max_new_tokens, eos_id)
    if replay is not None and references is None:
        references = [r.output_ids for r in generate_batch(EngineSpec("ar"), dep, prompts, max_new_tokens, max_seq,
                                                            eos_id)]
    proposer = make_engine_proposer(spec, dep.target, dep.drafter, replay, references)
    runner = TargetRunner(dep.target, len(prompts), max_seq, proposer.capture, dep.backend,
                          verify_width=engine_width(spec, proposer),
                          fused=spec.fused_verify)
    return generate(runner, proposer, prompts, max_new_tokens, eos_id, accept=spec.accept, profile=profile,
                    overlap=spec.overlap)


def engine_width(spec: EngineSpec, proposer=None) -> int:
    """The widest block engine ``spec`` verifies, which sizes its runner's sliding-window rings:
    the config's bound (:attr:`~specpilot.engine.config.EngineSpec.verify_width`: static tree
    N + 1, spine tree, second level, at any concurrency; a load-aware verify budget only narrows
    it) or the proposer's own width, whichever is larger (1 for AR)."""
    return max(spec.verify_width, int(proposer.verify_width) if proposer is not None else 1)


def default_max_seq(spec: EngineSpec, dep: Deployment, prompts: list[dict], max_new_tokens: int,
                    concurrency: int, regime: str = "continuous") -> int:
    """KV-cache slots per row that :func:`serve` allocates for ``prompts`` by default: what the
    longest request needs (:func:`kv_slots_needed`), + 64 under CUDA graphs in the continuous
    regime (a 64-token prefill chunk beyond a running row keeps the prefill widths on the
    scheduler's bucket: fewer captured shapes), capped at the target's max_position_embeddings."""
    batched = concurrency > 1 and len(prompts) > 1
    need = max(kv_slots_needed(len(p["prompt_ids"]), max_new_tokens, spec.verify_width, batched) for p in prompts)
    extra = 64 if regime == "continuous" and dep.backend.graphs else 0
    return min(need + extra, int(dep.target.config.max_position_embeddings))


def shift_times(record: Record, offset: float) -> None:
    """Move a record's ``arrival_s``, ``first_token_s`` and ``finish_s`` by ``offset`` seconds
    (requests served one call at a time then read as one sequential closed loop)."""
    for key in ("arrival_s", "first_token_s", "finish_s"):
        if getattr(record, key, None) is not None:
            setattr(record, key, getattr(record, key) + offset)


def _check_serving(spec: EngineSpec, dep: Deployment, prompts: list[dict], max_new_tokens: int,
                   concurrency: int, opts: ServeOptions) -> int:
    """Refuse what cannot be served (before any work); returns the KV-cache slots per row."""
    if not prompts:
        raise SpecpilotError("the prompt file holds no prompts")
    if concurrency < 1:
        raise SpecpilotError(f"concurrency must be >= 1, got {concurrency}")
    if opts.regime not in REGIMES:
        raise SpecpilotError(f"unknown serving regime {opts.regime!r}; use continuous or static")
    if spec.config.mixed_prefill and opts.regime != "continuous":
        raise SpecpilotError(f"mixed_prefill = {spec.config.mixed_prefill} needs the continuous regime (newcomers' "
                             f"prompts ride in the decode steps); the {opts.regime} regime has no newcomers")
    for p in prompts:
        if not p.get("prompt_ids"):
            raise SpecpilotError(f"request {p.get('request_id')!r} has an empty prompt")
    limit = int(dep.target.config.max_position_embeddings)
    max_seq = opts.max_seq
    if max_seq is not None and max_seq > limit:
        raise SpecpilotError(f"--max-seq {max_seq} exceeds the target's max_position_embeddings {limit}: "
                             f"it has no positions beyond that")
    if max_seq is not None and max_seq < 1:
        raise SpecpilotError(f"--max-seq must be >= 1, got {max_seq}")
    batched = concurrency > 1 and len(prompts) > 1
    max_seq = max_seq or default_max_seq(spec, dep, prompts, max_new_tokens, concurrency, opts.regime)
    for p in prompts:
        need = kv_slots_needed(len(p["prompt_ids"]), max_new_tokens, spec.verify_width, batched)
        if need > max_seq:
            what = (f"the target's max_position_embeddings {limit}" if max_seq == limit
                    else f"the KV cache of {max_seq} slots")
            raise SpecpilotError(
                f"request {p['request_id']}: prompt of {len(p['prompt_ids'])} tokens + {max_new_tokens} new tokens "
                f"(verify width {spec.verify_width}) needs {need} KV cache slots, more than {what}")
    if opts.replay is not None and opts.references is not None:
        missing = [p["request_id"] for p in prompts if p["request_id"] not in opts.references]
        if missing:
            raise SpecpilotError(f"replay reference records lack request(s) {missing[:5]}")
    return max_seq


def serve(spec: EngineSpec, dep: Deployment, prompts: list[dict], max_new_tokens: int, concurrency: int,
          meta: dict, opts: ServeOptions | None = None) -> list[Record]:
    """Serve ``prompts`` (rows with request_id, benchmark, prompt_ids) at closed-loop concurrency c.

    ``opts.regime = "continuous"`` (default): :class:`~specpilot.engine.scheduler.Scheduler` keeps
    c requests in flight over one runner and proposer built once, refilling a finished request's
    slot from the queue at once (SGLang ``bench_serving --max-concurrency c``). Records carry
    ``arrival_s``, ``first_token_s``, ``finish_s`` (seconds from the cell's start) and
    ``decode_s`` = finish - first token. ``"static"``: batches of c decoded in lock step, a new
    runner per batch (kept to measure against).

    Args:
        spec: the engine; dep: the deployment (its backend decides how the target runs).
        meta: record fields fixed for the run: deployment, target, drafter, gpu.
        opts: :class:`ServeOptions` (default: all defaults).
    Returns:
        one :class:`~specpilot.records.Record` per prompt, in order.
    Raises:
        SpecpilotError: empty prompt list, a prompt that does not fit the KV cache (exactly as
            much room as :func:`kv_slots_needed` is required), ``max_seq`` beyond the target's
            ``max_position_embeddings`` (positions it was not trained for), bad concurrency or
            regime, replay references that lack a request.
    """
    opts = opts or ServeOptions()
    max_seq = _check_serving(spec, dep, prompts, max_new_tokens, concurrency, opts)
    if opts.regime == "static":
        rows = _serve_static(spec, dep, prompts, max_new_tokens, concurrency, max_seq, opts)
    else:
        rows = _serve_continuous(spec, dep, prompts, max_new_tokens, concurrency, max_seq, opts)
    return [to_record(spec, p, r, concurrency, meta, opts, dep.backend.path) for p, r in zip(prompts, rows)]


def to_record(spec: EngineSpec, p: dict, r: RowResult, concurrency: int, meta: dict, opts: ServeOptions,
            path: str) -> Record:
    """One request's :class:`~specpilot.records.Record`; ``path``: the execution path every step
    of the engine ran (the backend's, :data:`~specpilot.engine.backend.PATHS`), recorded as
    ``engine_config["path"]`` (token forcing's teacher pass follows it)."""
    return Record(
        request_id=p["request_id"], benchmark=p["benchmark"], engine=spec.engine,
        concurrency=concurrency, prompt_tokens=len(p["prompt_ids"]), new_tokens=len(r.output_ids),
        prefill_s=r.prefill_s, decode_s=r.decode_s, verify_steps=r.verify_steps,
        committed_per_step=r.committed_per_step, output_ids=r.output_ids,
        engine_config={**spec.record_config(), "path": path}, draft_s=r.draft_s, verify_s=r.verify_s,
        synthetic=bool(meta.get("synthetic", False)) or opts.replay is not None,
        deployment=meta["deployment"], target=meta["target"],
        drafter=meta["drafter"] if spec.engine != "ar" else "none", gpu=meta["gpu"],
        arrival_s=getattr(r, "arrival_s", None), first_token_s=getattr(r, "first_token_s", None),
        finish_s=getattr(r, "finish_s", None), prefill_stall_s=getattr(r, "prefill_stall_s", 0.0),
        mixed_steps=getattr(r, "mixed_steps", None),
        threads=torch.get_num_threads())


def continuous_engine(spec: EngineSpec, dep: Deployment, slots: int, max_seq: int,
                      replay: AcceptanceProfile | None = None, references: list[list[int]] | None = None):
    """The proposer (None for AR) and the :class:`TargetRunner` of ``slots`` rows and ``max_seq``
    KV-cache slots each that continuous batching serves engine ``spec`` with over ``dep`` (the
    closed-loop cells here and ``specpilot serve``'s online scheduler alike)."""
    proposer = make_engine_proposer(spec, dep.target, dep.drafter, replay, references)
    capture = proposer.capture if proposer is not None else ()
    runner = TargetRunner(dep.target, slots, max_seq, capture, dep.backend, verify_width=engine_width(spec, proposer),
                          fused=spec.fused_verify)
    return proposer, runner


def _serve_continuous(spec: EngineSpec, dep: Deployment, prompts: list[dict], max_new_tokens: int,
                      concurrency: int, max_seq: int, opts: ServeOptions) -> list[RowResult]:
    """All prompts through one :class:`~specpilot.engine.scheduler.Scheduler` of c slots."""
    replay, references = opts.replay, opts.references
    if replay is not None and references is None:  # the AR engine first, through the same regime
        ar_opts = ServeOptions(eos_id=opts.eos_id, warmup=opts.warmup, progress=False, profile=False,
                               prefill_chunk=opts.prefill_chunk, prefill_beside=opts.prefill_beside)
        ar = _serve_continuous(EngineSpec("ar"), dep, prompts, max_new_tokens, concurrency, max_seq, ar_opts)
        references = {p["request_id"]: r.output_ids for p, r in zip(prompts, ar)}
    requests = [Request(p["prompt_ids"], max_new_tokens, references[p["request_id"]] if replay is not None else None)
                for p in prompts]
    B = min(concurrency, len(prompts))
    proposer, runner = continuous_engine(spec, dep, B, max_seq, replay,
                                         [r.reference for r in requests[:B]] if replay is not None else None)
    bar = tqdm(total=len(requests), desc=f"{spec.engine} c{concurrency}", unit="req", disable=not opts.progress)
    # (a sliding-window target's prompts go in the runner's fixed pieces, TargetRunner.prefill_piece,
    # and a refill block over every row is cut to its widest block, TargetRunner.max_block)
    sched = Scheduler(runner, proposer, accept=spec.accept, eos_id=opts.eos_id, profile=opts.profile,
                      prefill_chunk=opts.prefill_chunk, overlap=spec.overlap, prefill_beside=opts.prefill_beside,
                      mixed_prefill=spec.config.mixed_prefill)
    if opts.warmup:  # first forwards pay one-time allocation costs (and graph captures); keep them out of the timings
        sched.run([Request(r.prompt_ids, min(8, r.max_new_tokens), r.reference) for r in requests[:B]])
    sched.on_finish = lambda i: bar.update(1)
    rows = sched.run(requests)
    bar.close()
    return rows


def _serve_static(spec: EngineSpec, dep: Deployment, prompts: list[dict], max_new_tokens: int, concurrency: int,
                  max_seq: int, opts: ServeOptions) -> list[RowResult]:
    """Batches of ``concurrency`` prompts decoded in lock step, a new runner per batch."""
    if opts.warmup:
        first = [p["prompt_ids"] for p in prompts[:concurrency]]
        generate_batch(spec, dep, first, min(8, max_new_tokens), max_seq, opts.eos_id, replay=opts.replay)
    rows = []
    batches = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    for batch in tqdm(batches, desc=f"{spec.engine} c{concurrency} static", unit="batch", disable=not opts.progress):
        refs = ([opts.references[p["request_id"]] for p in batch]
                if opts.replay is not None and opts.references is not None else None)
        rows += generate_batch(spec, dep, [p["prompt_ids"] for p in batch], max_new_tokens, max_seq, opts.eos_id,
                               profile=opts.profile, replay=opts.replay, references=refs)
    return rows


def serve_turns(serve_rows: Callable[[list[dict]], list[Record]], prompts: list[dict], tokenizer) -> list[Record]:
    """Multi-turn chaining (as the DFlash harness does for mt-bench).

    Turn 1 is served as given; for every row with more user ``turns``, turn k+1's prompt is the chat
    template over [user 1, assistant 1 (the decoded answer), ..., user k+1], so each engine chains
    its own (token-identical) answers. Every turn is rendered with the template settings the prompt
    row recorded (``chat_template_kwargs``, e.g. ``enable_thinking=False`` for Qwen3; rows without
    them get :data:`specpilot.prompts.CHAT_TEMPLATE_KWARGS`, what turn 1 was rendered with), and
    every record carries them. Later turns' records carry ``prompt_ids`` and the request id
    ``"{request_id}/turn{k+1}"``.

    Raises:
        SpecpilotError: a row's ``chat_template_kwargs`` is not a JSON object.
    """
    settings = {}
    for p in prompts:
        kw = p.get("chat_template_kwargs", CHAT_TEMPLATE_KWARGS)
        if not isinstance(kw, dict):
            raise SpecpilotError(f"request {p['request_id']}: chat_template_kwargs must be an object, got {kw!r:.60}")
        settings[p["request_id"]] = dict(kw)
    records = serve_rows(prompts)
    for r in records:
        r.chat_template_kwargs = settings.get(r.request_id)
    done = {r.request_id: r for r in records}
    chats = {p["request_id"]: [{"role": "user", "content": p["turns"][0]}] for p in prompts if p.get("turns")}
    turn = 1
    while True:
        nxt = []
        for p in prompts:
            turns = p.get("turns") or []
            if len(turns) <= turn:
                continue
            prev = p["request_id"] if turn == 1 else f"{p['request_id']}/turn{turn}"
            chat = chats[p["request_id"]]
            chat.append({"role": "assistant", "content": tokenizer.decode(done[prev].output_ids, skip_special_tokens=True)})
            chat.append({"role": "user", "content": turns[turn]})
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                **settings[p["request_id"]])
            if hasattr(ids, "keys"):  # a BatchEncoding on newer transformers
                ids = ids["input_ids"]
            nxt.append({"request_id": f"{p['request_id']}/turn{turn + 1}", "benchmark": p["benchmark"],
                        "prompt_ids": list(ids), "chat_template_kwargs": settings[p["request_id"]]})
        if not nxt:
            return records
        more = serve_rows(nxt)
        for row, r in zip(nxt, more):
            r.prompt_ids = row["prompt_ids"]
            r.chat_template_kwargs = row["chat_template_kwargs"]
            done[r.request_id] = r
        records += more
        turn += 1

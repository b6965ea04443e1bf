"""Serve a prompt file with one engine and turn the results into per-request records."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..errors import SpecpilotError
from ..drafters import make_proposer
from ..drafters.lookup import LookupProposer
from ..drafters.static_tree import static_tree_for
from ..models.dflash import DFlashDrafter
from ..models.qwen3 import Transformer
from ..records import Record
from .generate import ACCEPT_RULES, RowResult, accept_greedy, generate, generate_ar
from .runner import TargetRunner

ENGINES = ("ar", "stock", "lookup", "specpilot")


def verify_width_bound(block_size: int, config: dict) -> int:
    """An upper bound of a speculative engine's tokens per verify forward: block + 1 + the tree's
    side leaves (``tree_branch`` x min(``tree_depth``, block)) + ``second_level``; a static tree
    (``tree_nodes`` N) verifies N + 1 tokens."""
    if config.get("tree_nodes"):
        return max(block_size + 1, int(config["tree_nodes"]) + 1)
    depth = min(int(config.get("tree_depth", 1)), block_size)
    return block_size + 1 + int(config.get("tree_branch", 0)) * depth + int(config.get("second_level", 0))


@dataclass
class EngineSpec:
    """Which loop to run and with what settings.

    ``config`` is recorded verbatim as ``engine_config``: block size, mechanisms, parameters.
    ``block_size`` is in the drafter's own counting (DFlash/DFlash2/lookup: anchor + drafts =
    verify width; DSpark: gamma drafts, verify width gamma + 1), see :mod:`specpilot.drafters`.
    """

    engine: str
    block_size: int = 8
    config: dict = field(default_factory=dict)
    accept: Callable = accept_greedy

    @property
    def overlap(self) -> bool:
        """Engine config ``overlap``: the next draft overlaps the host's bookkeeping (batching
        mechanism (b), :mod:`specpilot.engine.overlap`)."""
        return bool(self.config.get("overlap", False))

    @property
    def verify_width(self) -> int:
        """An upper bound of the tokens per verify forward (block + 1 + tree side branches), for
        sizing the KV cache; the drafter plug-in's ``verify_width`` is the exact value."""
        if self.engine == "ar":
            return 1
        return verify_width_bound(self.block_size, self.config)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise SpecpilotError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        if self.engine != "ar" and self.block_size < 2:
            raise SpecpilotError(f"block size must be >= 2, got {self.block_size}")
        rule = self.config.get("accept")
        if rule is not None:
            if rule not in ACCEPT_RULES:
                raise SpecpilotError(f"unknown verification rule accept={rule!r}; known: {', '.join(ACCEPT_RULES)}")
            self.accept = ACCEPT_RULES[rule]


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
            per verify forward (:attr:`EngineSpec.verify_width`); batched: more than one row per batch.
    Returns:
        The number of slots [int].
    """
    if max_new_tokens <= 1:
        return prompt_tokens
    return prompt_tokens + max_new_tokens - 2 + verify_width + (1 if batched else 0)


def generate_batch(spec: EngineSpec, target: Transformer, drafter: DFlashDrafter | None,
                   prompts: list[list[int]], max_new_tokens: int, max_seq: int,
                   eos_id: int | None = None, profile: bool = True, graphs: bool | None = None,
                   kernels: str | None = None, replay=None, references: list[list[int]] | None = None
                   ) -> list[RowResult]:
    """Run one batch of prompts (decoded together) through the engine ``spec``.

    graphs / kernels: CUDA-graph step path (default: on for CUDA) and its kernels (see
    :class:`TargetRunner`). replay: an :class:`~specpilot.engine.replay.AcceptanceProfile`: the
    stock loop then drafts with the replay drafter (``references`` = the AR outputs of these
    prompts; computed here when None), running ``drafter`` for its cost only.
    """
    if spec.engine == "ar":
        return generate_ar(TargetRunner(target, len(prompts), max_seq, (), graphs=graphs, kernels=kernels),
                           prompts, max_new_tokens, eos_id)
    if replay is not None and references is None:
        references = [r.output_ids for r in generate_batch(EngineSpec("ar"), target, None, prompts, max_new_tokens,
                                                            max_seq, eos_id, graphs=graphs, kernels=kernels)]
    proposer = make_engine_proposer(spec, target, drafter, graphs, kernels, replay, references)
    runner = TargetRunner(target, len(prompts), max_seq, proposer.capture, graphs=graphs, kernels=kernels)
    return generate(runner, proposer, prompts, max_new_tokens, eos_id, accept=spec.accept, profile=profile,
                    overlap=spec.overlap)


def make_engine_proposer(spec: EngineSpec, target: Transformer, drafter, graphs: bool | None = None,
                         kernels: str | None = None, replay=None, references: list[list[int]] | None = None):
    """The drafter plug-in of engine ``spec`` (None for AR): replay (``references`` = per row the
    AR output ids), lookup, or the drafter network's plug-in. Raises SpecpilotError when a
    drafter-based engine has no drafter."""
    if spec.engine == "ar":
        return None
    if replay is not None:
        from .replay import ReplayProposer

        if spec.config.get("second_level"):
            raise SpecpilotError("the replay drafter models chains and spine + side-branch trees; "
                                 "second_level is not modeled")
        net = make_proposer(drafter, spec.block_size, {}, graphs, kernels) if drafter is not None else None
        width = net.verify_width if net is not None else spec.block_size  # the drafter's counting (a chain)
        rp = ReplayProposer(references, replay, target.config.vocab_size, net,
                            seed=int(spec.config.get("replay_seed", 0)), block_size=width,
                            tree_branch=int(spec.config.get("tree_branch", 0)),
                            tree_depth=int(spec.config.get("tree_depth", 1)),
                            rank_draws=bool(spec.config.get("tree_nodes")))
        return static_tree_for(rp, spec.config, replay) if spec.config.get("tree_nodes") else rp
    if spec.engine == "lookup":
        return LookupProposer(int(spec.config.get("max_ngram", 3)), spec.block_size)
    if drafter is None:
        raise SpecpilotError(f"engine {spec.engine!r} needs a drafter (--drafter)")
    proposer = make_proposer(drafter, spec.block_size, spec.config, graphs, kernels)
    if spec.config.get("tree_nodes"):
        if spec.config.get("verify_budget", "off") != "off":
            raise SpecpilotError("tree_nodes (a static tree) cannot be combined with verify_budget")
        return static_tree_for(proposer, spec.config)
    budget = spec.config.get("verify_budget", "off")
    if budget == "load_aware":
        from .verify_budget import LoadAwareVerify

        return LoadAwareVerify(proposer)
    if budget != "off":
        raise SpecpilotError(f"unknown verify_budget {budget!r}; use off or load_aware")
    return proposer


def default_max_seq(spec: EngineSpec, target: Transformer, prompts: list[dict], max_new_tokens: int,
                    concurrency: int, graphs: bool | None = None, regime: str = "continuous") -> int:
    """KV-cache slots per row that :func:`serve` allocates for ``prompts`` by default: what the
    longest request needs (:func:`kv_slots_needed`), + 64 under CUDA graphs in the continuous
    regime (a 64-token prefill chunk beyond a running row keeps the prefill widths on the
    scheduler's bucket: fewer captured shapes), capped at the target's max_position_embeddings."""
    batched = concurrency > 1 and len(prompts) > 1
    need = max(kv_slots_needed(len(p["prompt_ids"]), max_new_tokens, spec.verify_width, batched) for p in prompts)
    extra = 0
    if regime == "continuous":
        from .runner import use_graphs

        extra = 64 if use_graphs(graphs, target.lm_head.weight.device) else 0
    return min(need + extra, int(target.config.max_position_embeddings))


def shift_times(record: Record, offset: float) -> None:
    """Move a record's ``arrival_s``, ``first_token_s`` and ``finish_s`` by ``offset`` seconds
    (requests served one call at a time then read as one sequential closed loop)."""
    for key in ("arrival_s", "first_token_s", "finish_s"):
        if getattr(record, key, None) is not None:
            setattr(record, key, getattr(record, key) + offset)


def serve(spec: EngineSpec, target: Transformer, drafter: DFlashDrafter | None, prompts: list[dict],
          max_new_tokens: int, concurrency: int, meta: dict, eos_id: int | None = None,
          max_seq: int | None = None, warmup: bool = True, progress: bool = True,
          graphs: bool | None = None, kernels: str | None = None, replay=None,
          references: dict[str, list[int]] | None = None, profile: bool = True,
          regime: str = "continuous", prefill_chunk: int | None = None,
          prefill_beside: bool = False) -> list[Record]:
    """Serve ``prompts`` (rows with request_id, benchmark, prompt_ids) at closed-loop concurrency c.

    ``regime = "continuous"`` (default): :class:`~specpilot.engine.scheduler.Scheduler` keeps c
    requests in flight over one runner and drafter built once, refilling a finished request's
    slot from the queue at once (SGLang ``bench_serving --max-concurrency c``). Records carry
    ``arrival_s``, ``first_token_s``, ``finish_s`` (seconds from the cell's start) and
    ``decode_s`` = finish - first token. ``"static"``: the earlier regime, batches of c decoded
    in lock step, a new runner per batch (kept to measure against).

    Args:
        meta: record fields fixed for the run: deployment, target, drafter, gpu.
        graphs, kernels: the CUDA-graph step path (default on for CUDA), see :class:`TargetRunner`.
        replay: acceptance profile of the replay drafter (system benchmarks on random weights;
            records are marked ``synthetic``); ``references``: request_id -> AR output ids (else
            the AR engine runs first).
        profile: synchronize around the draft step to time it (``draft_s``); off = one
            synchronization per verify step only.
        prefill_beside: continuous batching prefills a refill's prompt on a second CUDA stream
            beside the running requests' steps (needs
            :meth:`~specpilot.engine.scheduler.Scheduler.can_prefill_beside`); default off: the
            running requests wait for it.
        prefill_chunk: continuous batching prefills prompts in chunks of this many tokens (fewer
            KV-cache slots, see :class:`~specpilot.engine.scheduler.Scheduler`); None = whole prompts.
        max_seq: KV-cache slots; default = what the longest prompt needs (:func:`kv_slots_needed`;
            + 64 under CUDA graphs in the continuous regime, so prefill widths stay on the
            scheduler's buckets), capped at the target's ``max_position_embeddings``.
    Raises:
        SpecpilotError: empty prompt list, a prompt that does not fit the KV cache (exactly as
            much room as :func:`kv_slots_needed` is required), ``max_seq`` beyond the target's
            ``max_position_embeddings`` (positions it was not trained for), bad concurrency or
            regime, replay references that lack a request.
    """
    if not prompts:
        raise SpecpilotError("the prompt file holds no prompts")
    if concurrency < 1:
        raise SpecpilotError(f"concurrency must be >= 1, got {concurrency}")
    if regime not in ("continuous", "static"):
        raise SpecpilotError(f"unknown serving regime {regime!r}; use continuous or static")
    for p in prompts:
        if not p.get("prompt_ids"):
            raise SpecpilotError(f"request {p.get('request_id')!r} has an empty prompt")
    limit = int(target.config.max_position_embeddings)
    if max_seq is not None and max_seq > limit:
        raise SpecpilotError(f"--max-seq {max_seq} exceeds the target's max_position_embeddings {limit}: "
                             f"it has no positions beyond that")
    if max_seq is not None and max_seq < 1:
        raise SpecpilotError(f"--max-seq must be >= 1, got {max_seq}")
    batched = concurrency > 1 and len(prompts) > 1
    needs = {p["request_id"]: kv_slots_needed(len(p["prompt_ids"]), max_new_tokens, spec.verify_width, batched)
             for p in prompts}
    max_seq = max_seq or default_max_seq(spec, target, prompts, max_new_tokens, concurrency, graphs, regime)
    for p in prompts:
        if needs[p["request_id"]] > max_seq:
            what = (f"the target's max_position_embeddings {limit}" if max_seq == limit
                    else f"the KV cache of {max_seq} slots")
            raise SpecpilotError(
                f"request {p['request_id']}: prompt of {len(p['prompt_ids'])} tokens + {max_new_tokens} new tokens "
                f"(verify width {spec.verify_width}) needs {needs[p['request_id']]} KV cache slots, more than {what}")
    if replay is not None and references is not None:
        missing = [p["request_id"] for p in prompts if p["request_id"] not in references]
        if missing:
            raise SpecpilotError(f"replay reference records lack request(s) {missing[:5]}")
    opts = dict(graphs=graphs, kernels=kernels)
    if regime == "static":
        rows = _serve_static(spec, target, drafter, prompts, max_new_tokens, concurrency, eos_id, max_seq, warmup,
                             progress, replay, references, profile, opts)
    else:
        rows = _serve_continuous(spec, target, drafter, prompts, max_new_tokens, concurrency, eos_id, max_seq,
                                 warmup, progress, replay, references, profile,
                                 dict(opts, chunk=prefill_chunk, beside=prefill_beside))
    records = []
    for p, r in zip(prompts, rows):
        records.append(Record(
            request_id=p["request_id"], benchmark=p["benchmark"], engine=spec.engine,
            concurrency=concurrency, prompt_tokens=len(p["prompt_ids"]), new_tokens=len(r.output_ids),
            prefill_s=r.prefill_s, decode_s=r.decode_s, verify_steps=r.verify_steps,
            committed_per_step=r.committed_per_step, output_ids=r.output_ids,
            engine_config={"block_size": spec.block_size if spec.engine != "ar" else 1, **spec.config},
            draft_s=r.draft_s, verify_s=r.verify_s,
            synthetic=bool(meta.get("synthetic", False)) or replay is not None,
            deployment=meta["deployment"], target=meta["target"],
            drafter=meta["drafter"] if spec.engine != "ar" else "none", gpu=meta["gpu"],
            arrival_s=getattr(r, "arrival_s", None), first_token_s=getattr(r, "first_token_s", None),
            finish_s=getattr(r, "finish_s", None), prefill_stall_s=getattr(r, "prefill_stall_s", 0.0)))
    return records


def _serve_continuous(spec, target, drafter, prompts, max_new_tokens, concurrency, eos_id, max_seq, warmup,
                      progress, replay, references, profile, opts) -> list[RowResult]:
    """All prompts through one :class:`~specpilot.engine.scheduler.Scheduler` of c slots."""
    from .scheduler import Request, Scheduler

    if replay is not None and references is None:  # the AR engine first, through the same regime
        ar = _serve_continuous(EngineSpec("ar"), target, None, prompts, max_new_tokens, concurrency, eos_id,
                               max_seq, warmup, False, None, None, False, opts)
        references = {p["request_id"]: r.output_ids for p, r in zip(prompts, ar)}
    requests = [Request(p["prompt_ids"], max_new_tokens, references[p["request_id"]] if replay is not None else None)
                for p in prompts]
    B = min(concurrency, len(prompts))
    proposer = make_engine_proposer(spec, target, drafter, opts["graphs"], opts["kernels"], replay,
                                    [r.reference for r in requests[:B]] if replay is not None else None)
    capture = proposer.capture if proposer is not None else ()
    runner = TargetRunner(target, B, max_seq, capture, graphs=opts["graphs"], kernels=opts["kernels"])
    bar = tqdm(total=len(requests), desc=f"{spec.engine} c{concurrency}", unit="req", disable=not progress)
    chunk = opts.get("chunk")
    ring = getattr(getattr(target, "state", None), "ring", None)
    if ring is not None and ring.R < ring.window + (chunk or max_seq):
        # a sliding-window target's ring holds only `reserve` slots beyond the window: a refill's
        # prompt goes in chunks no wider, so it never evicts a running row's live entries
        chunk = min(chunk or ring.reserve, ring.reserve)
    sched = Scheduler(runner, proposer, accept=spec.accept, eos_id=eos_id, profile=profile,
                      prefill_chunk=chunk, overlap=spec.overlap, prefill_beside=opts.get("beside"))
    if warmup:  # first forwards pay one-time allocation costs (and graph captures); keep them out of the timings
        sched.run([Request(r.prompt_ids, min(8, r.max_new_tokens), r.reference) for r in requests[:B]])
    sched.on_finish = lambda i: bar.update(1)
    rows = sched.run(requests)
    bar.close()
    return rows


def _serve_static(spec, target, drafter, prompts, max_new_tokens, concurrency, eos_id, max_seq, warmup,
                  progress, replay, references, profile, opts) -> list[RowResult]:
    """Batches of ``concurrency`` prompts decoded in lock step, a new runner per batch."""
    if warmup:
        first = [p["prompt_ids"] for p in prompts[:concurrency]]
        generate_batch(spec, target, drafter, first, min(8, max_new_tokens), max_seq, eos_id, replay=replay, **opts)
    rows = []
    batches = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    for batch in tqdm(batches, desc=f"{spec.engine} c{concurrency} static", unit="batch", disable=not progress):
        refs = [references[p["request_id"]] for p in batch] if replay is not None and references is not None else None
        rows += generate_batch(spec, target, drafter, [p["prompt_ids"] for p in batch], max_new_tokens,
                               max_seq, eos_id, profile=profile, replay=replay, references=refs, **opts)
    return rows


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; errors on an unavailable explicit choice."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecpilotError(f"device {name!r} requested but CUDA is not available")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise SpecpilotError(f"unknown device {name!r}; use auto, cpu or cuda")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> fp32 on CPU, bf16 on CUDA."""
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise SpecpilotError(f"unknown dtype {name!r}; use auto, fp32 or bf16")
    return table[name]


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read a prompt file (JSON lines with request_id, benchmark, prompt_ids)."""
    from ..io import read_jsonl

    rows = read_jsonl(path)
    for i, r in enumerate(rows):
        for key in ("request_id", "benchmark", "prompt_ids"):
            if key not in r:
                raise SpecpilotError(f"{path}:{i + 1} lacks field {key!r}")
    return rows[:limit] if limit else rows


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
    from ..prompts import CHAT_TEMPLATE_KWARGS

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

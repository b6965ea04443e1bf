"""Part 3 of token forcing: the spot re-execution of each record's first verify steps.

The verify steps of the first :attr:`Reexecution.tokens` new tokens of every request are run
again with the record's own engine config, in the cell's batches (record order, the record's
concurrency, the cell's KV-cache size); a request served by ``specpilot serve`` with its own token
budget and EOS token (the record's ``max_new_tokens``, ``eos_id``), so a last step cut by either
is cut alike. Greedy decoding is deterministic, so the re-run's
``committed_per_step`` and output prefix must equal the record's; a record the engine did not
produce (AR's output ids with invented or copied step counts) fails here. It proves the engine did
the recorded work on those steps; it cannot prove the later steps' timings.

Not to be confused with the replay drafter (:mod:`specpilot.drafters.replay`, the synthetic
drafter): its records are skipped here. The verdict keeps its historical field names for this part
(``replay``, ``seconds.replay``, violations of check ``replay``; the CLI's ``--replay-tokens``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..deployment import Deployment
from ..engine.config import EngineConfig, EngineSpec
from ..engine.serve import ServeOptions, serve
from ..errors import SpecpilotError
from ..records import Record

REEXECUTION_TOKENS = 8  # leading new tokens whose verify steps are re-executed per request

ServeFn = Callable[..., list[Record]]


@dataclass
class Reexecution:
    """How to re-execute a candidate's engine for the spot re-execution.

    ``serve(spec, rows, max_new_tokens, concurrency, max_seq, eos_id=None)`` serves prompt rows (dicts with
    request_id, benchmark, prompt_ids) with an :class:`~specpilot.engine.config.EngineSpec` in
    batches of ``concurrency`` in the given order, and returns their records (no warm-up needed).
    ``tokens``: leading new tokens per request whose verify steps are re-run (0: none).
    ``max_new_tokens``: the cell's token budget (it sets the cell's KV-cache size, which the
    re-run reproduces); None = the largest ``new_tokens`` among the references.
    """

    serve: ServeFn
    tokens: int = REEXECUTION_TOKENS
    max_new_tokens: int | None = None
    max_positions: int | None = None  # the target's max_position_embeddings (caps the cache)


def serve_reexecution(deployment_for: Callable[[EngineConfig], Deployment], meta: dict) -> ServeFn:
    """A :attr:`Reexecution.serve` over a loaded deployment.

    Args:
        deployment_for: engine config -> the deployment (target, drafter, backend) in that
            config's weight format.
        meta: the records' deployment fields (deployment, target, drafter, gpu).
    Returns:
        a function serving rows through :func:`specpilot.engine.serve.serve` without warm-up or
        progress bar.
    """

    def run(spec, rows, max_new_tokens, concurrency, max_seq, eos_id=None):
        return serve(spec, deployment_for(spec.config), rows, max_new_tokens, concurrency, meta,
                     ServeOptions(eos_id=eos_id, max_seq=max_seq, warmup=False, progress=False))

    return run


def _turn(request_id: str) -> str:
    tail = request_id.rsplit("/", 1)[-1]
    return tail if tail.startswith("turn") else ""


def _serving_groups(candidate: list[Record]) -> dict[tuple, list[Record]]:
    """The candidate's records grouped as the engine served them: by turn of a multi-turn chain,
    engine, concurrency, engine config, and a served request's own budget and EOS token (records
    of ``specpilot serve``: ``max_new_tokens``, ``eos_id``; None in a workflow cell), each group in
    record order."""
    groups: dict[tuple, list[Record]] = {}
    for r in candidate:
        cfg = r.engine_config or {}
        key = (_turn(r.request_id), r.engine, int(r.concurrency), repr(sorted(cfg.items(), key=lambda kv: kv[0])),
               r.max_new_tokens, r.eos_id)
        groups.setdefault(key, []).append(r)
    return groups


def _rerun_group(reexecution: Reexecution, engine: str, concurrency: int, cfg: dict, rows: list[dict],
                 cell_max_new: int, eos_id: int | None = None) -> tuple[int, list[Record]]:
    """Serve one group's rows again with the cell's KV-cache size (``cell_max_new``: the cell's
    budget, or a served request's own), stopping at ``eos_id`` where the engine did; returns
    (token budget, records). Raises SpecpilotError when the engine config cannot run."""
    config = EngineConfig.parse(cfg, "the records' engine_config", record=True)
    block = config.block_size if isinstance(config.block_size, int) else 1
    spec = EngineSpec(engine, block, config.without("block_size"))
    width = spec.verify_width
    longest = max(len(row["prompt_ids"]) for row in rows)
    max_seq = longest + cell_max_new + width + 1
    if reexecution.max_positions:
        max_seq = min(max_seq, reexecution.max_positions)
    budget = max(1, min(1 + reexecution.tokens, cell_max_new, max_seq - longest - width - 1))
    return budget, reexecution.serve(spec, rows, budget, concurrency, max_seq, eos_id=eos_id)


def _compare_rerun(r: Record, x: Record, budget: int) -> tuple[int, dict | None]:
    """(verify steps compared, violation or None) of record ``r`` against its re-run ``x``: the
    record's leading steps that fit in ``budget - 1`` tokens and the output tokens they commit."""
    if not all(isinstance(c, int) and c >= 1 for c in r.committed_per_step):
        return 0, {"check": "replay", "request_id": r.request_id,
                   "detail": "committed_per_step is not a list of positive integers"}
    claim, total = [], 0
    for c in r.committed_per_step:
        if total + c > budget - 1:
            break
        claim.append(c)
        total += c
    got = x.committed_per_step[: len(claim)]
    m = 1 + total
    same_out = x.output_ids[:m] == r.output_ids[:m]
    if claim == got and same_out:
        return len(claim), None
    diff = next((i for i, (a, b) in enumerate(zip(r.output_ids[:m], x.output_ids[:m])) if a != b), None)
    return len(claim), {"check": "replay", "request_id": r.request_id,
                        "recorded_committed": claim, "rerun_committed": got,
                        "first_output_difference": diff,
                        "detail": f"re-run with the record's engine config, the first {len(claim)} verify "
                                  f"step(s) commit {got}; the record claims {claim}"
                                  + ("" if same_out else f"; output differs at position {diff}")}


def reexecution_check(candidate: list[Record], prompt_of: Callable[[Record], list[int] | None],
                      reexecution: Reexecution, cell_max_new: int) -> tuple[dict, list[dict]]:
    """Re-run the first ``reexecution.tokens`` tokens of every candidate request.

    Requests are grouped as the engine served them (turn-1 requests, then each later turn of a
    multi-turn chain), each group in record order at the record's concurrency, with the KV-cache
    size the cell had (longest prompt of the group + ``cell_max_new`` + verify width + 1, capped
    at the target's positions: the formula of :func:`specpilot.engine.serve.serve`), so the
    re-run repeats the cell's own computation. Its budget is ``1 + reexecution.tokens`` new tokens.
    Compared: the record's leading verify steps that fit in that budget (``sum <= tokens``)
    against the re-run's first steps, and the output tokens they commit. (A window in tokens, not
    steps: a record that copies AR's output claims one token per step, and a few steps would
    cover only a few tokens of it.) Records of the replay drafter (synthetic) are skipped.

    Args:
        candidate: the cell's records; prompt_of: record -> prompt ids (None: left out);
        reexecution: how to serve; cell_max_new: the cell's token budget (new tokens).
    Returns:
        (report, violations): report = {tokens, requests, reproduced, steps_compared, skipped,
        seconds}; one violation (check ``replay``) per request not reproduced (engine config not
        runnable, different step counts or output prefix), with the recorded and re-run step counts.
    """
    report = {"tokens": reexecution.tokens, "requests": 0, "reproduced": 0, "steps_compared": 0,
              "skipped": [], "seconds": 0.0}
    violations: list[dict] = []
    if reexecution.tokens <= 0:
        report["skipped"].append("replay_tokens 0")
        return report, violations
    t0 = time.perf_counter()
    for (_, engine, concurrency, _, own_max_new, eos_id), recs in _serving_groups(candidate).items():
        cfg = dict(recs[0].engine_config or {})
        if cfg.get("replay_profile") or any(r.synthetic for r in recs):
            report["skipped"].append(f"{len(recs)} synthetic request(s) (replay drafter)")
            continue
        recs = [r for r in recs if prompt_of(r)]
        if not recs:
            continue
        rows = [{"request_id": r.request_id, "benchmark": r.benchmark, "prompt_ids": prompt_of(r)} for r in recs]
        report["requests"] += len(recs)
        try:
            budget, rerun = _rerun_group(reexecution, engine, concurrency, cfg, rows, own_max_new or cell_max_new,
                                         eos_id)
        except SpecpilotError as e:
            violations += [{"check": "replay", "request_id": r.request_id,
                            "detail": f"engine config {recs[0].engine_config} could not be re-run: {e}"} for r in recs]
            continue
        for r, x in zip(recs, rerun):
            steps, v = _compare_rerun(r, x, budget)
            report["steps_compared"] += steps
            if v is None:
                report["reproduced"] += 1
            else:
                violations.append(v)
    report["seconds"] = time.perf_counter() - t0
    return report, violations

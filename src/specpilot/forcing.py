"""Token forcing: every output token of a candidate engine checked by the target itself.

The study's guarantee is that every token a speculative engine emits is the target's own greedy
choice. :func:`force` checks one cell (a candidate's records, the reference records, the prompts
and the target) in four parts; the workflow (``specpilot force``, one verdict file per cell) and
the agents' gate (:meth:`specpilot.agent.trial.Evaluator.gate`) both call it, so a candidate is
rejected by exactly the rule the table reports.

1. **Teacher-forced check** (the guarantee). For every candidate request the target runs once
   over prompt + the candidate's own output (one forward; chunked against the KV cache when the
   sequence is longer than ``chunk``). At every output position j, given prompt + output[:j]:
   ``margin = (target's top-1 logit) - (target's logit of the candidate's token)``. The token is
   the target's choice when margin is 0; a **near-tie** when 0 < margin < ``tolerance`` (two
   tokens the target scores almost equally, so a legitimately different kernel or batch shape can
   flip the argmax: counted and reported, with the largest such margin); otherwise a
   **violation** (position, candidate token, target's top-1, margin). Every token is checked
   whatever came before it: a near-tie never hides what follows, and coverage (tokens checked /
   tokens generated) must be 100 % for every request.
   *Which kernels* (:func:`pick_teacher_forced_path`, recorded as the verdict's ``teacher_forced_path``):
   on the CPU, and for engines that did not run the Triton step, the target's eager forward
   (:func:`teacher_forced`, ``"eager"``). When the engine ran the bit-invariant Triton step (a
   dense bf16 target with plain linears on CUDA, chain verification: the CUDA-graph fast path of
   :mod:`specpilot.engine.graphs`), the pass runs through the *same* kernels
   (:func:`teacher_forced_engine`, ``"triton"``): each prompt prefilled as the engine prefills
   every prompt on that path (row by row through the Triton step, whatever the regime,
   concurrency or arrival order), the output fed through ``FastTarget.forward`` in chunks, in
   batches of :func:`engine_prefill_batches`.
   The eager bf16 forward (cuBLAS) and the Triton step round differently, and on random-weight
   bf16 targets their top-1 margins differ by up to 0.125 logits (above the bf16 tolerance), so
   the eager pass would judge the deployment by a computation it never ran.
2. **Structure** of each record's own evidence: ``len(output_ids) == new_tokens``,
   ``sum(committed_per_step) == new_tokens - 1`` (the first token comes from prefill),
   ``verify_steps == len(committed_per_step)``, every committed count in 1..the verify width of
   its ``engine_config`` (block size plus tree side branches), ``prompt_tokens`` equal to the
   prompt's length, token ids inside the vocabulary.
3. **Spot re-execution** ("replay"): the verify steps of the first ``replay_tokens`` new tokens
   of every request are run again with the record's own engine config, in the cell's batches
   (record order, the record's concurrency, the cell's KV-cache size). Greedy decoding is
   deterministic, so the re-run's ``committed_per_step`` and output prefix must equal the
   record's; a record the engine did not produce (AR's output ids with invented or copied step
   counts) fails here. It proves the engine did the recorded work on those steps; it cannot prove
   the later steps' timings.
4. **Reference report** against each reference (AR; stock too for specpilot): the request ids and
   token counts must match exactly in both directions (a missing, extra, short or long request is
   a violation); the exact-match rate and, per request, where the outputs first part (with the
   teacher-forced classification of the candidate's token there) are reported but not judged:
   part 1 judges every token.

``passed`` = no violation of any part and coverage 100 % for every request. The verdict's fields
are listed in README.md ("Token forcing").
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import SpecpilotError
from .io import comma_list, one_out_each, read_json, write_json
from .records import Record, read_records

REPLAY_TOKENS = 8  # leading new tokens whose verify steps are re-executed per request (spot re-execution)
# config forcing.tolerance's default (config/schema.yaml), for the CLI without --tolerance
DEFAULT_TOLERANCE = {"fp32": 0.001, "bf16": 0.1}
CHUNK = 512  # output positions whose logits are reduced at once (fp32) in the teacher-forced check
LISTED = 100  # violations / near-ties listed in a verdict (the counts are always complete)
TF_ROWS = 256  # block rows (batch x width) per Triton step of the engine-kernel teacher-forced pass
TF_BATCH = 16  # rows per batch for prompts the engine prefilled through the Triton step
TF_PATHS = ("auto", "eager", "triton")


# ---------------------------------------------------------------------------------------------
# configuration


def tolerance_for(setting, dtype: str) -> float:
    """Near-tie tolerance for a compute dtype from config ``forcing.tolerance``.

    Args:
        setting: a number (every dtype) or a mapping ``{fp32: x, bf16: y}``.
        dtype: ``fp32`` or ``bf16`` (the deployment's compute dtype; w12 computes in bf16).
    Returns:
        the tolerance, a top-1 logit margin in logit units (>= 0).
    Raises:
        SpecpilotError: the mapping has no entry for ``dtype``, or the value is negative.
    """
    value = setting.get(dtype) if isinstance(setting, dict) else setting
    if value is None:
        raise SpecpilotError(f"forcing.tolerance has no value for dtype {dtype!r} (has {sorted(setting)})")
    if not isinstance(value, (int, float)) or value < 0:
        raise SpecpilotError(f"forcing.tolerance for {dtype} must be a number >= 0, got {value!r}")
    return float(value)


def verify_width(engine: str, engine_config: dict, drafter: str | None = None) -> int:
    """Most tokens one verify step of this engine config can commit (anchor/bonus included).

    AR: 1. A block drafter: ``block_size`` for a chain in DFlash counting (anchor + drafts), and no
    more for a tree either (a tree commits one root-to-leaf path, at most ``block_size`` tokens).
    DSpark counts ``block_size`` = gamma drafts sampled from the anchor (:mod:`specpilot.drafters`),
    so a step commits at most gamma + 1. Raises SpecpilotError when ``block_size`` is missing or
    not a positive integer.
    """
    if engine == "ar":
        return 1
    block = engine_config.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise SpecpilotError(f"engine_config block_size must be a positive integer, got {block!r}")
    return block + 1 if drafter == "dspark" else block


# ---------------------------------------------------------------------------------------------
# 1. teacher-forced check


def teacher_forced(target, prompt_ids: list[int], output_ids: list[int], chunk: int = CHUNK
                   ) -> tuple[list[int], list[float]]:
    """The target's greedy choice and the candidate token's margin at every output position.

    One cache-free causal forward of the target over ``prompt_ids + output_ids[:-1]`` (the last
    output token is predicted, never fed): exact from an empty state for every layer type, so no
    KV entry or recurrent (GDN) state left by an engine run can leak in. The logits of the output
    positions are reduced ``chunk`` rows at a time (fp32). The target's decoding state and RoPE
    tables are put back afterwards, so an engine's captured CUDA graphs stay valid.

    Args:
        target: a loaded target model (:mod:`specpilot.models.target`; any dtype/device).
        prompt_ids, output_ids: token ids, each inside the vocabulary; output_ids non-empty.
    Returns:
        (top1, margin), each of length ``len(output_ids)``: the target's argmax token id and
        ``max logit - logit[output_ids[j]]`` (float, logit units, >= 0; computed in fp32 from the
        model-dtype logits) at output position j.
    Raises:
        SpecpilotError: empty prompt or output.
    """
    import torch

    if not prompt_ids or not output_ids:
        raise SpecpilotError("teacher forcing needs a non-empty prompt and output")
    P, n = len(prompt_ids), len(output_ids)
    seq = list(prompt_ids) + list(output_ids[:-1])
    dev = target.lm_head.weight.device
    tokens = torch.tensor([seq], dtype=torch.long, device=dev)
    cand = torch.tensor(output_ids, dtype=torch.long, device=dev)
    saved = {k: getattr(target, k, None) for k in ("cache", "state", "cos", "sin")}
    top1, margin = [], []
    try:
        with torch.inference_mode():
            logits, _ = target.forward_causal(tokens)
            out = logits[0, P - 1:]  # row j predicts output token j
            for s in range(0, n, chunk):
                lg = out[s:s + chunk].float()
                best = lg.max(-1)
                top1 += best.indices.tolist()
                margin += (best.values - lg.gather(1, cand[s:s + chunk, None])[:, 0]).tolist()
    finally:
        for k, v in saved.items():
            if hasattr(target, k):
                setattr(target, k, v)
    assert len(top1) == n
    return top1, margin


def pick_teacher_forced_path(target, candidate: list[Record], asked: str = "auto") -> str:
    """Which kernels the teacher-forced pass runs: ``"triton"`` (the engine's) or ``"eager"``.

    ``auto`` picks ``"triton"`` exactly when the candidate's engine ran its prefix and verify steps
    through the Triton step (:class:`~specpilot.engine.graphs.FastTarget`) as the engine decides
    it by default (:class:`~specpilot.engine.runner.TargetRunner`, ``graphs``/``kernels`` auto):
    the target on a CUDA device in bf16 with Triton importable, a dense full-attention target with
    plain linears and a power-of-two head_dim (:func:`~specpilot.engine.graphs.fast_path_supported`),
    and records whose ``engine_config`` neither converts the weights (``weight_format`` other than
    bf16) nor verifies token trees wider than the Triton step takes (``TREE_FAST_NODES`` of
    :mod:`specpilot.engine.runner`, bounded from ``block_size``, ``tree_branch``, ``tree_depth``,
    ``second_level`` and ``tree_nodes``: the runner verifies wider trees eagerly). Else
    ``"eager"`` (the CPU path). An engine run with ``--graphs off`` or ``--kernels torch`` is not
    recorded in its records: pass ``asked="eager"`` for it.

    Args:
        target: the loaded target; candidate: the cell's records; asked: ``auto``, ``eager`` or
            ``triton``.
    Returns:
        ``"triton"`` or ``"eager"``.
    Raises:
        SpecpilotError: an unknown ``asked``; ``triton`` asked for a target the Triton step cannot
            run (not dense / not plain linears), or on the CPU without ``TRITON_INTERPRET=1``.
    """
    import os

    from .engine.graphs import fast_path_supported, resolve_kernels, triton_available
    from .engine.runner import TREE_FAST_NODES

    if asked not in TF_PATHS:
        raise SpecpilotError(f"unknown teacher-forced path {asked!r}; use {', '.join(TF_PATHS)}")
    if asked == "eager":
        return "eager"
    w = target.lm_head.weight
    runnable = bool(target.config.is_dense) and fast_path_supported(target)
    if asked == "triton":
        if not runnable or not triton_available():
            raise SpecpilotError("the teacher-forced pass through the Triton step needs Triton and a dense target "
                                 "with plain linear layers and a power-of-two head_dim")
        if w.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SpecpilotError("the Triton teacher-forced pass needs a CUDA target (or TRITON_INTERPRET=1)")
        return "triton"
    if w.device.type != "cuda" or not runnable or resolve_kernels("auto", w.device, w.dtype) != "triton":
        return "eager"
    for r in candidate:
        cfg = r.engine_config or {}
        if (cfg.get("weight_format") or "bf16") != "bf16" or _tree_width_bound(cfg) > TREE_FAST_NODES:
            return "eager"
    return "triton"


def _tree_width_bound(cfg: dict) -> int:
    """The verify width bound of an engine config's trees (0 for chains), as the engine sizes it
    (:func:`~specpilot.engine.serve.verify_width_bound`); a config whose fields are not integers
    counts as too wide (so it gets the eager path)."""
    from .engine.runner import TREE_FAST_NODES
    from .engine.serve import verify_width_bound

    branch, second = cfg.get("tree_branch") or 0, cfg.get("second_level") or 0
    nodes = cfg.get("tree_nodes") or 0
    if not isinstance(nodes, int) or isinstance(nodes, bool):
        return TREE_FAST_NODES + 1
    if nodes > 0:
        return nodes + 1
    if not isinstance(branch, int) or not isinstance(second, int):
        return TREE_FAST_NODES + 1
    if branch <= 0 and second <= 0:
        return 0
    bs, depth = cfg.get("block_size"), cfg.get("tree_depth", 1)
    if not isinstance(bs, int) or not isinstance(depth, int):
        return TREE_FAST_NODES + 1
    return verify_width_bound(bs, cfg)


def engine_prefill_batches(candidate: list[Record], prompt_of: Callable[[Record], list[int] | None]
                           ) -> list[list[Record]]:
    """The batches of the Triton teacher-forced pass: the candidate's records with a prompt, in
    record order, ``TF_BATCH`` at a time.

    On the Triton fast path the engine prefills every prompt the same way whatever the regime,
    the concurrency or the arrival order: row by row through the Triton step
    (:meth:`~specpilot.engine.runner.TargetRunner.prefill` and the continuous-batching refills
    both run :meth:`~specpilot.engine.runner.TargetRunner.prefill_row`), and the step is
    row-invariant, so :func:`teacher_forced_engine` reproduces any request's logits in any batch.

    Args:
        candidate: records; prompt_of: record -> prompt ids (None: the record is left out).
    Returns:
        lists of at most ``TF_BATCH`` records, covering every record with a prompt once.
    """
    recs = [r for r in candidate if prompt_of(r)]
    return [recs[i:i + TF_BATCH] for i in range(0, len(recs), TF_BATCH)]


def _fast_target(target, kernel_configs: dict | None = None):
    """A FastTarget of ``target`` with the matmul configs the engine's step graphs use (the
    process's ``step_graphs(target, "triton", ...)``, e.g. from ``run --kernel-configs``), else the
    defaults; ``kernel_configs`` on top. Its workspaces are its own (the engine's captured graphs
    keep theirs)."""
    from .engine.graphs import FastTarget

    fast = FastTarget(target)
    engine = target.__dict__.get("_step_graphs", {}).get("triton")
    if engine is not None and engine.fast is not None:
        fast.configs = dict(engine.fast.configs)
        fast.attn_rows = engine.fast.attn_rows
    if kernel_configs:
        fast.set_configs(kernel_configs)
    return fast


def teacher_forced_engine(target, prompts: list[list[int]], outputs: list[list[int]], width: int | None = None,
                          kernel_configs: dict | None = None) -> list[tuple[list[int], list[float]]]:
    """The teacher-forced check through the engine's own kernels, for one batch of requests.

    What the Triton fast path of the engine computes, reproduced: each prompt is prefilled as the
    engine prefills every prompt there, into its own cache row through the Triton step
    (:meth:`~specpilot.engine.graphs.FastTarget.forward` of the prompt alone, ``last_only``: the
    call :meth:`~specpilot.engine.runner.TargetRunner.prefill_row` makes, so the prompt's K/V and
    the first token's logits are the engine's, bit for bit). Then output[:-1] is fed in chunks of
    ``width`` positions per row through ``FastTarget.forward`` (the step the engine's decode and
    chain verify replay under CUDA graphs), all rows at once, and every position's logits are
    read. The step is row- and width-invariant by design (a row's bits do not depend on the
    batch, the block width or the cache size; checked on the GPU by ``gpu_bench/bench_verify.py``),
    so these are the logits the engine saw when it emitted each token, and every token of an
    honest engine has margin exactly 0 (unless matmul configs run cuBLAS, which pads rows and is
    not row-invariant beyond 16 rows: margins then fall to the tolerance). This is a valid check
    of the guarantee: it verifies that every output token is the argmax of the target *as the
    deployment computes it* (with these weights and kernels), given the candidate's own prefix,
    whatever the engine did between tokens; a token that is not that argmax has the same margin as
    under any other kernel up to rounding.

    The target's decoding state (``cache``, ``state``, ``cos``, ``sin``, the cache key) is put
    back afterwards and the pass uses a fresh cache and its own FastTarget workspaces, so an
    engine's captured CUDA graphs stay valid.

    Args:
        target: a loaded dense target the Triton step supports (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), any float dtype.
        prompts, outputs: per row the prompt and the candidate's output token ids (non-empty,
            inside the vocabulary).
        width: output positions per row per Triton step (default ``TF_ROWS // len(prompts)``, >= 1).
        kernel_configs: FastTarget matmul configs on top of the engine's (see :func:`_fast_target`).
    Returns:
        per row (top1, margin), each of length ``len(output)``: the target's argmax token id and
        ``max logit - logit[output[j]]`` (float, logit units, >= 0; fp32 from the model-dtype
        logits) at output position j, as :func:`teacher_forced`.
    Raises:
        SpecpilotError: no rows, rows of different counts, an empty prompt or output, a width < 1.
    """
    import torch

    if not prompts or len(prompts) != len(outputs):
        raise SpecpilotError(f"teacher forcing needs as many outputs as prompts (got {len(prompts)} / {len(outputs)})")
    if any(not p for p in prompts) or any(not o for o in outputs):
        raise SpecpilotError("teacher forcing needs a non-empty prompt and output")
    B = len(prompts)
    W = int(width) if width is not None else max(1, TF_ROWS // B)
    if W < 1:
        raise SpecpilotError(f"teacher-forced width must be >= 1, got {width}")
    P = [len(p) for p in prompts]
    seqs = [list(o[:-1]) for o in outputs]  # position P_b + i holds output[i]; its logits predict output[i + 1]
    total = max(len(x) for x in seqs)
    S = max(P) + max(1, total)  # the step's results do not depend on the cache size
    dev = target.lm_head.weight.device
    top1: list[list[int]] = [[] for _ in range(B)]
    margin: list[list[float]] = [[] for _ in range(B)]
    saved = {k: getattr(target, k, None) for k in ("cache", "state", "cos", "sin", "_state_key")}
    try:
        target.state = None  # a fresh cache: the engine's (and its graphs' addresses) stay untouched
        fast = _fast_target(target, kernel_configs)  # fuses q/k/v, gate/up as the engine did before its prefill
        with torch.inference_mode():
            target.setup_cache(B, S)
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            for b, p in enumerate(prompts):  # the engine's prefill_row of the whole prompt at slot 0
                tok = torch.tensor([list(p)], dtype=torch.long).to(dev)
                lg = fast.forward(tok, zero, rows=slice(b, b + 1), last_only=True)[0][0, 0].float()
                top1[b].append(int(lg.argmax()))
                margin[b].append((lg.max() - lg[outputs[b][0]]).item())
            start0 = torch.tensor(P, dtype=torch.long, device=dev)
            for s in range(0, total, W):
                w = min(W, total - s)  # full width but for the last chunk
                block = torch.zeros(B, w, dtype=torch.long)
                cand = torch.zeros(B, w, dtype=torch.long)
                want = []  # (row, block column, output index)
                for b, x in enumerate(seqs):
                    part = x[s:s + w]
                    if part:
                        block[b, :len(part)] = torch.tensor(part, dtype=torch.long)
                    for j in range(len(part)):
                        k = s + j + 1
                        cand[b, j] = outputs[b][k]
                        want.append((b, j, k))
                logits, _ = fast.forward(block.to(dev), start0 + s)
                lg = logits.float()
                best = lg.max(-1)
                mg = best.values - lg.gather(2, cand.to(dev)[:, :, None])[:, :, 0]
                tops, mgs = best.indices.tolist(), mg.tolist()
                for b, j, k in want:
                    assert k == len(top1[b])
                    top1[b].append(tops[b][j])
                    margin[b].append(mgs[b][j])
    finally:
        for k, v in saved.items():
            setattr(target, k, v)
    for b in range(B):
        assert len(top1[b]) == len(outputs[b]), (b, len(top1[b]), len(outputs[b]))
    return list(zip(top1, margin))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------
# 2. structure


def structure_problems(r: Record, prompt_len: int | None, vocab: int) -> list[dict]:
    """Inconsistencies of a record's own evidence (see the module docstring, part 2).

    Returns one ``{"field", "detail"}`` dict per problem (empty when consistent).
    """
    out = []

    def bad(field_, detail):
        out.append({"field": field_, "detail": detail})

    if len(r.output_ids) != r.new_tokens:
        bad("new_tokens", f"new_tokens {r.new_tokens} but {len(r.output_ids)} output ids")
    steps = r.committed_per_step
    if r.verify_steps != len(steps):
        bad("verify_steps", f"verify_steps {r.verify_steps} but {len(steps)} committed_per_step entries")
    if r.new_tokens >= 1 and sum(steps) != r.new_tokens - 1:
        bad("committed_per_step", f"sum(committed_per_step) {sum(steps)} != new_tokens - 1 = {r.new_tokens - 1}")
    if r.new_tokens < 1:
        bad("new_tokens", f"new_tokens {r.new_tokens}: every request generates at least one token")
    try:
        width = verify_width(r.engine, r.engine_config or {}, r.drafter)
        off = [(i, c) for i, c in enumerate(steps) if not (isinstance(c, int) and 1 <= c <= width)]
        if off:
            bad("committed_per_step", f"{len(off)} step(s) commit outside 1..{width} (verify width), "
                                      f"first: step {off[0][0]} commits {off[0][1]}")
    except SpecpilotError as e:
        bad("engine_config", str(e))
    if prompt_len is not None and r.prompt_tokens != prompt_len:
        bad("prompt_tokens", f"prompt_tokens {r.prompt_tokens} but the prompt has {prompt_len} tokens")
    outside = [t for t in r.output_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if outside:
        bad("output_ids", f"{len(outside)} token id(s) outside the vocabulary 0..{vocab - 1}, first {outside[0]!r}")
    return out


# ---------------------------------------------------------------------------------------------
# 3. spot re-execution


ServeFn = Callable[..., list[Record]]


@dataclass
class Replay:
    """How to re-execute a candidate's engine for the spot re-execution (part 3).

    ``serve(spec, rows, max_new_tokens, concurrency, max_seq)`` serves prompt rows (dicts with
    request_id, benchmark, prompt_ids) with an :class:`~specpilot.engine.serve.EngineSpec` in
    batches of ``concurrency`` in the given order, and returns their records (no warm-up needed).
    ``max_new_tokens``: the cell's token budget (it sets the cell's KV-cache size, which the
    re-run reproduces); None = the largest ``new_tokens`` among the references.
    """

    serve: ServeFn
    tokens: int = REPLAY_TOKENS
    max_new_tokens: int | None = None
    max_positions: int | None = None  # the target's max_position_embeddings (caps the cache)


def serve_replay(target_for: Callable[[dict], object], drafter, meta: dict) -> ServeFn:
    """A :attr:`Replay.serve` over a loaded deployment (``target_for(config)``: the target in the
    config's weight format)."""
    from .engine.serve import serve

    def run(spec, rows, max_new_tokens, concurrency, max_seq):
        return serve(spec, target_for(spec.config), drafter, rows, max_new_tokens, concurrency, meta,
                     max_seq=max_seq, warmup=False, progress=False)

    return run


def _turn(request_id: str) -> str:
    tail = request_id.rsplit("/", 1)[-1]
    return tail if tail.startswith("turn") else ""


def replay_check(candidate: list[Record], prompt_of: Callable[[Record], list[int] | None], replay: Replay,
                 cell_max_new: int) -> tuple[dict, list[dict]]:
    """Re-run the first ``replay.tokens`` tokens of every candidate request (part 3).

    Requests are grouped as the engine served them (turn-1 requests, then each later turn of a
    multi-turn chain), each group in record order at the record's concurrency, with the KV-cache
    size the cell had (longest prompt of the group + ``cell_max_new`` + verify width + 1, capped
    at the target's positions: the formula of :func:`specpilot.engine.serve.serve`), so the
    re-run repeats the cell's own computation. Its budget is ``1 + replay.tokens`` new tokens.
    Compared: the record's leading verify steps that fit in that budget (``sum <= replay.tokens``)
    against the re-run's first steps, and the output tokens they commit. (A window in tokens, not
    steps: a record that copies AR's output claims one token per step, and a few steps would
    cover only a few tokens of it.)

    Returns:
        (report, violations): report = {tokens, requests, reproduced, steps_compared, skipped,
        seconds}; one violation per request not reproduced (engine config not runnable, different
        step counts or output prefix), with the recorded and re-run step counts.
    """
    from .engine.serve import EngineSpec

    report = {"tokens": replay.tokens, "requests": 0, "reproduced": 0, "steps_compared": 0,
              "skipped": [], "seconds": 0.0}
    violations: list[dict] = []
    if replay.tokens <= 0:
        report["skipped"].append("replay_tokens 0")
        return report, violations
    t0 = time.perf_counter()
    groups: dict[tuple, list[Record]] = {}
    for r in candidate:
        cfg = r.engine_config or {}
        key = (_turn(r.request_id), r.engine, int(r.concurrency), repr(sorted(cfg.items(), key=lambda kv: kv[0])))
        groups.setdefault(key, []).append(r)
    for (_, engine, concurrency, _), recs in groups.items():
        cfg = dict(recs[0].engine_config or {})
        if cfg.get("replay_profile") or any(r.synthetic for r in recs):
            report["skipped"].append(f"{len(recs)} synthetic request(s) (replay drafter)")
            continue
        recs = [r for r in recs if prompt_of(r)]
        if not recs:
            continue
        rows = [{"request_id": r.request_id, "benchmark": r.benchmark, "prompt_ids": prompt_of(r)} for r in recs]
        report["requests"] += len(recs)
        block = cfg.pop("block_size", 1)
        try:
            spec = EngineSpec(engine, int(block), cfg)
            width = spec.verify_width
            longest = max(len(row["prompt_ids"]) for row in rows)
            max_seq = longest + cell_max_new + width + 1
            if replay.max_positions:
                max_seq = min(max_seq, replay.max_positions)
            budget = max(1, min(1 + replay.tokens, cell_max_new, max_seq - longest - width - 1))
            rerun = replay.serve(spec, rows, budget, concurrency, max_seq)
        except SpecpilotError as e:
            for r in recs:
                violations.append({"check": "replay", "request_id": r.request_id,
                                   "detail": f"engine config {recs[0].engine_config} could not be re-run: {e}"})
            continue
        for r, x in zip(recs, rerun):
            if not all(isinstance(c, int) and c >= 1 for c in r.committed_per_step):
                violations.append({"check": "replay", "request_id": r.request_id,
                                   "detail": "committed_per_step is not a list of positive integers"})
                continue
            claim, total = [], 0
            for c in r.committed_per_step:
                if total + c > budget - 1:
                    break
                claim.append(c)
                total += c
            got = x.committed_per_step[: len(claim)]
            m = 1 + total
            same_out = x.output_ids[:m] == r.output_ids[:m]
            report["steps_compared"] += len(claim)
            if claim == got and same_out:
                report["reproduced"] += 1
                continue
            diff = next((i for i, (a, b) in enumerate(zip(r.output_ids[:m], x.output_ids[:m])) if a != b), None)
            violations.append({"check": "replay", "request_id": r.request_id,
                               "recorded_committed": claim, "rerun_committed": got,
                               "first_output_difference": diff,
                               "detail": f"re-run with the record's engine config, the first {len(claim)} verify "
                                         f"step(s) commit {got}; the record claims {claim}"
                                         + ("" if same_out else f"; output differs at position {diff}")})
    report["seconds"] = time.perf_counter() - t0
    return report, violations


# ---------------------------------------------------------------------------------------------
# 4. reference report


def compare_reference(candidate: list[Record], reference: list[Record], classify: Callable[[str, int], dict]
                      ) -> tuple[dict, list[dict]]:
    """Compare the candidate with one reference (part 4).

    Args:
        classify: (request_id, position) -> the teacher-forced evidence of the candidate's token
            there ({"class": "top1" | "near_tie" | "violation" | "unchecked", "margin", "top1"}).
    Returns:
        (report, violations). Violations: a reference request the candidate lacks
        (``missing_request``), a candidate request the reference lacks (``extra_request``), a
        different number of tokens (``length``). The report holds request counts, the exact-match
        rate (identical outputs / reference requests), tokens equal before the first divergence,
        and per diverging request the first differing position with both tokens and ``classify``.
    """
    ref = {r.request_id: r for r in reference}
    cand = {r.request_id: r for r in candidate}
    violations = []
    missing = [rid for rid in ref if rid not in cand]
    extra = [rid for rid in cand if rid not in ref]
    for rid in missing:
        violations.append({"check": "missing_request", "request_id": rid,
                           "detail": f"the reference has request {rid}, the candidate does not"})
    for rid in extra:
        violations.append({"check": "extra_request", "request_id": rid,
                           "detail": f"the candidate has request {rid}, the reference does not"})
    identical, prefix_tokens, ref_tokens, divergences = 0, 0, 0, []
    for rid, r in ref.items():
        ref_tokens += len(r.output_ids)
        c = cand.get(rid)
        if c is None:
            continue
        if len(c.output_ids) != len(r.output_ids) or c.new_tokens != r.new_tokens:
            violations.append({"check": "length", "request_id": rid, "candidate_tokens": len(c.output_ids),
                               "reference_tokens": len(r.output_ids),
                               "detail": f"{len(c.output_ids)} tokens (new_tokens {c.new_tokens}) against "
                                         f"the reference's {len(r.output_ids)}"})
        i = next((j for j, (a, b) in enumerate(zip(c.output_ids, r.output_ids)) if a != b), None)
        if i is None and len(c.output_ids) == len(r.output_ids):
            identical += 1
            prefix_tokens += len(r.output_ids)
            continue
        if i is None:  # one is a prefix of the other
            prefix_tokens += min(len(c.output_ids), len(r.output_ids))
            continue
        prefix_tokens += i
        divergences.append({"request_id": rid, "position": i, "candidate_token": c.output_ids[i],
                            "reference_token": r.output_ids[i], **classify(rid, i)})
    report = {"requests_reference": len(ref), "requests_candidate": len(cand),
              "missing": missing[:LISTED], "extra": extra[:LISTED],
              "exact_match_rate": identical / len(ref) if ref else None,
              "identical_requests": identical,
              "tokens_before_divergence": prefix_tokens, "reference_tokens": ref_tokens,
              "divergences": divergences[:LISTED], "diverging_requests": len(divergences),
              "violations": len(violations)}
    return report, violations


# ---------------------------------------------------------------------------------------------
# the check


@dataclass
class _RequestCheck:
    generated: int
    checked: int = 0
    top1: list[int] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)
    violations: int = 0
    near_ties: int = 0


def force(candidate: list[Record], references: dict[str, list[Record]], prompts: dict[str, list[int]] | None,
          target, tolerance: float, replay: Replay | None = None, chunk: int = CHUNK,
          candidate_name: str = "candidate", teacher_forced_path: str = "auto",
          kernel_configs: dict | None = None) -> dict:
    """Token forcing of one cell: parts 1-4 of the module docstring.

    Args:
        candidate: the records under test (one engine, one cell).
        references: name -> reference records (e.g. ``{"ar": ..., "stock": ...}``); may be empty.
        prompts: request_id -> prompt token ids; a record carrying ``prompt_ids`` (a later turn of
            a multi-turn chain) uses its own.
        target: the loaded target (the reference weights, e.g. bf16 for a w12 candidate).
        tolerance: near-tie tolerance, a top-1 logit margin (logit units) for the target's dtype.
        replay: how to re-execute the engine (part 3); None skips it (reported as not run).
        chunk: tokens per teacher-forced forward (eager path).
        teacher_forced_path: ``auto`` (the engine's kernels where it ran the Triton step, see
            :func:`pick_teacher_forced_path`), ``eager`` or ``triton``; the verdict's
            ``teacher_forced_path`` says which ran.
        kernel_configs: the Triton path's FastTarget matmul configs, when the engine ran with
            others than the target's step graphs hold (``run --kernel-configs``).
    Returns:
        the verdict dict (fields in README.md, "Token forcing"); ``passed`` is True only with no
        violation and 100 % coverage of every request.
    Raises:
        SpecpilotError: no target, an empty candidate, a request id twice, a negative tolerance,
            an unknown or unrunnable ``teacher_forced_path``.
    """
    if target is None:
        raise SpecpilotError("token forcing needs the target (--target): every token is checked by it")
    if not candidate:
        raise SpecpilotError("the candidate has no records")
    if tolerance < 0:
        raise SpecpilotError(f"tolerance must be >= 0, got {tolerance}")
    seen = set()
    for r in candidate:
        if r.request_id in seen:
            raise SpecpilotError(f"candidate request {r.request_id} appears twice")
        seen.add(r.request_id)
    prompts = prompts or {}
    vocab = int(target.config.vocab_size)

    def prompt_of(r: Record) -> list[int] | None:
        return r.prompt_ids if r.prompt_ids is not None else prompts.get(r.request_id)

    violations: list[dict] = []
    near_ties: list[dict] = []
    checks: dict[str, _RequestCheck] = {}
    t0 = time.perf_counter()
    path = pick_teacher_forced_path(target, candidate, teacher_forced_path)
    engine_tf: dict[str, tuple[list[int], list[float]]] = {}
    if path == "triton":  # every checkable request through the engine's kernels, in its prefill batches
        def checkable(r: Record):
            p = prompt_of(r)
            ok = p and r.output_ids and all(isinstance(t, int) and 0 <= t < vocab for t in r.output_ids)
            return p if ok else None

        for recs in engine_prefill_batches(candidate, checkable):
            res = teacher_forced_engine(target, [prompt_of(r) for r in recs], [r.output_ids for r in recs],
                                        kernel_configs=kernel_configs)
            engine_tf.update({r.request_id: x for r, x in zip(recs, res)})
    for r in candidate:
        rc = checks[r.request_id] = _RequestCheck(generated=len(r.output_ids))
        prompt = prompt_of(r)
        problems = structure_problems(r, len(prompt) if prompt else None, vocab)
        for p in problems:
            violations.append({"check": "structure", "request_id": r.request_id, **p})
        if not prompt:
            violations.append({"check": "no_prompt", "request_id": r.request_id,
                               "detail": "no prompt for this request (not in the prompt file, no prompt_ids)"})
            continue
        if not r.output_ids or any(p["field"] == "output_ids" for p in problems):
            continue  # nothing checkable: coverage stays below 100 %
        if path == "triton":
            rc.top1, rc.margin = engine_tf[r.request_id]
        else:
            rc.top1, rc.margin = teacher_forced(target, prompt, r.output_ids, chunk)
        rc.checked = len(r.output_ids)
        for j, (tok, top, mg) in enumerate(zip(r.output_ids, rc.top1, rc.margin)):
            if tok == top or mg == 0.0:
                if tok != top:  # an exact tie: both are the target's argmax
                    rc.near_ties += 1
                    near_ties.append({"request_id": r.request_id, "position": j, "candidate_token": tok,
                                      "top1": top, "margin": 0.0})
                continue
            if mg < tolerance:
                rc.near_ties += 1
                near_ties.append({"request_id": r.request_id, "position": j, "candidate_token": tok,
                                  "top1": top, "margin": mg})
            else:
                rc.violations += 1
                violations.append({"check": "token", "request_id": r.request_id, "position": j,
                                   "candidate_token": tok, "top1": top, "margin": _finite(mg),
                                   "detail": f"position {j}: token {tok} where the target's top-1 is {top} "
                                             f"by a margin of {mg:.4g} (tolerance {tolerance:g})"})
    tf_seconds = time.perf_counter() - t0

    def classify(rid: str, pos: int) -> dict:
        rc = checks.get(rid)
        if rc is None or pos >= len(rc.margin):
            return {"class": "unchecked"}
        mg, top = rc.margin[pos], rc.top1[pos]
        cls = "top1" if mg == 0.0 else ("near_tie" if mg < tolerance else "violation")
        return {"class": cls, "margin": _finite(mg), "top1": top}

    ref_reports = {}
    for name, recs in references.items():
        rep, v = compare_reference(candidate, recs, classify)
        ref_reports[name] = rep
        violations += [{**x, "reference": name} for x in v]

    if replay is not None:
        refs_new = [r.new_tokens for recs in references.values() for r in recs]
        cell_max_new = replay.max_new_tokens or max(refs_new or [r.new_tokens for r in candidate])
        if replay.max_positions is None:
            replay.max_positions = getattr(target.config, "max_position_embeddings", None)
        replay_report, v = replay_check(candidate, prompt_of, replay, cell_max_new)
        violations += v
    else:
        replay_report = {"tokens": 0, "requests": 0, "reproduced": 0, "steps_compared": 0,
                         "skipped": ["not run"], "seconds": 0.0}

    per_request = [{"request_id": rid, "tokens_generated": rc.generated, "tokens_checked": rc.checked,
                    "coverage": rc.checked / rc.generated if rc.generated else 0.0,
                    "violations": rc.violations, "near_ties": rc.near_ties} for rid, rc in checks.items()]
    generated = sum(rc.generated for rc in checks.values())
    checked = sum(rc.checked for rc in checks.values())
    coverage = min(p["coverage"] for p in per_request)
    by_check: dict[str, int] = {}
    for v in violations:
        by_check[v["check"]] = by_check.get(v["check"], 0) + 1
    dtype = str(target.lm_head.weight.dtype).replace("torch.", "")
    near_sorted = sorted(near_ties, key=lambda x: -x["margin"])
    return {
        "candidate": candidate_name,
        "engine": candidate[0].engine,
        "passed": not violations and coverage == 1.0,
        "requests": len(candidate),
        "tokens_generated": generated,
        "tokens_checked": checked,
        "coverage": coverage,
        "tolerance": tolerance,
        "dtype": dtype,
        "teacher_forced_path": path,
        "violations": len(violations),
        "violations_by_check": by_check,
        "violation_list": violations[:LISTED],
        "near_ties": len(near_ties),
        "max_near_tie_margin": near_sorted[0]["margin"] if near_sorted else None,
        "near_tie_list": near_sorted[:LISTED],
        "per_request": per_request,
        "replay": replay_report,
        "references": ref_reports,
        "seconds": {"teacher_forced": tf_seconds, "replay": replay_report["seconds"]},
    }


def check(candidate: list[Record], reference: list[Record], prompts: dict[str, list[int]] | None = None,
          target=None, tolerance: float = 1e-3) -> dict:
    """:func:`force` against one reference (named ``reference``), without the spot re-execution."""
    return force(candidate, {"reference": reference}, prompts, target, tolerance)


def verdict_word(doc: dict | None, records: list[Record] | None = None) -> tuple[str, str]:
    """The table's word for a verdict file: (``pass`` | ``FAIL`` | ``not run``, why).

    ``pass`` needs ``passed`` true, zero violations, coverage 1.0 with tokens checked equal to
    tokens generated, and (given the cell's ``records`` of that engine) a verdict over exactly
    those records: the same request count and total new tokens. A verdict without coverage
    fields (from an older checker that stopped at the first mismatch) is a FAIL.
    """
    if doc is None:
        return "not run", "no verdict"
    if "coverage" not in doc or "tokens_generated" not in doc:
        return "FAIL", "verdict has no coverage (older checker); rerun token forcing"
    if not doc.get("passed") or doc.get("violations", 1) != 0:
        return "FAIL", f"{doc.get('violations', '?')} violations"
    if doc["coverage"] != 1.0 or doc.get("tokens_checked") != doc["tokens_generated"]:
        return "FAIL", f"coverage {doc['coverage']:.1%}"
    if records is not None and (doc.get("requests") != len(records)
                                or doc["tokens_generated"] != sum(r.new_tokens for r in records)):
        return "FAIL", (f"the verdict covers {doc.get('requests')} requests / {doc['tokens_generated']} tokens, "
                        f"the cell has {len(records)} / {sum(r.new_tokens for r in records)}")
    return "pass", ""


# ---------------------------------------------------------------------------------------------
# command line


def _check_engine_config(verdict: dict, candidate: list[Record], path: str) -> None:
    """Add an ``engine_config`` violation for every record whose config lacks a key/value of the
    file's (``{"engine_config": {...}}`` or the config itself), i.e. that ran something else.
    ``weight_format`` is left out: ``specpilot run --weight-format`` sets it from the deployment."""
    from .io import read_json

    doc = read_json(path)
    want = doc.get("engine_config", doc) if isinstance(doc, dict) else None
    if not isinstance(want, dict):
        raise SpecpilotError(f"{path} must hold a JSON object (the engine config)")
    for r in candidate:
        got = r.engine_config or {}
        diff = {k: v for k, v in want.items() if k != "weight_format" and got.get(k) != v}
        if diff:
            v = {"check": "engine_config", "request_id": r.request_id, "expected": diff,
                 "recorded": {k: got.get(k) for k in diff},
                 "detail": f"engine_config differs from {path}: expected {diff}, recorded {({k: got.get(k) for k in diff})}"}
            if len(verdict["violation_list"]) < LISTED:
                verdict["violation_list"].append(v)
            verdict["violations"] += 1
            verdict["violations_by_check"]["engine_config"] = verdict["violations_by_check"].get("engine_config", 0) + 1
    verdict["passed"] = verdict["passed"] and verdict["violations"] == 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--candidate", required=True, type=comma_list,
                   help="records file of the engine under test; several comma-separated (one --out each) are "
                        "checked in one job, each against the --reference files and the candidates before it "
                        "(stock,specpilot: stock against ar, specpilot against ar and stock)")
    p.add_argument("--reference", action="append", default=[],
                   help="reference records (repeatable): request ids and token counts must match")
    p.add_argument("--target", required=True, help="target checkpoint dir: checks every token")
    p.add_argument("--prompts", required=True, help="the cell's prompt file")
    p.add_argument("--drafter", help="drafter checkpoint dir (to re-execute a drafter engine's first steps)")
    p.add_argument("--engine-config", help="JSON file of the engine config the cell was run with (specpilot: "
                   "results/{gpu}/{deployment}/specpilot.json): every record's engine_config must hold it; with "
                   "several candidates it applies to the specpilot one")
    p.add_argument("--max-new-tokens", type=int,
                   help="the cell's token budget (default: the largest new_tokens of the references)")
    p.add_argument("--replay-tokens", type=int, default=REPLAY_TOKENS,
                   help="leading new tokens per request whose verify steps are re-executed (0: none)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="near-tie tolerance: top-1 logit margin (config forcing.tolerance for the dtype; "
                        "default the config default for the compute dtype: fp32 0.001, bf16 0.1)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="output positions whose logits are reduced at once in the teacher-forced check")
    p.add_argument("--teacher-forced-path", choices=TF_PATHS, default="auto",
                   help="kernels of the teacher-forced pass: auto (the engine's Triton step where the candidate's "
                        "engine ran it: a dense bf16 CUDA target, chain verify; else the eager forward), eager, triton "
                        "(an engine run with --graphs off or --kernels torch needs eager: its records do not say so)")
    p.add_argument("--kernel-configs", help="JSON file {role: config key}: the matmul configs the engine ran with "
                   "('specpilot run --kernel-configs'), for the Triton teacher-forced pass")
    p.add_argument("--kernel-agent", help="the kernel sub-agent's kernel-agent.json the engine cell ran with: its "
                   "engine matmul tables (engine_configs) for the Triton teacher-forced pass and the re-execution "
                   "(--kernel-configs on top, as in 'specpilot run')")
    p.add_argument("--out", required=True, type=comma_list,
                   help="verdict JSON to write; comma-separated, one per --candidate")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--report-only", action="store_true", help="exit 0 even when violations are found")


def forcing_kernel_configs(agent_path: str | None, configs_path: str | None) -> dict | None:
    """The matmul configs of the Triton teacher-forced pass: those the engine cell installed
    (``specpilot run``): the kernel sub-agent's ``engine_configs`` of ``agent_path`` merged with
    DEFAULT_CONFIGS, then the ``--kernel-configs`` file ``configs_path`` on top
    (:func:`specpilot.kernels_build.engine_tables`). None when neither names a config.

    Raises:
        SpecpilotError: a missing or corrupt file, malformed engine_configs (named).
    """
    from .io import read_json
    from .kernels_build import agent_engine_configs, engine_tables

    tables = engine_tables(agent_engine_configs(agent_path), dict(read_json(configs_path)) if configs_path else None)
    return tables or None


def run(args) -> int:
    import torch

    from .engine.serve import pick_device, pick_dtype, read_prompts
    from .models.loading import load_drafter, load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk < 1:
        raise SpecpilotError(f"--chunk must be >= 1, got {args.chunk}")
    candidates = [(str(c), read_records(c), out) for c, out in one_out_each(args.out, args.candidate, "candidate(s)")]
    references = {str(p): read_records(p) for p in args.reference}
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    prompts = {p["request_id"]: p["prompt_ids"] for p in read_prompts(args.prompts)}
    drafter = None
    if args.replay_tokens > 0:
        needs_drafter = any(r.engine in ("stock", "specpilot") for _, recs, _ in candidates for r in recs)
        if needs_drafter and not args.drafter:
            raise SpecpilotError("re-executing a drafter engine's first steps needs --drafter "
                                 "(or --replay-tokens 0 to skip the spot re-execution)")
        drafter = load_drafter(args.drafter, dtype=dtype, device=device) if args.drafter else None
    tol = args.tolerance if args.tolerance is not None else \
        tolerance_for(DEFAULT_TOLERANCE, "bf16" if dtype == torch.bfloat16 else "fp32")
    kernel_configs = forcing_kernel_configs(args.kernel_agent, args.kernel_configs)
    w12_choice = {}
    if args.kernel_agent:
        from .kernels_build import agent_w12_choice

        w12_choice = agent_w12_choice(read_json(args.kernel_agent), args.kernel_agent)
    loaded: dict = {}

    def reference_target():
        """The target in its stored weights; reloaded after a w12 re-execution converted it."""
        if loaded.get("w12") or "target" not in loaded:
            loaded["target"], loaded["w12"] = load_target(args.target, dtype, device), False
            if kernel_configs is not None and device.type == "cuda":  # as 'specpilot run' installs them
                from .kernels_build import install_engine_configs

                install_engine_configs(loaded["target"], kernel_configs, strict=bool(args.kernel_configs))
        return loaded["target"]

    def target_for(config: dict):
        """The target for the spot re-execution in ``config``'s weight format."""
        if config.get("weight_format") != "w12":
            return loaded["target"]
        if not loaded["w12"]:  # after the teacher-forced pass, which uses the reference weights
            from .w12 import apply_w12

            if dtype != torch.bfloat16:
                raise SpecpilotError("weight_format w12 needs bf16 weights (--dtype bf16)")
            apply_w12(loaded["target"])
            loaded["w12"] = True
            if w12_choice and config.get("w12_fast") and device.type == "cuda":  # as the engine cell ran them
                from .kernels_build import install_w12

                install_w12(loaded["target"], {"w12_choice": w12_choice}, config)
                if kernel_configs is not None:
                    from .kernels_build import install_engine_configs

                    install_engine_configs(loaded["target"], kernel_configs)
        return loaded["target"]

    failed = False
    for name, candidate, out in candidates:
        target = reference_target()
        replay = None
        if args.replay_tokens > 0:
            r0 = candidate[0] if candidate else None
            meta = {"deployment": r0.deployment, "target": r0.target, "drafter": r0.drafter, "gpu": r0.gpu} if r0 else {}
            replay = Replay(serve_replay(target_for, drafter, meta), args.replay_tokens, args.max_new_tokens)
        verdict = force(candidate, references, prompts, target, tol, replay, args.chunk,
                        candidate_name=name, teacher_forced_path=args.teacher_forced_path,
                        kernel_configs=kernel_configs)
        engine_config = args.engine_config if len(candidates) == 1 or (
            candidate and candidate[0].engine == "specpilot") else None
        if engine_config:
            _check_engine_config(verdict, candidate, engine_config)
        write_json(out, verdict)
        mx = verdict["max_near_tie_margin"]
        print(f"token forcing {Path(name).name}: {'pass' if verdict['passed'] else 'FAIL'} "
              f"({verdict['tokens_checked']}/{verdict['tokens_generated']} tokens checked, "
              f"{verdict['violations']} violations {verdict['violations_by_check'] or ''}, "
              f"{verdict['near_ties']} near-ties (largest margin {mx if mx is not None else '-'}, "
              f"tolerance {verdict['tolerance']:g}), replay {verdict['replay']['reproduced']}/"
              f"{verdict['replay']['requests']} reproduced; teacher-forced path {verdict['teacher_forced_path']}; "
              f"{verdict['seconds']['teacher_forced']:.2f} s + {verdict['seconds']['replay']:.2f} s)")
        for v in verdict["violation_list"][:5]:
            print(f"  {v['check']} {v['request_id']}: {v.get('detail', '')}")
        failed |= not verdict["passed"]
        references[name] = candidate  # a later candidate is checked against this one too
    return 0 if not failed or args.report_only else 1

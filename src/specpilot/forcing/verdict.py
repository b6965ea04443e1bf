"""Token forcing of one cell: parts 1-4 (:mod:`specpilot.forcing`) combined into one verdict.

:func:`force` runs the teacher-forced pass (:mod:`.teacher`), the structure checks
(:mod:`.structure`), the reference comparison (:mod:`.reference`) and the spot re-execution
(:mod:`.reexecute`) and returns the verdict dict that ``specpilot force`` writes;
:func:`check_engine_config` adds the check of a cell's engine config file; :func:`verdict_word` is
the study table's word for a verdict file.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.backend import Backend, choose_backend
from ..errors import SpecpilotError
from ..io import read_json
from ..records import Record
from .reexecute import Reexecution, reexecution_check
from .reference import LISTED, compare_reference
from .structure import structure_problems
from .teacher import (CHUNK, engine_prefill_batches, engine_verify_width, pick_teacher_forced_path, teacher_forced,
                      teacher_forced_engine)

PromptOf = Callable[[Record], "list[int] | None"]
Margins = Callable[[Record, "list[int]"], "tuple[list[int], list[float]]"]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass
class _RequestCheck:
    generated: int
    checked: int = 0
    top1: list[int] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)
    violations: int = 0
    near_ties: int = 0


def _check_force_inputs(candidate: list[Record], target, tolerance: float) -> None:
    """The errors :func:`force` raises before any work (see its Raises)."""
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


def _engine_pass(backend: Backend, candidate: list[Record], prompt_of: PromptOf, vocab: int, kernel_configs: dict | None
                 ) -> dict[str, tuple[list[int], list[float]]]:
    """request_id -> (top1, margin) of every checkable request through the engine's kernels, in
    its prefill batches (a request is checkable with a prompt and in-vocabulary output ids)."""
    def checkable(r: Record):
        p = prompt_of(r)
        ok = p and r.output_ids and all(isinstance(t, int) and 0 <= t < vocab for t in r.output_ids)
        return p if ok else None

    out: dict[str, tuple[list[int], list[float]]] = {}
    width = engine_verify_width(candidate)  # the engine's rings were sized for it
    for recs in engine_prefill_batches(candidate, checkable):
        res = teacher_forced_engine(backend, [prompt_of(r) for r in recs], [r.output_ids for r in recs],
                                    kernel_configs=kernel_configs, verify_width=width)
        out.update({r.request_id: x for r, x in zip(recs, res)})
    return out


def _judge_tokens(r: Record, rc: _RequestCheck, tolerance: float, violations: list[dict],
                  near_ties: list[dict]) -> None:
    """Classify every output token of ``r`` by its margin: the target's choice (margin 0 or the
    top-1 itself), a near-tie (margin below ``tolerance``; an exact tie of another token counts
    here with margin 0) or a violation; counts go to ``rc``, entries to the two lists."""
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


def _check_request(r: Record, prompt: list[int] | None, vocab: int, tolerance: float, margins: Margins,
                   violations: list[dict], near_ties: list[dict]) -> _RequestCheck:
    """Parts 1 and 2 for one record: its structure, then every token (when it has a prompt and
    in-vocabulary output ids; else it stays unchecked and its coverage below 100 %)."""
    rc = _RequestCheck(generated=len(r.output_ids))
    problems = structure_problems(r, len(prompt) if prompt else None, vocab)
    violations += [{"check": "structure", "request_id": r.request_id, **p} for p in problems]
    if not prompt:
        violations.append({"check": "no_prompt", "request_id": r.request_id,
                           "detail": "no prompt for this request (not in the prompt file, no prompt_ids)"})
        return rc
    if not r.output_ids or any(p["field"] == "output_ids" for p in problems):
        return rc  # nothing checkable: coverage stays below 100 %
    rc.top1, rc.margin = margins(r, prompt)
    rc.checked = len(r.output_ids)
    _judge_tokens(r, rc, tolerance, violations, near_ties)
    return rc


def _classifier(checks: dict[str, _RequestCheck], tolerance: float) -> Callable[[str, int], dict]:
    """(request_id, position) -> the teacher-forced class of the candidate's token there."""
    def classify(rid: str, pos: int) -> dict:
        rc = checks.get(rid)
        if rc is None or pos >= len(rc.margin):
            return {"class": "unchecked"}
        mg, top = rc.margin[pos], rc.top1[pos]
        cls = "top1" if mg == 0.0 else ("near_tie" if mg < tolerance else "violation")
        return {"class": cls, "margin": _finite(mg), "top1": top}

    return classify


def _reexecute(candidate: list[Record], references: dict[str, list[Record]], target, prompt_of: PromptOf,
               reexecution: Reexecution | None) -> tuple[dict, list[dict]]:
    """Part 3 with the cell's token budget (the given one, else the references' or the
    candidate's largest ``new_tokens``); a report saying ``not run`` without ``reexecution``."""
    if reexecution is None:
        return {"tokens": 0, "requests": 0, "reproduced": 0, "steps_compared": 0,
                "skipped": ["not run"], "seconds": 0.0}, []
    refs_new = [r.new_tokens for recs in references.values() for r in recs]
    cell_max_new = reexecution.max_new_tokens or max(refs_new or [r.new_tokens for r in candidate])
    if reexecution.max_positions is None:
        reexecution.max_positions = getattr(target.config, "max_position_embeddings", None)
    return reexecution_check(candidate, prompt_of, reexecution, cell_max_new)


def _verdict(candidate_name: str, candidate: list[Record], checks: dict[str, _RequestCheck], violations: list[dict],
             near_ties: list[dict], tolerance: float, dtype: str, path: str, reexecution: dict,
             ref_reports: dict, tf_seconds: float) -> dict:
    """The verdict dict of :func:`force` (fields in docs/forcing.md)."""
    per_request = [{"request_id": rid, "tokens_generated": rc.generated, "tokens_checked": rc.checked,
                    "coverage": rc.checked / rc.generated if rc.generated else 0.0,
                    "violations": rc.violations, "near_ties": rc.near_ties} for rid, rc in checks.items()]
    coverage = min(p["coverage"] for p in per_request)
    by_check: dict[str, int] = {}
    for v in violations:
        by_check[v["check"]] = by_check.get(v["check"], 0) + 1
    near_sorted = sorted(near_ties, key=lambda x: -x["margin"])
    return {
        "candidate": candidate_name,
        "engine": candidate[0].engine,
        "passed": not violations and coverage == 1.0,
        "requests": len(candidate),
        "tokens_generated": sum(rc.generated for rc in checks.values()),
        "tokens_checked": sum(rc.checked for rc in checks.values()),
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
        "replay": reexecution,
        "references": ref_reports,
        "seconds": {"teacher_forced": tf_seconds, "replay": reexecution["seconds"]},
    }


def force(candidate: list[Record], references: dict[str, list[Record]], prompts: dict[str, list[int]] | None,
          target: Backend | object, tolerance: float, reexecution: Reexecution | None = None, chunk: int = CHUNK,
          candidate_name: str = "candidate", teacher_forced_path: str = "auto",
          kernel_configs: dict | None = None) -> dict:
    """Token forcing of one cell: parts 1-4 of :mod:`specpilot.forcing`.

    Args:
        candidate: the records under test (one engine, one cell).
        references: name -> reference records (e.g. ``{"ar": ..., "stock": ...}``); may be empty.
        prompts: request_id -> prompt token ids; a record carrying ``prompt_ids`` (a later turn of
            a multi-turn chain) uses its own.
        target: the loaded target (the reference weights, e.g. bf16 for a w12 candidate), or its
            :class:`~specpilot.engine.backend.Backend` (the kernel path and tables the engine ran;
            a bare target gets the default backend of its device).
        tolerance: near-tie tolerance, a top-1 logit margin (logit units) for the target's dtype.
        reexecution: how to re-execute the engine (part 3); None skips it (reported as not run).
        chunk: tokens per teacher-forced forward (eager path).
        teacher_forced_path: ``auto`` (the engine's kernels where it ran the Triton step, see
            :func:`~specpilot.forcing.teacher.pick_teacher_forced_path`), ``eager`` or ``triton``;
            the verdict's ``teacher_forced_path`` says which ran.
        kernel_configs: the Triton path's FastTarget matmul configs, when the engine ran with
            others than the target's step graphs hold (``run --kernel-configs``).
    Returns:
        the verdict dict (fields in docs/forcing.md); ``passed`` is True only with no
        violation and 100 % coverage of every request.
    Raises:
        SpecpilotError: no target, an empty candidate, a request id twice, a negative tolerance,
            an unknown or unrunnable ``teacher_forced_path``.
    """
    _check_force_inputs(candidate, target, tolerance)
    backend = target if isinstance(target, Backend) else choose_backend(target)
    target = backend.model
    prompts = prompts or {}
    vocab = int(target.config.vocab_size)

    def prompt_of(r: Record) -> list[int] | None:
        return r.prompt_ids if r.prompt_ids is not None else prompts.get(r.request_id)

    violations: list[dict] = []
    near_ties: list[dict] = []
    t0 = time.perf_counter()
    path = pick_teacher_forced_path(backend, candidate, teacher_forced_path)
    engine_tf = _engine_pass(backend, candidate, prompt_of, vocab, kernel_configs) if path == "triton" else {}

    def margins(r: Record, prompt: list[int]) -> tuple[list[int], list[float]]:
        return engine_tf[r.request_id] if path == "triton" else teacher_forced(target, prompt, r.output_ids, chunk)

    checks = {r.request_id: _check_request(r, prompt_of(r), vocab, tolerance, margins, violations, near_ties)
              for r in candidate}
    tf_seconds = time.perf_counter() - t0
    classify = _classifier(checks, tolerance)
    ref_reports = {}
    for name, recs in references.items():
        rep, v = compare_reference(candidate, recs, classify)
        ref_reports[name] = rep
        violations += [{**x, "reference": name} for x in v]
    reexec_report, v = _reexecute(candidate, references, target, prompt_of, reexecution)
    violations += v
    dtype = str(target.lm_head.weight.dtype).replace("torch.", "")
    return _verdict(candidate_name, candidate, checks, violations, near_ties, tolerance, dtype, path,
                    reexec_report, ref_reports, tf_seconds)


def check(candidate: list[Record], reference: list[Record], prompts: dict[str, list[int]] | None = None,
          target=None, tolerance: float = 1e-3) -> dict:
    """:func:`force` against one reference (named ``reference``), without the spot re-execution.

    Same arguments, result and errors as :func:`force`; ``target`` is required despite its default.
    """
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


def check_engine_config(verdict: dict, candidate: list[Record], path: str) -> None:
    """Add an ``engine_config`` violation to ``verdict`` (in place) for every record whose config
    lacks a key/value of the file's, i.e. that ran something else.

    Args:
        verdict: a :func:`force` verdict; candidate: its records; path: a JSON file holding
            ``{"engine_config": {...}}`` or the config itself. ``weight_format`` is left out:
            ``specpilot run --weight-format`` sets it from the deployment.
    Raises:
        SpecpilotError: a missing or corrupt file, or one that holds no JSON object.
    """
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

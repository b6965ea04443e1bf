"""Token forcing: every output token of a candidate engine checked against reference engines.

For each request the candidate's ``output_ids`` must equal the reference's. At the first
mismatch the target is run teacher-forced on prompt + the reference prefix, and the top-2 logit
margin there decides: below ``tolerance`` it is a numerical near-tie (two tokens the target scores
almost equally, so a different but legitimate kernel order can flip it; counted and reported);
otherwise it is a violation: the candidate changed an output the target clearly decided.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .errors import SpecpilotError
from .io import write_json
from .records import Record, read_records


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the length difference); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_margin(target, prompt_ids: list[int], prefix: list[int]) -> tuple[float, int, int]:
    """Teacher-forced target logits after prompt + prefix: (top1 - top2 margin, top1, top2)."""
    seq = list(prompt_ids) + list(prefix)
    dev = target.lm_head.weight.device
    # cache-free causal forward: exact from an empty state for every layer type (a recurrent
    # state left by an earlier request must not leak in)
    logits, _ = target.forward_causal(torch.tensor([seq], device=dev))
    top = logits[0, -1].float().topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def check(candidate: list[Record], reference: list[Record], prompts: dict[str, list[int]] | None = None,
          target=None, tolerance: float = 1e-3) -> dict:
    """Compare every token of ``candidate`` against ``reference`` (matched by request_id).

    Args:
        prompts: request_id -> prompt token ids (needed with ``target`` to classify mismatches).
        target: a loaded :class:`Transformer`; without it every mismatch counts as a violation.
        tolerance: top-2 logit margin below which a mismatch is a near-tie.
    Returns:
        dict with tokens_checked, requests, violations, near_ties, mismatches (list), passed.
    Raises:
        SpecpilotError: the candidate has requests that the reference lacks.
    """
    ref = {r.request_id: r for r in reference}
    missing = [r.request_id for r in candidate if r.request_id not in ref]
    if missing:
        raise SpecpilotError(f"reference lacks request(s) {missing[:5]}")
    mismatches, checked, violations, ties = [], 0, 0, 0
    for c in candidate:
        r = ref[c.request_id]
        i = first_mismatch(c.output_ids, r.output_ids)
        checked += min(len(c.output_ids), len(r.output_ids)) if i is None else i + 1
        if i is None:
            continue
        entry = {"request_id": c.request_id, "position": i,
                 "candidate_token": c.output_ids[i] if i < len(c.output_ids) else None,
                 "reference_token": r.output_ids[i] if i < len(r.output_ids) else None}
        kind = "violation"
        if target is not None and (prompts is not None or r.prompt_ids is not None) \
                and entry["candidate_token"] is not None \
                and entry["reference_token"] is not None:
            prompt = r.prompt_ids if r.prompt_ids is not None else prompts[c.request_id]
            margin, top1, top2 = top2_margin(target, prompt, r.output_ids[:i])
            entry.update(margin=margin, top1=top1, top2=top2)
            if margin < tolerance and {top1, top2} == {entry["candidate_token"], entry["reference_token"]}:
                kind = "near_tie"
        entry["kind"] = kind
        violations += kind == "violation"
        ties += kind == "near_tie"
        mismatches.append(entry)
    return {"requests": len(candidate), "tokens_checked": checked, "violations": violations,
            "near_ties": ties, "tolerance": tolerance, "mismatches": mismatches, "passed": violations == 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--candidate", required=True, help="records file of the engine under test")
    p.add_argument("--reference", required=True, action="append", help="reference records (repeatable)")
    p.add_argument("--target", help="target checkpoint dir, to classify mismatches by logit margin")
    p.add_argument("--prompts", help="prompt file (needed with --target)")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--out", required=True, help="verdict JSON to write")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--report-only", action="store_true", help="exit 0 even when violations are found")


def run(args) -> int:
    from .engine.serve import pick_device, pick_dtype, read_prompts
    from .models.loading import load_target

    candidate = read_records(args.candidate)
    target = prompts = None
    if args.target:
        if not args.prompts:
            raise SpecpilotError("--target needs --prompts")
        device = pick_device(args.device)
        target = load_target(args.target, pick_dtype(args.dtype, device), device)
        prompts = {p["request_id"]: p["prompt_ids"] for p in read_prompts(args.prompts)}
    verdicts = {}
    for ref_path in args.reference:
        verdicts[str(ref_path)] = check(candidate, read_records(ref_path), prompts, target, args.tolerance)
    passed = all(v["passed"] for v in verdicts.values())
    summary = {"candidate": str(args.candidate), "passed": passed,
               "violations": sum(v["violations"] for v in verdicts.values()),
               "near_ties": sum(v["near_ties"] for v in verdicts.values()),
               "tokens_checked": sum(v["tokens_checked"] for v in verdicts.values()),
               "references": verdicts}
    write_json(args.out, summary)
    print(f"token forcing {Path(args.candidate).name}: {'pass' if passed else 'FAIL'} "
          f"({summary['tokens_checked']} tokens, {summary['violations']} violations, {summary['near_ties']} near-ties)")
    return 0 if passed or args.report_only else 1

"""Part 4 of token forcing: the candidate against each reference (AR; stock too for specpilot).

The request ids and token counts must match exactly in both directions (a missing, extra, short
or long request is a violation); the exact-match rate and, per request, where the outputs first
part (with the teacher-forced classification of the candidate's token there) are reported but not
judged: part 1 (:mod:`specpilot.forcing.teacher`) judges every token.
"""

from __future__ import annotations

from typing import Callable

from ..records import Record

LISTED = 100  # violations / near-ties / divergences listed in a verdict (the counts are always complete)


def _request_violations(ref: dict[str, Record], cand: dict[str, Record]) -> tuple[list, list, list[dict]]:
    """(missing ids, extra ids, violations) of the two sides' request ids."""
    missing = [rid for rid in ref if rid not in cand]
    extra = [rid for rid in cand if rid not in ref]
    violations = [{"check": "missing_request", "request_id": rid,
                   "detail": f"the reference has request {rid}, the candidate does not"} for rid in missing]
    violations += [{"check": "extra_request", "request_id": rid,
                    "detail": f"the candidate has request {rid}, the reference does not"} for rid in extra]
    return missing, extra, violations


def compare_reference(candidate: list[Record], reference: list[Record], classify: Callable[[str, int], dict]
                      ) -> tuple[dict, list[dict]]:
    """Compare the candidate with one reference.

    Args:
        candidate, reference: the records of the two engines (one cell).
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
    missing, extra, violations = _request_violations(ref, cand)
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

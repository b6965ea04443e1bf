"""Generation loops: AR greedy decoding and ONE draft-then-verify loop for any proposer.

:func:`generate` verifies any :class:`~specpilot.drafters.proposal.Proposal` (a chain, a tree,
rows of different lengths) in one target forward per step (:mod:`specpilot.engine.verify`:
ancestor mask, greedy accepted path, bonus token, compaction of the accepted path's K/V through the
runner). Both loops produce exactly ``max_new_tokens`` per row (EOS ignored, as the study does)
unless ``eos_id`` is given, share :class:`~specpilot.engine.runner.TargetRunner`, and time decode
with the device synchronized before each clock read, prefill excluded. Continuous batching runs the
same step in :mod:`specpilot.engine.scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..drafters.base import Proposer
from ..drafters.proposal import Proposal
from ..tuning.timing import clock
from .overlap import OverlapStepper
from .runner import TargetRunner
from .verify import accept_greedy, advance, step


@dataclass
class RowResult:
    """What one request produced; the engine turns it into a :class:`specpilot.records.Record`."""

    output_ids: list[int] = field(default_factory=list)
    committed_per_step: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def verify_steps(self) -> int:
        return len(self.committed_per_step)


def take_tokens(row: RowResult, tokens: list[int], max_new: int, eos_id: int | None) -> bool:
    """Append committed tokens to a row, honouring the budget ``max_new`` and EOS (``eos_id``, None:
    ignored); returns True when the row is done."""
    tokens = tokens[: max_new - len(row.output_ids)]
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    row.output_ids.extend(tokens)
    row.committed_per_step.append(len(tokens))
    return len(row.output_ids) >= max_new or (eos_id is not None and eos_id in tokens)


def _begin(runner: TargetRunner, proposer, prompts, max_new_tokens: int, eos_id: int | None):
    """Prefill, the first token of each row (from prefill), and the proposer's context (if any).

    Returns rows, done flags, last tokens [B] and the clock reading where decode starts.
    """
    rows = [RowResult() for _ in prompts]
    t0, feats, last = _prefill(runner, prompts, rows)
    done = [False] * len(rows)
    for b, tok in enumerate(last.tolist()):
        rows[b].output_ids.append(tok)
        done[b] = max_new_tokens <= 1 or tok == eos_id
    if proposer is not None:
        proposer.start(runner, prompts, feats, last)
    t1 = clock(runner.device)
    for r in rows:
        r.prefill_s = t1 - t0
    return rows, done, last, t1


def _record_step(rows, done, proposed: list[list[int]], max_new_tokens, eos_id, times, profile):
    """Commit one verify step's tokens per row; returns (counts kept per row, tokens kept per row).

    ``times`` = (decode start, draft start, verify start, step end) clock readings.
    """
    t1, ta, tb, tc = times
    counts, committed = [], []
    for b, r in enumerate(rows):
        if done[b]:
            counts.append(0), committed.append([])
            continue
        done[b] = take_tokens(r, proposed[b], max_new_tokens, eos_id)
        counts.append(r.committed_per_step[-1])
        committed.append(proposed[b][: counts[-1]])
        r.decode_s = tc - t1
        if profile:
            r.draft_s += tb - ta
            r.verify_s += tc - tb
    return counts, committed


def _prefill(runner: TargetRunner, prompts, rows):
    t0 = clock(runner.device)
    last_logits, feats, _ = runner.prefill(prompts)
    first = last_logits.argmax(-1)
    return t0, feats, first


def generate_ar(runner: TargetRunner, prompts: list[list[int]], max_new_tokens: int,
                eos_id: int | None = None) -> list[RowResult]:
    """Plain greedy decoding, one target forward per token, for a batch of prompts.

    Returns one :class:`RowResult` per prompt with ``committed_per_step`` all ones.
    """
    rows, done, last, t1 = _begin(runner, None, prompts, max_new_tokens, eos_id)
    if eos_id is None and not all(done):
        # every row decodes exactly max_new_tokens: no host synchronization until the end, so
        # the device never waits for the host between steps
        steps = []
        for _ in range(max_new_tokens - 1):
            last = runner.decode(last).argmax(-1)
            steps.append(last)
        toks = torch.stack(steps, 1).tolist()
        now = clock(runner.device)
        for b, r in enumerate(rows):
            r.output_ids.extend(toks[b])
            r.committed_per_step.extend([1] * len(toks[b]))
            r.decode_s = r.verify_s = now - t1
        return rows
    while not all(done):
        logits = runner.decode(last)
        last = logits.argmax(-1)
        toks = last.tolist()
        now = clock(runner.device)
        for b, r in enumerate(rows):
            if not done[b]:
                done[b] = take_tokens(r, [toks[b]], max_new_tokens, eos_id)
                r.decode_s = r.verify_s = now - t1
    return rows


def generate(runner: TargetRunner, drafter: Proposer, prompts: list[list[int]], max_new_tokens: int,
             eos_id: int | None = None, accept: Callable = accept_greedy, profile: bool = True,
             on_step: Callable[[Proposal, list[list[int]]], None] | None = None,
             overlap: bool = False) -> list[RowResult]:
    """Speculative decoding with any drafter: propose, verify in one forward, commit, repeat.

    Each step the drafter returns a :class:`Proposal` (root = the last committed token). The
    target verifies all its nodes at once (chain: causal mask; tree: ancestor mask, RoPE position
    = committed length + depth). The accepted path is the longest root path whose every token
    equals the target's argmax at its parent; the target's argmax after it is the bonus token.
    So each step commits accepted + 1 tokens and the output equals greedy AR decoding token for
    token (token forcing checks this). For a tree the accepted path's K/V are moved to contiguous
    cache slots (``runner.commit(counts, path_slots)``) so the cache stays chain-shaped. Rows that
    are done keep their slot in the batch without advancing (static shapes).

    Args:
        drafter: a proposer (:class:`~specpilot.drafters.base.Proposer`); it owns its block counting.
        accept: chain verification rule (drafts [B, k], logits [B, k+1, V]) -> (accepted [B],
            bonus [B]); tests plant cheats here. Tree proposals use
            :func:`~specpilot.engine.verify.accept_tree`.
        profile: synchronize and time draft and verify separately (``draft_s``/``verify_s``).
        on_step: optional callback(proposal, accepted paths) after each verify (calibration).
        overlap: launch the next draft before the host reads the acceptance
            (:mod:`specpilot.engine.overlap`; drafters that cannot overlap run as without it).
    Returns:
        one :class:`RowResult` per prompt.
    """
    rows, done, last, t1 = _begin(runner, drafter, prompts, max_new_tokens, eos_id)
    pipe = OverlapStepper(runner, drafter, accept) if overlap and drafter.can_overlap() else None
    while not all(done):
        if pipe is not None:
            st = pipe.step(last, [0 if done[b] else max_new_tokens - len(r.output_ids) for b, r in enumerate(rows)])
        else:
            st = step(runner, drafter, last, accept, profile)
        if on_step is not None:
            on_step(st.proposal, st.paths)
        counts, committed = _record_step(rows, done, st.proposed, max_new_tokens, eos_id,
                                         (t1, st.t_draft, st.t_verify, st.t_end), profile)
        last = pipe.advance(committed) if pipe is not None else advance(runner, drafter, st, counts, committed)
    return rows

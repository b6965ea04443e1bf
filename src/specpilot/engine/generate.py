"""Generation loops: AR greedy decoding and ONE draft-then-verify loop for any drafter.

:func:`generate` verifies any :class:`~specpilot.drafters.proposal.Proposal` (a chain, a tree,
rows of different lengths) in one target forward per step: ancestor mask, greedy accepted path,
bonus token, compaction of the accepted path's K/V through the runner. Both loops produce exactly ``max_new_tokens`` per row (EOS ignored, as the study does) unless
``eos_id`` is given, share :class:`TargetRunner`, and time decode with the device synchronized
before each clock read, prefill excluded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..drafters.proposal import Proposal
from ..errors import SpecpilotError
from .runner import PhaseTimer, TargetRunner, clock


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


class Drafter(Protocol):
    """A drafter plug-in (see :mod:`specpilot.drafters`): proposes candidates for :func:`generate`."""

    capture: tuple[int, ...]  # target layers whose outputs the drafter reads (empty: none)

    def start(self, runner: TargetRunner, prompts: list[list[int]], features, first: torch.Tensor) -> None:
        """Called after prefill with the prompt features [B, T, F] (or None) and first tokens [B]."""

    def propose(self, last: torch.Tensor, start: torch.Tensor) -> Proposal:
        """Candidates after ``last`` int64 [B] (the anchor, at position ``start`` int64 [B])."""

    def observe(self, features, start: torch.Tensor, counts: torch.Tensor, committed: list[list[int]]) -> None:
        """Told what was committed: features [B, P, F] of the accepted path (anchor first) at
        ``start``, counts int64 [B] (entries kept per row) and the committed tokens per row."""


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear verification at temperature 0 (DFlash ``dflash_generate``; SGLang "linear block").

    Draft i is accepted while it equals the target's argmax at block slot i - 1 (slot 0 is the
    anchor). Args: drafts int64 [B, k]; logits [B, k + 1, vocab] of the verified block.
    Returns: accepted count int64 [B] in 0..k and the bonus token int64 [B] (target argmax after
    the accepted prefix).
    """
    posterior = logits.argmax(-1)
    acc = (drafts == posterior[:, :-1]).long().cumprod(1).sum(1)
    bonus = posterior.gather(1, acc[:, None])[:, 0]
    return acc, bonus


# Verification rules by name (engine config key ``accept``). Only lossless rules belong here; tests
# register deliberately broken ones to prove the token-forcing gate rejects them.
ACCEPT_RULES: dict[str, Callable] = {"greedy": accept_greedy}


def _take(row: RowResult, tokens: list[int], max_new: int, eos_id: int | None) -> bool:
    """Append committed tokens to a row, honouring the budget and EOS; return True when done."""
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
        done[b] = _take(r, proposed[b], max_new_tokens, eos_id)
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
                done[b] = _take(r, [toks[b]], max_new_tokens, eos_id)
                r.decode_s = r.verify_s = now - t1
    return rows


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                lengths: torch.Tensor | None = None) -> tuple[list[list[int]], list[int]]:
    """Greedy tree verification (SGLang ``verify_tree_greedy``; DDTree/JetSpec at temperature 0).

    From the root (block index 0, the anchor), repeatedly step to the child whose token equals
    the target's argmax at the current node; stop when no child matches. The bonus token is the
    target's argmax at the last node, so every committed token is the target's own choice.

    Args:
        tokens int64 [B, N], parents int64 [B, N] (-1 for the root), logits [B, N, vocab];
        lengths int64 [B] valid nodes per row (None = all): padding nodes are never accepted.
    Returns:
        per row the accepted path of block indices (root first) and the bonus token.
    """
    post = logits.argmax(-1).tolist()
    toks, pars = tokens.tolist(), parents.tolist()
    lens = lengths.tolist() if lengths is not None else [tokens.shape[1]] * len(toks)
    paths, bonus = [], []
    for b in range(len(toks)):
        children: dict[int, list[int]] = {}
        for i, p in enumerate(pars[b][: lens[b]]):
            if p >= 0:
                children.setdefault(p, []).append(i)
        node, path = 0, [0]
        while True:
            nxt = next((c for c in children.get(node, []) if toks[b][c] == post[b][node]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        paths.append(path)
        bonus.append(post[b][node])
    return paths, bonus


def chain_drafts(prop: Proposal) -> torch.Tensor:
    """The drafts int64 [B, k] of a chain proposal as the acceptance rule sees them: padding
    nodes (index >= ``lengths[b]``) set to -1, which never matches an argmax (token ids are >= 0)."""
    drafts = prop.tokens[:, 1:]
    if prop.lengths is not None:
        pad = torch.arange(drafts.shape[1], device=drafts.device)[None, :] >= (prop.lengths[:, None] - 1)
        drafts = drafts.masked_fill(pad, -1)
    return drafts


def _verify_chain(prop: Proposal, logits: torch.Tensor, accept: Callable):
    """Accepted paths and bonus tokens of a chain proposal under the rule ``accept``."""
    acc, bonus = accept(chain_drafts(prop), logits)
    # the one host synchronization of a step: the acceptance decision
    host = torch.cat([acc[:, None], bonus[:, None]], 1).tolist()
    return [list(range(a + 1)) for a, _ in host], [b for _, b in host]


def generate(runner: TargetRunner, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int,
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
        drafter: a drafter plug-in (:mod:`specpilot.drafters`); it owns its block counting.
        accept: chain verification rule (drafts [B, k], logits [B, k+1, V]) -> (accepted [B],
            bonus [B]); tests plant cheats here. Tree proposals use :func:`accept_tree`.
        profile: synchronize and time draft and verify separately (``draft_s``/``verify_s``).
        on_step: optional callback(proposal, accepted paths) after each verify (calibration).
        overlap: launch the next draft before the host reads the acceptance
            (:mod:`specpilot.engine.overlap`; drafters that cannot overlap run as without it).
    Returns:
        one :class:`RowResult` per prompt.
    """
    from .overlap import OverlapStepper, can_overlap

    rows, done, last, t1 = _begin(runner, drafter, prompts, max_new_tokens, eos_id)
    pipe = OverlapStepper(runner, drafter, accept) if overlap and can_overlap(drafter) else None
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


@dataclass
class Step:
    """One draft + verify step before commit (see :func:`step`).

    Attributes:
        proposal: what the drafter proposed; paths: per row the accepted block indices (root
        first); bonus: per row the target's token after the accepted path; proposed: per row the
        tokens the step would commit (accepted drafts + bonus), before budgets/EOS; feats:
        captured target features [B, N, F] of the verified block (or None); t_draft, t_verify,
        t_end: clock readings [s] at the draft start, verify start and after the acceptance
        decision (the first two are 0.0 without ``profile``).
    """

    proposal: Proposal
    paths: list[list[int]]
    bonus: list[int]
    proposed: list[list[int]]
    feats: torch.Tensor | None
    t_draft: float
    t_verify: float
    t_end: float


def step(runner: TargetRunner, drafter: Drafter, last: torch.Tensor, accept: Callable = accept_greedy,
         profile: bool = True) -> Step:
    """Propose after ``last`` int64 [B], verify every row's candidates in one target forward and
    decide acceptance; nothing is committed yet (call :func:`advance`).

    Shared by :func:`generate` (static batches) and :mod:`specpilot.engine.scheduler`
    (continuous batching). Raises SpecpilotError when the drafter proposes the wrong row count.
    """
    B = runner.batch
    timer = PhaseTimer(runner.device, profile)  # no host synchronization between draft and verify
    timer.mark()
    prop = drafter.propose(last, runner.length)
    if prop.tokens.shape[0] != B:
        raise SpecpilotError(f"drafter proposed {prop.tokens.shape[0]} rows for a batch of {B}")
    timer.mark()
    logits, feats = runner.verify(prop.tokens, prop.parents)
    if prop.is_chain:
        paths, bonus = _verify_chain(prop, logits, accept)
    else:
        paths, bonus = accept_tree(prop.tokens, prop.parents, logits, prop.lengths)
    toks_l = prop.tokens.tolist()
    ta, tb, tc = timer.finish()
    proposed = [[toks_l[b][i] for i in paths[b][1:]] + [bonus[b]] for b in range(B)]
    return Step(prop, paths, bonus, proposed, feats, ta, tb, tc)


def advance(runner: TargetRunner, drafter: Drafter, st: Step, counts: list[int],
            committed: list[list[int]]) -> torch.Tensor:
    """Commit ``counts[b]`` entries of row b's accepted path (0 = row does not advance) and tell
    the drafter; tree paths are compacted in the cache. Returns the next anchors int64 [B]
    (the bonus tokens; a row that did not advance gets its bonus too, which its owner ignores)."""
    dev = runner.device
    counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
    feats, paths = st.feats, st.paths
    path_slots = path_feats = None
    if not st.proposal.is_chain:
        width = max(len(p) for p in paths)
        path_slots = torch.tensor([p + [0] * (width - len(p)) for p in paths], dtype=torch.long, device=dev)
        if feats is not None:
            path_feats = feats.gather(1, path_slots[:, :, None].expand(-1, -1, feats.shape[-1]))
    else:
        path_feats = feats
    drafter.observe(path_feats, runner.length, counts_t, committed)
    runner.commit(counts_t, path_slots=path_slots)
    return torch.tensor(st.bonus, dtype=torch.long, device=dev)


def generate_speculative(runner: TargetRunner, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int,
                         block_size: int, eos_id: int | None = None, accept: Callable = accept_greedy,
                         profile: bool = True) -> list[RowResult]:
    """:func:`generate` with the drafter's block size set first (kept for the benchmark scripts).

    ``block_size`` is in the drafter's own counting (DFlash / lookup / replay: the verify width).
    Raises SpecpilotError for a block size < 2.
    """
    if block_size < 2:
        raise SpecpilotError(f"block size must be >= 2, got {block_size}")
    drafter.block_size = block_size
    return generate(runner, drafter, prompts, max_new_tokens, eos_id, accept, profile)

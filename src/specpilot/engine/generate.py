"""Generation loops: AR greedy decoding and draft-then-verify speculative decoding.

Both produce exactly ``max_new_tokens`` per row (EOS ignored, as the study does) unless
``eos_id`` is given, share :class:`TargetRunner`, and time decode with the device synchronized
before each clock read, prefill excluded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .runner import TargetRunner, clock


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


class Proposer(Protocol):
    """Source of draft tokens for :func:`generate_speculative`."""

    def start(self, runner: TargetRunner, prompts: list[list[int]], features, first: torch.Tensor) -> None:
        """Called after prefill with the prompt features [B, T, F] and first tokens [B]."""

    def propose(self, last: torch.Tensor, start: torch.Tensor, k: int) -> torch.Tensor:
        """Return k draft tokens int64 [B, k] following ``last`` [B] (at position ``start`` [B])."""

    def observe(self, features, start: torch.Tensor, counts: torch.Tensor, committed: list[list[int]]) -> None:
        """Told which block entries were committed: features [B, N, F] at ``start``, counts [B]."""


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


def _take(row: RowResult, tokens: list[int], max_new: int, eos_id: int | None) -> bool:
    """Append committed tokens to a row, honouring the budget and EOS; return True when done."""
    tokens = tokens[: max_new - len(row.output_ids)]
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    row.output_ids.extend(tokens)
    row.committed_per_step.append(len(tokens))
    return len(row.output_ids) >= max_new or (eos_id is not None and eos_id in tokens)


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
    rows = [RowResult() for _ in prompts]
    t0, _, last = _prefill(runner, prompts, rows)
    done = [False] * len(rows)
    for b, tok in enumerate(last.tolist()):
        rows[b].output_ids.append(tok)
        done[b] = max_new_tokens <= 1 or tok == eos_id
    t1 = clock(runner.device)
    for r in rows:
        r.prefill_s = t1 - t0
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


def generate_speculative(runner: TargetRunner, proposer: Proposer, prompts: list[list[int]],
                         max_new_tokens: int, block_size: int, eos_id: int | None = None,
                         accept: Callable = accept_greedy, profile: bool = True) -> list[RowResult]:
    """Draft ``block_size - 1`` tokens, verify them in one target forward, commit, repeat.

    Each verify step commits the accepted drafts plus one bonus token from the target, so the
    output equals greedy AR decoding token for token (token forcing checks this). Rows that are
    done keep their slot in the batch without advancing (static shapes).

    Args:
        block_size: verified block length (anchor + block_size - 1 drafts); must be >= 2.
        accept: verification rule (drafts, logits) -> (accepted, bonus); tests plant cheats here.
        profile: synchronize and time draft and verify separately (``draft_s``/``verify_s``).
    """
    from ..errors import SpecpilotError

    if block_size < 2:
        raise SpecpilotError(f"block size must be >= 2, got {block_size}")
    k = block_size - 1
    rows = [RowResult() for _ in prompts]
    t0, feats, last = _prefill(runner, prompts, rows)
    done = [False] * len(rows)
    for b, tok in enumerate(last.tolist()):
        rows[b].output_ids.append(tok)
        done[b] = max_new_tokens <= 1 or tok == eos_id
    proposer.start(runner, prompts, feats, last)
    t1 = clock(runner.device)
    for r in rows:
        r.prefill_s = t1 - t0
    dev = runner.device
    while not all(done):
        ta = clock(dev) if profile else 0.0
        drafts = proposer.propose(last, runner.length, k)
        tb = clock(dev) if profile else 0.0
        block = torch.cat([last[:, None], drafts], 1)
        logits, feats = runner.verify(block)
        acc, bonus = accept(drafts, logits)
        acc_l, bonus_l, drafts_l = acc.tolist(), bonus.tolist(), drafts.tolist()
        tc = clock(dev)
        counts, committed = [], []
        for b, r in enumerate(rows):
            if done[b]:
                counts.append(0), committed.append([])
                continue
            toks = drafts_l[b][: acc_l[b]] + [bonus_l[b]]
            done[b] = _take(r, toks, max_new_tokens, eos_id)
            counts.append(r.committed_per_step[-1])
            committed.append(toks[: counts[-1]])
            r.decode_s = tc - t1
            if profile:
                r.draft_s += tb - ta
                r.verify_s += tc - tb
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        proposer.observe(feats, runner.length, counts_t, committed)
        runner.commit(counts_t)
        last = bonus
    return rows

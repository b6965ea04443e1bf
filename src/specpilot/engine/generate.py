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
    rows, done, last, t1 = _begin(runner, proposer, prompts, max_new_tokens, eos_id)
    dev = runner.device
    while not all(done):
        ta = clock(dev) if profile else 0.0
        drafts = proposer.propose(last, runner.length, k)
        tb = clock(dev) if profile else 0.0
        block = torch.cat([last[:, None], drafts], 1)
        logits, feats = runner.verify(block)
        acc, bonus = accept(drafts, logits)
        # the one host synchronization of a step: the acceptance decision
        host = torch.cat([acc[:, None], bonus[:, None], drafts], 1).tolist()
        acc_l, bonus_l, drafts_l = [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]
        tc = clock(dev)
        counts, committed = _record_step(rows, done, [d[:a] + [b] for d, a, b in zip(drafts_l, acc_l, bonus_l)],
                                         max_new_tokens, eos_id, (t1, ta, tb, tc), profile)
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        proposer.observe(feats, runner.length, counts_t, committed)
        runner.commit(counts_t)
        last = bonus
    return rows


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor
                ) -> tuple[list[list[int]], list[int]]:
    """Greedy tree verification (SGLang ``verify_tree_greedy``; DDTree/JetSpec at temperature 0).

    From the root (block index 0, the anchor), repeatedly step to the child whose token equals
    the target's argmax at the current node; stop when no child matches. The bonus token is the
    target's argmax at the last node, so every committed token is the target's own choice.

    Args:
        tokens int64 [B, N], parents int64 [B, N] (-1 for the root), logits [B, N, vocab].
    Returns:
        per row the accepted path of block indices (root first) and the bonus token.
    """
    post = logits.argmax(-1).tolist()
    toks, pars = tokens.tolist(), parents.tolist()
    paths, bonus = [], []
    for b in range(len(toks)):
        children: dict[int, list[int]] = {}
        for i, p in enumerate(pars[b]):
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


def generate_tree(runner: TargetRunner, proposer, prompts: list[list[int]], max_new_tokens: int,
                  block_size: int, branch: int, depth: int, eos_id: int | None = None,
                  profile: bool = True) -> list[RowResult]:
    """Speculative decoding with tree verification of a block drafter's output.

    The tree is the drafter's argmax chain (the spine, as in linear verification) plus, at the
    first ``depth`` draft positions, the drafter's next ``branch`` most likely tokens as leaves
    hanging off the previous spine node ("spine first, then side branches", so tree acceptance is
    never below chain acceptance; cf. JetSpec's depth_first builder). One target forward verifies
    it with an ancestor mask; the accepted path's K/V is compacted into contiguous cache slots.
    Output equals greedy AR decoding token for token.
    """
    from ..errors import SpecpilotError

    if block_size < 2:
        raise SpecpilotError(f"block size must be >= 2, got {block_size}")
    k = block_size - 1
    depth = min(depth, k)
    rows, done, last, t1 = _begin(runner, proposer, prompts, max_new_tokens, eos_id)
    dev = runner.device
    B = len(prompts)
    # static tree shape: root, spine 1..k, then `branch` leaves for each of the first `depth` positions
    par = [-1] + list(range(k)) + [i for i in range(depth) for _ in range(branch)]
    parents = torch.tensor([par] * B, dtype=torch.long, device=dev)
    while not all(done):
        ta = clock(dev) if profile else 0.0
        spine, logits_d = proposer.propose_logits(last, runner.length, k)
        alts = logits_d[:, :depth].topk(branch + 1, dim=-1).indices[:, :, 1:].reshape(B, -1)
        tb = clock(dev) if profile else 0.0
        tokens = torch.cat([last[:, None], spine, alts], 1)
        logits, feats = runner.verify(tokens, parents)
        paths, bonus = accept_tree(tokens, parents, logits)
        toks_l = tokens.tolist()
        tc = clock(dev)
        counts, committed = _record_step(rows, done, [[toks_l[b][i] for i in paths[b][1:]] + [bonus[b]]
                                                      for b in range(B)], max_new_tokens, eos_id, (t1, ta, tb, tc), profile)
        width = max(len(p) for p in paths)
        path_slots = torch.tensor([p + [0] * (width - len(p)) for p in paths], dtype=torch.long, device=dev)
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        path_feats = None
        if feats is not None:
            path_feats = feats.gather(1, path_slots[:, :, None].expand(-1, -1, feats.shape[-1]))
        proposer.observe(path_feats, runner.length, counts_t, committed)
        runner.commit(counts_t, path_slots=path_slots)
        last = torch.tensor(bonus, dtype=torch.long, device=dev)
    return rows

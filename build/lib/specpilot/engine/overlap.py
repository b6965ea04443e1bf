"""Overlap scheduling: the draft of step N+1 runs on the device while the host does step N's
bookkeeping (batching mechanism (b); the SGLang speculative "v2" overlap pattern).

Without overlap a step is: draft, verify, acceptance, then the host reads the accepted counts
(one synchronization), records them, commits, tells the drafter and only then launches the next
draft, so the device idles for the host's whole bookkeeping. With overlap, right after the
verify the device also gets, still unsynchronized: the acceptance (accepted drafts + bonus, on
the device), the commit of ``min(accepted + 1, budget left)`` entries per row, the drafter's
context injection of the verified block and the next draft from the bonus tokens. The host then
waits only for the acceptance's few numbers, while the device drafts.

Outputs are unchanged: the verify and acceptance are the same computations in the same order,
the commit is the count the host would commit (the budget clip included; a row stopped by EOS
keeps a few extra committed entries, never read again), and the next proposal's anchor is
whatever the host's loop passes (a refilled slot's new first token included), so a draft made
before a refill can only be rejected, never change a token.

A proposer takes part when its ``can_overlap()`` is true (the overlap hooks of
:class:`~specpilot.drafters.base.Proposer`: ``observe_device``, ``observe_host``, ``draft_async``,
``proposal``; chain proposals only: :class:`~specpilot.drafters.dflash.DFlashProposer` under CUDA
graphs, the replay drafter).
"""

from __future__ import annotations

import time

import torch

from ..errors import SpecpilotError
from .verify import Step, VerifyOutput, chain_drafts


class _Marks:
    """Device-time marks on CUDA (events), host clock readings elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class OverlapStepper:
    """Chain verify steps with the next draft launched before the host reads the acceptance.

    Use: ``st = stepper.step(last, remaining)`` (same :class:`~specpilot.engine.verify.Step`
    as :func:`~specpilot.engine.verify.step`, already committed on the device), then the loop's
    bookkeeping, then ``stepper.advance(committed)`` (the drafter's host state). Do not also call
    :func:`~specpilot.engine.verify.advance`.

    Args:
        runner: the :class:`~specpilot.engine.runner.TargetRunner`.
        drafter: an overlap-capable proposer (``drafter.can_overlap()``).
        accept: chain verification rule (drafts [B, k], logits [B, k+1, V]) -> (accepted [B], bonus [B]).
    Raises:
        SpecpilotError: the drafter cannot overlap, or proposes a tree.
    """

    def __init__(self, runner, drafter, accept):
        if not drafter.can_overlap():
            raise SpecpilotError(f"drafter {drafter.kind!r} cannot overlap "
                                 "(needs chain proposals drafted on the device)")
        self.runner, self.drafter, self.accept = runner, drafter, accept
        self.handle = None
        self.pending = False  # a draft was launched ahead for the next step
        self.marks = _Marks(runner.device)
        self.draft_marks = None  # (start, end) of the draft launched last step
        B = runner.batch
        pin = runner.device.type == "cuda"
        # pinned staging: copies from/to pageable memory would synchronize the stream (CUDA runs a
        # stream sync before a pageable host-to-device copy), which is what overlap must avoid
        self.host = torch.empty((B, 2), dtype=torch.long, pin_memory=pin)
        self.rem_host = torch.empty(B, dtype=torch.long, pin_memory=pin)
        self.tok_host = None
        self.pin = pin

    def step(self, last: torch.Tensor, remaining: list[int]):
        """Verify the pending proposal (drafting it first on the first step), accept, commit on the
        device and launch the next draft; returns the step's :class:`Step` (host values).

        Args:
            last: int64 [B] anchors (the bonus tokens of the last step, or a refilled slot's first token).
            remaining: per row the tokens it may still commit (0: the row does not advance).
        """
        r, d, m = self.runner, self.drafter, self.marks
        B = r.batch
        if len(remaining) != B:
            raise SpecpilotError(f"remaining budgets for {len(remaining)} rows, batch of {B}")
        if not self.pending:  # the first step: nothing was drafted ahead yet
            a = m.mark()
            self.handle = d.draft_async(last, r.length)
            self.draft_marks = (a, m.mark())
        prop = d.proposal(self.handle, last)
        self.handle, self.pending = None, False
        if not prop.is_chain:
            raise SpecpilotError("overlap scheduling verifies chain proposals only")
        if prop.tokens.shape[0] != B:
            raise SpecpilotError(f"drafter proposed {prop.tokens.shape[0]} rows for a batch of {B}")
        v0 = m.mark()
        logits, feats = r.verify(prop.tokens, None)
        acc, bonus = self.accept(chain_drafts(prop), logits)
        self.rem_host.copy_(torch.tensor(remaining, dtype=torch.long))  # free: last step's copy is done
        rem = self.rem_host.to(r.device, non_blocking=True)
        counts = torch.minimum(acc + 1, rem)
        self.host.copy_(torch.stack([acc, bonus], 1), non_blocking=True)
        if self.tok_host is None or self.tok_host.shape != prop.tokens.shape:
            self.tok_host = torch.empty(prop.tokens.shape, dtype=torch.long, pin_memory=self.pin)
        self.tok_host.copy_(prop.tokens, non_blocking=True)
        v1 = m.mark()
        ready = torch.cuda.Event() if r.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        # the device goes on: context injection, commit, the next draft (nothing here waits for the host)
        d.observe_device(feats, r.length, counts)
        r.commit(counts)
        prev = self.draft_marks
        a = m.mark()
        self.handle = d.draft_async(bonus, r.length)  # a handle may be None (the replay drafter's)
        self.pending = True
        self.draft_marks = (a, m.mark())
        if ready is not None:
            ready.synchronize()  # the acceptance only: the draft above keeps running
        t_end = time.perf_counter()
        host = self.host.tolist()
        toks = self.tok_host.tolist()
        grown = max((min(a_ + 1, rem_) for (a_, _), rem_ in zip(host, remaining)), default=0)
        r.settle(grown)
        t_verify = t_end - m.seconds(v0, v1)
        t_draft = t_verify - (m.seconds(*prev) if prev and prev[1] is not None else 0.0)
        paths = [list(range(a_ + 1)) for a_, _ in host]
        bonus_l = [b_ for _, b_ in host]
        proposed = [[toks[b][i] for i in paths[b][1:]] + [bonus_l[b]] for b in range(B)]
        self.next_last = bonus
        return Step(prop, VerifyOutput(paths, bonus_l, proposed), None, t_draft, t_verify, t_end)

    def advance(self, committed: list[list[int]]) -> torch.Tensor:
        """Tell the drafter the tokens the host recorded per row; returns the next anchors int64 [B]
        on the device (the bonus tokens; the loop replaces a refilled slot's)."""
        self.drafter.observe_host(committed)
        return self.next_last

"""The mixed prefill step: decode rows and newcomers' prompt chunks in one forward of a token budget.

Chunked prefill as vLLM and SGLang schedule it (Sarathi-Serve, Agrawal et al. 2024): under
continuous batching a newcomer's prompt does not stop the running requests for a prefill step of
its own. Each step holds every running row's verify block (its proposal, N tokens) and, in the
budget left, chunks of the prompts being filled (first come first served); the rows are ragged
(:mod:`specpilot.models.ragged`: one forward of ``rows x N + chunk`` tokens, not a uniform block).
A newcomer whose last chunk ran gets its first token from that step's logits and decodes from the
next step on. Engine config ``mixed_prefill`` = the step's token budget (0: off);
:class:`~specpilot.engine.scheduler.Scheduler` keeps the per-slot bookkeeping, this module the step.

Outputs equal AR token for token: a decode row is verified exactly as in
:func:`~specpilot.engine.verify.step` (same proposal, same acceptance), and a prompt chunk writes
only its own row's cache slots from its committed length on, as a prefill would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import SpecpilotError
from ..tuning.timing import PhaseTimer, clock
from .verify import Step, advance, decide, step


@dataclass
class Fill:
    """A newcomer being prefilled in chunks: its request, prompt tokens committed so far, when its
    slot freed [s from the run's start] and the prefill seconds charged to it so far."""

    request: int
    pos: int
    arrival: float
    prefill_s: float = 0.0


def check_budget(budget: int, batch: int, verify_width: int) -> None:
    """Refuse a token budget that leaves no room for a prompt chunk beside every row's verify block.

    Raises:
        SpecpilotError: ``budget`` <= batch x verify width (naming ``mixed_prefill``).
    """
    if budget <= batch * verify_width:
        raise SpecpilotError(f"mixed_prefill = {budget} tokens per step leaves no room for a prompt chunk: the decode "
                             f"rows take up to {batch} x {verify_width} (concurrency x verify width) = "
                             f"{batch * verify_width}; set it above that")


def plan_pieces(filling: dict[int, Fill], prompts: dict[int, list[int]], left: int) -> list[tuple[int, list[int]]]:
    """The prompt chunks of one step: the slots being filled, in the order they were assigned,
    each the next min(rest of its prompt, tokens left) tokens, until ``left`` tokens are used.
    ``prompts``: slot -> its newcomer's prompt ids. Returns [(slot, tokens)]."""
    pieces = []
    for b, f in filling.items():
        if left <= 0:
            break
        p = prompts[b]
        take = min(left, len(p) - f.pos)
        if take > 0:
            pieces.append((b, list(p[f.pos:f.pos + take])))
            left -= take
    return pieces


def prefill_cost(step_s: float, decode_steps_s: list[float], chunk: int, decode_tokens: int) -> float:
    """Seconds of a mixed step that its prompt chunks cost: the step's time beyond the mean of the
    run's decode steps without chunks so far (floor 0); before any such step was timed, the chunks'
    share by tokens (``chunk`` of ``chunk + decode_tokens``); a step without decode rows, all of it.
    An estimate (decode steps vary with the rows running): what a running request waited for the
    chunks, its ``prefill_stall_s`` (the cost model's prefill_stall term)."""
    if decode_tokens == 0:
        return step_s
    if not decode_steps_s:
        return step_s * chunk / (chunk + decode_tokens)
    return max(0.0, step_s - sum(decode_steps_s) / len(decode_steps_s))


def mixed_step(runner, drafter, last: torch.Tensor, rows: list[int], pieces: list[tuple[int, list[int]]],
               accept: Callable, profile: bool = True) -> tuple[Step, list[tuple]]:
    """Propose after ``last`` int64 [B]; verify the proposals of ``rows`` and run ``pieces``
    (:func:`plan_pieces`) in one :meth:`~specpilot.engine.runner.TargetRunner.verify_mixed`;
    decide acceptance. Nothing is committed (:func:`~specpilot.engine.verify.advance`, then
    :func:`commit_pieces`). Returns the :class:`~specpilot.engine.verify.Step` (rows outside
    ``rows`` hold decisions over zero logits: their counts must be 0) and per piece (logits [t,
    vocab], features [t, F] or None)."""
    timer = PhaseTimer(runner.device, profile)
    timer.mark()
    prop = drafter.propose(last, runner.length)
    if prop.tokens.shape[0] != runner.batch:
        raise SpecpilotError(f"drafter proposed {prop.tokens.shape[0]} rows for a batch of {runner.batch}")
    timer.mark()
    logits, feats, outs = runner.verify_mixed(prop.tokens, rows, pieces, prop.parents, prop.max_depth)
    out = decide(prop, logits, accept)
    ta, tb, tc = timer.finish()
    return Step(prop, out, feats, ta, tb, tc), outs


def commit_pieces(runner, drafter, pieces: list[tuple[int, list[int]]], outs: list[tuple]) -> None:
    """Commit the prompt chunks of a mixed step after its decode rows were committed: the drafter
    observes each chunk's features at its row's committed length (the other rows keep 0 entries,
    as a prefill step over every row tells it), then the runner commits the chunks' lengths. A
    drafter's observe writes every row's block width from the row's length, so the chunks go in
    windows no wider than the room every row has left (as a refill's prefill block is cut,
    :meth:`~specpilot.engine.scheduler.Scheduler._refill`; at least the verify width, which the
    KV-cache sizing leaves beyond every row)."""
    if not pieces:
        return
    B, dev = runner.batch, runner.device
    W = max(len(t) for _, t in pieces)
    c0 = 0
    while c0 < W:
        room = runner.max_seq - int(runner.length.max())
        if room < 1:  # the KV-cache sizing (slots_needed) guarantees room; a broken invariant must not loop
            raise SpecpilotError(f"no KV-cache room left to commit a prompt chunk (max_seq {runner.max_seq})")
        w = min(room, W - c0)
        counts = [0] * B
        committed: list[list[int]] = [[] for _ in range(B)]
        feats = None
        for (b, toks), (_, f) in zip(pieces, outs):
            part = toks[c0:c0 + w]
            counts[b], committed[b] = len(part), list(part)
            if f is not None:
                if feats is None:
                    feats = f.new_zeros(B, w, f.shape[-1])
                feats[b, :len(part)] = f[c0:c0 + len(part)]
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        drafter.observe(feats, runner.length, counts_t, committed)
        runner.commit(counts_t)
        c0 += w


class MixedPrefill:
    """The :class:`~specpilot.engine.scheduler.Scheduler`'s mixed prefill steps (its base class):
    with ``mixed_prefill`` on, a freed slot's newcomer rides in chunks in the next decode steps (one
    ragged forward of the running rows' verify blocks and the chunks, within the token budget) and
    decodes from the step after its last chunk. A request's ``prefill_stall_s`` is then what the mixed
    steps it decoded through took beyond a decode step (:func:`prefill_cost`), its ``prefill_s`` its
    chunks' part of that in the steps that carried them, and ``mixed_steps`` counts the steps of its
    decode that carried a chunk. Eager path only (:meth:`TargetRunner.mix_refusal`). Uses the
    scheduler's state (``runner``, ``drafter``, ``mixed``, ``_filling``, ``_decode_times``) and
    its ``_record`` / ``_admit``."""

    def _check_mixed(self) -> None:
        """Refuse a ``mixed_prefill`` this scheduler cannot run (one message naming the setting)."""
        why = self.runner.mix_refusal()
        if why is not None:
            raise SpecpilotError(f"mixed_prefill: {why}")
        for name, on in (("prefill_chunk", self.chunk is not None), ("prefill_beside", self.prefill_beside),
                         ("overlap", self.overlap)):
            if on:
                raise SpecpilotError(f"mixed_prefill cannot be combined with {name}: the mixed step chunks prompts "
                                     f"by its token budget inside the decode steps")
        check_budget(self.mixed, self.runner.batch, self.verify_width)

    def _fill(self, freed: list[int], now: float, queue, length: list[int]) -> None:
        """Mixed prefill: give each freed slot the next queued request to fill in the coming mixed
        steps (its cache row emptied: ``runner.rollback`` to length 0)."""
        new = False
        for b in freed:
            if not queue:
                break
            self._filling[b] = Fill(queue.popleft(), 0, now)
            length[b] = 0
            new = True
        if new:
            self.runner.rollback(torch.tensor(length, dtype=torch.long))

    def _iteration_mixed(self, queue, slot: list, length: list[int], last: torch.Tensor, requests, out,
                         t0: float) -> torch.Tensor:
        """One mixed step (:mod:`specpilot.engine.mixed`): every running row's verify block and the
        filling slots' next prompt chunks (within the token budget) in one forward (with no slot to
        fill, the plain step of :meth:`_iteration`); the decode rows
        committed as in :meth:`_iteration`, then the chunks; a newcomer whose prompt is complete is
        admitted with its first token, the slots freed get the next queued requests."""
        runner, drafter, dev = self.runner, self.drafter, self.runner.device
        rows = [b for b, i in enumerate(slot) if i is not None]
        prompts = {b: requests[f.request].prompt_ids for b, f in self._filling.items()}
        pieces = plan_pieces(self._filling, prompts, self.mixed - len(rows) * self.verify_width)
        ta = clock(dev)
        if pieces:
            st, outs = mixed_step(runner, drafter, last, rows, pieces, self.accept, self.profile)
        else:  # nothing to fill: the plain batched step (a uniform block runs faster than ragged rows)
            st, outs = step(runner, drafter, last, self.accept, self.profile), []
        if rows:
            self.steps += 1
            if self.on_step is not None:
                self.on_step(st.proposal, st.paths)
        running = [slot[b] for b in rows]
        counts, committed, freed = self._record(st, slot, requests, out, st.t_end - t0)
        last = advance(runner, drafter, st, counts, committed)
        for b in range(runner.batch):
            length[b] += counts[b]
        commit_pieces(runner, drafter, pieces, outs)
        tb = clock(dev)
        if rows and not pieces:
            self._decode_times.append(tb - ta)
        if pieces:
            self.prefill_steps += 0 if rows else 1
            self.mixed_steps += 1 if rows else 0
            chunk = sum(len(t) for _, t in pieces)
            extra = prefill_cost(tb - ta, self._decode_times, chunk, len(rows) * st.proposal.tokens.shape[1])
            for i in running:  # what this row's step took beyond a decode step: the chunks' cost
                out[i].prefill_stall_s += extra
                if self.profile:  # counted once: as stall, not also as verify time (the cost model adds them)
                    out[i].verify_s -= min(extra, st.t_end - st.t_verify)
                out[i].mixed_steps = (out[i].mixed_steps or 0) + 1
            done = []
            for (b, toks), (lg, _) in zip(pieces, outs):
                f = self._filling[b]
                f.pos += len(toks)
                f.prefill_s += extra * len(toks) / chunk
                length[b] += len(toks)
                if f.pos == len(prompts[b]):
                    done.append((b, int(lg[-1].argmax(-1))))
            if done:
                last = last.clone()
            for b, tok in done:
                f = self._filling.pop(b)
                last[b] = tok
                slot[b] = f.request
                if self._admit(b, f.request, tok, f.arrival, f.prefill_s, tb - t0, requests, out):
                    slot[b] = None
                    freed.append(b)
        self._fill(freed, tb - t0, queue, length)
        return last


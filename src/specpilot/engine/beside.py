"""A newcomer's prefill beside the decode steps (``prefill_beside``): the
:class:`~specpilot.engine.scheduler.Scheduler`'s second-CUDA-stream refill (its base class).

A freed slot is parked at its newcomer's prompt length and the prompt is prefilled into that row
only (``runner.prefill_row``) on a second stream while the running rows keep decoding; an event
admits the request when its prefill has passed. Off by default: on the H200 at concurrency 16-24
it measured no gain (BENCHMARKS.md, issue 15).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass

import torch

from ..errors import SpecpilotError


@dataclass
class _Beside:
    """A newcomer's prefill in flight beside the decode steps (:meth:`Scheduler._launch_beside`)."""

    request: int
    event: object  # torch.cuda.Event recorded after the prefill (None on the CPU: done)
    first: torch.Tensor  # [1] its first token, copied to (pinned) host memory by the prefill stream
    arrival: float  # seconds from the run's start when its slot freed
    delay: int = 0  # tests: polls to wait before admission on the CPU



class PrefillBeside:
    """The scheduler's prefill-beside methods; uses its ``runner``, ``drafter``, ``prefill_beside``,
    ``_pending``, ``_side``, ``_beside_delay`` and its ``_prefill_row`` / ``_admit`` / ``_rows_prefill``."""

    def can_prefill_beside(self) -> bool:
        """True when a refill can run beside the decode steps: newcomers prefill into their own rows
        (:meth:`_rows_prefill`), the target is dense (a parked row's verify writes only KV slots
        past its prompt, which the prefill does not touch; recurrent state or a sliding-window ring
        would be shared), and there is more than one slot."""
        r = self.runner
        return self._rows_prefill() and r.model.config.is_dense and r.batch > 1

    def _use_beside(self) -> bool:
        if not self.prefill_beside:
            return False
        if not self.can_prefill_beside():
            raise SpecpilotError("prefill_beside needs row prefill on the Triton fast path (a dense target, a "
                                 "drafter that takes one row's context) and more than one slot")
        return True

    def _launch_beside(self, freed: list[int], now: float, queue: deque, slot: list, length: list[int],
                       requests, out) -> None:
        """Start the prefill of a queued request in each freed slot, beside the decode steps.

        The slot is parked first: its committed length is set to the newcomer's prompt length, so
        the decode steps that run meanwhile (which verify every row; a parked row commits nothing)
        write the row's KV cache and draft cache only at slots >= the prompt's, while the prefill
        writes the prompt's slots 0 .. P-1 and the drafter's context of them (``observe_row``); the
        parked row's own logits are garbage and never read. On CUDA the prefill is queued on a
        second stream (after everything queued so far on the main one) and an event marks its end;
        :meth:`_poll` admits the request once the event has passed. The prefill makes the same
        ``prefill_row`` calls (same chunks) as a blocking refill, so a request's tokens do not
        depend on which of the two served it. ``arrival_s`` = ``now`` (when the slot freed).
        """
        runner, dev = self.runner, self.runner.device
        cuda = dev.type == "cuda"
        for b in freed:
            if not queue:
                return
            i = queue.popleft()
            p = requests[i].prompt_ids
            runner.park_row(b, len(p))
            length[b] = len(p)
            side = None
            if cuda:
                if self._side is None:
                    self._side = torch.cuda.Stream(device=dev)
                side = self._side
                side.wait_stream(torch.cuda.current_stream(dev))
            first = torch.empty(1, dtype=torch.long, pin_memory=cuda)
            with torch.inference_mode(), (torch.cuda.stream(side) if cuda else _nullcontext()):
                logits = self._prefill_row(b, p, set_length=False)
                first.copy_(logits.argmax(-1).reshape(1), non_blocking=cuda)
                ev = None
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record(side)
            self._pending[b] = _Beside(i, ev, first, now, self._beside_delay)

    def _poll(self, queue: deque, slot: list, length: list[int], last: torch.Tensor, requests,
              out, t0: float) -> tuple[torch.Tensor, list[int]]:
        """Admit every pending newcomer whose prefill has finished (waiting for the first one when
        no request is running, so an empty batch does not spin); a newcomer done at once (a
        one-token budget, EOS) frees its slot for the next in the queue. Returns the anchors with
        the admitted rows' first tokens, and the slots admitted."""
        dev = self.runner.device
        running = any(s is not None for s in slot)
        if not running:  # nothing to decode meanwhile: wait for the earliest launched prefill
            b0 = min(self._pending, key=lambda b: self._pending[b].arrival)
            p0 = self._pending[b0]
            if p0.event is not None:
                p0.event.synchronize()
            p0.delay = 0
        admitted = []
        for b, p in list(self._pending.items()):
            if p.event is not None and not p.event.query():
                continue
            if p.delay > 0:
                p.delay -= 1
                continue
            admitted.append(b)
        if not admitted:
            return last, admitted
        last = last.clone()
        now = time.perf_counter() - t0  # no device synchronization: the events have passed
        again = []
        for b in admitted:
            p = self._pending.pop(b)
            if p.event is not None:
                torch.cuda.current_stream(dev).wait_event(p.event)
            tok = int(p.first[0])
            last[b] = tok
            slot[b] = p.request
            if self._admit(b, p.request, tok, p.arrival, now - p.arrival, now, requests, out):
                slot[b] = None  # done at once (a budget of one token, or EOS): the slot frees again
                again.append(b)
        self._launch_beside(again, now, queue, slot, length, requests, out)
        return last, admitted

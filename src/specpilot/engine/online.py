"""Online continuous batching: the scheduler's engine loop in its own thread, fed while it runs.

:class:`OnlineScheduler` is a :class:`~specpilot.engine.scheduler.Scheduler` (the same slots,
decode steps, refills and verify / commit code: :meth:`Scheduler._iteration` and
:meth:`Scheduler._refill`) whose queue is filled by other threads while it runs instead of being a
fixed list. Requests are submitted (:meth:`OnlineScheduler.submit`) with two callbacks, called in
the engine thread: ``on_tokens(ids)`` after every step that committed tokens to the request (its
first token after prefill, then each verify step's committed tokens, cut to the budget and EOS as
in a closed-loop run), and ``on_finish(result, reason)`` once. ``on_tokens`` returning True ends
the request after that step (a stop string found in its text): the step's tokens are the last it
gets. A request can be cancelled (:meth:`cancel`, e.g. a client that disconnected): a queued one
is dropped, a running one leaves its slot before the next step and the slot is refilled from the
queue. At most ``max_queue`` requests wait for a slot; one more is refused with :class:`QueueFull`
(the server answers 429), never dropped.

Every request enters its slot through :meth:`Scheduler._refill` (the engine is started once with a
short warm-up run, :meth:`start`), so a request's prompt takes one path whatever else is running:
the batch invariance of closed-loop continuous batching (outputs equal AR token for token at every
concurrency) carries over. Times (seconds from :meth:`start`): ``arrival_s`` = when it was
submitted, ``first_token_s`` = end of its prefill step, ``finish_s`` = end of its last step.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SpecpilotError
from ..tuning.timing import clock
from .runner import TargetRunner
from .scheduler import Request, RequestResult, Scheduler
from .verify import accept_greedy

REASONS = ("length", "eos", "stop", "cancelled", "error")  # why a request finished (on_finish's reason)


class QueueFull(SpecpilotError):
    """The queue holds ``max_queue`` requests waiting for a slot (HTTP 429)."""


def _no_tokens(ids: list[int]) -> bool:
    return False


def _no_finish(result: RequestResult, reason: str) -> None:
    return None


@dataclass
class Submission:
    """One request for :meth:`OnlineScheduler.submit`.

    Attributes:
        prompt_ids: the prompt's token ids (non-empty); max_new_tokens: its budget (>= 1).
        ignore_eos: decode the whole budget past the target's EOS.
        on_tokens: called in the engine thread with each step's new token ids; True ends the
            request after that step (reason ``stop``).
        on_finish: called in the engine thread once, with the request's
            :class:`~specpilot.engine.scheduler.RequestResult` and one of :data:`REASONS`.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    on_tokens: Callable[[list[int]], bool] = _no_tokens
    on_finish: Callable[[RequestResult, str], None] = _no_finish


@dataclass
class Counters:
    """Totals since :meth:`OnlineScheduler.start` (read by ``/metrics``)."""

    submitted: int = 0
    rejected: int = 0  # refused with QueueFull
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    prompt_tokens: int = 0
    output_tokens: int = 0
    verify_steps: int = 0  # of finished requests (tau = committed tokens / verify steps)
    committed: int = 0  # tokens committed by those steps, bonus included


class OnlineScheduler(Scheduler):
    """Continuous batching over ``runner.batch`` slots, fed while it runs (module docstring).

    Args:
        runner, drafter, accept, eos_id, prefill_chunk, overlap: as :class:`Scheduler`.
        max_queue: requests that may wait for a slot (>= 0); more are refused with :class:`QueueFull`.
    Raises:
        SpecpilotError: a negative ``max_queue``, and as :class:`Scheduler`.
    """

    def __init__(self, runner: TargetRunner, drafter=None, accept: Callable = accept_greedy,
                 eos_id: int | None = None, max_queue: int = 64, prefill_chunk: int | None = None,
                 overlap: bool = False):
        super().__init__(runner, drafter, accept=accept, eos_id=eos_id, profile=False,
                         prefill_chunk=prefill_chunk, overlap=overlap)
        if max_queue < 0:
            raise SpecpilotError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = int(max_queue)
        self.counters = Counters()
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._incoming: deque[int] = deque()  # submitted, not yet seen by the engine thread
        self._waiting = 0  # submitted and not yet in a slot (nor cancelled)
        self._subs: dict[int, Submission] = {}
        self._cancelled: set[int] = set()
        self._requests: dict[int, Request] = {}
        self._out: dict[int, RequestResult] = {}
        self._sent: dict[int, int] = {}
        self._arrival: dict[int, float] = {}
        self._gone: list[int] = []
        self._slots: list[int | None] = [None] * runner.batch
        self._next = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._online = False  # False during the warm-up run: the overrides below pass through

    # ---- other threads -------------------------------------------------------------------
    def start(self, warmup_prompt: list[int]) -> None:
        """Warm the engine up (a short closed-loop run of ``warmup_prompt`` in every slot: first
        allocations, the proposer started) and start the engine thread."""
        with torch.inference_mode():
            self.run([Request(list(warmup_prompt), 4)] * self.runner.batch)
        self.on_finish, self._online = self._finished, True
        self._t0 = clock(self.runner.device)
        self._thread = threading.Thread(target=self._main, name="specpilot-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the engine thread (requests still in flight are finished as ``cancelled``)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    def submit(self, sub: Submission) -> int:
        """Queue a request; returns its id.

        Raises:
            QueueFull: ``max_queue`` requests already wait for a slot.
            SpecpilotError: an empty prompt, a budget < 1, the engine stopped or failed.
        """
        if not sub.prompt_ids or sub.max_new_tokens < 1:
            raise SpecpilotError("a request needs a non-empty prompt and max_new_tokens >= 1")
        with self._cv:
            if self.error is not None or self._stopping:
                raise SpecpilotError(f"the engine is not running ({self.error or 'stopped'})")
            if self._waiting - sum(s is None for s in self._slots) >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"the queue holds --max-queue {self.max_queue} requests waiting for a slot")
            i, self._next = self._next, self._next + 1
            self._subs[i] = sub
            self._requests[i] = Request(list(sub.prompt_ids), int(sub.max_new_tokens), ignore_eos=sub.ignore_eos)
            self._out[i] = RequestResult()
            self._sent[i] = 0
            self._arrival[i] = clock(torch.device("cpu")) - self._t0
            self._incoming.append(i)
            self._waiting += 1
            self.counters.submitted += 1
            self.counters.prompt_tokens += len(sub.prompt_ids)
            self._cv.notify_all()
        return i

    def cancel(self, i: int) -> None:
        """Cancel request ``i`` (queued: dropped; running: its slot frees before the next step)."""
        with self._cv:
            if i in self._subs:
                self._cancelled.add(i)
                self._cv.notify_all()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (started, not stopped, no error)."""
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def load(self) -> tuple[int, int]:
        """(requests waiting for a slot, requests in slots)."""
        with self._cv:
            return self._waiting, sum(s is not None for s in self._slots)

    # ---- the engine thread ---------------------------------------------------------------
    def _main(self) -> None:
        try:
            with torch.inference_mode():
                self._serve()
        except BaseException as e:  # the server reports it (/health) and fails every request in flight
            with self._cv:
                self.error = e
            for i in list(self._subs):
                self._end(i, "error")

    def _serve(self) -> None:
        runner, B = self.runner, self.runner.batch
        slot = self._slots
        length = [int(x) for x in runner.length.tolist()]
        last = torch.zeros(B, dtype=torch.long, device=runner.device)
        queue: deque[int] = deque()
        pipe = self._pipe()
        reqs, out, t0 = self._requests, self._out, self._t0
        while self._take(queue, slot):
            for b, i in enumerate(slot):  # cancelled requests leave their slots
                if i is not None and i in self._cancelled:
                    slot[b] = None
                    self._end(i, "cancelled", clock(runner.device) - t0)
            idle = [b for b in range(B) if slot[b] is None]
            if idle and queue:
                last = self._refill(idle, clock(runner.device) - t0, queue, slot, length, last, reqs, out, t0)
            if any(s is not None for s in slot):
                last = self._iteration(pipe, queue, slot, length, last, reqs, out, t0)
            self._forget()
        for i in list(self._subs):
            self._end(i, "cancelled")

    def _take(self, queue: deque, slot: list) -> bool:
        """Move submitted requests into the engine's queue (cancelled ones dropped); wait while
        nothing runs or waits. False when the scheduler is stopping."""
        with self._cv:
            while not self._stopping and not self._incoming and not queue and all(s is None for s in slot):
                self._cv.wait()
            if self._stopping:
                return False
            queue.extend(self._incoming)
            self._incoming.clear()
            dropped = [i for i in queue if i in self._cancelled]
        for i in dropped:
            queue.remove(i)
            with self._cv:
                self._waiting -= 1
            self._end(i, "cancelled")
        return True

    def _forget(self) -> None:
        """Drop the finished requests' state (after the iteration that finished them)."""
        for i in self._gone:
            for d in (self._requests, self._out, self._sent, self._arrival):
                d.pop(i, None)
        self._gone.clear()

    def _emit(self, i: int) -> bool:
        """Send request i's tokens not yet sent; True when its ``on_tokens`` asks to stop."""
        ids = self._out[i].output_ids
        new = ids[self._sent[i]:]
        self._sent[i] = len(ids)
        return bool(new) and bool(self._subs[i].on_tokens(list(new)))

    def _end(self, i: int, reason: str, now: float | None = None) -> None:
        """Finish request i with ``reason``: its last tokens sent, ``on_finish`` called once."""
        sub = self._subs.pop(i, None)
        if sub is None:
            return
        r = self._out.get(i, RequestResult())
        if now is not None:
            r.finish_s, r.decode_s = now, now - r.first_token_s
        c = self.counters
        c.finished[reason] += 1
        c.output_tokens += len(r.output_ids)
        c.verify_steps += len(r.committed_per_step)
        c.committed += sum(r.committed_per_step)
        self._cancelled.discard(i)
        self._gone.append(i)
        sub.on_finish(r, reason)

    def _finished(self, i: int) -> None:
        """Scheduler.on_finish: the budget or EOS ended request i."""
        stop = self._emit(i)
        req, ids = self._requests[i], self._out[i].output_ids
        eos = self._eos(req)
        self._end(i, "stop" if stop else "eos" if eos is not None and ids and ids[-1] == eos else "length")

    def _record(self, st, slot: list, requests, out, now: float):
        """:meth:`Scheduler._record`, then each running request's new tokens sent; a request whose
        ``on_tokens`` asks to stop ends after this step (its slot freed for a refill)."""
        ids = list(slot)
        counts, committed, freed = super()._record(st, slot, requests, out, now)
        if not self._online:
            return counts, committed, freed
        for b, i in enumerate(ids):
            if i is not None and slot[b] is not None and self._emit(i):
                slot[b] = None
                freed.append(b)
                self._end(i, "stop", now)
        return counts, committed, freed

    def _admit(self, b: int, i: int, first: int, arrival: float, prefill_s: float, first_s: float,
               requests, out) -> bool:
        """:meth:`Scheduler._admit` with the request's own arrival time; its first token sent."""
        if not self._online:
            return super()._admit(b, i, first, arrival, prefill_s, first_s, requests, out)
        with self._cv:
            self._waiting -= 1
        done = super()._admit(b, i, first, self._arrival[i], prefill_s, first_s, requests, out)
        if done:
            return True
        if self._emit(i):
            self._end(i, "stop", first_s)
            return True
        return False

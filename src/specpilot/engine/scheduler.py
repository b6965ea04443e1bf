"""Closed-loop continuous batching: c request slots over one static-shape batch.

The serving regime of SGLang ``bench_serving --max-concurrency c`` (and of nano-vllm /
mini-sglang's schedulers): c requests are in flight; when one finishes, the next request from the
queue takes its slot at once, so no slot idles while work is queued and nothing waits for a
batch's slowest row. The :class:`TargetRunner` and the drafter are built once for the c slots and
kept; each slot has its own committed length (KV cache rows) and drafter state.

One scheduler iteration is

1. a **decode step** for every slot: :func:`specpilot.engine.verify.step` (the same propose /
   verify / accept as :func:`~specpilot.engine.loop.generate`) and
   :func:`~specpilot.engine.verify.advance` with count 0 for slots that hold no running request
   (idle, or the queue is empty);
2. for the slots whose request finished in that step, while the queue has requests, a **prefill
   step**: the slots' committed lengths are reset to 0 (``runner.rollback`` with a length
   vector), the newcomers' prompts are the block of their rows in one ``runner.verify`` (the
   other rows carry padding), and ``runner.commit`` keeps prompt-length entries for the new rows
   and 0 for the others. Verify never changes committed state before commit, so a running row is
   untouched by its neighbours' prefill. The drafter is told the prompt as committed context
   (``observe``: DFlash's draft cache is rewritten from position 0) and then
   ``reset_slot(b, prompt_ids, first_token, reference)`` resets its host-side per-slot state
   (lookup: the n-gram history; replay: the reference output). On the Triton fast path
   (``runner.can_prefill_rows`` and a drafter that can take one row's context) a newcomer's
   prompt instead goes into its own cache row only (``runner.prefill_row``, the running rows
   untouched).

The run starts with the first c requests through ``runner.prefill``; on the Triton fast path
that is the same ``prefill_row`` calls (same chunks) a refill makes, so every prompt of a fast-path
run takes one batch-invariant path: a request's outputs do not depend on the concurrency or on
whether it arrived first or as a refill (AR at c1 equals AR at c16 token for token).

With engine config ``mixed_prefill`` a freed slot's newcomer is prefilled in chunks inside the
next decode steps instead of a step of its own (:mod:`specpilot.engine.mixed`).

AR runs through the same loop with :class:`ARProposer` (a proposal of width 1: no drafts, the
bonus token is the AR token). Outputs equal AR token for token at every concurrency (tests).

Times (seconds from the run's start, device synchronized before each clock read): a closed-loop
client issues a request when a slot frees (``arrival_s``: 0 for the first c requests, else the
end of the step that freed the slot); ``first_token_s`` = end of its prefill step;
``finish_s`` = end of the step that committed its last token. ``decode_s`` = finish - first token
(its own prefill excluded; the neighbours' prefill steps it waited through included: that is what
continuous batching costs a running request).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..drafters.base import Proposer
from ..drafters.proposal import chain
from ..errors import SpecpilotError
from ..tuning.timing import clock
from .loop import RowResult, take_tokens
from .beside import PrefillBeside, _Beside
from .mixed import Fill, MixedPrefill
from .overlap import OverlapStepper
from .runner import TargetRunner
from .verify import accept_greedy, advance, step


@dataclass
class Request:
    """One queued request: prompt ids, its new-token budget, the replay drafter's reference
    output (AR output ids of the same prompt; only the replay drafter reads it), and whether it
    ignores the scheduler's ``eos_id``."""

    prompt_ids: list[int]
    max_new_tokens: int
    reference: list[int] | None = None
    ignore_eos: bool = False  # decode the whole budget even past the scheduler's eos_id (serving's ignore_eos)


@dataclass
class RequestResult(RowResult):
    """A :class:`RowResult` plus the request's times in the run [s from the run's start]."""

    arrival_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    prefill_stall_s: float = 0.0  # seconds of neighbours' prefill steps while this request decoded
    mixed_steps: int | None = None  # decode steps that carried a newcomer's prompt chunk (None: mixed_prefill off)


class ARProposer(Proposer):
    """The AR engine as a proposer: proposes nothing (width-1 proposals: the anchor only), so each
    verify step commits exactly the target's next token. Lets AR share the scheduler's loop."""

    kind = "ar"
    block_size = 1

    def propose(self, last: torch.Tensor, start: torch.Tensor):
        """The anchors alone: [B, 1]."""
        return chain(last, last.new_zeros((last.shape[0], 0)))

    def can_observe_row(self) -> bool:
        return True

    def observe_row(self, b: int, features, start: int) -> None:
        """No context to keep."""


def prefill_width(lengths: list[int], bucket: int) -> int:
    """Block width of a prefill step: the longest prompt rounded up to a multiple of ``bucket``
    (bounds the CUDA-graph shapes a run captures; 1 = no rounding)."""
    w = max(lengths)
    return -(-w // bucket) * bucket


def slots_needed(requests: list[Request], verify_width: int, batched: bool = True) -> int:
    """KV-cache slots per row that a run of ``requests`` needs (as
    :func:`specpilot.engine.serve.kv_slots_needed`): a running row verifies while it has fewer
    than its budget of tokens, so from at most prompt + budget - 2 committed entries, writing
    ``verify_width`` entries beyond them; with more than one slot (``batched``) an idle row, done
    at prompt + budget - 1 entries, is verified beside the others, one slot more. A prefill step's
    block is cut to the room every row has left (chunked prefill), so it needs no slots of its own."""
    return max(len(r.prompt_ids) + r.max_new_tokens for r in requests) - 2 + verify_width + (1 if batched else 0)


class Scheduler(MixedPrefill, PrefillBeside):
    """Closed-loop continuous batching over ``runner.batch`` slots (see the module docstring).

    Args:
        runner: the target runner; its batch is the concurrency c (built once, reused by runs).
        drafter: a proposer (:class:`~specpilot.drafters.base.Proposer`), or None for AR
            (:class:`ARProposer`).
        accept: chain verification rule (as :func:`~specpilot.engine.loop.generate`).
        eos_id: stop a request at this token (None: every request decodes its whole budget).
        profile: time the draft and verify phases per step (``draft_s``/``verify_s``).
        prefill_bucket: prefill block widths are rounded up to a multiple of this (default: 64
            under CUDA graphs, else 1).
        prefill_chunk: newcomers' prompts are prefilled in chunks of at most this many tokens,
            one prefill step per chunk; None = as much as fits. A prefill block is always cut to
            the KV-cache room every row has left (its entries land beyond each row's length, as
            padding in the running rows), so a prompt may take several chunks near a full cache.
        on_step: optional callback(proposal, accepted paths) after each decode step.
        overlap: launch each next draft before the host reads the acceptance
            (:mod:`specpilot.engine.overlap`; drafters that cannot overlap run as without it).
        prefill_beside: a newcomer's prefill runs on a second CUDA stream beside the running
            requests' steps instead of stopping them (:meth:`_launch_beside`; needs
            :meth:`can_prefill_beside`). Off by default: on the H200 at concurrency 16-24 the
            verify steps already keep the GPU busy, so the prefill only slowed them (BENCHMARKS.md,
            issue 15: stock 1.60x -> 1.44x AR at c24, 1.76x -> 1.72x at c16).
        mixed_prefill: token budget of a mixed step (:mod:`specpilot.engine.mixed`): newcomers'
            prompts ride in chunks in the decode steps instead of prefill steps of their own; 0 =
            off. Needs the eager path (:meth:`TargetRunner.mix_refusal`) and a budget above
            concurrency x verify width; not with ``prefill_chunk``, ``prefill_beside`` or ``overlap``.
    Raises:
        SpecpilotError: ``prefill_beside=True`` where it cannot run; bad bucket or chunk; a
            ``mixed_prefill`` this runner cannot run or combined with the settings above.
    """

    def __init__(self, runner: TargetRunner, drafter=None, accept: Callable = accept_greedy,
                 eos_id: int | None = None, profile: bool = True, prefill_bucket: int | None = None,
                 on_step: Callable | None = None, prefill_chunk: int | None = None, overlap: bool = False,
                 prefill_beside: bool = False, mixed_prefill: int = 0):
        self.runner = runner
        self.overlap = bool(overlap)
        self.prefill_beside = prefill_beside
        if drafter is not None and not isinstance(drafter, Proposer):
            raise SpecpilotError(f"drafter {type(drafter).__name__} is not a specpilot.drafters.base.Proposer: "
                                 "the scheduler calls its continuous-batching hooks (reset_slot, observe_row)")
        self.drafter = drafter if drafter is not None else ARProposer()
        self.accept, self.eos_id, self.profile, self.on_step = accept, eos_id, profile, on_step
        self.bucket = int(prefill_bucket or (64 if runner.steps is not None else 1))
        if self.bucket < 1:
            raise SpecpilotError(f"prefill_bucket must be >= 1, got {self.bucket}")
        self.chunk = None if prefill_chunk is None else int(prefill_chunk)
        if self.chunk is not None and self.chunk < 1:
            raise SpecpilotError(f"prefill_chunk must be >= 1, got {self.chunk}")
        self.on_finish: Callable[[int], None] | None = None  # called with a request's index when it finishes
        self.steps = 0  # decode steps of the last run
        self.overlapped = False  # whether the last run's decode steps overlapped (engine.overlap)
        self.prefill_steps = 0  # prefill steps of the last run (the initial fill included)
        self.beside = False  # whether the last run prefilled refills beside the decode steps
        self._pending: dict[int, _Beside] = {}  # slot -> its newcomer's prefill in flight
        self._side = None  # the prefill stream (CUDA)
        self._beside_delay = 0  # tests: polls a finished CPU prefill waits before it is admitted
        self.mixed = int(mixed_prefill or 0)
        self.mixed_steps = 0  # decode steps of the last run that carried prompt chunks
        self._filling: dict[int, Fill] = {}  # slot -> its newcomer being prefilled in mixed steps
        if self.mixed:
            self._check_mixed()

    @property
    def verify_width(self) -> int:
        """The proposer's tokens per verify forward."""
        return int(self.drafter.verify_width)

    def _rows_prefill(self) -> bool:
        """Newcomers prefill in their own rows (:meth:`TargetRunner.prefill_row`) when the runner
        and the proposer can (the Triton step on a GPU); else one block over every row."""
        return self.runner.can_prefill_rows and self.drafter.can_observe_row()

    def _check(self, requests: list[Request]) -> None:
        if not requests:
            raise SpecpilotError("no requests to serve")
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise SpecpilotError(f"request {i} has an empty prompt")
            if r.max_new_tokens < 1:
                raise SpecpilotError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        need = slots_needed(requests, self.verify_width, self.runner.batch > 1)
        if need > self.runner.max_seq:
            raise SpecpilotError(f"continuous batching needs {need} KV-cache slots per row (longest prompt + "
                                 f"budget - 2 + verify width, + 1 with several slots) but the cache holds {self.runner.max_seq}")

    def run(self, requests: list[Request]) -> list[RequestResult]:
        """Serve ``requests`` in queue order; returns one :class:`RequestResult` per request, in order.

        Raises SpecpilotError for an empty list, an empty prompt or a budget < 1, and when the
        KV cache is too small (:func:`slots_needed`).
        """
        self._check(requests)
        B = self.runner.batch
        out = [RequestResult() for _ in requests]
        slot: list[int | None] = [None] * B  # request index per slot (None = idle)
        length = [0] * B  # committed entries per row, known on the host
        self.steps = self.prefill_steps = self.mixed_steps = 0
        self._filling.clear()
        self._decode_times: list[float] = []  # seconds of this run's decode steps that carried no chunk
        queue = deque(range(len(requests)))
        t0 = clock(self.runner.device)
        last = self._start(queue, slot, length, requests, out, t0)
        if isinstance(self.drafter, ARProposer) and self.eos_id is None and self.on_step is None and not self.mixed:
            self._loop_ar(queue, slot, length, last, requests, out, t0)
        else:
            self._loop(queue, slot, length, last, requests, out, t0)
        return out

    def _start(self, queue: deque, slot: list, length: list[int], requests: list[Request],
               out: list[RequestResult], t0: float) -> torch.Tensor:
        """Prefill the first c requests (idle rows repeat request 0) and start the proposer; returns
        the anchors [B]. ``runner.prefill`` on the Triton fast path makes per row exactly the
        ``prefill_row`` calls a refill of that request would make (:meth:`_refill`, same chunks), so
        a request's prompt K/V and first token do not depend on whether it came first or as a
        refill; elsewhere one eager block."""
        runner, drafter, dev, B = self.runner, self.drafter, self.runner.device, self.runner.batch
        first_idx = [queue.popleft() for _ in range(min(B, len(requests)))]
        prompts = [requests[i].prompt_ids for i in first_idx]
        prompts += [prompts[0]] * (B - len(prompts))
        with torch.inference_mode():
            last_logits, feats, _ = runner.prefill(prompts, chunk=self.chunk)
            last = last_logits.argmax(-1)
            drafter.start(runner, prompts, feats, last)
        firsts = last.tolist()
        t1 = clock(dev)
        self.prefill_steps += 1 if runner.prefill_path == "eager" else \
            sum(-(-len(p) // (self.chunk or len(p))) for p in prompts)
        freed = []
        for b, p in enumerate(prompts):
            length[b] = len(p)
        for b, i in enumerate(first_idx):
            slot[b] = i
            if self._admit(b, i, firsts[b], 0.0, t1 - t0, t1 - t0, requests, out):
                slot[b] = None
                freed.append(b)
        self.beside = self._use_beside()
        self._pending.clear()
        if self.mixed:
            self._fill(freed, t1 - t0, queue, length)
            return last
        if self.beside:
            self._launch_beside(freed, t1 - t0, queue, slot, length, requests, out)
            return last
        return self._refill(freed, t1 - t0, queue, slot, length, last, requests, out, t0)

    def _loop(self, queue: deque, slot: list, length: list[int], last: torch.Tensor, requests: list[Request],
              out: list[RequestResult], t0: float) -> None:
        """Decode steps (and the refills between them) until the queue and every slot are empty."""
        pipe = self._pipe()
        while any(s is not None for s in slot) or self._pending or self._filling:
            last = self._iteration(pipe, queue, slot, length, last, requests, out, t0)

    def _pipe(self) -> OverlapStepper | None:
        """The overlap stepper of a run (None: steps one at a time); sets :attr:`overlapped`."""
        runner, drafter = self.runner, self.drafter
        pipe = OverlapStepper(runner, drafter, self.accept) if self.overlap and drafter.can_overlap() else None
        self.overlapped = pipe is not None
        return pipe

    def _iteration(self, pipe: OverlapStepper | None, queue, slot: list, length: list[int], last: torch.Tensor,
                   requests, out, t0: float) -> torch.Tensor:
        """One scheduler iteration (module docstring): admit finished beside-prefills, one decode step
        for every slot, the refills of the slots it freed. Returns the anchors [B] of the next step.
        ``queue``, ``requests`` and ``out`` may be any containers indexed by request id (the online
        scheduler, :mod:`specpilot.engine.online`, keys them by id)."""
        runner, drafter = self.runner, self.drafter
        if self.mixed:
            return self._iteration_mixed(queue, slot, length, last, requests, out, t0)
        if self._pending:  # admit the newcomers whose prefill finished beside the last steps
            last, _ = self._poll(queue, slot, length, last, requests, out, t0)
            if not any(s is not None for s in slot):
                return last
        if pipe is not None:  # the next draft runs while the host does this step's bookkeeping
            st = pipe.step(last, [0 if i is None else requests[i].max_new_tokens - len(out[i].output_ids)
                                  for i in slot])
        else:
            st = step(runner, drafter, last, self.accept, self.profile)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(st.proposal, st.paths)
        now = st.t_end - t0
        counts, committed, freed = self._record(st, slot, requests, out, now)
        last = pipe.advance(committed) if pipe is not None else advance(runner, drafter, st, counts, committed)
        for b in range(runner.batch):
            length[b] += counts[b]
        if self.beside:
            self._launch_beside(freed, now, queue, slot, length, requests, out)
            return last
        return self._refill(freed, now, queue, slot, length, last, requests, out, t0)

    def _record(self, st, slot: list, requests: list[Request], out: list[RequestResult], now: float):
        """Commit one step's tokens to each running request (budgets, EOS); returns (counts kept per
        row, tokens kept per row, the slots whose request finished)."""
        counts, committed, freed = [], [], []
        for b, i in enumerate(slot):
            if i is None:
                counts.append(0), committed.append([])
                continue
            r = out[i]
            done = take_tokens(r, st.proposed[b], requests[i].max_new_tokens, self._eos(requests[i]))
            counts.append(r.committed_per_step[-1])
            committed.append(st.proposed[b][: counts[-1]])
            if self.profile:
                r.draft_s += st.t_verify - st.t_draft
                r.verify_s += st.t_end - st.t_verify
            if done:
                r.finish_s = now
                r.decode_s = r.finish_s - r.first_token_s
                slot[b] = None
                freed.append(b)
                if self.on_finish is not None:
                    self.on_finish(i)
        return counts, committed, freed

    def _loop_ar(self, queue, slot, length, last, requests, out, t0) -> None:
        """AR without EOS: every running row commits exactly one token per step, so the host knows
        when each request finishes without reading tokens; the device is synchronized only when a
        request finishes (its tokens are read then) and for refills, not every step (as
        :func:`~specpilot.engine.loop.generate_ar`). ``verify_s`` = ``decode_s``."""
        runner, dev, B = self.runner, self.runner.device, self.runner.batch
        hist: list[torch.Tensor] = []  # next token of every row, per step
        begin = [0] * B  # step index where the slot's request started decoding
        left = [0] * B
        for b, i in enumerate(slot):
            if i is not None:
                left[b] = requests[i].max_new_tokens - len(out[i].output_ids)
        counts_dev = None  # 1 per running slot, on the device: a host tensor would be copied every
        # step, and a copy from pageable memory waits for the device, so the host could not queue
        # the next step while the device runs this one; rebuilt only when the running slots change
        while any(i is not None for i in slot) or self._pending:
            if self._pending:
                last, admitted = self._poll(queue, slot, length, last, requests, out, t0)
                for b in admitted:
                    if slot[b] is not None:
                        begin[b] = len(hist)
                        left[b] = requests[slot[b]].max_new_tokens - len(out[slot[b]].output_ids)
                counts_dev = None if admitted else counts_dev
                if not any(i is not None for i in slot):
                    continue
            if counts_dev is None:
                counts_dev = torch.tensor([1 if i is not None else 0 for i in slot], dtype=torch.long).to(dev)
            with torch.inference_mode():
                logits, _ = runner.verify(last[:, None])
                last = logits[:, 0].argmax(-1)
                runner.commit(counts_dev)
            hist.append(last)
            self.steps += 1
            done = []
            for b, i in enumerate(slot):
                if i is not None:
                    left[b] -= 1
                    length[b] += 1
                    if left[b] == 0:
                        done.append(b)
            if not done:
                continue
            toks = torch.stack(hist[min(begin[b] for b in done):], 1).tolist()
            now = clock(dev) - t0
            base = min(begin[b] for b in done)
            for b in done:
                i, r = slot[b], out[slot[b]]
                new = toks[b][begin[b] - base:]
                r.output_ids.extend(new)
                r.committed_per_step.extend([1] * len(new))
                r.finish_s = now
                r.decode_s = r.verify_s = now - r.first_token_s
                slot[b] = None
                if self.on_finish is not None:
                    self.on_finish(i)
            if self.beside:
                self._launch_beside(done, now, queue, slot, length, requests, out)
            else:
                last = self._refill(done, now, queue, slot, length, last, requests, out, t0)
            counts_dev = None
            for b, i in enumerate(slot):
                if i is not None and b in done:
                    begin[b] = len(hist)
                    left[b] = requests[i].max_new_tokens - len(out[i].output_ids)
            if len(hist) > 4096 and not self._pending and all(i is None or begin[b] > 0 for b, i in enumerate(slot)):
                cut = min(begin[b] for b, i in enumerate(slot) if i is not None) if any(
                    i is not None for i in slot) else len(hist)
                hist = hist[cut:]
                begin = [max(0, x - cut) for x in begin]

    def _prefill_row(self, b: int, prompt: list[int], set_length: bool = True) -> torch.Tensor:
        """A newcomer's prompt into cache row ``b`` alone (:meth:`TargetRunner.prefill_row`, in chunks
        of ``prefill_chunk``) and its context into the drafter's row; the logits [vocab] at its last
        token. The one path of every refill, blocking or beside the decode steps."""
        C = self.chunk or len(prompt)
        for s0 in range(0, len(prompt), C):
            logits, feats = self.runner.prefill_row(b, prompt[s0:s0 + C], s0, set_length=set_length)
            self.drafter.observe_row(b, feats, s0)
            self.prefill_steps += 1
        return logits

    def _eos(self, req: Request) -> int | None:
        """The token that ends ``req`` (None: it decodes its whole budget)."""
        return None if req.ignore_eos else self.eos_id

    def _admit(self, b: int, i: int, first: int, arrival: float, prefill_s: float, first_s: float,
               requests: list[Request], out: list[RequestResult]) -> bool:
        """Record request i's first token in slot b and reset the drafter's slot; True if it is done."""
        req, r = requests[i], out[i]
        r.arrival_s, r.prefill_s, r.first_token_s = arrival, prefill_s, first_s
        r.output_ids.append(first)
        if self.mixed and r.mixed_steps is None:
            r.mixed_steps = 0
        self.drafter.reset_slot(b, list(req.prompt_ids), first, req.reference)
        done = req.max_new_tokens <= 1 or first == self._eos(req)
        if done:
            r.finish_s, r.decode_s = first_s, 0.0
            if self.on_finish is not None:
                self.on_finish(i)
        return done

    def _refill(self, freed: list[int], now: float, queue: deque, slot: list, length: list[int],
                last: torch.Tensor, requests: list[Request], out: list[RequestResult], t0: float) -> torch.Tensor:
        """Prefill queued requests into the freed slots (repeatedly: a newcomer may finish at once)."""
        runner, dev = self.runner, self.runner.device
        while freed and queue:
            new = [(b, queue.popleft()) for b in freed[: len(queue)]]
            freed = freed[len(new):]
            ta = clock(dev)
            for b, _ in new:
                length[b] = 0
            runner.rollback(torch.tensor(length, dtype=torch.long))
            prompts = {b: requests[i].prompt_ids for b, i in new}
            rows = torch.tensor([b for b, _ in new], device=dev)
            pos = {b: 0 for b in prompts}  # prompt tokens of each newcomer committed so far
            if self._rows_prefill():
                # each newcomer's prompt into its own cache row only (the running rows are not
                # touched): T rows of work per prompt, not T x batch
                with torch.inference_mode():
                    last = last.clone()
                    for b, p in prompts.items():
                        last[b] = self._prefill_row(b, p).argmax(-1)
                        length[b] = len(p)
                        pos[b] = len(p)
            while any(pos[b] < len(p) for b, p in prompts.items()):  # one prefill step per chunk
                # every row (running, idle, new) gets this block's entries beyond its length: fit the room
                room = runner.max_seq - max(length)
                if room < 1:  # _check guarantees room >= verify width; a broken invariant must not loop
                    raise SpecpilotError(f"no KV-cache room left for a prefill step (max_seq {runner.max_seq})")
                W = min(max(len(p) - pos[b] for b, p in prompts.items()), self.chunk or runner.max_seq, room,
                        runner.max_block)
                Wb = prefill_width([W], self.bucket)
                if Wb > min(room, runner.max_block):  # padding columns write entries too
                    Wb = W
                parts = {b: p[pos[b]: pos[b] + W] for b, p in prompts.items()}
                block = torch.zeros(runner.batch, Wb, dtype=torch.long)
                for b, x in parts.items():
                    block[b, : len(x)] = torch.tensor(x, dtype=torch.long)
                block = block.to(dev)
                with torch.inference_mode():
                    logits, feats = runner.verify(block)
                    # a prompt's first output token: the argmax at its last position (in its last chunk)
                    ends = [b for b, x in parts.items() if x and pos[b] + len(x) == len(prompts[b])]
                    if ends:
                        er = torch.tensor(ends, device=dev)
                        ep = torch.tensor([len(parts[b]) - 1 for b in ends], device=dev)
                        last = last.clone()
                        last[er] = logits[er, ep].argmax(-1)
                    counts = [len(parts[b]) if b in parts else 0 for b in range(runner.batch)]
                    committed = [list(parts[b]) if b in parts else [] for b in range(runner.batch)]
                    counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
                    self.drafter.observe(feats, runner.length, counts_t, committed)
                    runner.commit(counts_t)
                for b, x in parts.items():
                    pos[b] += len(x)
                    length[b] += len(x)
                self.prefill_steps += 1
            first = last[rows]
            firsts = first.tolist()
            tb = clock(dev)
            for i in slot:  # the running requests waited through this prefill
                if i is not None:
                    out[i].prefill_stall_s += tb - ta
            for (b, i), tok in zip(new, firsts):
                slot[b] = i
                if self._admit(b, i, tok, now, tb - ta, tb - t0, requests, out):
                    slot[b] = None
                    freed.append(b)
            now = tb - t0
        return last

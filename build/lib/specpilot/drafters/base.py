"""The proposer interface: every hook the engine calls on a drafter's plug-in, with defaults.

A *proposer* turns a draft source (a drafter network, prompt lookup, the replay drafter's model, or
nothing for AR) into one :class:`~specpilot.drafters.proposal.Proposal` per verify step. The engine
(static loop :func:`specpilot.engine.loop.generate`, continuous batching
:class:`specpilot.engine.scheduler.Scheduler`, overlap scheduling
:class:`specpilot.engine.overlap.OverlapStepper`) calls only the hooks declared here; a proposer
overrides what it supports and says so through the ``can_*`` queries, so nothing probes for
attributes. SGLang's ``BaseSpecWorker`` / draft-worker classes are the model (explicit hooks,
capabilities queried, not guessed).

Lifecycle: ``start`` after the prefill; each step ``propose`` then (after verification)
``observe``; under continuous batching ``reset_slot`` when a slot takes a new request and, on the
Triton path, ``observe_row`` for its prompt; under overlap scheduling ``draft_async`` /
``proposal`` / ``observe_device`` / ``observe_host`` instead of ``propose`` / ``observe``.
"""

from __future__ import annotations

import torch

from ..errors import SpecpilotError
from .proposal import Proposal


class Proposer:
    """Base class of every proposer (see the module docstring).

    Attributes:
        kind: the proposer's name (``dflash``, ``dflash2``, ``dspark``, ``lookup``, ``replay``, ``ar``, ...).
        capture: target layers whose outputs the proposer reads (empty: none).
        synthetic: True for the replay drafter (its records are labelled synthetic).
        block_size: in the drafter's own counting (see :mod:`specpilot.drafters`).
    """

    kind: str = "proposer"
    capture: tuple[int, ...] = ()
    synthetic: bool = False
    block_size: int = 1

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward (root included); sizes the KV cache."""
        return self.block_size

    # -- the static loop ------------------------------------------------------------------------
    def start(self, runner, prompts: list[list[int]], features, first: torch.Tensor) -> None:
        """Called after prefill with the runner, the prompts, the prompt features [B, T, F] (or
        None) and the first tokens int64 [B]."""

    def propose(self, last: torch.Tensor, start: torch.Tensor) -> Proposal:
        """Candidates after ``last`` int64 [B] (the anchor, at position ``start`` int64 [B])."""
        raise NotImplementedError(f"{type(self).__name__} does not propose")

    def observe(self, features, start: torch.Tensor, counts: torch.Tensor, committed: list[list[int]]) -> None:
        """Told what was committed: features [B, P, F] of the accepted path (anchor first) at
        ``start``, counts int64 [B] (entries kept per row) and the committed tokens per row."""

    # -- continuous batching --------------------------------------------------------------------
    def reset_slot(self, b: int, prompt_ids: list[int], first_token: int, reference: list[int] | None = None) -> None:
        """Slot ``b`` now serves a new request (its prompt, first token and, for the replay
        drafter, its AR reference output). Default: no host state per slot."""

    def can_observe_row(self) -> bool:
        """Whether :meth:`observe_row` can take one row's prompt context (Triton row prefill)."""
        return False

    def observe_row(self, b: int, features, start: int) -> None:
        """A newcomer's prompt chunk: features [1, T, F] of positions ``start``.. of row ``b`` only."""
        raise SpecpilotError(f"{self.kind}: no row-wise context injection")

    # -- overlap scheduling ---------------------------------------------------------------------
    def can_overlap(self) -> bool:
        """Whether the overlap hooks below can run now (after :meth:`start`; chains drafted on the device)."""
        return False

    def observe_device(self, features, start: torch.Tensor, counts: torch.Tensor) -> None:
        """The device part of :meth:`observe` (context injection), launched before the host knows counts."""
        raise SpecpilotError(f"{self.kind} cannot overlap")

    def observe_host(self, committed: list[list[int]]) -> None:
        """The host part of :meth:`observe` (committed tokens per row)."""

    def draft_async(self, last: torch.Tensor, start: torch.Tensor):
        """Launch the next draft on the device; returns a handle for :meth:`proposal`."""
        raise SpecpilotError(f"{self.kind} cannot overlap")

    def proposal(self, handle, last: torch.Tensor) -> Proposal:
        """The proposal of a :meth:`draft_async` handle behind the anchors ``last`` [B]."""
        raise SpecpilotError(f"{self.kind} cannot overlap")

    # -- trees --------------------------------------------------------------------------------
    def set_tree(self, branch: int, depth: int) -> None:
        """Draft the spine + side-branch tree of ``branch`` leaves at each of the first ``depth``
        positions (0: a chain), for the static-tree wrapper. Default: only chains."""
        if branch:
            raise SpecpilotError(f"{self.kind} drafts no side branches")

    # -- load-aware verify length ---------------------------------------------------------------
    def use_confidence(self) -> bool:
        """Ask the proposer to attach per-draft confidences to its chains; returns whether it does
        (the load-aware verify length ranks by them). Default: it cannot."""
        return False


class WrappingProposer(Proposer):
    """A proposer around an ``inner`` one (a static tree, a verify-length policy): every hook goes
    to ``inner`` unless the subclass overrides it."""

    def __init__(self, inner: Proposer):
        self.inner = inner

    kind = property(lambda self: self.inner.kind)
    capture = property(lambda self: self.inner.capture)
    synthetic = property(lambda self: self.inner.synthetic)

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @block_size.setter
    def block_size(self, v: int) -> None:
        self.inner.block_size = v

    @property
    def verify_width(self) -> int:
        return self.inner.verify_width

    def start(self, runner, prompts, features, first) -> None:
        self.inner.start(runner, prompts, features, first)

    def propose(self, last, start) -> Proposal:
        return self.inner.propose(last, start)

    def observe(self, features, start, counts, committed) -> None:
        self.inner.observe(features, start, counts, committed)

    def reset_slot(self, b, prompt_ids, first_token, reference=None) -> None:
        self.inner.reset_slot(b, prompt_ids, first_token, reference)

    def can_observe_row(self) -> bool:
        return self.inner.can_observe_row()

    def observe_row(self, b, features, start) -> None:
        self.inner.observe_row(b, features, start)

    def can_overlap(self) -> bool:
        return self.inner.can_overlap()

    def observe_device(self, features, start, counts) -> None:
        self.inner.observe_device(features, start, counts)

    def observe_host(self, committed) -> None:
        self.inner.observe_host(committed)

    def draft_async(self, last, start):
        return self.inner.draft_async(last, start)

    def proposal(self, handle, last) -> Proposal:
        return self.inner.proposal(handle, last)

    def use_confidence(self) -> bool:
        return self.inner.use_confidence()

    def set_tree(self, branch: int, depth: int) -> None:
        self.inner.set_tree(branch, depth)

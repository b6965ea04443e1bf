"""Speculation turned down under load: a per-step goodput test, an AR step when it wins.

SmartSpec (arXiv 2406.14066: speculate only while the goodput estimate, expected committed tokens
per second of the batch, beats not speculating) and vLLM's ``disable_by_batch_size`` (speculative
decoding switched off under load) both decide per step from measured costs. Here, each step:

- speculative goodput = B x tau_hat / (draft_s + cost[N]), with ``tau_hat`` an exponential moving
  average of the committed tokens per row of the speculative steps so far (bonus included),
  ``draft_s`` the same average of the drafter's measured proposal time, ``cost[N]`` the batch's
  verify forward at the proposer's width N;
- AR goodput = B / cost[1] (one token per row from a width-1 forward).

When AR wins, the step proposes only the anchors (width 1: an AR step through the same verify and
commit, so the output is the target's greedy tokens either way) and the drafter is not run; every
``probe_every``-th step speculates anyway, so ``tau_hat`` follows the text. ``cost`` is profiled at
the first :meth:`GoodputGate.start` for the runner's batch
(:func:`~specpilot.drafters.verify_budget.profile_step_costs`, as the load-aware verify length does).
Engine config ``verify_budget: goodput``; the rounds' ``spec_gate`` direction (cost term
``speculation``: the measured per-token time of speculating above AR's at the regime's concurrency).
"""

from __future__ import annotations

import torch

from ..tuning.timing import clock
from .base import WrappingProposer
from .proposal import chain
from .verify_budget import profile_step_costs

EMA = 0.3  # weight of the newest speculative step in tau_hat and draft_s
PROBE_EVERY = 8  # while AR wins, every this-many-th step speculates to re-measure tau


class GoodputGate(WrappingProposer):
    """Wraps a chain or tree proposer: each step either its proposal or an AR step (module docstring).

    Args:
        inner: the drafter plug-in.
        probe_every: while AR wins, speculate every this-many-th step (>= 1).
    Attributes:
        decisions: per step, True where it speculated (for tests and reports).
    """

    kind = "goodput"

    def __init__(self, inner, probe_every: int = PROBE_EVERY):
        super().__init__(inner)
        self.probe_every = max(1, int(probe_every))
        self.cost: dict[int, float] | None = None
        self.cost_batch = None
        self.tau_hat: float | None = None
        self.draft_s: float | None = None
        self.decisions: list[bool] = []
        self._speculated = False
        self._ar_steps = 0  # AR steps since the last speculative one
        self._device = torch.device("cpu")

    def start(self, runner, prompts, features, first) -> None:
        self.inner.start(runner, prompts, features, first)
        self._device = runner.device
        if self.cost is None or self.cost_batch != runner.batch:
            self.cost = profile_step_costs(runner, sorted({1, self.inner.verify_width}))
            self.cost_batch = runner.batch

    def speculate(self) -> bool:
        """Whether speculation's goodput estimate beats AR's (True until a speculative step was seen)."""
        if self.tau_hat is None or self.draft_s is None or self.cost is None:
            return True
        spec = self.tau_hat / (self.draft_s + self.cost[self.inner.verify_width])
        return spec >= 1.0 / self.cost[1]

    def propose(self, last, start):
        if not self.speculate() and (self._ar_steps + 1) % self.probe_every:
            self.decisions.append(False)
            self._speculated = False
            self._ar_steps += 1
            return chain(last, last.new_zeros(last.shape[0], 0))
        self._ar_steps = 0
        t0 = clock(self._device)
        prop = self.inner.propose(last, start)
        dt = clock(self._device) - t0
        self.draft_s = dt if self.draft_s is None else (1 - EMA) * self.draft_s + EMA * dt
        self.decisions.append(True)
        self._speculated = True
        return prop

    def observe(self, features, start, counts, committed) -> None:
        if self._speculated:
            rows = [len(c) for c in committed if c]
            if rows:
                tau = sum(rows) / len(rows)
                self.tau_hat = tau if self.tau_hat is None else (1 - EMA) * self.tau_hat + EMA * tau
            self._speculated = False
        self.inner.observe(features, start, counts, committed)

    def can_overlap(self) -> bool:
        """AR steps are decided on the host before drafting: the plain loop, not overlap's."""
        return False

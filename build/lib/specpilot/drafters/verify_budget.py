"""Load-aware verify length: per step, how many of each request's drafted tokens to verify.

DSpark (arXiv 2607.05147, Algorithm 1) and vLLM "Adaptive Verification": score every (request,
position) slot by its **survival** value (the probability that the draft at that position and all
before it are accepted: the running product of per-position confidences), and admit slots in
descending survival order while the expected accepted tokens per second of the step rises, the
step's cost coming from a step-cost table profiled at startup. TensorRT-LLM PR #17056 takes the
global argmax of that rate over the admitted prefix (the cost curve is a staircase, not unimodal);
so does :func:`plan_lengths`. Only the verify width changes, never the drafted tokens, so the
committed tokens (and the output) are those of greedy AR decoding: a shorter row just accepts at
most its admitted prefix.

Our runner verifies a static [B, N] block, so a step's cost depends on the widest row:
``cost[N]`` (seconds of one verify forward of the whole batch at width N, profiled by
:func:`profile_step_costs`). Expected committed tokens of a row verified to length L (anchor
included) = 1 (the bonus) + sum of its survival values at positions 1..L-1.

Survival sources: DSpark's confidence head; for DFlash/DFlash2 the draft's top-1 probability per
position (:attr:`~specpilot.drafters.dflash.DFlashProposer.confidence`), an unverified proxy
(mechanisms.md section E).
"""

from __future__ import annotations

import torch

from ..errors import SpecpilotError
from ..tuning.timing import clock
from .base import WrappingProposer


def profile_step_costs(runner, widths: list[int], repeats: int = 3) -> dict[int, float]:
    """Seconds of one ``runner.verify`` of a [batch, w] chain for each width w (best of ``repeats``).

    Verify never changes committed state (nothing is committed here), so this may run between
    decode steps. Raises SpecpilotError when the cache has no room for the widest block.
    """
    out = {}
    dev = runner.device
    for w in sorted(set(widths)):
        block = torch.zeros(runner.batch, w, dtype=torch.long, device=dev)
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = clock(dev)
            runner.verify(block)
            best = min(best, clock(dev) - t0)
        out[w] = best
    runner.rollback(runner.length.clone())  # forget the uncommitted blocks (lengths unchanged)
    return out


def plan_lengths(survival: torch.Tensor, cost: dict[int, float], overhead_s: float = 0.0) -> torch.Tensor:
    """Per-row verify lengths (anchor included) maximizing expected committed tokens per second.

    Args:
        survival: float [B, N]; column 0 (the anchor) is ignored, column j >= 1 = probability that
            drafts 1..j of the row are all accepted (non-increasing along a row).
        cost: step seconds by verify width (at least width 1 and the widths up to N that may be
            chosen); a width missing from the table is never chosen.
        overhead_s: seconds per step that do not depend on the width (draft, host).
    Returns:
        int64 [B] lengths in 1..N: slots admitted in descending survival order, the prefix of
        admissions with the highest (B + admitted survival) / (cost[widest row] + overhead).
    Raises:
        SpecpilotError: no cost for width 1.
    """
    if 1 not in cost:
        raise SpecpilotError("the step-cost table needs the cost of width 1")
    B, N = survival.shape
    s = survival[:, 1:].float().cpu()
    lengths = [1] * B
    if N == 1:
        return torch.ones(B, dtype=torch.long)
    order = torch.argsort(s.reshape(-1), descending=True, stable=True).tolist()
    expected, widest = float(B), 1
    best = (expected / (cost[1] + overhead_s), list(lengths))
    for flat in order:
        b, j = divmod(flat, N - 1)
        if lengths[b] != j + 1:  # a row's positions are admitted in order (survival is non-increasing)
            continue
        lengths[b] = j + 2
        expected += float(s[b, j])
        widest = max(widest, lengths[b])
        if widest in cost:
            rate = expected / (cost[widest] + overhead_s)
            if rate > best[0]:
                best = (rate, list(lengths))
    return torch.tensor(best[1], dtype=torch.long)


class LoadAwareVerify(WrappingProposer):
    """Wraps a chain proposer: each step its proposal is truncated to :func:`plan_lengths`.

    The step-cost table is profiled at the first :meth:`start` for the runner's batch size (the
    warm-up run of serve pays for it) at every width 1..verify_width.

    Args:
        inner: a drafter plug-in whose proposals are chains with ``confidence`` (DSpark; DFlash
            and DFlash2 when their ``confidence`` flag is set, which this wrapper does).
        overhead_s: width-independent seconds per step added to every cost.
    Tree proposals pass unchanged. Raises SpecpilotError for a chain proposal without confidences.
    """

    kind = "load_aware"

    def __init__(self, inner, overhead_s: float = 0.0):
        super().__init__(inner)
        inner.use_confidence()  # DFlash / DFlash2 attach their top-1 probabilities; DSpark has its head
        self.overhead_s = float(overhead_s)
        self.cost: dict[int, float] | None = None
        self.cost_batch = None
        self.widths: list[int] = []  # chosen widest row per step (for tests and reports)

    def start(self, runner, prompts, features, first) -> None:
        self.inner.start(runner, prompts, features, first)
        if self.cost is None or self.cost_batch != runner.batch:
            self.cost = profile_step_costs(runner, list(range(1, self.inner.verify_width + 1)))
            self.cost_batch = runner.batch

    def propose(self, last, start):
        prop = self.inner.propose(last, start)
        if not prop.is_chain:  # trees keep their static shape (the planner ranks chain positions)
            return prop
        surv = prop.survival
        if surv is None:
            raise SpecpilotError(f"verify_budget load_aware needs draft confidences; proposer "
                                 f"{self.inner.kind} gives none")
        lengths = plan_lengths(surv, self.cost, self.overhead_s).to(prop.tokens.device)
        out = prop.truncate(lengths)
        self.widths.append(out.width)
        return out

    def can_observe_row(self) -> bool:
        """Refills prefill as one block over every row (the planner profiled whole-batch steps)."""
        return False

    def can_overlap(self) -> bool:
        """Truncated proposals verify through the plain loop (overlap drafts the inner chain as is)."""
        return False

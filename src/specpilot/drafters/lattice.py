"""Path-conditioned token trees from DFlash2's candidate lattice (engine config ``tree_lattice: N``).

DFlash2's candidate selector (:class:`~specpilot.models.dflash2.CandidateSelector`) keeps the K
best draft tokens of every block slot and scores each transition between adjacent slots'
candidates, ``unary[c] + edge(p -> c)``; its chain is the greedy walk through that lattice. The
softmax of a slot's scores over its K candidates given the predecessor p is the selector's
conditional P(c at slot j | p at slot j - 1) (the K-way cross-entropy it is trained with,
teacher-forced on the gold predecessor), so a path's probability is the product of its
transitions' and every tree of the paths through the lattice is *path-conditioned*: a node's
children are the best successors of that node's own token, not of the chain's (the static trees
of :mod:`specpilot.drafters.static_tree` hang the chain's next tokens under a side branch; the
block drafter's per-slot marginals make such branches mutually inconsistent).

The tree of ``N`` nodes (:func:`best_first_tree`) is the N most probable paths: best-first by
path probability (Sequoia's / DDTree's budgeted tree, here over the lattice's conditional
probabilities), computed as a beam of width N per depth (a node among the N most probable of all
depths is among the N most probable of its own depth, and its parent is at least as probable as
it is, so the N best of the beams' union are exact and ancestor-closed; ties go to the shallower
node). Sources: SGLang PR #36196 (DFlash2 beam-tree drafting from the selector's transition
scores: cumulative selector log-probability, a node budget, ancestor closure), Sequoia (Chen et
al., arXiv 2402.12374) and DDTree (Ringel & Romano, arXiv 2604.12989) for the best-first budget,
JetSpec (arXiv 2606.18394) for path-conditioned branches. Our own implementation; no code copied.

Verification is the engine's tree verify (:func:`~specpilot.engine.verify.accept_tree`): lossless
whatever the tree. :func:`prefix_ranks` gives, for a measured step, the rank of the correct path's
prefix of each depth in the best-first order: the tree of N nodes holds the prefix of depth d
exactly when that rank is <= N, which is what the replay drafter's lattice profile stores
(:class:`LatticeProfile`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecpilotError
from .dflash2 import DFlash2Proposer
from .proposal import Proposal


def transition_logprobs(unary: torch.Tensor, first: torch.Tensor, trans: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's conditional log-probabilities over each slot's K candidates.

    Args:
        unary: [B, k, K] draft logits of the candidates; first: [B, K] edges from the anchor to
            slot 1; trans: [B, k - 1, K, K] edges between adjacent slots' candidates
            (:meth:`~specpilot.models.dflash2.CandidateSelector.lattice`).
        temperature: > 0, divides the scores (1: the selector's own softmax).
    Returns:
        lp1 float32 [B, K] = log P(c at slot 1 | anchor) and lpT float32 [B, k - 1, K, K] =
        log P(c at slot j + 2 | candidate a at slot j + 1), both log-softmax over c.
    Raises:
        SpecpilotError: temperature <= 0.
    """
    if not temperature > 0:
        raise SpecpilotError(f"lattice temperature must be > 0, got {temperature}")
    lp1 = ((unary[:, 0] + first).float() / temperature).log_softmax(-1)
    lpT = ((unary[:, 1:, None, :] + trans).float() / temperature).log_softmax(-1)
    return lp1, lpT


@dataclass
class Beams:
    """The per-depth beams of a lattice (see :func:`lattice_beams`); depth d = index d - 1.

    Attributes:
        logp: per depth float32 [B, W_d] path log-probabilities, descending.
        cand: per depth int64 [B, W_d] candidate index (0..K-1) of the node's slot.
        parent: per depth int64 [B, W_d] index of the parent in the previous depth's beam (-1:
            the root).
    """

    logp: list[torch.Tensor]
    cand: list[torch.Tensor]
    parent: list[torch.Tensor]

    @property
    def offsets(self) -> list[int]:
        """Start of each depth in the depth-major concatenation of the beams."""
        out, s = [], 0
        for lp in self.logp:
            out.append(s)
            s += lp.shape[1]
        return out

    def order(self) -> torch.Tensor:
        """int64 [B, T]: the concatenation's indices by descending path probability; ties keep the
        depth-major order (a parent before its equally probable child)."""
        return torch.sort(torch.cat(self.logp, 1), dim=1, descending=True, stable=True).indices


def lattice_beams(lp1: torch.Tensor, lpT: torch.Tensor, width: int, depth: int | None = None) -> Beams:
    """The ``width`` most probable paths of each depth (1 .. ``depth``, default all slots).

    Args:
        lp1 [B, K], lpT [B, k - 1, K, K]: :func:`transition_logprobs`; width >= 1.
    Returns:
        :class:`Beams` (depth d keeps min(width, W_{d-1} x K) paths).
    """
    B, K = lp1.shape
    depth = lpT.shape[1] + 1 if depth is None else min(depth, lpT.shape[1] + 1)
    logp, cand = lp1.topk(min(width, K), dim=1)
    beams = Beams([logp], [cand], [torch.full_like(cand, -1)])
    for j in range(depth - 1):
        rows = lpT[:, j].gather(1, beams.cand[-1][:, :, None].expand(-1, -1, K))  # [B, W, K]
        total = (beams.logp[-1][:, :, None] + rows).reshape(B, -1)
        logp, flat = total.topk(min(width, total.shape[1]), dim=1)
        beams.logp.append(logp)
        beams.cand.append(flat % K)
        beams.parent.append(flat // K)
    return beams


def select_nodes(beams: Beams, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``nodes`` most probable paths of the beams as a tree, parents first.

    Returns:
        depth int64 [B, N] (1-based slot), cand int64 [B, N] (candidate index), parents int64
        [B, N + 1] (the root first, -1; a node's parent is a lower index) and logp float32 [B, N].
    Raises:
        SpecpilotError: fewer than ``nodes`` paths in the beams.
    """
    logp = torch.cat(beams.logp, 1)
    B, T = logp.shape
    if nodes > T:
        raise SpecpilotError(f"tree_lattice: {nodes} nodes asked of a lattice of {T} paths")
    dev = logp.device
    offs = beams.offsets
    depth = torch.cat([torch.full_like(c, d + 1) for d, c in enumerate(beams.cand)], 1)
    parent = torch.cat([beams.parent[0]] + [p + offs[d - 1] for d, p in enumerate(beams.parent) if d > 0], 1)
    chosen = beams.order()[:, :nodes].sort(dim=1).values  # depth-major: parents before children
    pos = torch.zeros(B, T, dtype=torch.long, device=dev)
    pos.scatter_(1, chosen, torch.arange(1, nodes + 1, device=dev).expand(B, -1))
    par = parent.gather(1, chosen)
    parents = torch.where(par >= 0, pos.gather(1, par.clamp(min=0)), 0)
    root = torch.full((B, 1), -1, dtype=torch.long, device=dev)
    return (depth.gather(1, chosen), torch.cat(beams.cand, 1).gather(1, chosen), torch.cat([root, parents], 1),
            logp.gather(1, chosen))


def best_first_tree(cands: torch.Tensor, lp1: torch.Tensor, lpT: torch.Tensor, anchor: torch.Tensor,
                    nodes: int) -> Proposal:
    """The tree of the ``nodes`` most probable lattice paths behind ``anchor`` (module docstring).

    Args:
        cands: int64 [B, k, K] candidate tokens per slot; lp1, lpT: :func:`transition_logprobs`;
        anchor: int64 [B]; nodes: N >= 1.
    Returns:
        a :class:`Proposal`: tokens int64 [B, N + 1] (anchor first), parents int64 [B, N + 1],
        scores = each node's path log-probability (root 0).
    """
    B, k, K = cands.shape
    beams = lattice_beams(lp1, lpT, nodes)
    depth, cand, parents, logp = select_nodes(beams, nodes)
    tokens = cands.reshape(B, k * K).gather(1, (depth - 1) * K + cand)
    return Proposal(torch.cat([anchor[:, None], tokens], 1), parents, None,
                    torch.cat([logp.new_zeros(B, 1), logp], 1), max_depth=k)


def prefix_ranks(beams: Beams, path: torch.Tensor) -> torch.Tensor:
    """The rank (1 = most probable) of the correct path's prefix of each depth among all lattice
    nodes in best-first order, or 0 where it is not among the beams' ``width`` best (its rank is
    then > width) or leaves the candidates.

    Args:
        beams: :func:`lattice_beams` of width W; path: int64 [B, D] the correct token's
            candidate index at each slot (-1: not a candidate), D <= the beams' depth.
    Returns:
        int64 [B, D]; non-zero entries are exact ranks <= W. The tree of N <= W nodes holds the
        prefix of depth d exactly when 0 < rank <= N (ties as :func:`select_nodes` breaks them).
    """
    order = beams.order()
    B, T = order.shape
    W = max(lp.shape[1] for lp in beams.logp)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(1, T + 1, device=order.device).expand(B, -1))
    out = torch.zeros(B, path.shape[1], dtype=torch.long, device=order.device)
    cur = torch.zeros(B, dtype=torch.long, device=order.device)
    alive = torch.ones(B, dtype=torch.bool, device=order.device)
    for d, off in zip(range(path.shape[1]), beams.offsets):
        match = beams.cand[d] == path[:, d:d + 1]
        if d:
            match &= beams.parent[d] == cur[:, None]
        alive &= match.any(1) & (path[:, d] >= 0)
        cur = match.long().argmax(1)
        r = rank.gather(1, (off + cur)[:, None])[:, 0]
        out[:, d] = torch.where(alive & (r <= W), r, 0)
        alive &= r <= W
    return out


def lattice_paths(cands: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The candidate index of ``tokens`` int64 [B, D] at slots 1..D of ``cands`` int64 [B, k, K]
    (D <= k), -1 where the token is not a candidate: the path :func:`prefix_ranks` reads."""
    D = tokens.shape[1]
    hit = cands[:, :D] == tokens[:, :, None]
    return torch.where(hit.any(-1), hit.long().argmax(-1), -1)


class LatticeTreeProposer(DFlash2Proposer):
    """DFlash2 proposer whose proposal is the best-first lattice tree of ``nodes`` nodes.

    The drafter network runs eagerly (:meth:`~specpilot.models.dflash2.DFlash2Drafter.draft_lattice`:
    the block forward and the selector's K x K tables), the tree is built on the device
    (:func:`best_first_tree`, no host synchronization) and verified as any tree, verify width
    ``nodes`` + 1. The last step's lattice is kept in :attr:`last` (cands, lp1, lpT) for
    measurements (``specpilot bench trees``).

    Args:
        drafter: a network with ``draft_lattice`` (DFlash2); block_size: the chain's verify width
            (anchor + B-1 drafts; None: the drafter config's); nodes: N >= 1, at most the
            lattice's paths; temperature: of the selector's softmax (1: its own).
    Raises:
        SpecpilotError: a network without a candidate selector, or a bad node count.
    """

    graph_drafts = False  # the lattice needs the drafter states: eager drafting

    def __init__(self, drafter, *, block_size: int | None = None, nodes: int, temperature: float = 1.0):
        if not hasattr(drafter, "draft_lattice"):
            raise SpecpilotError(f"tree_lattice needs a drafter with a candidate selector (DFlash2); "
                                 f"{getattr(drafter, 'kind', type(drafter).__name__)} has none")
        super().__init__(drafter, block_size=block_size)
        K = int(drafter.candidate_selector.top_k)
        paths = sum(K ** d for d in range(1, self.n_drafts + 1))
        if not 1 <= int(nodes) <= paths:
            raise SpecpilotError(f"tree_lattice must lie in 1..{paths} (the paths of a lattice of "
                                 f"{self.n_drafts} slots x {K} candidates), got {nodes}")
        self.nodes = int(nodes)
        self.temperature = float(temperature)
        self.last = None

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward: the tree's nodes + the root."""
        return self.nodes + 1

    def set_tree(self, branch: int, depth: int) -> None:
        """A lattice tree has no spine + side-branch form: only ``branch`` 0 is accepted."""
        if branch:
            raise SpecpilotError("tree_lattice cannot be combined with tree_branch (another tree builder)")

    def use_confidence(self) -> bool:
        """Trees carry no chain confidences."""
        return False

    def can_overlap(self) -> bool:
        """Trees verify through the plain loop."""
        return False

    @torch.inference_mode()
    def propose(self, last: torch.Tensor, start: torch.Tensor) -> Proposal:
        """The lattice tree after ``last`` int64 [B] at ``start`` int64 [B]: tokens and parents
        int64 [B, N + 1]."""
        cands, unary, first, trans = self.drafter.draft_lattice(last, start, self.embed, self.lm_head, self.block_size)
        lp1, lpT = transition_logprobs(unary, first, trans, self.temperature)
        self.last = (cands, lp1, lpT)
        return best_first_tree(cands, lp1, lpT, last, self.nodes)


def lattice_tree_for(inner, config):
    """The lattice-tree proposer of engine config ``tree_lattice`` N (an
    :class:`~specpilot.engine.config.EngineConfig`) over the drafter of proposer ``inner``.

    Raises SpecpilotError for a drafter without a candidate selector, or ``tree_lattice`` combined
    with ``tree_nodes``, ``tree_branch``, ``second_level`` or ``verify_budget``."""
    others = [k for k in ("tree_nodes", "tree_branch", "second_level") if getattr(config, k)]
    if config.verify_budget != "off":
        others.append("verify_budget")
    if others:
        raise SpecpilotError(f"tree_lattice (a lattice tree) cannot be combined with {', '.join(others)}")
    if inner.kind != "dflash2":
        raise SpecpilotError(f"tree_lattice needs a drafter with a candidate selector (DFlash2); drafter "
                             f"{inner.kind!r} has none")
    return LatticeTreeProposer(inner.drafter, block_size=inner.block_size, nodes=config.tree_lattice)

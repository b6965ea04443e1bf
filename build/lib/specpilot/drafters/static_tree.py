"""Static token trees chosen from a drafter's rank profile (the ``tree_nodes`` mechanism).

A block drafter (DFlash, DFlash2, DSpark) scores every draft position of its block in one
forward, so the candidates at position j do not depend on which candidate was taken at j - 1:
any token tree whose node at depth j carries one of the drafter's top-R tokens of position j can
be built from one draft step. Which tree to verify, for a budget of N nodes, is the question
Sequoia answers (Chen et al., "Sequoia: Scalable, Robust, and Hardware-aware Speculative
Decoding", arXiv 2402.12374, the positional-acceptance tree; Medusa's static trees, Cai et al.,
arXiv 2401.10774, are picked the same way from per-head top-k accuracies): under the model that
the correct token's rank at position j is drawn independently per position with the drafter's
measured rank distribution P(rank = r | position j), a node (path of ranks r_1 .. r_d) is
accepted with probability prod_i P(rank = r_i | i), and the expected tokens a step commits are
1 + the sum of its nodes' probabilities (bonus included). Every child is less likely than its
parent, so the N most probable paths form a tree, and it is the tree of N nodes with the
largest expected acceptance (:func:`optimal_tree`, best-first over a heap).

The profile is an :class:`~specpilot.drafters.replay.AcceptanceProfile` with ``rank_recall`` (the
packaged ones: measured on the tiny drafters, or the replay profiles built from published
recall figures). The drafter plug-in still drafts a "spine + side branches" proposal
(:func:`~specpilot.drafters.proposal.spine_tree`, the spine = ranks 1, side branches = ranks
2..R at the first positions): :class:`StaticTreeProposer` gathers the tree's tokens out of it,
so the same captured draft step serves chains, spine trees and static trees, and verification
is unchanged (:func:`~specpilot.engine.verify.accept_tree`: lossless whatever the tree).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..errors import SpecpilotError
from .base import WrappingProposer
from .proposal import Proposal
from .replay import AcceptanceProfile, load_profile, profile_names

MAX_RANK = 8  # the deepest rank a node may take (DFlash2's selector keeps 8 candidates per slot)


@dataclass(frozen=True)
class TreeShape:
    """A static tree: per non-root node its parent (node index, 0 = the root), its draft position
    (1-based depth) and the rank of the drafter's candidate it carries (1 = the top token).
    Nodes are listed parents first; node indices count the root as 0.

    Attributes:
        parents, positions, ranks: tuples of int, one per non-root node.
        expected_tau: expected tokens committed per step under the profile it was chosen from
            (bonus included), or None.
    """

    parents: tuple[int, ...]
    positions: tuple[int, ...]
    ranks: tuple[int, ...]
    expected_tau: float | None = None

    def __post_init__(self):
        n = len(self.parents)
        if not (len(self.positions) == len(self.ranks) == n):
            raise SpecpilotError("tree shape: parents, positions and ranks must have one entry per node")
        for i, (p, j, r) in enumerate(zip(self.parents, self.positions, self.ranks), 1):
            if not 0 <= p < i:
                raise SpecpilotError(f"tree shape: node {i} has parent {p}, not an earlier node")
            if j != (1 if p == 0 else self.positions[p - 1] + 1):
                raise SpecpilotError(f"tree shape: node {i} at position {j} under a node at position "
                                     f"{0 if p == 0 else self.positions[p - 1]}")
            if r < 1:
                raise SpecpilotError(f"tree shape: node {i} has rank {r} (ranks start at 1)")
        seen = set(zip(self.parents, self.ranks))
        if len(seen) != n:
            raise SpecpilotError("tree shape: two children of one node carry the same rank")

    @property
    def nodes(self) -> int:
        """Non-root nodes N (verify width N + 1)."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """The deepest draft position."""
        return max(self.positions, default=0)

    @property
    def branch(self) -> int:
        """Side branches per position the drafter must propose: the largest rank - 1."""
        return max(self.ranks, default=1) - 1

    @property
    def side_depth(self) -> int:
        """The last position holding a node of rank > 1 (0 = the tree is a chain of ranks 1)."""
        return max((j for j, r in zip(self.positions, self.ranks) if r > 1), default=0)

    def parent_list(self) -> list[int]:
        """Parents of every node, root first (-1), as :class:`Proposal` takes them."""
        return [-1] + list(self.parents)

    def gather_index(self, k: int) -> list[int]:
        """Per node (root first) its column in the spine-tree proposal the drafter returns for a
        block of ``k`` drafts with :attr:`branch` side branches on the first :attr:`side_depth`
        positions: [anchor, spine 1..k, side branches position-major]. Raises SpecpilotError when
        the tree is deeper than ``k``."""
        if self.depth > k:
            raise SpecpilotError(f"tree shape reaches draft position {self.depth}, but the block has {k} drafts")
        b = self.branch
        return [0] + [j if r == 1 else 1 + k + (j - 1) * b + (r - 2) for j, r in zip(self.positions, self.ranks)]


def rank_probability(profile, j: int, r: int) -> float:
    """P(the correct token has rank ``r`` among the drafter's candidates at draft position ``j``),
    from the profile's cumulative ``rank_recall`` (SpecpilotError without one)."""
    hi = profile.recall_at(j, r)
    return max(0.0, hi - (profile.recall_at(j, r - 1) if r > 1 else 0.0))


def optimal_tree(profile, nodes: int, depth: int, max_rank: int = MAX_RANK) -> TreeShape:
    """The tree of ``nodes`` non-root nodes with the largest expected acceptance under ``profile``
    (positions' ranks independent; see the module docstring), no deeper than ``depth`` draft
    positions, ranks at most ``max_rank``.

    Best-first: a heap of candidate nodes keyed by their path probability; the most probable is
    taken and its children (ranks 1..max_rank at the next position) become candidates. Ties break
    by depth, then by the rank path, so the shape is deterministic.

    Args:
        profile: :class:`~specpilot.drafters.replay.AcceptanceProfile` with ``rank_recall``.
        nodes: N >= 1; depth: >= 1 (a block's drafts); max_rank: >= 1.
    Returns:
        the :class:`TreeShape` (``expected_tau`` set).
    Raises:
        SpecpilotError: bad sizes, or a profile without ``rank_recall``.
    """
    if nodes < 1 or depth < 1 or max_rank < 1:
        raise SpecpilotError(f"optimal tree: nodes, depth and max_rank must be >= 1, got {nodes}, {depth}, {max_rank}")
    probs = {(j, r): rank_probability(profile, j, r) for j in range(1, depth + 1) for r in range(1, max_rank + 1)}
    heap = [(-probs[1, r], 1, (r,), 0) for r in range(1, max_rank + 1)]
    heapq.heapify(heap)
    parents, positions, ranks, index, total = [], [], [], {}, 0.0
    while heap and len(parents) < nodes:
        negp, j, path, parent = heapq.heappop(heap)
        parents.append(parent), positions.append(j), ranks.append(path[-1])
        me = index[path] = len(parents)
        total += -negp
        if j < depth:
            for r in range(1, max_rank + 1):
                heapq.heappush(heap, (negp * probs[j + 1, r], j + 1, path + (r,), me))
    return TreeShape(tuple(parents), tuple(positions), tuple(ranks), expected_tau=1.0 + total)


def expected_tau_shape(profile, shape: TreeShape) -> float:
    """Expected tokens per step (bonus included) of ``shape`` under ``profile``'s rank model."""
    probs = [1.0]
    for p, j, r in zip(shape.parents, shape.positions, shape.ranks):
        probs.append(probs[p] * rank_probability(profile, j, r))
    return sum(probs)


class StaticTreeProposer(WrappingProposer):
    """Wraps a proposer (DFlash / DFlash2 / DSpark / replay): the inner proposer drafts the
    spine + side branches the shape needs, and each step's proposal is the static tree gathered
    from it. Everything else (start, observe, refills) is the inner proposer's.

    Args:
        inner: a proposer with ``block_size`` (chain verify width, anchor included) and
            ``set_tree`` (the spine + side-branch shape it drafts).
        shape: the :class:`TreeShape` (no deeper than the inner block's drafts).
    Raises:
        SpecpilotError: the shape is deeper than the block.
    """

    def __init__(self, inner, shape: TreeShape):
        super().__init__(inner)
        self.shape = shape
        self.k = int(inner.block_size) - 1
        self.index = shape.gather_index(self.k)
        inner.set_tree(shape.branch, shape.side_depth if shape.branch else 1)
        self._idx: dict[str, torch.Tensor] = {}
        self._parents: dict[tuple, torch.Tensor] = {}

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward: the tree's nodes + the root."""
        return self.shape.nodes + 1

    def can_overlap(self) -> bool:
        """Trees verify through the plain loop (the overlap pipeline is for chains)."""
        return False

    def _tensors(self, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather index [N + 1] and the parents [batch, N + 1], built once per batch and
        device (the runner keeps a tree's ancestor mask per parents tensor)."""
        dev = str(device)
        if dev not in self._idx:
            self._idx[dev] = torch.tensor(self.index, dtype=torch.long, device=device)
        key = (batch, dev)
        if key not in self._parents:
            row = torch.tensor(self.shape.parent_list(), dtype=torch.long, device=device)
            self._parents[key] = row[None].expand(batch, -1).contiguous()
        return self._idx[dev], self._parents[key]

    def propose(self, last: torch.Tensor, start: torch.Tensor) -> Proposal:
        """The static tree after ``last`` int64 [B] (tokens [B, N + 1], shared parents)."""
        prop = self.inner.propose(last, start)
        idx, parents = self._tensors(prop.tokens.shape[0], prop.tokens.device)
        return Proposal(prop.tokens.index_select(1, idx), parents)


def tree_profile_name(config, replay=None, kind: str | None = None):
    """The rank profile a static tree is chosen from: engine config ``tree_profile`` (a packaged
    profile's name or a path), else the replay drafter's own profile, else the packaged profile
    measured on the tiny drafter of that kind (``tiny_{kind}_ranks``). Returns a profile name,
    path or :class:`~specpilot.drafters.replay.AcceptanceProfile`. Raises SpecpilotError naming
    ``tree_profile`` when none applies."""
    if config.tree_profile:
        return config.tree_profile
    if replay is not None:
        return replay
    if kind and f"tiny_{kind}_ranks" in profile_names():
        return f"tiny_{kind}_ranks"
    raise SpecpilotError(f"tree_nodes needs a rank profile for drafter {kind!r}: set the engine config's "
                         f"tree_profile (packaged: {', '.join(profile_names())})")


def static_tree_for(inner, config, replay=None) -> StaticTreeProposer:
    """Wrap the proposer ``inner`` in the static tree of engine config ``tree_nodes`` (N >= 1; an
    :class:`~specpilot.engine.config.EngineConfig`), chosen by :func:`optimal_tree` from
    :func:`tree_profile_name`'s profile for the inner block's drafts. Raises SpecpilotError for
    ``tree_nodes`` < 1, or one combined with ``tree_branch`` / ``second_level`` (other tree builders)."""
    n = config.tree_nodes
    if n < 1:
        raise SpecpilotError(f"tree_nodes must be a positive integer (non-root tree nodes), got {n!r}")
    if config.tree_branch or config.second_level:
        raise SpecpilotError("tree_nodes (a static tree) cannot be combined with tree_branch or second_level")
    source = tree_profile_name(config, replay, inner.kind if replay is None else None)
    profile = source if isinstance(source, AcceptanceProfile) else load_profile(source)
    shape = optimal_tree(profile, n, int(inner.block_size) - 1)
    return StaticTreeProposer(inner, shape)

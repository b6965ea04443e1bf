"""Lattice trees under the replay drafter: the measured behaviour of a real drafter's lattice trees
(:mod:`specpilot.drafters.lattice`) as a replay profile section, and the replay proposer that
emulates it for any node budget.

What a lattice tree of N nodes commits is decided by one number per depth: the best-first rank of
the correct continuation's prefix of that depth among all lattice nodes (:func:`~specpilot.drafters.lattice.prefix_ranks`).
The tree holds the prefix of depth d exactly when that rank is <= N, and a child's rank exceeds its
parent's, so the accepted drafts of a step are A(N) = #{d : rank_d <= N} and

    P(A(N) >= d) = P(rank_d <= N) = R_d(N),    tau(N) = 1 + sum_d R_d(N)     (bonus included).

A profile's ``lattice`` section (:class:`LatticeProfile`, written by ``specpilot bench trees
--profile-out``) stores R_d(n) on a grid of n (:data:`RANK_GRID`, linear in between), the oracle
(P(the prefix of depth d is in the lattice at all), the bound of an unlimited budget) and, per
measured budget, the mean nodes per depth of the trees (their geometry). The replay proposer
(:class:`LatticeReplayProposer`) draws A(N) with one uniform per step and row (u < R_d(N) for
d = 1..A: exactly the distribution above, since R_d(N) falls with d) and proposes a tree of N
nodes of the measured geometry whose first node at every depth (the spine) carries the AR
reference up to depth A and a wrong token at A + 1; every other node carries a wrong token, so the
target accepts exactly A drafts and the verify costs what a lattice tree of N nodes costs.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field

import torch

from ..errors import SpecpilotError
from ..models.layers import tree_ancestors
from .lattice import lattice_beams, lattice_paths, prefix_ranks
from .proposal import Proposal
from .replay import AcceptanceProfile, ReplayProposer

RANK_GRID = tuple(sorted(set(range(1, 65)) | set(range(72, 257, 8)) | set(range(288, 1025, 32))
                         | {127, 255, 511, 1023}))


@dataclass
class LatticeProfile:
    """The lattice section of a replay profile (see the module docstring).

    Attributes:
        ranks: ascending node budgets n of the grid (>= 1).
        prefix_recall: per depth d (1..k) per grid budget, R_d(n) in [0, 1]: non-decreasing in n,
            non-increasing in d.
        shapes: measured budget (a string key, JSON) -> mean nodes per depth (k floats summing to it).
        oracle: per depth, P(the correct prefix of depth d is in the lattice), non-increasing.
        samples: measured steps.
    Raises:
        SpecpilotError: any of the above violated.
    """

    ranks: list[int]
    prefix_recall: list[list[float]]
    shapes: dict[str, list[float]] = field(default_factory=dict)
    oracle: list[float] = field(default_factory=list)
    samples: int = 0

    def __post_init__(self):
        if not self.ranks or any(b <= a for a, b in zip(self.ranks, self.ranks[1:])) or self.ranks[0] < 1:
            raise SpecpilotError("lattice profile: ranks must be ascending budgets >= 1")
        if not self.prefix_recall:
            raise SpecpilotError("lattice profile: prefix_recall needs one row per depth")
        for d, row in enumerate(self.prefix_recall, 1):
            if len(row) != len(self.ranks) or any(not 0.0 <= x <= 1.0 for x in row) \
                    or any(b < a - 1e-9 for a, b in zip(row, row[1:])):
                raise SpecpilotError(f"lattice profile: prefix_recall at depth {d} must hold {len(self.ranks)} "
                                     f"non-decreasing values in [0, 1]")
        for d, (a, b) in enumerate(zip(self.prefix_recall, self.prefix_recall[1:]), 2):
            if any(y > x + 1e-9 for x, y in zip(a, b)):
                raise SpecpilotError(f"lattice profile: prefix_recall at depth {d} exceeds depth {d - 1}'s")
        for n, row in self.shapes.items():
            if len(row) != self.depth or any(x < 0 for x in row) or abs(sum(row) - int(n)) > 0.01 * int(n) + 0.5:
                raise SpecpilotError(f"lattice profile: the shape of {n} nodes must be {self.depth} non-negative "
                                     f"counts summing to {n}")

    @property
    def depth(self) -> int:
        """Draft positions k the profile was measured over."""
        return len(self.prefix_recall)

    def recall(self, d: int, n: int) -> float:
        """R_d(n): depth d (1-based) in a tree of n nodes; linear between grid budgets, the last
        grid value beyond it, 0 for n < 1 or d beyond the profile."""
        if n < 1 or not 1 <= d <= self.depth:
            return 0.0
        row, g = self.prefix_recall[d - 1], self.ranks
        i = bisect.bisect_left(g, n)
        if i < len(g) and g[i] == n:
            return row[i]
        if i == 0:
            return row[0] * n / g[0]
        if i == len(g):
            return row[-1]
        return row[i - 1] + (row[i] - row[i - 1]) * (n - g[i - 1]) / (g[i] - g[i - 1])

    def expected_tau(self, n: int) -> float:
        """tau of a lattice tree of n nodes: 1 + sum_d R_d(n)."""
        return 1.0 + sum(self.recall(d, n) for d in range(1, self.depth + 1))

    def sample(self, n: int, rng: random.Random) -> int:
        """Accepted drafts A in 0..k of one step of a tree of n nodes (one uniform draw)."""
        u = rng.random()
        a = 0
        while a < self.depth and u < self.recall(a + 1, n):
            a += 1
        return a

    def counts(self, n: int) -> list[int]:
        """Nodes per depth (k integers summing to n) of the replay's tree of n nodes: the measured
        mean geometry of the nearest budgets (fractions interpolated in log n), rounded by largest
        remainders, with at least one node at every depth the tree can accept."""
        if not self.shapes:
            raise SpecpilotError("lattice profile has no measured tree shapes")
        keys = sorted(int(k) for k in self.shapes)
        frac = {m: [x / m for x in self.shapes[str(m)]] for m in keys}
        if n <= keys[0] or n >= keys[-1]:
            f = frac[keys[0] if n <= keys[0] else keys[-1]]
        else:
            i = bisect.bisect_left(keys, n)
            lo, hi = keys[i - 1], keys[i]
            t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
            f = [a + (b - a) * t for a, b in zip(frac[lo], frac[hi])]
        deep = max([d for d in range(1, self.depth + 1) if self.recall(d, n) > 0], default=1)
        if n <= deep:
            return [1] * n + [0] * (self.depth - n)
        total = sum(f) or 1.0
        want = [x / total * n for x in f]
        out = [int(x) for x in want]
        for d in sorted(range(self.depth), key=lambda d: out[d] - want[d])[: n - sum(out)]:
            out[d] += 1
        for d in range(deep):  # the spine reaches every depth the tree accepts
            if out[d] == 0:
                donors = [j for j in range(self.depth) if out[j] > (1 if j < deep else 0)]
                out[d] = 1
                out[max(donors, key=lambda j: out[j])] -= 1
        gap = next((d for d in range(self.depth) if out[d] == 0), self.depth)
        if gap < self.depth:  # no depth without nodes above a depth with nodes
            out[gap - 1] += sum(out[gap:])
            out[gap:] = [0] * (self.depth - gap)
        return out

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "prefix_recall": self.prefix_recall, "shapes": self.shapes,
                "oracle": self.oracle, "samples": self.samples,
                "expected_tau": {str(n): round(self.expected_tau(n), 4) for n in (15, 31, 63, 127, 255)}}

    @classmethod
    def from_dict(cls, d: dict, where: str = "lattice profile") -> "LatticeProfile":
        """Read a profile's ``lattice`` section. Raises SpecpilotError for missing or bad fields."""
        try:
            return cls(ranks=[int(x) for x in d["ranks"]], prefix_recall=[[float(x) for x in r] for r in d["prefix_recall"]],
                       shapes={str(k): [float(x) for x in v] for k, v in (d.get("shapes") or {}).items()},
                       oracle=[float(x) for x in d.get("oracle") or []], samples=int(d.get("samples") or 0))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecpilotError(f"{where}: a lattice section needs ranks and prefix_recall lists ({e})") from None


class LatticeRecorder:
    """Measures a lattice proposer's trees (:class:`~specpilot.drafters.lattice.LatticeTreeProposer`)
    against the AR references while it runs: per step and row, the prefix ranks up to ``width``
    (:func:`~specpilot.drafters.lattice.prefix_ranks`), the oracle (the prefix is in the lattice)
    and the proposed tree's nodes per depth. A row's step is counted once (a finished row keeps
    proposing at the same anchor) and only while the reference holds all its block's drafts.

    Args:
        prompts: per row the prompt ids; references: per row the AR output ids; width: >= 1.
    """

    def __init__(self, prompts: list[list[int]], references: list[list[int]], width: int = 1024):
        self.plen = [len(p) for p in prompts]
        self.ref, self.width = references, int(width)
        self.seen = [-1] * len(prompts)
        self.ranks: list[list[int]] = []
        self.oracle: list[list[int]] = []
        self.depths: list[list[int]] = []

    def wrap(self, prop) -> None:
        """Record every proposal of ``prop`` from now on."""
        orig = prop.propose

        def propose(last, start):
            out = orig(last, start)
            self.record(prop, out, start)
            return out

        prop.propose = propose

    def record(self, prop, proposal: Proposal, start: torch.Tensor) -> None:
        """One step: ``prop.last`` (cands, lp1, lpT) and its ``proposal`` at ``start`` int64 [B]."""
        cands, lp1, lpT = prop.last
        k = cands.shape[1]
        rows, toks = [], []
        for b, s in enumerate(start.tolist()):
            a = s - self.plen[b]  # output index of the step's anchor
            if a == self.seen[b] or a + k >= len(self.ref[b]):
                continue
            self.seen[b] = a
            rows.append(b)
            toks.append(self.ref[b][a + 1:a + 1 + k])
        if not rows:
            return
        idx = torch.tensor(rows, device=cands.device)
        path = lattice_paths(cands[idx], torch.tensor(toks, device=cands.device))
        self.ranks += prefix_ranks(lattice_beams(lp1[idx], lpT[idx], self.width), path).tolist()
        self.oracle += (path >= 0).long().cumprod(1).tolist()
        depth = tree_ancestors(proposal.parents[idx], k)[1][:, 1:]
        self.depths += [[int((d == j).sum()) for j in range(1, k + 1)] for d in depth]

    def mean_shape(self, k: int) -> list[float] | None:
        """Mean nodes per depth of the recorded trees (None before any step)."""
        if not self.depths:
            return None
        return [round(sum(r[d] for r in self.depths) / len(self.depths), 3) for d in range(k)]


def pooled_profile(recorders: list[LatticeRecorder], k: int, shapes: dict[str, list[float]] | None = None
                   ) -> LatticeProfile:
    """The :class:`LatticeProfile` of the recorders' pooled steps over ``k`` draft positions, on
    :data:`RANK_GRID`. Raises SpecpilotError when no step was recorded."""
    ranks = [r for rec in recorders for r in rec.ranks]
    oracle = [o for rec in recorders for o in rec.oracle]
    n = len(ranks)
    if not n:
        raise SpecpilotError("lattice profile: no step was measured (too few new tokens for the block)")
    recall = [[round(sum(1 for r in ranks if 0 < r[d] <= g) / n, 6) for g in RANK_GRID] for d in range(k)]
    return LatticeProfile(ranks=list(RANK_GRID), prefix_recall=recall, shapes=shapes or {},
                          oracle=[round(sum(o[d] for o in oracle) / n, 6) for d in range(k)], samples=n)


def lattice_of(profile: AcceptanceProfile) -> LatticeProfile | None:
    """The ``lattice`` section of a replay profile, or None when it has none."""
    d = profile.extra.get("lattice")
    return None if d is None else LatticeProfile.from_dict(d, f"profile {profile.name!r}")


def shape_parents(counts: list[int]) -> tuple[list[int], list[int]]:
    """(parents root first, spine node index per depth) of the depth-major tree with ``counts[d]``
    nodes at depth d + 1: node i of a depth hangs under node i mod (nodes of the depth above), so
    the first node of every depth (the spine) is the child of the one above."""
    parents, spine, start, prev = [-1], [], 1, (0, 1)
    for c in counts:
        if c == 0:
            break
        spine.append(start)
        parents += [prev[0] + (i % prev[1]) for i in range(c)]
        prev, start = (start, c), start + c
    return parents, spine


class LatticeReplayProposer(ReplayProposer):
    """The replay drafter proposing lattice trees of ``nodes`` nodes (module docstring).

    Args:
        references, profile, vocab_size, network, seed, row_keys, block_size: as
            :class:`~specpilot.drafters.replay.ReplayProposer` (``network``: its cost only, e.g. a
            :class:`~specpilot.drafters.lattice.LatticeTreeProposer` of the same budget).
        nodes: N >= 1.
    Raises:
        SpecpilotError: a profile without a lattice section, or one measured over another number of
            draft positions than the block's.
    """

    def __init__(self, references, profile: AcceptanceProfile, vocab_size: int, network=None, seed: int = 0,
                 row_keys=None, block_size: int | None = None, *, nodes: int):
        super().__init__(references, profile, vocab_size, network, seed, row_keys, block_size)
        lat = lattice_of(profile)
        if lat is None:
            raise SpecpilotError(f"tree_lattice under the replay drafter needs a profile with a lattice section "
                                 f"(specpilot bench trees --profile-out); {profile.name!r} has none")
        if lat.depth != self.block_size - 1:
            raise SpecpilotError(f"profile {profile.name!r}: its lattice was measured over {lat.depth} draft positions "
                                 f"(block {lat.depth + 1}); this replay drafts {self.block_size - 1}")
        if int(nodes) < 1:
            raise SpecpilotError(f"tree_lattice must be a positive integer, got {nodes}")
        self.lattice, self.nodes = lat, int(nodes)
        self.parents_row, self.spine = shape_parents(lat.counts(self.nodes))
        self._parents: dict[tuple, torch.Tensor] = {}
        depth_of = [0] * len(self.parents_row)
        for i, p in enumerate(self.parents_row[1:], 1):
            depth_of[i] = depth_of[p] + 1
        spine = set(self.spine)
        # per node after the root: (its depth, on the spine?, the offset of its wrong token off the spine)
        self._nodes = [(depth_of[j], j in spine, 1 + (1 + j) % (vocab_size - 1)) for j in range(1, len(depth_of))]
        self._recall = [lat.recall(d, self.nodes) for d in range(1, lat.depth + 1)]  # R_d(N), d = 1..k

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward: the tree's nodes + the root."""
        return self.nodes + 1

    def can_overlap(self) -> bool:
        return False

    def _network_block(self) -> None:
        if self.network.kind in ("dflash", "dflash2"):
            self.network.block_size = self.block_size

    def proposal(self, handle, last):
        """The tree after ``last`` [B]: per row the reference along the spine up to the drawn A."""
        k, V = self.block_size - 1, self.vocab
        rows = []
        for ref, i, rng in zip(self.refs, self.pos, self.rngs):
            d = ref[i:i + k]
            d = d + [ref[-1] if ref else 0] * (k - len(d))
            u, a = rng.random(), 0  # LatticeProfile.sample with R_d(N) read once
            while a < k and u < self._recall[a]:
                a += 1
            self.planted.append(a)
            rows.append([(d[dj - 1] + ((0 if dj <= a else 1) if sp else off)) % V for dj, sp, off in self._nodes])
        dev = self.device
        key = (len(rows), str(dev))
        if key not in self._parents:  # one parents tensor per batch: the runner keeps its mask
            self._parents[key] = torch.tensor(self.parents_row, dtype=torch.long, device=dev)[None].expand(
                len(rows), -1).contiguous()
        tokens = torch.cat([last[:, None], torch.tensor(rows, dtype=torch.long, device=dev)], 1)
        return Proposal(tokens, self._parents[key])

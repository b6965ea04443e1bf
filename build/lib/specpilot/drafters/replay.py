"""Replay drafter: realistic acceptance on random-weight targets, for system benchmarks only.

A random-weight target writes meaningless text, so no trained drafter can be run against it.
To measure the engine's speed at a published acceptance length anyway, :class:`ReplayProposer`
drafts the AR reference continuation of the same prompt (computed by the AR engine first) and
plants one wrong token per block at a position drawn from an *acceptance profile*, while running
a drafter network of the real drafter's shape (e.g. a random DFlash drafter), so that the draft
step costs what it would cost. The target still verifies every token with the unchanged rule
and the output still goes through token forcing; every record is marked ``synthetic``.

Acceptance profile: per-position conditional acceptance rates ``p_1 .. p_k`` (``p_j`` = chance
that draft j is accepted given drafts 1..j-1 were). Each step draws the accepted count A:
draft j is accepted with probability ``p_j`` while all before it were, and the first rejected
position gets a wrong token (reference token + 1 mod vocab), so the target rejects exactly there
(its argmax is the reference token). The expected acceptance length, bonus token included, is

    tau = 1 + E[A] = 1 + sum_{j=1..k} prod_{i=1..j} p_i        (k = block_size - 1)

(:func:`expected_tau`). Profiles are JSON files shipped in the package (``specpilot/replay_profiles/``,
listed by :func:`profile_names`) or any path.

Trees (``tree_branch`` b > 0, ``tree_depth`` d): the replay proposes the engine's "spine + side
branches" tree (:func:`~specpilot.drafters.proposal.spine_tree`): the spine as above, and at each
of the first d draft positions b side leaves standing for the drafter's next-best tokens. Where
the spine is first wrong (position j = A + 1 <= d), the reference token is among those leaves
with the chance that the correct token's rank lies in 2..b+1 given it is not 1, from the
profile's ``rank_recall`` (per position, the cumulative recall P(rank <= r | earlier positions
accepted) for r = 1..K; its first column equals the conditional acceptance); its leaf is the one of
rank r. Side leaves have no children, so a hit commits one token more. The expected tau is
:func:`expected_tau_tree`. A profile without ``rank_recall`` cannot model trees.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import torch

from ..errors import SpecpilotError
from .base import Proposer
from .proposal import chain, spine_tree



def _profile_dir():
    """The packaged replay profiles (``specpilot/replay_profiles``, package data)."""
    return files("specpilot") / "replay_profiles"


def profile_names() -> list[str]:
    """Names of the packaged acceptance profiles (file names without ``.json``)."""
    return sorted(f.name[:-5] for f in _profile_dir().iterdir() if f.name.endswith(".json"))


@dataclass
class AcceptanceProfile:
    """Conditional acceptance rates per draft position (``rates[j-1]`` = p_j)."""

    name: str
    rates: list[float]
    block_size: int = 16
    source: str = ""
    target_tau: float | None = None
    extra: dict = field(default_factory=dict)
    recall: list[list[float]] | None = None  # rank_recall: per position, P(rank <= r), r = 1..K

    def __post_init__(self):
        if not self.rates or any(not (0.0 <= p <= 1.0) for p in self.rates):
            raise SpecpilotError(f"profile {self.name!r}: conditional acceptance rates must lie in [0, 1]")
        if self.recall is not None:
            if len(self.recall) != len(self.rates):
                raise SpecpilotError(f"profile {self.name!r}: rank_recall has {len(self.recall)} positions, "
                                     f"conditional_acceptance {len(self.rates)}")
            for j, (row, p) in enumerate(zip(self.recall, self.rates), 1):
                if not row or any(not (0.0 <= x <= 1.0) for x in row) or any(b < a - 1e-9 for a, b in zip(row, row[1:])):
                    raise SpecpilotError(f"profile {self.name!r}: rank_recall at position {j} must be "
                                         f"non-decreasing values in [0, 1], got {row}")
                if abs(row[0] - p) > 1e-6:
                    raise SpecpilotError(f"profile {self.name!r}: rank_recall at position {j} starts at {row[0]}, "
                                         f"not at the conditional acceptance {p}")

    def rate(self, j: int) -> float:
        """p_j for draft position j >= 1 (the last rate repeats past the profile's length)."""
        return self.rates[min(j, len(self.rates)) - 1]

    def recall_at(self, j: int, r: int) -> float:
        """P(rank <= r | drafts 1..j-1 accepted) at draft position j >= 1 for rank r >= 1 (the last
        position repeats past the profile's length; ranks past the profile's K recall no more).

        Raises SpecpilotError for a profile without ``rank_recall``."""
        if self.recall is None:
            raise SpecpilotError(f"profile {self.name!r} has no rank_recall: it cannot model side branches")
        row = self.recall[min(j, len(self.recall)) - 1]
        return row[min(r, len(row)) - 1]

    def side_hit(self, j: int, branch: int) -> float:
        """P(the correct token at position j is among ranks 2..branch+1 | it is not rank 1)."""
        p1 = self.recall_at(j, 1)
        return 0.0 if p1 >= 1.0 else (self.recall_at(j, branch + 1) - p1) / (1.0 - p1)

    def sample(self, k: int, rng: random.Random) -> int:
        """Accepted count A in 0..k for a block of k drafts."""
        a = 0
        while a < k and rng.random() < self.rate(a + 1):
            a += 1
        return a

    def sample_tree(self, k: int, branch: int, depth: int, rng: random.Random) -> tuple[int, int | None]:
        """(A, leaf): the spine's accepted count as :meth:`sample`, and where the spine is first
        wrong at a position j = A + 1 <= depth, the side leaf (0 .. branch-1, rank leaf + 2) that
        holds the correct token, or None."""
        a = self.sample(k, rng)
        if a >= k or a + 1 > depth or branch < 1:
            return a, None
        j = a + 1
        if rng.random() >= self.side_hit(j, branch):
            return a, None
        p1, top = self.recall_at(j, 1), self.recall_at(j, branch + 1)
        u = p1 + rng.random() * (top - p1)  # the rank r with recall(r - 1) < u <= recall(r)
        for r in range(2, branch + 2):
            if u <= self.recall_at(j, r):
                return a, r - 2
        return a, branch - 1

    def to_dict(self) -> dict:
        d = {"name": self.name, "block_size": self.block_size, "source": self.source,
             "target_tau": self.target_tau, "expected_tau": round(expected_tau(self, self.block_size), 4),
             "conditional_acceptance": self.rates, **self.extra}
        if self.recall is not None:
            d["rank_recall"] = self.recall
        return d


def expected_tau(profile: AcceptanceProfile, block_size: int | None = None) -> float:
    """tau = 1 + sum_{j=1..k} prod_{i<=j} p_i with k = block_size - 1 (the bonus token counts)."""
    k = (block_size or profile.block_size) - 1
    tau, run = 1.0, 1.0
    for j in range(1, k + 1):
        run *= profile.rate(j)
        tau += run
    return tau


def expected_tau_tree(profile: AcceptanceProfile, block_size: int, branch: int, depth: int) -> float:
    """Expected tau of the spine + side-branch tree: the chain's tau plus, per position j <= depth,
    P(the spine is first wrong at j) x :meth:`AcceptanceProfile.side_hit` (a side leaf commits one
    token more). ``branch`` 0 gives :func:`expected_tau`."""
    k = block_size - 1
    tau = expected_tau(profile, block_size)
    if branch < 1:
        return tau
    run = 1.0  # P(drafts 1..j-1 accepted)
    for j in range(1, min(depth, k) + 1):
        p = profile.rate(j)
        tau += run * (1.0 - p) * profile.side_hit(j, branch)
        run *= p
    return tau


def geometric_recall(rates: list[float], ranks: int = 16, miss_ratio: float = 0.005 / 0.146) -> list[list[float]]:
    """Cumulative rank recall per position from its top-1 rate p: the miss 1 - recall(r) falls
    geometrically from 1 - p at r = 1 to ``miss_ratio`` x (1 - p) at r = ``ranks``. The default
    ratio is DFlash2's published top-1 85.4 % / top-16 99.5 % recall (inco.ai, quoted in
    notes/drafters.md): misses 0.146 -> 0.005. An assumption between those two points."""
    rho = miss_ratio ** (1.0 / (ranks - 1))
    return [[round(1.0 - (1.0 - p) * rho ** (r - 1), 6) if r > 1 else p for r in range(1, ranks + 1)] for p in rates]


def load_profile(path_or_name: str | Path) -> AcceptanceProfile:
    """Read a profile JSON (a path, or the name of a packaged profile, see :func:`profile_names`).

    Raises:
        SpecpilotError: missing file, bad JSON, or no ``conditional_acceptance`` list.
    """
    p = Path(path_or_name)
    if not p.exists() and not p.suffix:
        p = _profile_dir() / f"{path_or_name}.json"
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecpilotError(f"acceptance profile not found: {path_or_name} (packaged: "
                             f"{', '.join(profile_names())})") from None
    except json.JSONDecodeError as e:
        raise SpecpilotError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d.get("conditional_acceptance"), list):
        raise SpecpilotError(f"{p}: a profile needs a 'conditional_acceptance' list")
    recall = d.get("rank_recall")
    if recall is not None and not (isinstance(recall, list) and all(isinstance(r, list) for r in recall)):
        raise SpecpilotError(f"{p}: 'rank_recall' must be a list (per position) of lists (per rank)")
    known = {"name", "conditional_acceptance", "block_size", "source", "target_tau", "expected_tau", "rank_recall"}
    return AcceptanceProfile(name=d.get("name", Path(p.name).stem), rates=[float(x) for x in d["conditional_acceptance"]],
                             block_size=int(d.get("block_size", 16)), source=d.get("source", ""),
                             target_tau=d.get("target_tau"), extra={k: v for k, v in d.items() if k not in known},
                             recall=[[float(x) for x in r] for r in recall] if recall is not None else None)


def calibrate(target_tau: float, block_size: int = 16, slope: float = 0.006) -> list[float]:
    """Rates ``p_j = c - slope * (j - 1)`` (a gentle decline with position) whose tau is ``target_tau``."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        c = (lo + hi) / 2
        rates = [min(1.0, max(0.0, c - slope * j)) for j in range(block_size - 1)]
        if expected_tau(AcceptanceProfile("x", rates), block_size) < target_tau:
            lo = c
        else:
            hi = c
    return [round(min(1.0, max(0.0, hi - slope * j)), 6) for j in range(block_size - 1)]


class ReplayProposer(Proposer):
    """Drafts the reference continuation with profile-drawn wrong tokens (see the module docstring).

    Args:
        references: per row the AR output ids of the same prompt (first token included).
        profile: the acceptance profile.
        vocab_size: to build wrong tokens.
        network: optional proposer whose forward runs each step for its cost only (a
            :class:`~specpilot.drafters.dflash.DFlashProposer` of the real drafter's shape).
        seed: of the acceptance draws.
        row_keys: one string per row naming its request (e.g. the request id); default: the
            row's prompt tokens. Each row draws from its own generator seeded by (``seed``, key),
            so requests get different acceptance sequences, the same ones on every run, whichever
            requests share their batch.
        tree_branch, tree_depth: propose the spine + side-branch tree (see the module docstring;
            the network, when it is a DFlash proposer, drafts the same tree for its cost).
        rank_draws: plant every position by a rank draw (:meth:`_rank_planted`) instead of the
            first-wrong-position draw: the proposal a static tree
            (:class:`~specpilot.drafters.static_tree.StaticTreeProposer`) gathers its nodes from.
    Raises:
        SpecpilotError: a block size < 2; side branches with a profile without ``rank_recall``.
    """

    synthetic = True

    kind = "replay"

    def __init__(self, references: list[list[int]], profile: AcceptanceProfile, vocab_size: int,
                 network=None, seed: int = 0, row_keys: list[str] | None = None,
                 block_size: int | None = None, tree_branch: int = 0, tree_depth: int = 1,
                 rank_draws: bool = False):
        self.refs = [list(r) for r in references]
        self.block_size = int(block_size or (network.block_size if network is not None else 0) or profile.block_size)
        if self.block_size < 2:
            raise SpecpilotError(f"replay: block size must be >= 2, got {self.block_size}")
        self.branch, self.depth = int(tree_branch), int(tree_depth)
        if self.branch < 0 or self.depth < 0:
            raise SpecpilotError("replay: tree_branch and tree_depth must be >= 0")
        self.rank_draws = bool(rank_draws)
        if (self.branch or self.rank_draws) and profile.recall is None:
            raise SpecpilotError(f"replay: side branches need a profile with rank_recall; {profile.name!r} has none")
        self.capture = tuple(network.capture) if network is not None else ()
        self.profile = profile
        self.vocab = vocab_size
        self.network = network
        self.seed = int(seed)
        self.row_keys = None if row_keys is None else [str(k) for k in row_keys]
        self.rngs: list[random.Random] = []
        self.planted: list[int] = []  # accepted count drawn per step and row (for tests)
        self.leaves: list[int | None] = []  # side leaf holding the correct token per step and row (trees)
        self._pin = None  # pinned host buffer of the chain proposal (CUDA)

    @staticmethod
    def _row_rng(seed: int, key: str) -> random.Random:
        """A generator seeded from (seed, key) through SHA-256 (stable across runs and Pythons)."""
        digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))

    def start(self, runner, prompts, features, first) -> None:
        if len(prompts) != len(self.refs):
            raise SpecpilotError(f"replay: {len(prompts)} prompts but {len(self.refs)} reference outputs")
        self.device = first.device
        self.pos = [1] * len(prompts)  # output tokens so far (the first came from prefill)
        keys = self.row_keys if self.row_keys is not None else [",".join(map(str, p)) for p in prompts]
        if len(keys) != len(prompts):
            raise SpecpilotError(f"replay: {len(prompts)} prompts but {len(keys)} row keys")
        self.rngs = [self._row_rng(self.seed, k) for k in keys]
        if self.network is not None:
            self.network.start(runner, prompts, features, first)

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward: anchor + drafts (+ the side leaves of a tree)."""
        return self.block_size + self.branch * min(self.depth, self.block_size - 1)

    def propose(self, last, start):
        """A chain of block_size - 1 reference tokens with one planted wrong token (or none)."""
        if self.network is not None:
            self._network_block()
            self.network.propose(last, start)  # the real draft cost; its tokens are not used
        return self.proposal(None, last)

    def _network_block(self) -> None:
        if self.network.kind in ("dflash", "dflash2"):  # same counting: draft this block
            self.network.block_size = self.block_size
            self.network.set_tree(self.branch, self.depth)  # and its side branches

    def set_tree(self, branch: int, depth: int) -> None:
        """Propose the spine + side-branch tree (see the module docstring; 0 branches: a chain)."""
        self.branch, self.depth = int(branch), int(depth)

    def can_observe_row(self) -> bool:
        """Row-wise context injection is available when the network has it (or there is none)."""
        return self.network is None or self.network.can_observe_row()

    def observe_row(self, b: int, features, start: int) -> None:
        """A newcomer's prompt chunk (features [1, T, F] at ``start``) into the network's row b."""
        if self.network is not None:
            self.network.observe_row(b, features, start)

    # -- overlap scheduling (specpilot.engine.overlap) ----------------------------------------
    def can_overlap(self) -> bool:
        """Overlaps when its network does (or there is none); chains only."""
        return self.branch == 0 and (self.network is None or self.network.can_overlap())

    def observe_device(self, features, start, counts) -> None:
        """The network's context injection of a verified block (device work only)."""
        if self.network is not None:
            self.network.observe_device(features, start, counts)

    def observe_host(self, committed) -> None:
        """Advance each row's position in its reference by the tokens the host recorded."""
        for b, toks in enumerate(committed):
            self.pos[b] += len(toks)

    def draft_async(self, last, start):
        """The network's draft (its cost; its tokens are not used)."""
        if self.network is not None:
            self._network_block()
            self.network.draft_async(last, start)
        return None

    def proposal(self, handle, last):
        """The reference chain behind ``last`` [B] with this step's planted wrong token per row
        (a tree: and its side leaves, one of which may hold the reference token)."""
        k = self.block_size - 1
        d_ = min(self.depth, k)
        rows, alts = [], []
        for ref, i, rng in zip(self.refs, self.pos, self.rngs):
            d = ref[i:i + k]
            d = d + [ref[-1] if ref else 0] * (k - len(d))
            if self.rank_draws:
                d, alt = self._rank_planted(d, k, d_, rng)
                rows.append(d)
                alts.append(alt)
                continue
            if self.branch:
                a, leaf = self.profile.sample_tree(k, self.branch, self.depth, rng)
                self.leaves.append(leaf)
                # side leaves: tokens other than the spine's and the reference's (wrong), but the
                # reference token at the drawn leaf where the spine is first wrong
                alt = [[(d[j] + 2 + s) % self.vocab for s in range(self.branch)] for j in range(d_)]
                if leaf is not None:
                    alt[a][leaf] = d[a]
                alts.append(alt)
            else:
                a = self.profile.sample(k, rng)
            self.planted.append(a)
            if a < k:
                d[a] = (d[a] + 1) % self.vocab
            rows.append(d)
        if self.branch:
            spine = torch.tensor(rows, dtype=torch.long, device=self.device)
            return spine_tree(last, spine, torch.tensor(alts, dtype=torch.long, device=self.device).view(
                len(rows), d_, self.branch))
        host = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            # through pinned memory: a pageable host-to-device copy synchronizes the stream (it would
            # wait for the draft network's step before the verify could be queued). One buffer is
            # enough: the next proposal comes after the host read this step's acceptance, which
            # follows this copy on the stream.
            if self._pin is None or self._pin.shape != host.shape:
                self._pin = torch.empty(host.shape, dtype=torch.long, pin_memory=True)
            self._pin.copy_(host)
            host = self._pin
        return chain(last, host.to(self.device, non_blocking=True))

    def _rank_planted(self, d: list[int], k: int, d_: int, rng: random.Random) -> tuple[list[int], list[list[int]]]:
        """Rank draws for static trees (:mod:`specpilot.drafters.static_tree`): at every draft
        position j the rank R_j of the reference token among the drafter's candidates is drawn
        from the profile's rank distribution, independently per position (the model the tree
        was chosen under); the spine holds the reference token where R_j = 1 and the side leaf of
        rank R_j (2..branch + 1, first ``d_`` positions) holds it elsewhere, every other candidate
        being a distinct wrong token. Returns (spine [k], side branches [d_][branch])."""
        spine, alt = [], []
        for j in range(1, k + 1):
            u, rank = rng.random(), None
            for r in range(1, len(self.profile.recall[min(j, len(self.profile.recall)) - 1]) + 1):
                if u < self.profile.recall_at(j, r):
                    rank = r
                    break
            ref = d[j - 1]
            spine.append(ref if rank == 1 else (ref + 1) % self.vocab)
            if j <= d_:
                alt.append([ref if rank == s + 2 else (ref + 2 + s) % self.vocab for s in range(self.branch)])
        self.planted.append(next((j for j, t in enumerate(spine) if t != d[j]), k))
        return spine, alt

    def reset_slot(self, b: int, prompt_ids: list[int], first_token: int, reference=None) -> None:
        """Continuous batching: slot b now serves a new request whose AR output is ``reference``.

        Raises SpecpilotError without a reference."""
        if reference is None:
            raise SpecpilotError("replay: a request without a reference output (run AR first)")
        self.refs[b], self.pos[b] = list(reference), 1
        if b < len(self.rngs):  # the newcomer's own acceptance sequence, as start() seeds it
            self.rngs[b] = self._row_rng(self.seed, ",".join(map(str, prompt_ids)))
        if self.network is not None:
            self.network.reset_slot(b, prompt_ids, first_token)

    def observe(self, features, start, counts, committed) -> None:
        if self.network is not None:
            self.network.observe(features, start, counts, committed)
        self.observe_host(committed)

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
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SpecpilotError



def _profile_dir():
    """The packaged replay profiles (``specpilot/replay_profiles``, package data)."""
    from importlib.resources import files

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

    def __post_init__(self):
        if not self.rates or any(not (0.0 <= p <= 1.0) for p in self.rates):
            raise SpecpilotError(f"profile {self.name!r}: conditional acceptance rates must lie in [0, 1]")

    def rate(self, j: int) -> float:
        """p_j for draft position j >= 1 (the last rate repeats past the profile's length)."""
        return self.rates[min(j, len(self.rates)) - 1]

    def sample(self, k: int, rng: random.Random) -> int:
        """Accepted count A in 0..k for a block of k drafts."""
        a = 0
        while a < k and rng.random() < self.rate(a + 1):
            a += 1
        return a

    def to_dict(self) -> dict:
        return {"name": self.name, "block_size": self.block_size, "source": self.source,
                "target_tau": self.target_tau, "expected_tau": round(expected_tau(self, self.block_size), 4),
                "conditional_acceptance": self.rates, **self.extra}


def expected_tau(profile: AcceptanceProfile, block_size: int | None = None) -> float:
    """tau = 1 + sum_{j=1..k} prod_{i<=j} p_i with k = block_size - 1 (the bonus token counts)."""
    k = (block_size or profile.block_size) - 1
    tau, run = 1.0, 1.0
    for j in range(1, k + 1):
        run *= profile.rate(j)
        tau += run
    return tau


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
    known = {"name", "conditional_acceptance", "block_size", "source", "target_tau", "expected_tau"}
    return AcceptanceProfile(name=d.get("name", Path(p.name).stem), rates=[float(x) for x in d["conditional_acceptance"]],
                             block_size=int(d.get("block_size", 16)), source=d.get("source", ""),
                             target_tau=d.get("target_tau"), extra={k: v for k, v in d.items() if k not in known})


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


class ReplayProposer:
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
    """

    synthetic = True

    kind = "replay"

    def __init__(self, references: list[list[int]], profile: AcceptanceProfile, vocab_size: int,
                 network=None, seed: int = 0, row_keys: list[str] | None = None,
                 block_size: int | None = None):
        self.refs = [list(r) for r in references]
        self.block_size = int(block_size or getattr(network, "block_size", 0) or profile.block_size)
        if self.block_size < 2:
            raise SpecpilotError(f"replay: block size must be >= 2, got {self.block_size}")
        self.capture = tuple(getattr(network, "capture", ()))
        self.profile = profile
        self.vocab = vocab_size
        self.network = network
        self.seed = int(seed)
        self.row_keys = None if row_keys is None else [str(k) for k in row_keys]
        self.rngs: list[random.Random] = []
        self.planted: list[int] = []  # accepted count drawn per step and row (for tests)

    @staticmethod
    def _row_rng(seed: int, key: str) -> random.Random:
        """A generator seeded from (seed, key) through SHA-256 (stable across runs and Pythons)."""
        import hashlib

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
        return self.block_size

    def propose(self, last, start):
        """A chain of block_size - 1 reference tokens with one planted wrong token (or none)."""
        if self.network is not None:
            self._network_block()
            self.network.propose(last, start)  # the real draft cost; its tokens are not used
        return self.proposal(None, last)

    def _network_block(self) -> None:
        if getattr(self.network, "kind", "") in ("dflash", "dflash2"):  # same counting: draft this block
            self.network.block_size = self.block_size

    def can_observe_row(self) -> bool:
        """Row-wise context injection is available when the network has it (or there is none)."""
        return self.network is None or bool(getattr(self.network, "can_observe_row", lambda: False)())

    def observe_row(self, b: int, features, start: int) -> None:
        """A newcomer's prompt chunk (features [1, T, F] at ``start``) into the network's row b."""
        if self.network is not None:
            self.network.observe_row(b, features, start)

    # -- overlap scheduling (specpilot.engine.overlap) ----------------------------------------
    def can_overlap(self) -> bool:
        """Overlaps when its network does (or there is none)."""
        from .overlap import can_overlap

        return self.network is None or can_overlap(self.network)

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
        """The reference chain behind ``last`` [B] with this step's planted wrong token per row."""
        from ..drafters.proposal import chain

        k = self.block_size - 1
        rows = []
        for ref, i, rng in zip(self.refs, self.pos, self.rngs):
            d = ref[i:i + k]
            d = d + [ref[-1] if ref else 0] * (k - len(d))
            a = self.profile.sample(k, rng)
            self.planted.append(a)
            if a < k:
                d[a] = (d[a] + 1) % self.vocab
            rows.append(d)
        host = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            # through pinned memory: a pageable host-to-device copy synchronizes the stream (it would
            # wait for the draft network's step before the verify could be queued). One buffer is
            # enough: the next proposal comes after the host read this step's acceptance, which
            # follows this copy on the stream.
            if getattr(self, "_pin", None) is None or self._pin.shape != host.shape:
                self._pin = torch.empty(host.shape, dtype=torch.long, pin_memory=True)
            self._pin.copy_(host)
            host = self._pin
        return chain(last, host.to(self.device, non_blocking=True))

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

"""The engine config, typed: parsed once, strictly, from JSON / YAML / a dict; read as attributes.

An engine config names the mechanisms a speculative engine runs and their parameters (the
specpilot engine's config comes from the agent loop's last round; stock runs with none). Every key,
its type, its default and what it allows is in :data:`FIELDS`, the one place defaults live. A bad
config stops before any work with one :class:`~specpilot.errors.SpecpilotError` naming the key, the
value and what is allowed: an unknown key (with the nearest known key), a string where an integer
belongs, a float for an integer (``8.5`` is not silently 8), a boolean for a number (``true`` is not
1), a value out of range, a config that is not a JSON object, or a key set where it has no effect
(:data:`NEEDS`: ``tree_depth`` without ``tree_branch``, ``tree_profile`` without ``tree_nodes``). ``to_dict`` gives back exactly the
keys that were set, typed, for the records' ``engine_config``.

:class:`EngineSpec` is what one engine run is: the engine (``ar``, ``stock``, ``lookup``,
``specpilot``), its block size in the drafter's own counting and its config.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import SpecpilotError
from .verify import ACCEPT_RULES

ENGINES = ("ar", "stock", "lookup", "specpilot")
WEIGHT_FORMATS = ("native", "bf16", "fp32", "w12")
VERIFY_BUDGETS = ("off", "load_aware", "goodput")
STEP_PATHS = ("plain", "fused")  # the target's / drafter's step: as the model computes it, or the fused CPU step
# keys the CLI adds to records' engine_config (not engine settings): the kernels used; the execution path that ran
# (``path``: the record's teacher-forced pass follows it); why stock runs
# at a block other than its drafter's trained one (``specpilot run --block-reason``; the table's note)
RECORD_ONLY = ("kernels", "path", "block_reason")


def _int(lo: int | None = None) -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)  # noqa: E731
    return ok, "an integer" + (f" >= {lo}" if lo is not None else "")


def _bool() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, bool)), "true or false"


def _choice(names) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, str) and v in names), "one of " + ", ".join(map(repr, names))


def _name() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v is None or (isinstance(v, str) and bool(v.strip()))), "a non-empty name or path (or null)"


def _fraction() -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1  # noqa: E731
    return ok, "a number in [0, 1)"


def _block() -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)  # noqa: E731
    return ok, "an integer >= 1 (in the drafter's own counting) or 'auto'"


def _accept() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, str) and v in ACCEPT_RULES), "a verification rule: " + ", ".join(ACCEPT_RULES)


# key -> (default, (check, what is allowed), meaning). The defaults are the "mechanism off" values.
FIELDS: dict[str, tuple[Any, tuple, str]] = {
    "block_size": (None, _block(), "block size in the drafter's own counting ('auto': the drafter config's)"),
    "weight_format": ("native", _choice(WEIGHT_FORMATS), "weights as loaded, or lossless 12-bit (w12)"),
    "w12_fast": (True, _bool(), "w12: the Triton step's 12-bit loader (bit-identical to bf16); false: eager decode"),
    "tree_branch": (0, _int(0), "side branches per position of a spine tree (0: chain)"),
    "tree_depth": (1, _int(0), "draft positions that get side branches"),
    "tree_nodes": (0, _int(0), "nodes of a static tree from the drafter's rank profile (0: off)"),
    "tree_profile": (None, _name(), "rank profile of the static tree (packaged name or path)"),
    "tree_lattice": (0, _int(0), "nodes of a path-conditioned tree from DFlash2's candidate lattice (0: off)"),
    "second_level": (0, _int(0), "two-level drafting: drafts of a second block appended (0: off)"),
    "verify_budget": ("off", _choice(VERIFY_BUDGETS), "load-aware verify length per request, or goodput: an AR step when it beats speculating"),
    "overlap": (False, _bool(), "overlap scheduling: the next draft before the host's bookkeeping"),
    "accept": ("greedy", _accept(), "the verification rule (only lossless rules are registered)"),
    "replay_seed": (0, _int(), "seed of the replay drafter's acceptance draws"),
    "replay_profile": (None, _name(), "the replay drafter's acceptance profile (set by the CLI)"),
    "max_ngram": (3, _int(1), "prompt lookup: longest n-gram matched"),
    "confidence_threshold": (0.0, _fraction(), "DSpark: stop a row's chain below this survival (0: off)"),
    "mixed_prefill": (0, _int(0), "mixed prefill step: token budget of a decode step that also carries newcomers' "
                      "prompt chunks (continuous batching, eager path; 0: off)"),
    "verify_path": ("plain", _choice(STEP_PATHS), "the target's verify/decode step: plain, or fused (CPU, dense)"),
    "draft_path": ("plain", _choice(STEP_PATHS), "the drafter's draft forward: plain, or fused (CPU)"),
    "context_path": ("plain", _choice(STEP_PATHS), "the drafter's context injection: plain, or fused (CPU)"),
}


# key -> (the setting it needs to have any effect, a test of the config's values, what that setting is)
NEEDS: dict[str, tuple[str, Callable[[dict], bool], str]] = {
    "tree_depth": ("tree_branch", lambda v: v.get("tree_branch", 0) > 0, "tree_branch > 0 (a spine tree)"),
    "tree_profile": ("tree_nodes", lambda v: v.get("tree_nodes", 0) > 0, "tree_nodes > 0 (a static tree)"),
}  # (w12_fast is not here: --weight-format w12 of `specpilot run` may complete it after parsing)


def _check_effect(values: dict, where: str) -> None:
    """Refuse a key set where it has no effect (:data:`NEEDS`): a config that says more than it does."""
    for key, (other, ok, what) in NEEDS.items():
        if key in values and not ok(values):
            raise SpecpilotError(f"{where}: {key} = {values[key]!r} has no effect without {what}; set {other} or "
                                 f"drop {key}")


def _describe(v: Any) -> str:
    kind = {bool: "a boolean", str: "a string", float: "a number", int: "an integer", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
    return f"{v!r} ({kind})"


@dataclass(frozen=True)
class EngineConfig:
    """A validated engine config (see :data:`FIELDS` for every key). Build with :meth:`parse`;
    read the settings as attributes (``cfg.tree_branch``); :meth:`to_dict` for records."""

    values: dict = field(default_factory=dict)  # the keys that were set, typed, in their order

    def __getattr__(self, name: str):
        if name in FIELDS:
            return self.values.get(name, FIELDS[name][0])
        raise AttributeError(name)

    @classmethod
    def parse(cls, obj: Any, where: str = "engine config", record: bool = False) -> "EngineConfig":
        """Validate ``obj`` (a dict, e.g. from JSON/YAML; None = empty) into an EngineConfig.

        ``record``: ``obj`` is a record's ``engine_config``; keys the CLI adds there
        (:data:`RECORD_ONLY`) are dropped. Raises SpecpilotError (one message naming ``where``, the
        key, the value and what is allowed) for anything :data:`FIELDS` does not allow.
        """
        if obj is None:
            return cls({})
        if not isinstance(obj, dict):
            raise SpecpilotError(f"{where} must be a JSON object of settings, got {_describe(obj)}")
        values = {}
        for key, v in obj.items():
            if record and key in RECORD_ONLY:
                continue
            if key not in FIELDS:
                near = difflib.get_close_matches(str(key), FIELDS, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise SpecpilotError(f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(FIELDS)}")
            check, allowed = FIELDS[key][1]
            if not check(v):
                raise SpecpilotError(f"{where}: {key} = {_describe(v)} is not allowed: {allowed}")
            values[key] = v
        if not record:
            _check_effect(values, where)
        return cls(values)

    def to_dict(self) -> dict:
        """The keys that were set, with their typed values (what the records' engine_config holds)."""
        return dict(self.values)

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` set (validated as :meth:`parse` does); a value None unsets a key."""
        merged = {k: v for k, v in {**self.values, **changes}.items() if v is not None}
        return EngineConfig.parse(merged)

    def without(self, *keys: str) -> "EngineConfig":
        """A copy without ``keys``."""
        return EngineConfig({k: v for k, v in self.values.items() if k not in keys})

    def is_set(self, key: str) -> bool:
        """Whether ``key`` was given (a default is not)."""
        return key in self.values

    def verify_width(self, block_size: int) -> int:
        """An upper bound of a speculative engine's tokens per verify forward: block + 1 + the tree's
        side leaves (``tree_branch`` x min(``tree_depth``, block)) + ``second_level``; a static tree
        (``tree_nodes`` N) and a lattice tree (``tree_lattice`` N) verify N + 1 tokens."""
        if self.tree_nodes or self.tree_lattice:
            return max(block_size + 1, max(self.tree_nodes, self.tree_lattice) + 1)
        return block_size + 1 + self.tree_branch * min(self.tree_depth, block_size) + self.second_level


def tree_width_of(cfg: dict) -> int:
    """The verify width bound of a record's engine config when it verifies trees (0 for chains),
    as :meth:`EngineConfig.verify_width` sizes it; a config whose tree fields are not integers
    counts as wider than any fast-path tree (token forcing then checks it eagerly)."""
    too_wide = 1 << 30
    ints = all(isinstance(cfg.get(k, 0), int) and not isinstance(cfg.get(k, 0), bool)
               for k in ("tree_branch", "second_level", "tree_nodes", "tree_lattice", "tree_depth"))
    if not ints:
        return too_wide
    nodes = max(cfg.get("tree_nodes") or 0, cfg.get("tree_lattice") or 0)
    branch, second = cfg.get("tree_branch") or 0, cfg.get("second_level") or 0
    if nodes > 0:
        return nodes + 1
    if branch <= 0 and second <= 0:
        return 0
    bs = cfg.get("block_size")
    if not isinstance(bs, int) or isinstance(bs, bool):
        return too_wide
    depth = cfg.get("tree_depth", 1)
    return bs + 1 + branch * min(depth, bs) + second


@dataclass
class EngineSpec:
    """Which loop to run and with what settings.

    ``block_size`` is in the drafter's own counting (DFlash/DFlash2/lookup: anchor + drafts =
    verify width; DSpark: gamma drafts, verify width gamma + 1), see :mod:`specpilot.drafters`.
    ``config``: an :class:`EngineConfig` or a dict (parsed here). Raises SpecpilotError for an
    unknown engine, a block size < 2 for a speculative engine, or a bad config.
    """

    engine: str
    block_size: int = 8
    config: EngineConfig | dict = field(default_factory=dict)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise SpecpilotError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)}")
        if not isinstance(self.config, EngineConfig):
            self.config = EngineConfig.parse(self.config)
        if self.engine != "ar" and self.block_size < 2:
            raise SpecpilotError(f"block size must be >= 2, got {self.block_size}")

    @property
    def accept(self) -> Callable:
        """The chain verification rule (:data:`~specpilot.engine.verify.ACCEPT_RULES`)."""
        return ACCEPT_RULES[self.config.accept]

    @property
    def overlap(self) -> bool:
        """Engine config ``overlap``: batching mechanism (b), :mod:`specpilot.engine.overlap`."""
        return self.config.overlap

    @property
    def fused_verify(self) -> bool:
        """Engine config ``verify_path`` is ``fused``: the target's steps run the fused CPU step."""
        return self.config.verify_path == "fused"

    @property
    def verify_width(self) -> int:
        """An upper bound of the tokens per verify forward, for sizing the KV cache (AR: 1); the
        proposer's ``verify_width`` is the exact value."""
        return 1 if self.engine == "ar" else self.config.verify_width(self.block_size)

    def record_config(self) -> dict:
        """The records' ``engine_config``: block size (1 for AR) and the config's keys."""
        return {"block_size": self.block_size if self.engine != "ar" else 1, **self.config.without("block_size").to_dict()}

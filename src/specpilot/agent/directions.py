"""Directions registry: one mechanism each, with its parameter space and the cost term it attacks.

A direction turns a point of its space into engine-config keys (:meth:`Direction.apply`). The
round loop never names a mechanism: it ranks cost terms, takes the directions registered for the
largest gaps, and asks each direction's agent for candidates. A later mechanism registers itself
here (``register``) with no change to the loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from ..errors import SpecpilotError

# Cost terms the cost model reports (see costmodel.py).
COST_TERMS = ("acceptance", "verify", "draft", "host", "weight_bytes", "prefill_stall", "idle_slots", "speculation")


@dataclass
class Direction:
    """One mechanism the agents may explore.

    Attributes:
        name: registry key, also the agent's file name (``agent-{name}.json``).
        cost_term: the cost-model term it attacks (one of :data:`COST_TERMS`).
        space: parameter -> allowed values (a finite grid the offline policy searches).
        applies: predicate on the deployment context dict (gpu, dtype, concurrency, drafter...).
        description: one line for reports and LLM prompts.
        excludes: engine-config keys of other mechanisms this one replaces: :meth:`apply` drops
            them when it switches this mechanism on (two tree builders never meet in one config).
    """

    name: str
    cost_term: str
    space: dict[str, list[Any]]
    description: str = ""
    applies: Callable[[dict], bool] = field(default=lambda ctx: True)
    excludes: tuple[str, ...] = ()

    def candidates(self) -> list[dict]:
        """Every point of the grid, in a fixed order."""
        keys = sorted(self.space)
        return [dict(zip(keys, vals)) for vals in itertools.product(*(self.space[k] for k in keys))]

    def schema(self) -> dict:
        """JSON schema a proposal must validate against (one value per parameter, from the space)."""
        return {"type": "object", "additionalProperties": False, "required": sorted(self.space),
                "properties": {k: {"enum": list(v)} for k, v in self.space.items()}}

    def changes(self, base: dict) -> list[dict]:
        """The grid's candidates that change ``base`` other than by switching the mechanism off."""
        return [c for c in self.candidates()
                if not all(k in DEFAULTS and v in DEFAULTS[k] for k, v in c.items()) and self.apply(base, c) != base]

    def explorable(self, base: dict) -> bool:
        """Whether the grid holds a candidate that changes ``base`` other than switching the mechanism
        off (a mechanism already on at its only setting has nothing left to try)."""
        return bool(self.changes(base))

    def apply(self, config: dict, params: dict) -> dict:
        """A new engine config with ``params`` set (the input is not modified), normalized; when a
        parameter that has an "off" value (:data:`DEFAULTS`) is on, the keys of :attr:`excludes` are dropped first."""
        on = any(k in DEFAULTS and v not in DEFAULTS[k] for k, v in params.items())
        base = {k: v for k, v in config.items() if not (on and k in self.excludes)}
        return normalize({**base, **params})


# Engine-config values that mean "mechanism off": a config holding them equals one without them.
DEFAULTS = {"weight_format": ("bf16", "fp32", "native"), "tree_branch": (0,), "accept": ("greedy",),
            "verify_budget": ("off",), "overlap": (False,), "second_level": (0,),
            "tree_nodes": (0,), "tree_lattice": (0,), "verify_path": ("plain",), "draft_path": ("plain",),
            "context_path": ("plain",), "mixed_prefill": (0,)}


def normalize(config: dict) -> dict:
    """Drop keys at their "off" value (and tree_depth without a tree), so equal engines compare equal."""
    out = {k: v for k, v in config.items() if v not in DEFAULTS.get(k, ())}
    if "tree_branch" not in out:
        out.pop("tree_depth", None)
    return out


REGISTRY: dict[str, Direction] = {}


def register(direction: Direction) -> Direction:
    """Add (or replace) a direction in the registry; returns it."""
    REGISTRY[direction.name] = direction
    return direction


def applicable(ctx: dict) -> list[Direction]:
    """Registered directions that apply to a deployment context, in registration order; only those
    ``ctx["directions"]`` names when it is set (config ``rounds.directions``).

    Raises:
        SpecpilotError: ``ctx["directions"]`` names a direction that is not registered."""
    allowed = ctx.get("directions")
    if allowed:
        unknown = [n for n in allowed if n not in REGISTRY]
        if unknown:
            raise SpecpilotError(f"rounds.directions names {', '.join(map(repr, unknown))}, not a registered "
                                 f"direction ({', '.join(REGISTRY)})")
    return [d for d in REGISTRY.values() if d.applies(ctx) and (not allowed or d.name in allowed)]


def covered(direction: Direction, base: dict, tried: list[dict]) -> bool:
    """Whether memory trials on this deployment already measured every candidate of ``direction``
    that changes ``base`` (``tried``: the plan's ``memory_tried`` entries; only trials of the entry
    on its own count, not merged ones): an agent for it would re-time the same configs."""
    seen = [direction.apply(base, t["params"]) for t in tried
            if t.get("direction") == direction.name and not t.get("merged")]
    todo = direction.changes(base)
    return bool(todo) and all(direction.apply(base, c) in seen for c in todo)


def plan_directions(ctx: dict, gaps: dict[str, float], base: dict, agents: int,
                    skip: Collection[str] = ()) -> list[str]:
    """The directions of a round: of those that apply to ``ctx``, attack a term with a positive gap
    (``gaps``: term -> seconds per token), have something to try from ``base``
    (:meth:`Direction.explorable`) and are not in ``skip`` (the round's plan: those its memory
    trials measured whole, :func:`covered`), first the best-ranked direction of each term, terms by gap (so
    every term the cost model ranks gets a direction, not only the largest one's many), then the
    others by gap; ``agents`` of them (registration order breaks ties)."""
    live = sorted((d for d in applicable(ctx) if gaps.get(d.cost_term, 0.0) > 0 and d.explorable(base)
                   and d.name not in skip),
                  key=lambda d: -gaps[d.cost_term])
    firsts = {}
    for d in live:
        firsts.setdefault(d.cost_term, d)
    order = list(firsts.values()) + [d for d in live if d not in firsts.values()]
    return [d.name for d in order][:agents]


def _batched(ctx: dict) -> bool:
    return int(ctx.get("concurrency", 1)) > 1


def _drafts(ctx: dict) -> bool:
    return ctx.get("drafter") not in (None, "none", "lookup")


register(Direction(
    "block_size", "acceptance", {"block_size": [3, 4, 5, 6, 8, 10, 12, 16]},
    "verification length: tokens per verify step (anchor + drafts); trades verify cost for acceptance "
    "(at one request; under batching the batch_block direction)",
    applies=lambda ctx: not _batched(ctx)))
register(Direction(
    "batch_block", "verify", {"block_size": [4, 6, 8, 10, 12, 16]},
    "block size per concurrency: under batching every verify step checks batch x block rows, so a "
    "shorter block trades acceptance for the batched verify width's cost (the cost model's verify "
    "term measured at the regime's concurrency)",
    applies=lambda ctx: _batched(ctx) and _drafts(ctx)))
register(Direction(
    "spec_gate", "speculation", {"verify_budget": ["off", "goodput"]},
    "speculation turned down under load (SmartSpec's goodput test, vLLM's auto-disable): per step, "
    "an AR step when B / cost[1] beats B x tau / (draft + cost[N]) (drafters.goodput_gate); "
    "outputs unchanged",
    applies=lambda ctx: _batched(ctx) and _drafts(ctx), excludes=("tree_nodes", "tree_lattice")))
register(Direction(
    "tree_lattice", "acceptance", {"tree_lattice": [0, 15, 31, 63, 127, 255]},
    "path-conditioned tree of N nodes from DFlash2's candidate lattice (the N most probable paths by the "
    "selector's transition probabilities; drafters.lattice); verify width N + 1; GPU only (on a CPU a "
    "verify row costs about what it saves). The plan ranks the budgets by predicted tokens per ms "
    "(agent.tree_budget: tau curve x verify-cost curve measured on this device)",
    applies=lambda ctx: ctx.get("drafter") == "dflash2" and ctx.get("gpu", "cpu") != "cpu",
    excludes=("tree_branch", "tree_depth", "tree_nodes", "second_level", "verify_budget")))


register(Direction(
    "tree_verify", "acceptance", {"tree_branch": [0, 1, 2, 3], "tree_depth": [1, 2, 3]},
    "tree verification: the drafter's next-best tokens at the first positions as side branches",
    applies=lambda ctx: ctx.get("drafter") not in (None, "none", "lookup"), excludes=("tree_nodes", "tree_lattice")))


# GB kept free beside the two copies of a w12 trial (KV cache, CUDA graphs, activations)
W12_HEADROOM_GB = 10.0


def _w12_applies(ctx: dict) -> bool:
    """bf16 weights on a GPU (the 12-bit loader of the Triton step, dense and family targets) and
    room on the device for the 12-bit copy a trial loads beside the bf16 one (0.75 x its bytes)
    when the context knows the sizes (``target_gb``, ``device_gb``)."""
    if ctx.get("dtype") != "bf16" or ctx.get("gpu", "cpu") == "cpu":
        return False
    size, room = ctx.get("target_gb"), ctx.get("device_gb")
    return size is None or room is None or 1.75 * size + W12_HEADROOM_GB <= room


register(Direction(
    "w12_weights", "weight_bytes", {"weight_format": ["bf16", "w12"]},
    "lossless 12-bit weights: 25% fewer weight bytes per verify step, bit-identical outputs",
    applies=_w12_applies))


register(Direction(
    "verify_budget", "verify", {"verify_budget": ["off", "load_aware"]},
    "load-aware verify length (DSpark Algorithm 1): per step, verify the (request, position) slots of "
    "highest survival while expected committed tokens per second (profiled step-cost table) rises; "
    "outputs unchanged, only verify width changes",
    applies=lambda ctx: ctx.get("drafter") not in (None, "none", "lookup") and int(ctx.get("concurrency", 1)) > 1,
    excludes=("tree_nodes", "tree_lattice")))


register(Direction(
    "overlap", "host", {"overlap": [False, True]},
    "overlap scheduling (SGLang speculative v2 pattern): the next draft, the commit and the context "
    "injection are launched before the host reads the acceptance, so the device drafts while the host "
    "does its bookkeeping; outputs unchanged (engine.overlap)",
    applies=lambda ctx: ctx.get("gpu", "cpu") != "cpu" and ctx.get("drafter") not in (None, "none", "lookup")))


register(Direction(
    "tree_shape", "acceptance", {"tree_nodes": [0, 15, 31, 63]},
    "static token tree of N nodes chosen from the drafter's rank profile (Sequoia's positional-acceptance "
    "tree: the N most probable rank paths; drafters.static_tree); verify width N + 1",
    applies=lambda ctx: ctx.get("drafter") not in (None, "none", "lookup"),
    excludes=("tree_branch", "tree_depth", "second_level", "tree_lattice")))


register(Direction(
    "two_level", "acceptance", {"second_level": [0, 2, 4, 7]},
    "two-level drafting: a second block drafted beyond level 1's last draft, verified with it in one "
    "pass, so a step can commit more than a block (verify width block + second_level)",
    applies=lambda ctx: ctx.get("drafter") == "dflash" and not ctx.get("replay"), excludes=("tree_nodes", "tree_lattice")))
# (the replay drafter models chains and trees, not a second level: engine.proposers refuses it)


def _cpu_path(key: str):
    """Applies where the kernel sub-agent chose the fused CPU step for ``key`` (its checks passed and
    it timed faster: :mod:`specpilot.agent.kernel_cpu`), as ``ctx["kernels"]["cpu"]`` records."""
    return lambda ctx: ((ctx.get("kernels") or {}).get("cpu") or {}).get(key) == "fused"


register(Direction(
    "verify_path", "verify", {"verify_path": ["plain", "fused"]},
    "the target's verify and decode steps through the fused CPU step (q/k/v and gate/up in one matmul each, "
    "attention over the slots in use, one K/V write per layer: fastpath.cpu_target), as the kernel sub-agent "
    "checked and chose it",
    applies=_cpu_path("verify_path")))
register(Direction(
    "draft_path", "draft", {"draft_path": ["plain", "fused"]},
    "the drafter's draft forward through its fused CPU step (q/k/v and gate/up in one matmul each, the block's "
    "K/V beside the context instead of the context copied to the block: fastpath.cpu_drafter), as the kernel "
    "sub-agent checked and chose it",
    applies=lambda ctx: _cpu_path("draft_path")(ctx) and ctx.get("drafter") not in (None, "none", "lookup")))
register(Direction(
    "context_path", "host", {"context_path": ["plain", "fused"]},
    "the drafter's context injection after each verify (host time in the cost model: outside the draft and "
    "verify phases) through its fused CPU step: every layer's context K/V in one matmul and one write "
    "(fastpath.cpu_drafter), as the kernel sub-agent checked and chose it",
    applies=lambda ctx: _cpu_path("context_path")(ctx) and ctx.get("drafter") not in (None, "none", "lookup")))


register(Direction(
    "mixed_prefill", "prefill_stall", {"mixed_prefill": [0, 256, 512, 1024]},
    "mixed prefill step (chunked prefill, Sarathi-Serve; vLLM's and SGLang's scheduler): a newcomer's prompt rides "
    "in chunks in the decode steps, one ragged forward of at most N tokens (the running rows' verify blocks + the "
    "chunks), instead of stopping every running request for a prefill step of its own (engine.mixed); outputs "
    "unchanged. Continuous batching on the eager path (full-attention targets); a budget <= concurrency x verify "
    "width is refused",
    applies=lambda ctx: _batched(ctx) and ctx.get("gpu", "cpu") == "cpu" and ctx.get("dense", True),
    excludes=("verify_path", "overlap")))

"""The proposer of an engine run: from the engine spec and the loaded deployment to a
:class:`~specpilot.drafters.base.Proposer` (None for AR)."""

from __future__ import annotations

from ..drafters.base import Proposer
from ..drafters.dflash import DFlashProposer
from ..drafters.dflash2 import DFlash2Proposer
from ..drafters.dspark import DSparkProposer
from ..drafters.lattice import LatticeTreeProposer, lattice_tree_for
from ..drafters.lattice_profile import LatticeReplayProposer
from ..drafters.lookup import LookupProposer
from ..drafters.replay import ReplayProposer
from ..drafters.static_tree import static_tree_for
from ..drafters.goodput_gate import GoodputGate
from ..drafters.verify_budget import LoadAwareVerify
from ..errors import SpecpilotError
from ..fastpath.cpu_drafter import fused_drafter
from .config import EngineConfig, EngineSpec

NETWORK_PROPOSERS = {"dflash": DFlashProposer, "dflash2": DFlash2Proposer, "dspark": DSparkProposer}


def make_proposer(network, block_size: int | None = None, config: EngineConfig | dict | None = None) -> Proposer:
    """The proposer of a loaded drafter network (its ``kind`` picks it, see :mod:`specpilot.drafters`).

    Args:
        network: a drafter network; block_size: in the drafter's own counting (None = its config's).
        config: engine config (:class:`~specpilot.engine.config.EngineConfig` or a dict):
            ``tree_branch``, ``tree_depth`` (side branches; 0 = chain), ``second_level`` (DFlash:
            two-level drafting, 0 = off), ``draft_path`` / ``context_path`` (``fused``: the draft
            forward / the context injection through the network's fused CPU step,
            :func:`specpilot.fastpath.cpu_drafter.fused_drafter`) and, for DSpark, ``confidence_threshold``.
    Raises:
        SpecpilotError: unknown drafter kind or bad settings.
    """
    cfg = config if isinstance(config, EngineConfig) else EngineConfig.parse(config)
    kind = network.kind
    if kind not in NETWORK_PROPOSERS:
        raise SpecpilotError(f"no proposer for drafter network {type(network).__name__} (kind {kind!r})")
    tree = dict(block_size=block_size, tree_branch=cfg.tree_branch, tree_depth=cfg.tree_depth)
    if kind == "dflash":
        proposer = DFlashProposer(network, **tree, second_level=cfg.second_level)
    elif kind == "dflash2":
        proposer = DFlash2Proposer(network, **tree)
    else:
        proposer = DSparkProposer(network, **tree, confidence_threshold=cfg.confidence_threshold)
    if cfg.draft_path == "fused":  # the network's draft forward through its fused CPU step
        proposer.step = fused_drafter(network)
    if cfg.context_path == "fused":  # its context injection through the fused CPU step
        proposer.inject = fused_drafter(network)
    return proposer


def _replay_proposer(spec: EngineSpec, target, drafter, replay, references) -> Proposer:
    """The replay drafter of ``spec`` (``references`` = per row the AR output ids), running
    ``drafter``'s proposer for its cost; a static tree when ``tree_nodes`` is set, a lattice tree
    (the profile's measured lattice behaviour; a DFlash2 drafter drafts the lattice tree for its
    cost, any other its chain) when ``tree_lattice`` is."""
    cfg = spec.config
    if cfg.second_level:
        raise SpecpilotError("the replay drafter models chains and spine + side-branch trees; "
                             "second_level is not modeled")
    net = make_proposer(drafter, spec.block_size) if drafter is not None else None
    width = net.verify_width if net is not None else spec.block_size  # the drafter's counting (a chain)
    if cfg.tree_lattice:
        others = [k for k in ("tree_nodes", "tree_branch") if getattr(cfg, k)]
        others += ["verify_budget"] if cfg.verify_budget != "off" else []
        if others:
            raise SpecpilotError(f"tree_lattice (a lattice tree) cannot be combined with {', '.join(others)}")
        if net is not None and net.kind == "dflash2":  # the lattice tree's own draft cost
            net = LatticeTreeProposer(drafter, block_size=spec.block_size, nodes=cfg.tree_lattice)
        return LatticeReplayProposer(references, replay, target.config.vocab_size, net, seed=cfg.replay_seed,
                                     block_size=width, nodes=cfg.tree_lattice)
    rp = ReplayProposer(references, replay, target.config.vocab_size, net, seed=cfg.replay_seed, block_size=width,
                        tree_branch=cfg.tree_branch, tree_depth=cfg.tree_depth, rank_draws=bool(cfg.tree_nodes))
    out = static_tree_for(rp, cfg, replay) if cfg.tree_nodes else rp
    return GoodputGate(out) if cfg.verify_budget == "goodput" else out


def make_engine_proposer(spec: EngineSpec, target, drafter, replay=None,
                         references: list[list[int]] | None = None) -> Proposer | None:
    """The proposer of engine ``spec`` (None for AR): the replay drafter (``replay`` = its
    :class:`~specpilot.drafters.replay.AcceptanceProfile`, ``references`` = per row the AR output
    ids), prompt lookup, or the drafter network's proposer with the config's tree builder
    (``tree_nodes``: a static tree; ``tree_lattice``: a lattice tree, DFlash2 only) and
    verify-length policy (``verify_budget``).

    Raises:
        SpecpilotError: a drafter-based engine without a drafter; a static tree with a verify budget;
        a lattice tree with a drafter without a candidate selector or with another tree builder.
    """
    if spec.engine == "ar":
        return None
    if replay is not None:
        return _replay_proposer(spec, target, drafter, replay, references)
    cfg = spec.config
    if spec.engine == "lookup":
        if cfg.tree_lattice:
            raise SpecpilotError("tree_lattice needs a drafter with a candidate selector (DFlash2); lookup has none")
        return LookupProposer(cfg.max_ngram, spec.block_size)
    if drafter is None:
        raise SpecpilotError(f"engine {spec.engine!r} needs a drafter (--drafter)")
    if cfg.tree_lattice:
        return lattice_tree_for(make_proposer(drafter, spec.block_size), cfg)
    proposer = make_proposer(drafter, spec.block_size, cfg)
    if cfg.tree_nodes:
        if cfg.verify_budget != "off":
            raise SpecpilotError("tree_nodes (a static tree) cannot be combined with verify_budget")
        return static_tree_for(proposer, cfg)
    if cfg.verify_budget == "load_aware":
        return LoadAwareVerify(proposer)
    if cfg.verify_budget == "goodput":
        return GoodputGate(proposer)
    return proposer

"""Drafter plug-ins over one verify path.

Every drafter returns a :class:`~specpilot.drafters.proposal.Proposal` (candidate tokens with
parent indices; a chain is the special case) to :func:`specpilot.engine.generate.generate`, and
owns its block counting and tree builder:

| kind | network | counting of ``block_size`` | verify width (chain) |
| --- | --- | --- | --- |
| ``dflash`` | :class:`~specpilot.models.dflash.DFlashDrafter` | anchor + B-1 drafts | B |
| ``dflash2`` | :class:`~specpilot.drafters.dflash2.DFlash2Drafter` | anchor + B-1 drafts | B |
| ``dspark`` | :class:`~specpilot.drafters.dspark.DSparkDrafter` | gamma drafts (sample from anchor) | gamma + 1 |
| ``lookup`` | none (prompt n-grams) | anchor + B-1 drafts | B |

Checkpoint architectures: ``DFlashDraftModel``, ``DFlash2DraftModel``, ``Qwen3DSparkModel``.
"""

from __future__ import annotations

from ..errors import SpecpilotError

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "Qwen3DSparkModel": "dspark"}


def network_class(arch: str):
    """The network class of a checkpoint architecture. Raises SpecpilotError for others."""
    kind = ARCHITECTURES.get(arch)
    if kind == "dflash":
        from ..models.dflash import DFlashDrafter

        return DFlashDrafter
    if kind == "dflash2":
        from .dflash2 import DFlash2Drafter

        return DFlash2Drafter
    if kind == "dspark":
        from .dspark import DSparkDrafter

        return DSparkDrafter
    raise SpecpilotError(f"unsupported drafter architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")


def make_proposer(network, block_size: int | None = None, config: dict | None = None,
                  graphs: bool | None = None, kernels: str | None = None):
    """The plug-in for a loaded drafter network.

    Args:
        network: a drafter network (its ``kind`` picks the plug-in).
        block_size: in the drafter's own counting (see the table above); None = its config's.
        config: engine config: ``tree_branch``, ``tree_depth`` (side branches; 0 = chain),
            ``second_level`` (DFlash: two-level drafting, 0 = off) and, for DSpark,
            ``confidence_threshold``.
    Raises:
        SpecpilotError: unknown drafter kind or bad settings.
    """
    config = config or {}
    tree = dict(tree_branch=int(config.get("tree_branch", 0)), tree_depth=int(config.get("tree_depth", 1)))
    kind = getattr(network, "kind", None)
    if kind == "dflash":
        from .dflash import DFlashProposer

        return DFlashProposer(network, graphs, kernels, block_size=block_size, **tree,
                              second_level=int(config.get("second_level", 0)))
    if kind == "dflash2":
        from .dflash2 import DFlash2Proposer

        return DFlash2Proposer(network, graphs, kernels, block_size=block_size, **tree)
    if kind == "dspark":
        from .dspark import DSparkProposer

        return DSparkProposer(network, graphs, kernels, block_size=block_size, **tree,
                              confidence_threshold=float(config.get("confidence_threshold", 0.0)))
    raise SpecpilotError(f"no drafter plug-in for {type(network).__name__}")

"""Proposers: the engine's plug-ins that turn a draft source into proposals, over one verify path.

Every proposer (:class:`~specpilot.drafters.base.Proposer`) returns a
:class:`~specpilot.drafters.proposal.Proposal` (candidate tokens with parent indices; a chain is
the special case) to the engine, and owns its block counting and tree builder:

| kind | drafter network (``specpilot.models``) | counting of ``block_size`` | verify width (chain) |
| --- | --- | --- | --- |
| ``dflash`` | :class:`~specpilot.models.dflash.DFlashDrafter` | anchor + B-1 drafts | B |
| ``dflash2`` | :class:`~specpilot.models.dflash2.DFlash2Drafter` | anchor + B-1 drafts | B |
| ``dspark`` | :class:`~specpilot.models.dspark.DSparkDrafter` | gamma drafts (sample from anchor) | gamma + 1 |
| ``lookup`` | none (prompt n-grams) | anchor + B-1 drafts | B |
| ``replay`` | the replay drafter (AR outputs + an acceptance profile) | the network's it stands for | |

Wrappers: :class:`~specpilot.drafters.static_tree.StaticTreeProposer` (a static tree gathered from
the inner proposer's candidates) and :class:`~specpilot.drafters.verify_budget.LoadAwareVerify`
(per-request verify length). The engine builds them from an engine config
(:func:`specpilot.engine.proposers.make_engine_proposer`). Checkpoint architectures:
:data:`ARCHITECTURES`.
"""

from __future__ import annotations

from ..models.loading import DRAFTER_NETWORKS

# checkpoint ``architectures`` -> proposer kind
ARCHITECTURES = {arch: cls.kind for arch, cls in DRAFTER_NETWORKS.items()}

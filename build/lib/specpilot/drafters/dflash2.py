"""The DFlash2 proposer: chain = the candidate selector's greedy walk; tree = the walk as the spine
plus the selector's next-best candidates as side branches (the network:
:class:`specpilot.models.dflash2.DFlash2Drafter`; block counting as DFlash).
"""

from __future__ import annotations

from .dflash import DFlashProposer


class DFlash2Proposer(DFlashProposer):
    """DFlash2 drafter plug-in: chain = the selector walk; tree = walk spine + selector side branches."""

    kind = "dflash2"

"""The DSpark proposer: gamma drafts sampled from the anchor with the Markov head, each with its
confidence (the network: :class:`specpilot.models.dspark.DSparkDrafter`).
"""

from __future__ import annotations

import torch

from ..errors import SpecpilotError
from ..models.dspark import DSparkDrafter
from .dflash import DFlashProposer
from .proposal import Proposal, chain, side_branches, spine_tree


class DSparkProposer(DFlashProposer):
    """DSpark drafter plug-in.

    Block counting: ``block_size`` = gamma drafts (DSpark counting, e.g. 7 for ``*_block7``); the
    verify width of a chain is gamma + 1. The proposal carries each draft's confidence (its
    ``survival`` = running product is what the load-aware verify length ranks). With
    ``confidence_threshold`` > 0 a row stops at its first draft whose survival falls below the
    threshold (the offline rule of the paper; at least one draft is kept); the verify width is
    then the longest row's length. Trees (``tree_branch`` > 0: Markov-corrected spine plus
    next-best side branches) carry no confidence and ignore the threshold.
    """

    kind = "dspark"
    graph_drafts = False  # the sequential Markov walk and confidences run eagerly

    def __init__(self, drafter: DSparkDrafter, *, block_size: int | None = None,
                 tree_branch: int = 0, tree_depth: int = 1, confidence_threshold: float = 0.0):
        gamma = int(block_size or drafter.config.block_size)
        if gamma < 1:
            raise SpecpilotError(f"dspark: gamma (block_size) must be >= 1, got {gamma}")
        super().__init__(drafter, block_size=gamma + 1, tree_branch=tree_branch, tree_depth=tree_depth)
        self.gamma = gamma
        self.threshold = float(confidence_threshold)
        if not 0.0 <= self.threshold < 1.0:
            raise SpecpilotError(f"dspark: confidence_threshold must lie in [0, 1), got {self.threshold}")

    def use_confidence(self) -> bool:
        """DSpark chains carry their confidence head's values already."""
        return True

    def start(self, runner, prompts, features, first) -> None:
        self.embed, self.lm_head = self.drafter.embed_tokens, self.drafter.lm_head
        self.drafter.setup_cache(len(prompts), runner.max_seq)
        with torch.inference_mode():
            self.inject.add_context(features, torch.zeros(len(prompts), dtype=torch.long, device=first.device))

    @torch.inference_mode()
    def propose(self, last: torch.Tensor, start: torch.Tensor) -> Proposal:
        toks, logits, conf = self.step.draft_full(last, start, self.gamma)
        if self.branch:
            return spine_tree(last, toks, side_branches(logits, toks, self.depth, self.branch))
        prop = chain(last, toks, confidence=conf)
        if self.threshold > 0:
            surv = prop.survival[:, 1:]
            below = surv < self.threshold
            n = torch.where(below.any(1), below.float().argmax(1), torch.full_like(below[:, 0], self.gamma,
                                                                                   dtype=torch.long))
            prop = prop.truncate(1 + n.clamp(min=1))
        return prop

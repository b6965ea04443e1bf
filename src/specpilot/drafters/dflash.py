"""DFlash drafter plug-in: block drafting from the target's hidden states (the network is
:class:`specpilot.models.dflash.DFlashDrafter`; Chen, Liang, Liu, arXiv 2602.06036; z-lab/dflash).

Block counting (DFlash, anchor included): ``block_size`` B = the verify width of a chain; the
drafter's input is [anchor, mask x (B-1)] and slots 1..B-1 are the B-1 drafts. With
``tree_branch`` > 0 the proposal is a tree: the drafter's argmax chain (the spine) plus, at the
first ``tree_depth`` draft positions, its next ``tree_branch`` best tokens as side branches
(verify width B + branch x min(depth, B-1)).

Two-level drafting (``second_level`` L > 0; the study's "two-level verification", our reading): the
drafter runs a second time with level 1's last draft as the anchor of a block one block further on,
seeing the committed context only (the level-1 positions have no target features yet); its first L
drafts extend the chain, and one verify pass checks both levels, so a step can commit up to
B + L tokens (verify width B + L). Lossless by construction: chain verification.
"""

from __future__ import annotations

import torch

from ..errors import SpecpilotError
from ..models.dflash import DFlashDrafter
from .base import Proposer
from .proposal import Proposal, chain, side_branches, spine_tree


class DFlashProposer(Proposer):
    """Drafts a block with a DFlash-style network conditioned on the target's hidden states.

    The network's context cache grows by the target features of every committed position
    (prompt at prefill, anchor + accepted drafts after each verify step), as in z-lab/dflash.

    Under CUDA graphs (the runner's backend) the draft and context steps replay captured graphs
    (:meth:`specpilot.engine.backend.Backend.drafter_graphs`; chains, and spine trees in the Triton
    draft step of a plain DFlash network).

    Args:
        drafter: the network (:class:`DFlashDrafter` or a subclass with the same interface).
        block_size: verify width of the chain (anchor + B-1 drafts); default the network's config.
        tree_branch, tree_depth: side branches (0 = chain).
    Raises:
        SpecpilotError: block size < 2, negative branch/depth.
    """

    kind = "dflash"
    graph_drafts = True  # drafts in captured graphs when the backend runs graphs (DSpark: eager)

    def __init__(self, drafter: DFlashDrafter, *, block_size: int | None = None, tree_branch: int = 0,
                 tree_depth: int = 1, second_level: int = 0):
        self.drafter = drafter
        self.graphs = None
        self.block_size = int(block_size or drafter.config.block_size)
        self.branch, self.depth = int(tree_branch), int(tree_depth)
        self.second_level = int(second_level)
        if self.block_size < 2:
            raise SpecpilotError(f"{self.kind}: block size must be >= 2 (anchor + drafts), got {self.block_size}")
        if self.branch < 0 or self.depth < 0:
            raise SpecpilotError(f"{self.kind}: tree_branch and tree_depth must be >= 0")
        if self.second_level:
            if self.kind != "dflash" or self.branch:
                raise SpecpilotError(f"second_level drafting is built for DFlash chains (got {self.kind}, "
                                     f"tree_branch {self.branch})")
            if not 0 < self.second_level < self.block_size:
                raise SpecpilotError(f"second_level must lie in 1..block_size - 1 = {self.block_size - 1}, "
                                     f"got {self.second_level}")
        self.capture = tuple(drafter.config.target_layer_ids)
        # what runs the network's draft forward and its context injection: the network itself, or its
        # fused CPU step (engine config draft_path / context_path: fused, :mod:`specpilot.fastpath.cpu_drafter`)
        self.step = self.inject = drafter
        # attach each draft's top-1 probability as its confidence (the load-aware verify length's
        # survival proxy; eager drafting only, since the captured draft graph returns tokens only)
        self.confidence = False

    @property
    def n_drafts(self) -> int:
        """Drafted tokens per step on the spine: B - 1."""
        return self.block_size - 1

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward: anchor + drafts + side branches + the second level."""
        return 1 + self.n_drafts + (self.branch * min(self.depth, self.n_drafts) if self.branch else 0) \
            + self.second_level

    def _net_block(self) -> int:
        """Input length of the network's block forward (DFlash: anchor + B-1 mask slots)."""
        return self.block_size

    def set_tree(self, branch: int, depth: int) -> None:
        """Draft the spine + side-branch tree of ``branch`` leaves at the first ``depth`` positions
        (0 branches: a chain); what the static-tree wrapper and the replay drafter ask for."""
        self.branch, self.depth = int(branch), int(depth)

    def use_confidence(self) -> bool:
        """Attach each draft's top-1 probability as its confidence (eager drafting only)."""
        self.confidence = True
        return True

    def start(self, runner, prompts, features, first) -> None:
        self.embed = runner.model.model.embed_tokens
        self.lm_head = runner.model.lm_head
        # the draft block's own K/V sit at slots length .. length + block - 1 (Triton / fused CPU draft step)
        self.drafter.setup_cache(len(prompts), runner.max_seq + self._net_block())
        self.graphs = None
        if self.graph_drafts and not self.second_level and not self.confidence and runner.backend.graphs:
            # side branches come out of the captured Triton draft step (plain DFlash); other
            # networks with side branches draft eagerly
            g = runner.backend.drafter_graphs(self.drafter, self.embed, self.lm_head)
            self.graphs = g if self.branch == 0 or g.fast is not None else None
        with torch.inference_mode():
            self.inject.add_context(features, torch.zeros(len(prompts), dtype=torch.long, device=first.device))

    def _draft(self, last, start):
        """(tokens [B, k], scores [B, k, V] for side branches) of one network forward."""
        return self.step.draft(last, start, self.embed, self.lm_head, self._net_block())

    @torch.inference_mode()
    def propose(self, last: torch.Tensor, start: torch.Tensor) -> Proposal:
        """A chain (anchor + B-1 drafts) or the spine + side-branch tree after ``last`` [B]."""
        if self.graphs is not None and not self.branch:
            return chain(last, self.graphs.draft(last, start, self._net_block()))
        if self.graphs is not None and self.graphs.fast is not None:  # spine + side branches, one captured step
            spine, alts = self.graphs.draft(last, start, self._net_block(), self.branch, self.depth)
            return spine_tree(last, spine, alts)
        tokens, logits = self._draft(last, start)
        if self.second_level:
            return chain(last, torch.cat([tokens, self._second_level(tokens, start)], 1))
        if self.branch:
            return spine_tree(last, tokens, side_branches(logits, tokens, self.depth, self.branch))
        if self.confidence:
            return chain(last, tokens, confidence=logits.float().softmax(-1).gather(-1, tokens[..., None])[..., 0])
        return chain(last, tokens)

    def can_observe_row(self) -> bool:
        """Row-wise context injection (:meth:`observe_row`) runs in the Triton draft step."""
        return self.graphs is not None and self.graphs.fast is not None

    @torch.inference_mode()
    def observe_row(self, b: int, features: torch.Tensor, start: int) -> None:
        """Context of a newcomer's prompt chunk: features [1, T, F] of positions start.. of row b only."""
        st = torch.full((1,), start, dtype=torch.long, device=features.device)
        self.graphs.fast.add_context(features, st, rows=slice(b, b + 1))

    # -- overlap scheduling (specpilot.engine.overlap) ----------------------------------------
    def can_overlap(self) -> bool:
        """Chains drafted by the captured draft graph (after :meth:`start`) can overlap."""
        return self.graphs is not None and self.branch == 0 and not self.confidence

    def observe_device(self, features, start, counts) -> None:
        """The context injection of a verified chain block (device work only)."""
        self.graphs.add_context(features, start)

    def observe_host(self, committed) -> None:
        """Nothing on the host: the draft reads only context slots below each row's length."""

    def draft_async(self, last: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Launch the draft after ``last`` [B] at ``start`` [B]; returns its (static) token buffer."""
        return self.graphs.draft(last, start, self._net_block())

    def proposal(self, handle: torch.Tensor, last: torch.Tensor) -> Proposal:
        """The chain of ``draft_async``'s tokens behind the anchors ``last`` [B]."""
        return chain(last, handle)

    def _second_level(self, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Two-level drafting (the study's mechanism; our reading, see the module docstring of
        :mod:`specpilot.drafters.dflash`): a second block drafted beyond level 1's last draft (its
        most likely leaf), which becomes the second block's anchor at position start + B - 1. The
        level-1 positions have no target features yet, so the second block sees the committed
        context only (``ctx_len = start``); its first ``second_level`` drafts extend the chain, and
        the one verify pass checks both levels (every committed token is still the target's argmax).
        tokens int64 [B, B_blk - 1]; returns int64 [B, second_level]."""
        t2, _ = self.step.draft(tokens[:, -1], start + self.block_size - 1, self.embed, self.lm_head,
                                self._net_block(), ctx_len=start)
        return t2[:, : self.second_level]

    def reset_slot(self, b: int, prompt_ids: list[int], first_token: int, reference=None) -> None:
        """Continuous batching: slot b now serves a new request. Nothing to reset on the host: the
        scheduler's prefill step wrote the prompt's context from position 0 through
        :meth:`observe`, and the draft only reads context slots below the row's length."""

    @torch.inference_mode()
    def observe(self, features, start, counts, committed) -> None:
        """Inject the committed positions' target features into the draft cache."""
        if self.graphs is not None:
            self.graphs.add_context(features, start)
            return
        self.inject.add_context(features, start)

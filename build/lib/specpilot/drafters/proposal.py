"""The proposal every drafter returns, and the tree builder the block drafters share.

A :class:`Proposal` is what one verify step checks: per request a set of candidate tokens with
parent indices. Node 0 of every row is the root (the anchor: the last committed token, whose K/V
the target has not seen yet); a chain is the special case ``parents = [-1, 0, 1, ..., N-2]``
(``parents=None``). Rows may hold fewer valid nodes than the verify width (``lengths``): nodes at
index >= ``lengths[b]`` are padding, verified but never accepted. A drafter may attach per-node
scores (log-probabilities) and confidences (DSpark: the probability that the node survives
verification given its parent did); ``survival`` is their running product along the chain.

Sources: the chain/tree verify layout of SGLang ``build_eagle_tree.py`` (root first, parents
before children) and DDTree / JetSpec (one forward over a tree with an ancestor-only mask); the
"spine first, then side branches" builder of SGLang ``dflash_tree.py`` (``depth_first``), which
keeps tree acceptance >= chain acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecpilotError


@dataclass
class Proposal:
    """Candidates of one verify step for a batch of B requests.

    Attributes:
        tokens: int64 [B, N]; column 0 is the anchor (root), N = verify width.
        parents: int64 [B, N] parent node index (< own index; -1 for the root), or None for a chain.
        lengths: int64 [B] valid nodes per row (root included, 1..N), or None = all N valid.
        scores: float [B, N] drafter score per node (log-probability; root 0), optional.
        confidence: float32 [B, N] conditional survival probability per node (root 1), optional.
    """

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def __post_init__(self):
        if self.tokens.dim() != 2 or self.tokens.shape[1] < 1:
            raise SpecpilotError(f"proposal tokens must be [batch, width >= 1], got {tuple(self.tokens.shape)}")
        if self.parents is not None and self.parents.shape != self.tokens.shape:
            raise SpecpilotError(f"proposal parents {tuple(self.parents.shape)} do not match tokens "
                                 f"{tuple(self.tokens.shape)}")

    @property
    def width(self) -> int:
        """Verify width N (tokens per row in the verify forward, root included)."""
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @property
    def survival(self) -> torch.Tensor | None:
        """float32 [B, N]: probability that node j and all its ancestors survive (chains only)."""
        if self.confidence is None:
            return None
        if not self.is_chain:
            raise SpecpilotError("survival values are defined for chain proposals only")
        return torch.cumprod(self.confidence.float(), dim=1)

    def valid(self) -> torch.Tensor:
        """bool [B, N]: node is real (index < length)."""
        idx = torch.arange(self.width, device=self.tokens.device)[None, :]
        if self.lengths is None:
            return idx.expand(self.tokens.shape[0], -1) >= 0
        return idx < self.lengths[:, None]

    def truncate(self, lengths: torch.Tensor) -> "Proposal":
        """Chain proposal cut to ``lengths`` [B] per row (the width shrinks to max(lengths)).

        Used by a confidence-threshold stop: rows may differ; columns past every row's length go.
        """
        if not self.is_chain:
            raise SpecpilotError("only chain proposals can be truncated")
        lengths = lengths.clamp(1, self.width)
        if self.lengths is not None:
            lengths = torch.minimum(lengths, self.lengths)
        n = int(lengths.max())
        cut = lambda t: None if t is None else t[:, :n]  # noqa: E731
        return Proposal(self.tokens[:, :n], None, lengths, cut(self.scores), cut(self.confidence))


def chain(anchor: torch.Tensor, drafts: torch.Tensor, scores: torch.Tensor | None = None,
          confidence: torch.Tensor | None = None) -> Proposal:
    """A chain proposal: anchor int64 [B] followed by drafts int64 [B, k]; optional per-draft
    scores / confidence [B, k] (the root gets score 0 and confidence 1)."""
    tokens = torch.cat([anchor[:, None], drafts], 1)
    pad = lambda t, v: None if t is None else torch.cat([t.new_full((t.shape[0], 1), v), t], 1)  # noqa: E731
    return Proposal(tokens, None, None, pad(scores, 0.0), pad(confidence, 1.0))


def spine_tree_parents(k: int, branch: int, depth: int) -> list[int]:
    """Parent list of the static "spine + side branches" tree.

    Node 0 = root, nodes 1..k = the spine (the drafter's chain), then ``branch`` leaves for each
    of the first ``depth`` draft positions, hanging off the spine node before that position.
    Width = 1 + k + branch * min(depth, k).
    """
    depth = min(depth, k)
    return [-1] + list(range(k)) + [i for i in range(depth) for _ in range(branch)]


def spine_tree(anchor: torch.Tensor, spine: torch.Tensor, alternatives: torch.Tensor,
               spine_scores: torch.Tensor | None = None, alt_scores: torch.Tensor | None = None) -> Proposal:
    """A tree proposal from a chain (the spine) and side branches.

    Args:
        anchor: int64 [B]; spine: int64 [B, k] the drafter's chain;
        alternatives: int64 [B, depth, branch]: at draft position i (0-based) the next-best tokens
            after the spine's prefix up to i (they must differ from spine[:, i]).
        spine_scores / alt_scores: optional float [B, k] / [B, depth, branch].
    Returns:
        a :class:`Proposal` with parents from :func:`spine_tree_parents`.
    """
    B, k = spine.shape
    depth, branch = alternatives.shape[1], alternatives.shape[2]
    tokens = torch.cat([anchor[:, None], spine, alternatives.reshape(B, -1)], 1)
    scores = None
    if spine_scores is not None and alt_scores is not None:
        scores = torch.cat([spine_scores.new_zeros(B, 1), spine_scores, alt_scores.reshape(B, -1)], 1)
    return Proposal(tokens, _static_parents(k, branch, depth, B, spine.device), None, scores)


_PARENTS: dict[tuple, torch.Tensor] = {}


def _static_parents(k: int, branch: int, depth: int, batch: int, device) -> torch.Tensor:
    """The parents int64 [batch, width] of a spine tree, one tensor per shape and device, reused by
    every step: the runner keeps the tree's ancestor mask per parents tensor, so a tensor built anew
    each step would rebuild the mask every verify (one small launch per node on a GPU)."""
    key = (k, branch, depth, batch, str(device))
    par = _PARENTS.get(key)
    if par is None:
        row = torch.tensor(spine_tree_parents(k, branch, depth), dtype=torch.long, device=device)
        par = _PARENTS[key] = row[None].expand(batch, -1).contiguous()
    return par


def side_branches(logits: torch.Tensor, spine: torch.Tensor, depth: int, branch: int) -> torch.Tensor:
    """The ``branch`` best tokens other than the spine's at each of the first ``depth`` positions.

    Args:
        logits: [B, k, V] drafter scores per position (given the spine prefix); spine int64 [B, k].
    Returns:
        int64 [B, min(depth, k), branch].
    """
    d = min(depth, spine.shape[1])
    sc = logits[:, :d].float().scatter(-1, spine[:, :d, None], float("-inf"))
    return sc.topk(branch, dim=-1).indices

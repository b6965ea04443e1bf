"""The DFlash2 drafter network: DFlash plus grouped dynamic causal convolutions and a low-rank
candidate selector (its proposer is :class:`specpilot.drafters.dflash2.DFlash2Proposer`).

Sources: z-lab's reference package ``dflash`` 0.1.0 (``dflash/model.py``: ``DFlash2DraftModel``,
``GroupedDynamicCausalConv``, ``CandidateSelector``), SGLang PR #35371 and vLLM PR #52816
("DFlash2: local convolution + candidate selector"), dflash-mlx ``draft/dflash2.py``. Facts are
re-implemented here; no code is copied.

Network (on top of :class:`~specpilot.models.dflash.DFlashDrafter`):

- every layer has two convolutions, ``attention_conv`` and ``mlp_conv``, each with
  ``base_kernel`` [2, K, hidden] and ``kernel_projection`` (hidden -> 2*K*groups, no bias). The
  sublayer's normed input x is projected once to per-position dynamic taps; the "in" convolution
  (base[0] + dynamic[0]) is applied to x before the sublayer and the "out" convolution
  (base[1] + dynamic[1]) to the sublayer's output before the residual add:
  ``out[i, c] = sum_t (base[t, c] + dyn[i, t, group(c)]) * x[i - t, c]``, taps causal, zero
  before the block's first slot (the convolution runs over the query block only);
- the candidate selector keeps the top-K draft logits per slot (``unary``) and scores a candidate
  c after predecessor p as ``unary[c] + <A[p] * (H h), B[c]>`` (A = predecessor codebook [V, r],
  B = successor codebook [V, r], H = ``hidden_projection`` [r, hidden], h = the slot's normed
  drafter state); the draft is a greedy walk left to right from the verified anchor (argmax per
  slot, not a global Viterbi search). Where the papers and the reference disagree, the reference
  wins: e.g. the reference takes the candidates with ``topk(..., sorted=False)``; we sort them
  (same argmax; ties between equal scores may break differently).

Checkpoint: ``architectures: ["DFlash2DraftModel"]``; ``dflash_config`` adds
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``; tensors
``layers.N.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}``,
``candidate_selector.{predecessor_codebook, successor_codebook}`` (stored without ``.weight``) and
``candidate_selector.hidden_projection.weight``.

Block counting as DFlash: ``block_size`` B = anchor + B-1 drafts = verify width of a chain. The
tree (``tree_branch`` > 0): the selector's greedy walk is the spine; at each of the first
``tree_depth`` positions the side branches are the next-best of the K candidates after the
spine's predecessor (so tree acceptance is never below chain acceptance).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from .dflash import DFlashDrafter, DrafterConfig

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int,
                         block_len: int | None = None) -> torch.Tensor:
    """Causal depthwise convolution with per-position, per-group dynamic taps.

    Args:
        x: [B, L, C] input; L = n_blocks x block_len (taps never cross a block boundary).
        dynamic: [B, L, K, C // group] dynamic taps at each output position.
        base: [K, C] static taps (tap t multiplies x[i - t]).
        group: channels sharing one dynamic tap.
        block_len: block length (None = L, one block).
    Returns:
        [B, L, C]: out[i, c] = sum_t (base[t, c] + dynamic[i, t, c // group]) * x[i - t, c].
    """
    B, L, C = x.shape
    n = block_len or L
    K = base.shape[0]
    xb = x.view(B, L // n, n, C // group, group)
    dyn = dynamic.view(B, L // n, n, K, C // group, 1)
    out = torch.zeros_like(xb)
    for t in range(K):
        shifted = xb if t == 0 else F.pad(xb[:, :, :-t], (0, 0, 0, 0, t, 0))
        out = out + (base[t].view(C // group, group).to(x.dtype) + dyn[:, :, :, t]) * shifted
    return out.view(B, L, C)


class GroupedDynamicCausalConv(nn.Module):
    """The in/out convolution pair around one sublayer (see the module docstring)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden % group_size:
            raise SpecpilotError(f"DFlash2: hidden_size {hidden} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def prepare(self, x: torch.Tensor, block_len: int | None = None):
        """(in-convolved x [B, L, C], the out convolution's dynamic taps) of the normed input x."""
        G = x.shape[-1] // self.group_size
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, G)
        return grouped_dynamic_conv(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size, block_len), \
            dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        """The out convolution of the sublayer output y [B, L, C]."""
        return grouped_dynamic_conv(y, dyn, self.base_kernel[1], self.group_size, block_len)

    @torch.no_grad()
    def identity_(self) -> None:
        """Identity init (SpecForge DFlash2 docs): tap 0 = 1, others 0, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()


class CandidateSelector(nn.Module):
    """Low-rank transition scores over the top-K draft candidates (see the module docstring)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def edge(self, prev: torch.Tensor, hproj: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        """Transition scores [..., K]: <A[prev] * hproj, B[cands]> for prev [...], hproj [..., r],
        cands [..., K]."""
        return torch.einsum("...r,...kr->...k", self.predecessor_codebook(prev) * hproj,
                            self.successor_codebook(cands))

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor):
        """Greedy left-to-right walk from the anchor.

        Args:
            hidden: [B, k, hidden] drafter states of the draft slots; logits [B, k, V]; anchor int64 [B].
        Returns:
            path int64 [B, k], candidates int64 [B, k, K] (sorted by unary), scores [B, k, K]
            (unary + edge from the path's predecessor at each slot).
        """
        unary, cands = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        hp = self.hidden_projection(hidden)
        prev, path, scores = anchor, [], []
        for j in range(hidden.shape[1]):
            sc = unary[:, j] + self.edge(prev, hp[:, j], cands[:, j])
            prev = cands[:, j].gather(1, sc.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
            scores.append(sc)
        return torch.stack(path, 1), cands, torch.stack(scores, 1)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash2 network; ``draft`` returns the selector walk and full-vocab scores (-inf
    outside each slot's top-K) for side branches."""

    kind = "dflash2"

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        x = cfg.extra
        missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k not in x]
        if missing:
            raise SpecpilotError(f"DFlash2 drafter config lacks dflash_config.{missing[0]}")
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, int(x["conv_kernel_size"]),
                                                            int(x["conv_group_size"]))
            layer.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, int(x["conv_kernel_size"]),
                                                      int(x["conv_group_size"]))
        self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, int(x["selector_rank"]),
                                                    int(x["selector_top_k"]))

    def draft(self, anchor, start, embed, lm_head, block_size):
        """Draft ``block_size - 1`` tokens by the selector walk.

        Returns tokens int64 [B, block_size - 1] and scores [B, block_size - 1, V] (selector
        scores at the K candidates given the walk's predecessor, -inf elsewhere).
        """
        B = anchor.shape[0]
        block = torch.full((B, block_size), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        hidden = self.block_hidden(block, start, embed)[:, 1:]
        logits = self.logits(hidden, lm_head)
        path, cands, scores = self.candidate_selector.walk(hidden, logits, anchor)
        full = torch.full_like(logits, float("-inf")).scatter(-1, cands, scores.to(logits.dtype))
        return path, full

    def draft_logits(self, anchor, start, embed, lm_head, block_size):
        """The unary draft logits [B, block_size - 1, V] (before the selector), for parity tests."""
        B = anchor.shape[0]
        block = torch.full((B, block_size), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        return self.logits(self.block_hidden(block, start, embed)[:, 1:], lm_head)


def selector_loss(drafter: DFlash2Drafter, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor,
                  gold: torch.Tensor) -> torch.Tensor:
    """Teacher-forced K-way selector cross-entropy per slot (DFlash2 training objective).

    Args:
        hidden: [..., hidden] drafter states; logits [..., V] draft logits (detached here: the
            selector CE trains the selector, the block CE trains the backbone); prev int64 [...]
            the gold predecessor (anchor for the first slot); gold int64 [...] the gold token.
    Returns:
        CE [...] over the K candidates. A gold token outside the top-K is injected in place of the
        K-th candidate (the speculators PR #1006 choice, so every slot trains the selector).
    """
    sel = drafter.candidate_selector
    unary, cands = logits.detach().topk(sel.top_k, dim=-1)
    inside = (cands == gold[..., None]).any(-1)
    cands = cands.clone()
    unary = unary.clone()
    cands[..., -1] = torch.where(inside, cands[..., -1], gold)
    unary[..., -1] = torch.where(inside, unary[..., -1], logits.detach().gather(-1, gold[..., None])[..., 0])
    scores = unary + sel.edge(prev, sel.hidden_projection(hidden), cands)
    target = (cands == gold[..., None]).float().argmax(-1)
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1), reduction="none").view(
        target.shape)

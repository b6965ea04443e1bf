"""Ragged forward: rows of different widths in one target forward (the mixed prefill step).

A batched verify runs a uniform block [B, T]: every row pays the widest row's width. The mixed
step of chunked prefill (Sarathi-Serve, Agrawal et al. 2024; vLLM's and SGLang's schedulers)
puts the decode rows' verify blocks and a newcomer's prompt chunk into ONE forward of a token
budget, so the tokens are ragged: row b contributes ``t_b`` tokens (its verify width, or its
chunk), and the forward holds ``S = sum(t_b)`` tokens, not ``B x max(t_b)``.

Here the tokens of every segment are packed along one sequence axis [1, S]: embeddings, norms,
projections, the MLP and the LM head run once over all S tokens (the shared weight reads that
make the mixed step pay), and only attention is per segment: segment (row b, start s, t tokens)
writes its K/V into cache row b at slots s .. s+t-1 and its queries attend to row b's cache under
:func:`~specpilot.models.layers.block_mask` (committed context + the segment's own ancestors), as
:meth:`~specpilot.models.target.Transformer.forward` does for a uniform block. Full-attention
layers only (a sliding-window ring or a Gated DeltaNet state would need per-segment state
updates): :func:`ragged_supported` says whether a target can, :func:`forward_ragged` refuses others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecpilotError
from .layers import block_mask


@dataclass
class Segment:
    """One row's tokens in a ragged forward.

    Attributes:
        row: cache row (batch index) the tokens belong to.
        tokens: int64 [t] the row's block (a verify chain or tree, or a prompt chunk).
        start: the row's committed length: token j writes cache slot start + j.
        ancestors: bool [t, t] block-internal visibility (chain: lower triangle).
        depth: int64 [t] each node's depth (RoPE position start + depth[j]); None = chain.
    """

    row: int
    tokens: torch.Tensor
    start: int
    ancestors: torch.Tensor
    depth: torch.Tensor | None = None


class RaggedContext:
    """What the attention layers of a ragged forward read: the state and its groups, each a run of
    consecutive segments of one width t (the decode rows' verify blocks form one): rows int64 [R],
    slots int64 [R, t] (start + j), the token offset of the run in the packed sequence, t, and the
    cache mask bool [R, 1, t, max_seq]. A group's attention is one batched call over its rows."""

    ragged = True  # DecoderLayer routes attention to Attention.forward_ragged

    def __init__(self, state, segments: list[Segment]):
        self.state = state
        runs: list[list[Segment]] = []
        for seg in segments:
            if runs and runs[-1][0].tokens.shape[0] == seg.tokens.shape[0]:
                runs[-1].append(seg)
            else:
                runs.append([seg])
        S = state.kv.max_seq
        self.groups = []
        offset = 0
        for run in runs:
            dev, t = run[0].tokens.device, int(run[0].tokens.shape[0])
            rows = torch.tensor([g.row for g in run], dtype=torch.long, device=dev)
            start = torch.tensor([g.start for g in run], dtype=torch.long, device=dev)
            mask = block_mask(start, torch.stack([g.ancestors for g in run]), S)
            slots = start[:, None] + torch.arange(t, device=dev)[None, :]
            self.groups.append((rows, slots, offset, t, mask))
            offset += t * len(run)


def ragged_supported(cfg) -> bool:
    """True when every layer of target config ``cfg`` is full attention (one static KV cache: the
    layout :func:`forward_ragged` writes per segment)."""
    return set(cfg.layer_types) <= {"full_attention"}


def forward_ragged(model, segments: list[Segment], capture: tuple[int, ...] = ()):
    """Run ``segments`` (each its own cache row; at most one segment per row) in one forward.

    Args:
        model: a :class:`~specpilot.models.target.Transformer` with its cache set up.
        segments: the rows' blocks (:class:`Segment`), in the order their outputs are packed.
        capture: target layer ids whose outputs to return (as ``Transformer.forward``).
    Returns:
        logits [S, vocab] (model dtype) and captured features [S, len(capture) * hidden] (None
        without capture), the segments' tokens in order (S = total tokens).
    Raises:
        SpecpilotError: a target with sliding-window or linear-attention layers, no segment, two
            segments of one row, or a segment beyond the KV cache.
    """
    cfg = model.config
    if not ragged_supported(cfg) or model.state is None or model.state.kv is None:
        raise SpecpilotError(f"a ragged (mixed prefill) forward needs a target of full-attention layers only; "
                             f"this one has {sorted(set(cfg.layer_types))}")
    if not segments:
        raise SpecpilotError("a ragged forward needs at least one segment")
    rows = [s.row for s in segments]
    if len(set(rows)) != len(rows):
        raise SpecpilotError(f"a ragged forward holds one segment per cache row, got rows {rows}")
    S = model.state.kv.max_seq
    for s in segments:
        if s.start + int(s.tokens.shape[0]) > S:
            raise SpecpilotError(f"row {s.row}: {s.tokens.shape[0]} tokens from slot {s.start} exceed the KV cache "
                                 f"of {S} slots")
    dev = segments[0].tokens.device
    tokens = torch.cat([s.tokens for s in segments])[None]  # [1, S]
    pos = torch.cat([s.start + (torch.arange(s.tokens.shape[0], device=dev) if s.depth is None else s.depth)
                     for s in segments])
    cos, sin = model.cos[pos][None], model.sin[pos][None]
    ctx = RaggedContext(model.state, segments)
    x = model.model.embed(tokens)
    feats = {}
    for i, layer in enumerate(model.model.layers):
        x = layer(x, cos, sin, ctx)
        if i in capture:
            feats[i] = x
    logits = model._logits(x)[0]
    return logits, (torch.cat([feats[i] for i in capture], -1)[0] if capture else None)

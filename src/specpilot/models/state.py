"""Per-layer decoding state with one interface: write during verify, commit the accepted path
(chain or tree), roll back the rest.

- :class:`KVCache` (full attention): static K/V [B, L, H, S, D]; a verify writes slots
  ``start + j``; rollback is free (slots past the committed length are invisible, see
  :func:`layers.block_mask`); a tree's accepted path is compacted into contiguous slots.
- :class:`RingKV` (sliding-window attention): a ring of ``R >= W + verify width`` slots per row,
  position p in slot p mod R. Rejected drafts write at most ``verify width`` positions past the
  committed length, so they can only overwrite slots of positions older than every live window:
  they never evict a live entry. Slot R is a sink for writes that must not land (prefill padding,
  prompt tokens older than the ring).
- :class:`GDNState` (Gated DeltaNet): conv state [B, L, C, K-1] and fp32 recurrent state
  [B, L, HV, Dk, Dv]. Verify leaves both untouched and records the block's inputs (a tape:
  pre-conv projections, normalised keys, values, decay, beta); commit replays the accepted path's
  tape from the committed state (checkpoint + replay, z-lab dflash ``_GDNStateCapture`` / TRT-LLM
  PR #13453 pattern), so rejected drafts never reach the state.

:class:`TargetState` holds the three and commits them together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import SpecpilotError
from .gdn import conv_gather_index, step


@dataclass
class StepContext:
    """What one forward over a block needs besides the hidden states.

    start int64 [B] committed length; ancestors bool [B, N, N]; depth int64 [B, N] (None = chain);
    parents int64 [B, N] (None = chain); lengths int64 [B] valid tokens per row (prefill padding;
    None = all); write: commit the whole valid block (prefill/decode) rather than verify.
    """

    state: "TargetState"
    start: torch.Tensor
    ancestors: torch.Tensor
    depth: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    write: bool = False

    def __post_init__(self):
        self._conv = {}

    def node_depth(self) -> torch.Tensor:
        if self.depth is not None:
            return self.depth
        B, N = self.ancestors.shape[:2]
        return torch.arange(N, device=self.start.device).expand(B, N)

    def conv_index(self, K: int) -> torch.Tensor:
        """Cached :func:`gdn.conv_gather_index` for this block."""
        if K not in self._conv:
            self._conv[K] = conv_gather_index(self.node_depth(), self.parents, K)
        return self._conv[K]


class KVCache(nn.Module):
    """Static KV cache, k and v each shaped (batch, layers, kv_heads, max_seq, head_dim)."""

    def __init__(self, batch: int, layers: int, kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        shape = (batch, layers, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, H, T, D] at slots int64 [B, T]; return this layer's full k, v [B, H, S, D]."""
        B = slots.shape[0]
        rows = torch.arange(B, device=slots.device)[:, None].expand_as(slots)
        kc, vc = self.k[:, layer], self.v[:, layer]
        kc[rows, :, slots] = k.transpose(1, 2)
        vc[rows, :, slots] = v.transpose(1, 2)
        return kc, vc

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to ``dst`` (int64 [N] each) of ``rows`` [N].

        Used to compact the accepted path of a tree into contiguous slots.
        """
        self.k[rows, :, :, dst] = self.k[rows, :, :, src]
        self.v[rows, :, :, dst] = self.v[rows, :, :, src]

    def nbytes_per_row(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()


class RingKV(nn.Module):
    """Sliding-window K/V rings: k, v (batch, layers, kv_heads, R + 1, head_dim); slot R is a sink.

    ``window`` W: a query at position P sees keys at P-W+1 .. P. ``reserve``: the widest verify
    block the ring is sized for (R = W + reserve, or max_seq when that is smaller: no wrap).
    """

    def __init__(self, batch: int, layers: int, kv_heads: int, head_dim: int, window: int, reserve: int,
                 max_seq: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.window, self.reserve = window, reserve
        self.R = min(window + reserve, max_seq)
        shape = (batch, layers, kv_heads, self.R + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def keys(self, layer: int, ctx: StepContext, k: torch.Tensor, v: torch.Tensor):
        """Keys/values a block attends to and the mask: ring (committed) then the block itself.

        Args: k, v [B, H, N, D] of the block. Returns keys, values [B, H, R + N, D] and the
        bool mask [B, 1, N, R + N].
        """
        R, W = self.R, self.window
        B, _, N, _ = k.shape
        dev = k.device
        depth = ctx.node_depth()  # [B, N]
        s = torch.arange(R, device=dev)
        rel = (s[None, :] - ctx.start[:, None]) % R  # [B, R]
        pos = ctx.start[:, None] - R + rel  # committed position held by slot s
        qpos = ctx.start[:, None] + depth  # [B, N]
        ring_vis = (pos[:, None, :] >= 0) & (pos[:, None, :] > qpos[:, :, None] - W)
        near = (depth[:, :, None] - depth[:, None, :]) < W
        block_vis = ctx.ancestors & near
        mask = torch.cat([ring_vis, block_vis], -1)[:, None]
        keys = torch.cat([self.k[:, layer, :, :R], k], 2)
        vals = torch.cat([self.v[:, layer, :, :R], v], 2)
        return keys, vals, mask

    def write(self, layer: int, ctx: StepContext, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the block's k, v [B, H, N, D] at slots (start + j) mod R; writes of padding and of
        entries older than the ring's span go to the sink slot."""
        R = self.R
        B, _, N, _ = k.shape
        j = torch.arange(N, device=k.device)[None, :]
        valid = ctx.lengths[:, None] if ctx.lengths is not None else torch.full((B, 1), N, device=k.device)
        keep = (j < valid) & (j >= valid - R)
        slots = torch.where(keep, (ctx.start[:, None] + j) % R, R)
        rows = torch.arange(B, device=k.device)[:, None].expand(B, N)
        self.k[:, layer][rows, :, slots] = k.transpose(1, 2)
        self.v[:, layer][rows, :, slots] = v.transpose(1, 2)

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's entries of positions ``src`` to positions ``dst`` (int64 [N]) of ``rows``."""
        src, dst = src % self.R, dst % self.R
        self.k[rows, :, :, dst] = self.k[rows, :, :, src]
        self.v[rows, :, :, dst] = self.v[rows, :, :, src]

    def nbytes_per_row(self) -> int:
        return 2 * self.k[0].numel() * self.k.element_size()


class GDNState(nn.Module):
    """Gated DeltaNet states of every GDN layer plus the tape of the last verify.

    conv [B, L, C, K-1] (model dtype): the last K-1 committed pre-conv inputs; rec
    [B, L, HV, Dk, Dv] fp32: the recurrent state after the committed prefix.
    """

    def __init__(self, batch: int, layers: int, conv_dim: int, K: int, hv: int, h: int, dk: int, dv: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.h, self.hv = h, hv
        self.register_buffer("conv", torch.zeros(batch, layers, conv_dim, K - 1, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("rec", torch.zeros(batch, layers, hv, dk, dv, dtype=torch.float32, device=device),
                             persistent=False)
        self.tape: dict[int, tuple] = {}

    def reset(self) -> None:
        """Zero every state (a new prefill from an empty cache) and drop the tape."""
        self.conv.zero_()
        self.rec.zero_()
        self.tape.clear()

    def record(self, slot: int, pre, k, v, g, beta) -> None:
        """Keep a verify block's inputs of GDN layer ``slot``: pre [B, N, C], k [B, N, H, Dk] (key
        heads, normalised), v [B, N, HV, Dv], g and beta [B, N, HV] (fp32)."""
        self.tape[slot] = (pre, k, v, g, beta)

    def commit(self, counts: torch.Tensor, path: torch.Tensor | None) -> None:
        """Advance every layer by the first ``counts[b]`` entries of the accepted path.

        path int64 [B, P] block indices of the accepted nodes in order (None: the chain 0..N-1).
        Entries past ``counts[b]`` are identity updates (g = 0, beta = 0), so rows that accept
        nothing keep their state exactly.
        """
        if not self.tape:
            return
        B = counts.shape[0]
        r = self.hv // self.h
        for slot, (pre, k, v, g, beta) in self.tape.items():
            N = pre.shape[1]
            idx = path if path is not None else torch.arange(N, device=pre.device).expand(B, N)
            P = min(idx.shape[1], int(counts.max()) if B else 0)  # steps past every count are identities
            idx = idx[:, :P]
            live = torch.arange(P, device=pre.device)[None, :] < counts[:, None]  # [B, P]

            def take(t):
                return torch.gather(t, 1, idx.reshape(B, P, *([1] * (t.dim() - 2))).expand(B, P, *t.shape[2:]))

            kp, vp, gp, bp = take(k), take(v), take(g) * live[..., None], take(beta) * live[..., None]
            if r > 1:
                kp = kp.repeat_interleave(r, dim=2)
            S = self.rec[:, slot]
            for t in range(P):
                S = step(S, kp[:, t], vp[:, t], gp[:, t], bp[:, t])
            self.rec[:, slot] = S
            # conv window: the last K-1 inputs of (committed window, accepted path[:count])
            seq = torch.cat([self.conv[:, slot], take(pre).transpose(1, 2)], -1)  # [B, C, K-1+P]
            Km1 = self.conv.shape[-1]
            cols = counts[:, None] + torch.arange(Km1, device=pre.device)[None, :]
            self.conv[:, slot] = torch.gather(seq, 2, cols[:, None, :].expand(-1, seq.shape[1], -1))
        self.tape.clear()

    def nbytes_per_row(self) -> int:
        return self.conv[0].numel() * self.conv.element_size() + self.rec[0].numel() * self.rec.element_size()


class TargetState(nn.Module):
    """All per-layer state of a target: ``kv`` (full attention), ``ring`` (sliding), ``gdn`` (recurrent);
    absent kinds are None."""

    def __init__(self, kv: KVCache | None, ring: RingKV | None, gdn: GDNState | None):
        super().__init__()
        self.kv, self.ring, self.gdn = kv, ring, gdn

    def reset(self) -> None:
        """Prepare for a prefill from an empty cache (attention slots need nothing: start = 0)."""
        if self.gdn is not None:
            self.gdn.reset()

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty the state of ``rows`` (int64 [n] or bool [B]) for a new request in those slots:
        the recurrent conv and GDN states are zeroed; attention and ring entries need nothing
        (a row of committed length 0 sees none of them)."""
        if self.gdn is not None:
            self.gdn.conv[rows] = 0
            self.gdn.rec[rows] = 0

    def data_ptrs(self) -> tuple:
        """(address, shape) of every state tensor: a captured CUDA graph is valid while these hold."""
        return tuple((t.data_ptr(), tuple(t.shape)) for c in (self.kv, self.ring, self.gdn) if c is not None
                     for t in c.buffers())

    def discard(self) -> None:
        """Drop an uncommitted verify (its attention writes are invisible past the committed length)."""
        if self.gdn is not None:
            self.gdn.tape.clear()

    def commit(self, start: torch.Tensor, counts: torch.Tensor, path_slots: torch.Tensor | None = None) -> None:
        """Keep ``counts[b]`` entries of the last verify block (along ``path_slots`` for a tree) and
        roll back the rest. start int64 [B]: committed length before this commit (device)."""
        counts = counts.to(start.device)
        if path_slots is not None:
            path_slots = path_slots.to(start.device)
            P = path_slots.shape[1]
            j = torch.arange(P, device=start.device)[None, :].expand_as(path_slots)
            need = (j < counts[:, None]) & (path_slots != j)
            if bool(need.any()):
                rows = torch.arange(len(start), device=start.device)[:, None].expand_as(path_slots)[need]
                src = (start[:, None] + path_slots)[need]
                dst = (start[:, None] + j)[need]
                for c in (self.kv, self.ring):
                    if c is not None:
                        c.move(rows, src, dst)
        if self.gdn is not None:
            self.gdn.commit(counts, path_slots)

    def nbytes_per_row(self) -> dict:
        """Bytes of state one request (row) holds, by kind (the tape is transient and not counted)."""
        return {name: (c.nbytes_per_row() if c is not None else 0)
                for name, c in (("kv", self.kv), ("ring", self.ring), ("gdn", self.gdn))}


def check_width(state: TargetState, n: int) -> None:
    """Raise when a verify block of ``n`` entries is wider than the sliding rings were sized for
    (an engine is sized for its verify width when its runner is built, so this names the engine
    settings that set the width)."""
    if state.ring is not None and n > state.ring.reserve and state.ring.R < state.ring.window + n:
        raise SpecpilotError(f"a verify block of {n} tokens is wider than the {state.ring.reserve} tokens the "
                             f"sliding-window ring was sized for: the engine's verify width (block_size, "
                             f"tree_nodes, tree_branch x tree_depth, second_level) must size the runner "
                             f"(TargetRunner verify_width)")

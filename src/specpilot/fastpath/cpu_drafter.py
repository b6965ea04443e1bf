"""The CPU step path of a block drafter: its draft forward and context injection in fewer operations.

The drafter networks (:class:`~specpilot.models.dflash.DFlashDrafter` and its DFlash2 / DSpark
subclasses) run a handful of small operations per layer and per drafted slot; on a CPU their time
is per-operation overhead. :class:`FusedDrafter` computes what the network computes, reading its
weights and its context cache in place, with fewer operations:

- context injection (:meth:`FusedDrafter.add_context`): the K/V projections of every layer in one
  matmul (every layer reads the same fused context), their norms and RoPE over all layers at once,
  and one write of all layers' K/V (the cache is batch-major: one row's context of every layer is
  one block);
- every matmul through the kernel the kernel sub-agent chose (:mod:`.cpu_linear`: aten's or oneDNN's
  prepacked), the LM head's too;
- the draft forward (:meth:`FusedDrafter.draft`): q/k/v in one matmul, gate/up in one; with one
  row, no window or causal layer in reach and no ``ctx_len``, the block's K/V are written beside the
  context (slots ``start ..``, which only the block itself reads; the context injection of the
  accepted positions overwrites them) and attention reads the slots in use without a mask, instead
  of concatenating the whole context to the block every layer; otherwise the network's masks over
  the slots in use;
- DFlash2's convolutions as two taps' sum (kernel 2) without the zero start or a padded copy, its
  selector walk over the scores of every (predecessor, candidate) pair computed at once (a host
  argmax loop over a [slots, k, k] table); DSpark's Markov walk reading one row of the pair table
  ``W1 W2^T`` per slot (vocabularies up to :data:`MARKOV_TABLE_BYTES`; else one ``addmv`` per slot),
  with the confidence head run once over the walk afterwards;
- the signed sine table made once per cache, no pass over a tensor for a scale of 1, residual adds
  in place.

Profile of one draft step (tiny build, 1 thread, 2026-12-05): the matmuls ~0.29 ms of DFlash's
~0.55 ms (onednn, near the one-thread matmul rate), the rest per-operation overhead (norms, RoPE,
attention, ~20 small ops per layer); DFlash2's walk (~8 ops per slot) and convolutions, DSpark's
Markov walk (all of W2 read per slot) on top.

Drafts equal the network's (the same arithmetic up to matmul blocking; proposals are verified
anyway, so a draft that differed could only change acceptance, never an output). The kernel
sub-agent checks that before anything uses the path (:mod:`specpilot.agent.kernel_agent`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..models.dflash import DFlashDrafter, _visible
from ..models.dflash2 import DFlash2Drafter
from ..models.dspark import DSparkDrafter
from .cpu_linear import Linear, matmul
from .cpu_target import rotate, signed_sin

MARKOV_TABLE_BYTES = 64 * 2**20  # DSpark's Markov pair table is kept up to this size (vocabularies to ~4k)
_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()  # net -> {kernel: step}


def drafter_support(net) -> str | None:
    """None when :class:`FusedDrafter` runs the drafter network ``net`` on its device, else why not."""
    if not isinstance(net, DFlashDrafter):
        return f"{type(net).__name__} is not a DFlash-family drafter"
    if net.fc.weight.device.type != "cpu":
        return f"the drafter is on {net.fc.weight.device.type} (the fused step is the CPU path)"
    for layer in net.layers:
        a, m = layer.self_attn, layer.mlp
        if not all(type(x) is nn.Linear for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                   m.down_proj)):
            return "projections that are not plain linear layers"
    return None


def fused_drafter(net, kernel: str | None = None) -> "FusedDrafter":
    """The fused step of drafter network ``net`` with matmul ``kernel`` (default the installed one,
    :func:`specpilot.fastpath.cpu_linear.matmul`), built once per network and kernel and kept while
    the network lives.

    Raises SpecpilotError for a network :func:`drafter_support` refuses."""
    kernel = kernel or matmul()
    steps = _CACHE.setdefault(net, {})
    if kernel not in steps:
        steps[kernel] = FusedDrafter(net, kernel)
    return steps[kernel]


class FusedDrafter:
    """The fused CPU step of a DFlash-family drafter network ``net`` (see the module docstring).

    Exposes what the proposers call on a network: :meth:`setup_cache`, :meth:`add_context`,
    :meth:`draft` and (DSpark) :meth:`draft_full`, plus ``config`` and ``kind``.

    Raises:
        SpecpilotError: a network :func:`drafter_support` refuses (the reason named).
    """

    def __init__(self, net: DFlashDrafter, kernel: str | None = None):
        why = drafter_support(net)
        if why is not None:
            raise SpecpilotError(f"the fused CPU drafter step cannot run this drafter: {why}")
        c = net.config
        self.net, self.config, self.kind, self.kernel = net, c, net.kind, kernel or matmul()
        self.nh, self.nkv, self.hd, self.eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        self.hidden, self.inter, self.L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
        self.gqa = self.nh != self.nkv
        lin = lambda w: Linear(w.contiguous(), self.kernel)  # noqa: E731
        with torch.no_grad():
            attn = [layer.self_attn for layer in net.layers]
            self.fc = lin(net.fc.weight)
            # all layers' context K/V in one matmul: rows [k_0; v_0; k_1; v_1; ...]
            self.kv = lin(torch.cat([w for a in attn for w in (a.k_proj.weight, a.v_proj.weight)], 0))
            self.k_norms = torch.stack([a.k_norm.weight for a in attn])[:, None]  # [L, 1, D]
            # per layer the q and k norms' weights over its q and k heads (one norm, then the weights)
            self.qk_norms = [torch.cat([a.q_norm.weight.expand(self.nh, -1), a.k_norm.weight.expand(self.nkv, -1)])
                             .contiguous() for a in attn]
            self.qkv = [lin(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)) for a in attn]
            self.o = [lin(a.o_proj.weight) for a in attn]
            self.gu = [lin(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight], 0))
                       for layer in net.layers]
            self.down = [lin(layer.mlp.down_proj.weight) for layer in net.layers]
            self.convs = [[lin(conv.kernel_projection.weight) if conv is not None else None
                           for conv in (layer.attention_conv, layer.mlp_conv)] for layer in net.layers]
        self._heads: dict[int, Linear] = {}  # id(LM head weight) -> its matmul
        # the mask-free draft: every layer non-causal; a window only while it spans every position
        self.windows = [c.layer_window(i) for i in range(self.L)]
        self.open_block = not any(c.layer_causal(i) for i in range(self.L))
        self._ssin = (None, None)  # (the network's sine table, its signed_sin): made once per table
        self._markov = None  # DSpark: (W1, W2, their pair table or None), :meth:`_markov_table`

    def _rope(self, start: torch.Tensor, T: int, B: int, lo: int):
        """cos and signed sin [B or 1, T, D] of positions start.. (the signed sine table made once
        per :meth:`setup_cache`'s table, not per step)."""
        net = self.net
        if self._ssin[0] is not net.sin:
            self._ssin = (net.sin, signed_sin(net.sin))
        ssin = self._ssin[1]
        if B == 1:
            return net.cos[lo:lo + T][None], ssin[lo:lo + T][None]
        pos = start[:, None] + torch.arange(T)
        return net.cos[pos], ssin[pos]

    def setup_cache(self, batch: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        """The network's own context cache (:meth:`DFlashDrafter.setup_cache`): the fused step reads it in place."""
        self.net.setup_cache(batch, max_seq, dtype)

    # -- context injection ----------------------------------------------------------------------
    @torch.no_grad()
    def add_context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        """:meth:`DFlashDrafter.add_context`: the injected K/V of positions start.. of every layer
        from target features [B, T, n_layers * hidden], in one projection and one write."""
        net = self.net
        B, T, _ = features.shape
        ctx = net.hidden_norm(self.fc(features))
        kv = self.kv(ctx).view(B, T, self.L, 2, self.nkv, self.hd)
        lo = int(start.min())
        cos, sin = self._rope(start, T, B, lo)
        k = rotate(F.rms_norm(kv[:, :, :, 0], (self.hd,), None, self.eps) * self.k_norms, cos[:, :, None, None],
                   sin[:, :, None, None])
        v = kv[:, :, :, 1]
        store_k, store_v = net.ctx_k.transpose(0, 1), net.ctx_v.transpose(0, 1)  # (B, L, Hkv, S, D)
        if B == 1:
            store_k[:, :, :, lo:lo + T] = k.permute(0, 2, 3, 1, 4)
            store_v[:, :, :, lo:lo + T] = v.permute(0, 2, 3, 1, 4)
        else:
            rows, slots = torch.arange(B)[:, None].expand(B, T), start[:, None] + torch.arange(T)
            store_k[rows, :, :, slots] = k
            store_v[rows, :, :, slots] = v

    # -- the draft forward ----------------------------------------------------------------------
    def _open(self, B: int, start: int, T: int, ctx_len) -> bool:
        """The mask-free draft applies: one row, all context visible, the block fits the cache."""
        return (B == 1 and ctx_len is None and self.open_block and start + T <= self.net.ctx_k.shape[3]
                and all(w is None or start + T <= w for w in self.windows))

    def _masks(self, start: torch.Tensor, T: int, C: int, ctx_len) -> list[torch.Tensor]:
        """Per layer the network's mask [B, 1, T, C + T] over context slots 0..C-1 then the block."""
        B = start.shape[0]
        pos = start[:, None] + torch.arange(T)
        slots = torch.arange(C)
        visible_ctx = slots[None, :] < (start if ctx_len is None else ctx_len)[:, None]
        out, made = [], {}
        for i in range(self.L):
            key = (self.config.layer_causal(i), self.windows[i])
            if key not in made:
                if key == (False, None):
                    made[key] = torch.cat([visible_ctx, visible_ctx.new_ones(B, T)], 1)[:, None, None, :]
                else:
                    ctx = visible_ctx[:, None, :] & _visible(pos, slots[None, :].expand(B, -1), *key)
                    made[key] = torch.cat([ctx, _visible(pos, pos, *key)], 2)[:, None]
            out.append(made[key])
        return out

    def block_hidden(self, block: torch.Tensor, start: torch.Tensor, embed, ctx_len=None) -> torch.Tensor:
        """:meth:`DFlashDrafter.block_hidden`: the drafter's normed output states [B, T, hidden]."""
        net = self.net
        B, T = block.shape
        lo = int(start.min())
        open_ = self._open(B, lo, T, ctx_len)
        cos, sin = self._rope(start, T, B, lo)
        cos, sin = cos[:, :, None], sin[:, :, None]
        C = int((start if ctx_len is None else ctx_len).max())
        masks = None if open_ else self._masks(start, T, C, ctx_len)
        nh, nkv, hd, eps = self.nh, self.nkv, self.hd, self.eps
        # :meth:`DFlashDrafter.embed_block` (DSpark: its own table), the scale skipped when 1 (x * 1.0 == x)
        h = (net.embed_tokens if isinstance(net, DSparkDrafter) else embed)(block)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        for i, layer in enumerate(net.layers):
            x = F.rms_norm(h, (self.hidden,), layer.input_layernorm.weight, eps)
            if layer.attention_conv is not None:
                x, dyn = _conv_prepare(layer.attention_conv, self.convs[i][0], x)
            qkv = self.qkv[i](x).view(B, T, nh + 2 * nkv, hd)
            qk = rotate(F.rms_norm(qkv[:, :, :nh + nkv], (hd,), None, eps) * self.qk_norms[i], cos, sin)
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)
            v = qkv[:, :, nh + nkv:].transpose(1, 2)
            if open_:  # the block's K/V beside the context, attention over the slots in use
                net.ctx_k[i][:, :, lo:lo + T] = k
                net.ctx_v[i][:, :, lo:lo + T] = v
                y = F.scaled_dot_product_attention(q, net.ctx_k[i][:, :, :lo + T], net.ctx_v[i][:, :, :lo + T],
                                                   enable_gqa=self.gqa)
            else:
                keys = torch.cat([net.ctx_k[i][:, :, :C], k], 2)
                vals = torch.cat([net.ctx_v[i][:, :, :C], v], 2)
                y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=masks[i], enable_gqa=self.gqa)
            y = self.o[i](y.transpose(1, 2).reshape(B, T, nh * hd))
            if layer.attention_conv is not None:
                y = _conv(y, dyn, layer.attention_conv.base_kernel[1], layer.attention_conv.group_size)
            h += y  # h is this step's own tensor: in place
            x = F.rms_norm(h, (self.hidden,), layer.post_attention_layernorm.weight, eps)
            if layer.mlp_conv is not None:
                x, dyn = _conv_prepare(layer.mlp_conv, self.convs[i][1], x)
            g, u = self.gu[i](x).split(self.inter, -1)
            y = self.down[i](F.silu(g) * u)
            if layer.mlp_conv is not None:
                y = _conv(y, dyn, layer.mlp_conv.base_kernel[1], layer.mlp_conv.group_size)
            h += y
        return net.norm(h)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """:meth:`DFlashDrafter.logits` through this step's matmul (the LM head's packed once)."""
        head = self._heads.get(id(lm_head.weight))
        if head is None or head.weight is not lm_head.weight:
            head = self._heads[id(lm_head.weight)] = Linear(lm_head.weight, self.kernel)
        out = head(hidden)
        if self.config.output_multiplier != 1.0:  # x * 1.0 == x: no pass over the logits for it
            out = out * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def _block(self, anchor: torch.Tensor, T: int) -> torch.Tensor:
        block = torch.full((anchor.shape[0], T), self.config.mask_token_id, dtype=torch.long)
        block[:, 0] = anchor
        return block

    @torch.no_grad()
    def draft(self, anchor: torch.Tensor, start: torch.Tensor, embed, lm_head, block_size: int,
              ctx_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The network's ``draft``: tokens int64 [B, block_size - 1] and their scores [B, block_size - 1, V]
        (DFlash: the logits; DFlash2: the selector's scores, -inf outside each slot's candidates;
        DSpark: the Markov-corrected logits of its ``block_size - 1`` drafts)."""
        net = self.net
        if isinstance(net, DSparkDrafter):
            toks, logits, _ = self.draft_full(anchor, start, block_size - 1)
            return toks, logits
        hidden = self.block_hidden(self._block(anchor, block_size), start, embed, ctx_len)[:, 1:]
        logits = self.logits(hidden, lm_head)
        if isinstance(net, DFlash2Drafter):
            path, cands, scores = _walk(net.candidate_selector, hidden, logits, anchor)
            # the logits are spent: their buffer holds the scores (in place, no second block of V)
            return path, logits.fill_(float("-inf")).scatter_(-1, cands, scores.to(logits.dtype))
        return logits.argmax(-1), logits

    @torch.no_grad()
    def draft_full(self, anchor: torch.Tensor, start: torch.Tensor, gamma: int):
        """:meth:`DSparkDrafter.draft_full`: tokens int64 [B, gamma], Markov-corrected logits
        [B, gamma, V] and confidences float32 [B, gamma] (ones without a confidence head)."""
        net = self.net
        hidden = self.block_hidden(self._block(anchor, gamma), start, None)
        base = self.logits(hidden, net.lm_head)
        toks_t, logits = self._markov_walk(base, anchor)
        if net.confidence_head is None:
            conf = torch.ones(anchor.shape[0], gamma)
        else:  # the walk's predecessors: the anchor, then each draft but the last
            prevs = torch.cat([anchor[:, None], toks_t[:, :-1]], 1)
            conf = torch.sigmoid(net.confidence_head(hidden, net.markov_head.markov_w1(prevs)).float())
        return toks_t, logits, conf

    def _markov_table(self) -> torch.Tensor | None:
        """DSpark's Markov bias of every (previous, next) token pair, ``W1 @ W2^T`` [V, V], made once
        per network when it holds at most :data:`MARKOV_TABLE_BYTES` (a small vocabulary: the tiny
        build's 2048 tokens, 16 MiB), else None."""
        net = self.net
        w1, w2 = net.markov_head.markov_w1.weight, net.markov_head.markov_w2.weight
        if self._markov is None or self._markov[0] is not w1 or self._markov[1] is not w2:
            V = w2.shape[0]
            fits = w1.shape[0] * V * w1.element_size() <= MARKOV_TABLE_BYTES
            self._markov = (w1, w2, (w1 @ w2.T).contiguous() if fits else None)
        return self._markov[2]

    def _markov_walk(self, base: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's Markov walk over base logits [B, gamma, V] after ``anchor`` [B]: each slot's
        logits are ``base_j + W2 W1[prev]``, prev the previous slot's argmax. Returns (tokens int64
        [B, gamma], logits [B, gamma, V]).

        With the pair table (:meth:`_markov_table`) a slot reads one row of it (8 KiB for 2048
        tokens) instead of all of W2 (its matrix-vector product), the walk's only work per slot; the
        bias is the same sum of r products in another order (~1e-6 apart). Without it, one row:
        ``addmv`` into the output (bit-equal to the network's ``linear`` + add); more rows: the
        network's arithmetic."""
        net = self.net
        w1, w2 = net.markov_head.markov_w1.weight, net.markov_head.markov_w2.weight
        B, gamma, V = base.shape
        table = self._markov_table()
        out = torch.empty_like(base)
        if B == 1:
            p, toks = int(anchor[0]), []
            for j in range(gamma):
                if table is not None:
                    torch.add(base[0, j], table[p], out=out[0, j])
                else:
                    torch.addmv(base[0, j], w2, w1[p], out=out[0, j])
                p = int(out[0, j].argmax())
                toks.append(p)
            return torch.tensor([toks], dtype=torch.long), out
        prev, toks = anchor, []
        for j in range(gamma):
            bias = table[prev] if table is not None else F.linear(F.embedding(prev, w1), w2)
            torch.add(base[:, j], bias, out=out[:, j])
            prev = out[:, j].argmax(-1)
            toks.append(prev)
        return torch.stack(toks, 1), out


def _conv_prepare(conv, projection: Linear, x: torch.Tensor):
    """:meth:`GroupedDynamicCausalConv.prepare` over one block: (in-convolved x, out taps)."""
    G = x.shape[-1] // conv.group_size
    dyn = projection(x).view(*x.shape[:-1], 2, conv.kernel_size, G)
    return _conv(x, dyn[..., 0, :, :], conv.base_kernel[0], conv.group_size), dyn[..., 1, :, :]


def _conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`specpilot.models.dflash2.grouped_dynamic_conv` over one block [B, T, C] (taps summed
    from tap 0, as the reference accumulates them after its zero start). Tap t adds its product to
    rows t.. only (rows before it would add the zero start's 0), in place: no padded copy."""
    B, T, C = x.shape
    K = base.shape[0]
    G = C // group
    xb = x.view(B, T, G, group)
    dyn = dyn.view(B, T, K, G, 1)
    base = base.view(K, G, group)
    out = (base[0] + dyn[:, :, 0]) * xb
    for t in range(1, min(K, T)):
        out[:, t:] += (base[t] + dyn[:, t:, t]) * xb[:, :-t]
    return out.view(B, T, C)


def _walk(sel, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor):
    """:meth:`CandidateSelector.walk` in a fixed handful of operations instead of a handful per slot.

    The walk's score at slot j is ``unary[j] + (pred(prev) * hp[j]) . succ[j, c]`` for the candidates
    c of slot j, ``prev`` being the anchor (slot 0) or the candidate the walk took at slot j - 1.
    Every predecessor the walk can take is one of slot j - 1's ``k`` candidates, so the scores of
    every (predecessor, candidate) pair are computed at once (the lattice's edge tables,
    :meth:`CandidateSelector.lattice`, plus the unary scores), and the walk itself is a host loop of
    argmaxes over that small table (first maximum on ties, as ``argmax``). The scores and the
    path are the walk's (the same products, summed over the rank by a matmul of k rows instead of
    one)."""
    cands, unary, first, trans = sel.lattice(hidden, logits, anchor)  # edges [B, k], [B, n - 1, k, k]
    B, n, k = cands.shape
    first = unary[:, 0] + first
    if n == 1:
        idx = first.argmax(-1, keepdim=True)
        return cands[:, 0].gather(1, idx), cands, first[:, None]
    trans = unary[:, 1:, None, :] + trans  # the walk's scores: unary + edge
    rows_first, rows_trans, picks = first.tolist(), trans.tolist(), []
    for b in range(B):
        row, taken = rows_first[b], []
        for j in range(n):
            i = max(range(k), key=row.__getitem__)  # the first maximum, as argmax
            taken.append(i)
            if j + 1 < n:
                row = rows_trans[b][j][i]
        picks.append(taken)
    idx = torch.tensor(picks, dtype=torch.long)  # [B, n]: the candidate taken at each slot
    path = cands.gather(2, idx[:, :, None])[:, :, 0]
    later = trans.gather(2, idx[:, :-1, None, None].expand(B, n - 1, 1, k))[:, :, 0]
    return path, cands, torch.cat([first[:, None], later], 1)

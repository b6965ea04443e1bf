"""The drafter's fast path: the DFlash draft step in the target step's Triton kernels
(:class:`FastDrafter`), the drafter's CUDA graphs (:class:`DrafterGraphs`), and the few-row Triton
linear (:class:`TritonLinear`) that other drafter networks run inside those graphs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..kernels import step as kstep
from .dense import FastTarget, _Workspace, fuse_layer_weights
from .graphs import GraphCache
from .support import drafter_support
from .tables import DEFAULT_CONFIGS, DRAFTER_CONTEXT_CONFIGS, FAST_LINEAR_KEY, FAST_LINEAR_MAX_M, LINEAR_ROLES, LinearConfig


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: through the Triton matmul (config :data:`~specpilot.fastpath.tables.FAST_LINEAR_KEY`)
    for 1..64 rows of bf16 on CUDA without bias and a contiguous weight, else ``F.linear``.

    x [..., K] -> [..., N]; weight [N, K]."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and bias is None \
            and 0 < rows <= FAST_LINEAR_MAX_M and weight.is_contiguous():
        y = kstep.linear(x.reshape(rows, K), weight, cfg=LinearConfig.parse(FAST_LINEAR_KEY))
        return y.view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, weight, bias)


class TritonLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`triton_linear` (same parameters, same state_dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_linear(x, self.weight, self.bias)


def route_linears(module: nn.Module, enable: bool = True) -> nn.Module:
    """Make every plain ``nn.Linear`` of ``module`` a :class:`TritonLinear` (``enable``) or turn them
    back (in place; parameters untouched). Returns ``module``."""
    for m in module.modules():
        if enable and type(m) is nn.Linear:
            m.__class__ = TritonLinear
        elif not enable and type(m) is TritonLinear:
            m.__class__ = nn.Linear
    return module


class FastLinear(nn.Module):
    """``x @ weight.T`` through :func:`triton_linear`; shares (does not own) ``weight`` (the target's
    LM head inside a drafter's captured step)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight_ref = [weight]
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_ref[0]

    def forward(self, x):
        return triton_linear(x, self.weight)


class FastDrafter(FastTarget):
    """The DFlash draft step and context injection through the target fast path's Triton kernels.

    A DFlash drafter layer is a Qwen3 layer whose block queries see the injected context and the
    whole block (Chen, Liang, Liu, arXiv 2602.06036; z-lab/dflash ``DFlashDraftModel``): the
    block's K/V are written to the draft cache at slots start .. start+T-1 (the next
    :meth:`add_context` overwrites the committed ones with the target's features) and attention
    runs as a tree whose every node sees every other (all ancestor bits set), so the layer is
    :meth:`FastTarget._layer` unchanged: 7 kernels per layer, matmul tiles by rows from the same
    tables (the drafter has the target's width). The LM head is the target's; its output scaling
    and softcap are monotonic, so the argmax (the draft) skips them.

    Drafts may differ from the eager drafter's in low bits (norm rounding); they are proposals,
    checked by the target. Needs :func:`~specpilot.fastpath.support.drafter_support`; the draft cache must hold
    start + block size slots.

    Context injection runs two matmuls of its own roles: ``ctx_fc`` (the fc projection of the
    target's features, [M, n_layers x hidden] @ [hidden, n_layers x hidden].T) and ``ctx_kv`` (every
    layer's k/v rows, [M, hidden] @ [2 L Hkv D, hidden].T); their tables are
    :data:`DRAFTER_CONTEXT_CONFIGS` unless ``configs`` names them.
    """

    roles = LINEAR_ROLES + ("ctx_fc", "ctx_kv")
    default_configs = {**DEFAULT_CONFIGS, **DRAFTER_CONTEXT_CONFIGS}

    def __init__(self, drafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 configs: dict | None = None, attn_rows: int | None = None):
        why = drafter_support(drafter)
        if why:
            raise SpecpilotError(f"the Triton draft step cannot run this drafter: {why}")
        self.embed_w, self.lm_w = embed_weight, lm_head_weight
        super().__init__(drafter, configs, attn_rows)

    def _fuse_weights(self) -> None:
        fuse_layer_weights(self.model.layers)

    def _dims(self) -> tuple:
        d = self.model
        if d.ctx_k is None:
            raise SpecpilotError("drafter setup_cache() must be called before the draft step")
        return d.config, d.ctx_k.shape[3], self.lm_w.device, self.lm_w.dtype

    def _buf(self, ws: _Workspace, name: str, cols: int, dtype=None) -> torch.Tensor:
        t = ws.extra.get(name)
        if t is None:
            t = ws.extra[name] = torch.zeros(ws.qkv.shape[0], cols, dtype=dtype or ws.qkv.dtype,
                                             device=ws.qkv.device)
        return t

    @torch.inference_mode()
    def draft(self, anchor: torch.Tensor, start: torch.Tensor, block_size: int, branch: int = 0,
              depth: int = 0):
        """Draft tokens int64 [B, block_size - 1] (argmax) after ``anchor`` int64 [B] at ``start`` int64 [B].

        Same contract as :meth:`DFlashDrafter.draft` (tokens only). With ``branch`` > 0 also the
        side branches of a "spine + side branches" tree (:func:`~specpilot.drafters.proposal.spine_tree`):
        returns (spine [B, block_size - 1], alternatives int64 [B, min(depth, block_size - 1), branch]),
        the alternatives at position i being the drafter's next ``branch`` best tokens there (one
        top-(branch + 1) per position, whose first is the spine token; so they never repeat it), all
        inside the captured step. Raises SpecpilotError for a block of more than 63 slots (the
        ancestor bits of one int64).
        """
        d, c = self.model, self.model.config
        B, T = anchor.shape[0], int(block_size)
        if not 2 <= T <= 63:
            raise SpecpilotError(f"the Triton draft step takes blocks of 2..63 slots, got {T}")
        M = B * T
        ws = self._workspace(B, T, 0)
        anc = ws.extra.get("anc")
        if anc is None:  # every block node sees the whole block (DFlash's non-causal draft attention)
            anc = ws.extra["anc"] = torch.full((B, T), (1 << T) - 1, dtype=torch.long, device=anchor.device)
        tok = ws.tok[:M].view(B, T)
        tok.fill_(c.mask_token_id)
        tok[:, 0] = anchor
        x = F.embedding(ws.tok, self.embed_w)  # padded rows (cuBLAS configs) embed the mask token
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        for i, layer in enumerate(d.layers):
            self._layer(x, layer, d.ctx_k[i], d.ctx_v[i], d.cos, d.sin, start, T, M, ws, anc_bits=anc)
        self._linear("lm_head", x, self.lm_w, ws.logits, ws, norm=d.norm.weight)
        logits = ws.logits[:M].view(B, T, -1)[:, 1:]
        largest = c.output_multiplier >= 0  # a negative scale reverses the order (the softcap keeps it)
        spine = logits.argmax(-1) if largest else logits.argmin(-1)
        if not branch:
            return spine
        dd = min(int(depth), T - 1)
        top = logits[:, :dd].topk(int(branch) + 1, dim=-1, largest=largest).indices
        return torch.cat([top[..., 0], spine[:, dd:]], 1), top[..., 1:]

    @torch.inference_mode()
    def add_context(self, features: torch.Tensor, start: torch.Tensor, rows: slice | None = None) -> None:
        """Write the injected K/V of positions start .. start+T-1 into the draft cache (of cache
        rows ``rows`` only, when given: B = their count).

        Same contract as :meth:`DFlashDrafter.add_context`: features [B, T, n_layers * hidden]
        (target hidden states), start int64 [B]. fc + hidden norm, then the k/v rows of every
        layer's projection in one matmul and one cache write (k norm, RoPE): 4 kernels.
        """
        d, c = self.model, self.model.config
        B, T, Fd = features.shape
        M, L, Hkv = B * T, c.num_hidden_layers, c.num_key_value_heads
        if d.ctx_k.stride(0) != Hkv * d.ctx_k.stride(2) or d.ctx_v.stride() != d.ctx_k.stride():
            raise SpecpilotError("the Triton context injection needs the batch-major draft cache of "
                                 "DFlashDrafter.setup_cache")
        ws = self._workspace(B, T, 0)
        ctx, ctxn = self._buf(ws, "ctx", c.hidden_size)[:M], self._buf(ws, "ctxn", c.hidden_size)[:M]
        kv = self._buf(ws, "kv", 2 * L * Hkv * c.head_dim)[:M]
        self._linear("ctx_fc", features.reshape(M, Fd).contiguous(), d.fc.weight, ctx, ws)
        self.k.rmsnorm(ctx, d.hidden_norm.weight, ctxn, c.rms_norm_eps)
        # every layer's k and v projections in one matmul, K/V of every layer in one cache write:
        # layer l's head h is head l * Hkv + h of the batch-major cache's layer-0 view
        w, kn = self._context_weights()
        self._linear("ctx_kv", ctxn, w, kv, ws)
        rows = rows if rows is not None else slice(None)
        kc, vc = d.ctx_k[0][rows], d.ctx_v[0][rows]
        if kc.shape[0] != B:
            raise SpecpilotError(f"context of {B} rows for draft-cache rows {rows} of a batch of {d.ctx_k.shape[1]}")
        self.k.qk_rope_cache(kv, ws.q, kc, vc, kn, kn, d.cos, d.sin, start, T,
                             0, L * Hkv, c.head_dim, c.rms_norm_eps, k_norm_group=Hkv)

    def _context_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k rows of every layer then v rows of every layer [2 L Hkv D, hidden], k norms [L, D]):
        copies of the drafter's projections (2 L Hkv D x hidden values; 80 MB at the Qwen3-8B
        drafter shape), made once."""
        if getattr(self, "_ctx_w", None) is None:
            c = self.model.config
            nq, nkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            qkv = [layer.fused_qkv for layer in self.model.layers]
            self._ctx_w = (torch.cat([w[nq:nq + nkv] for w in qkv] + [w[nq + nkv:] for w in qkv], 0).contiguous(),
                           torch.stack([layer.self_attn.k_norm.weight for layer in self.model.layers]).contiguous())
        return self._ctx_w


class DrafterGraphs:
    """Captured DFlash-family drafter steps: ``draft`` and ``add_context`` per shape.

    One per (drafter network, target embedding, LM head), held by the deployment's
    :class:`~specpilot.engine.backend.Backend` (:meth:`~specpilot.engine.backend.Backend.drafter_graphs`).
    With ``kernels`` "triton" a plain DFlash network drafts in :class:`FastDrafter`; other networks
    (DFlash2, DSpark) run eagerly inside the graph with their few-row linears through the Triton
    matmul (:class:`TritonLinear`)."""

    def __init__(self, drafter, embed: nn.Embedding, lm_head: nn.Module, kernels: str = "triton"):
        self.drafter = drafter
        self.embed = embed
        self.kernels = kernels
        self.lm_head = FastLinear(lm_head.weight) if kernels == "triton" else lm_head
        self.cache = GraphCache()
        # the whole draft step in the Triton kernels where the network allows it (plain DFlash);
        # else the eager network with its linears through the Triton matmul
        self.fast = FastDrafter(drafter, embed.weight, lm_head.weight) \
            if kernels == "triton" and drafter_support(drafter) is None and type(lm_head) is nn.Linear else None

    def _prepare(self):  # the drafter's linears as this graph set wants them, before a capture
        route_linears(self.drafter, self.kernels == "triton" and self.fast is None)

    def _token(self):
        return (self.drafter.ctx_k.data_ptr(), tuple(self.drafter.ctx_k.shape))

    def draft(self, anchor: torch.Tensor, start: torch.Tensor, block_size: int, branch: int = 0, depth: int = 0):
        """Draft tokens [B, block_size - 1] (static buffer) after ``anchor`` [B] at ``start`` [B]; with
        ``branch`` > 0 (the Triton draft step only) also the side branches, see :meth:`FastDrafter.draft`.

        Raises SpecpilotError for side branches without the Triton draft step."""
        if self.fast is not None:
            fn = lambda a, s: self.fast.draft(a, s, block_size, branch, depth)  # noqa: E731
        elif branch:
            raise SpecpilotError("side branches in a captured draft step need the Triton draft step (plain DFlash)")
        else:
            fn = lambda a, s: self.drafter.draft(a, s, self.embed, self.lm_head, block_size)[0]  # noqa: E731
        key = ("draft", anchor.shape[0], block_size) + ((branch, depth) if branch else ())
        with torch.inference_mode():
            return self.cache.run(key, fn, (anchor, start), self._token(), self._prepare)

    def add_context(self, features: torch.Tensor, start: torch.Tensor) -> None:
        """Inject target features [B, T, F] of positions start..start+T-1 into the draft cache."""
        with torch.inference_mode():
            fn = self.fast.add_context if self.fast is not None else self.drafter.add_context
            self.cache.run(("ctx", tuple(features.shape)), fn, (features, start), self._token(), self._prepare)

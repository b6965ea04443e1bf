"""The Triton fast path of a dense target: one decode / verify / prefill step (:class:`FastTarget`).

7 Triton kernels per layer (:mod:`specpilot.kernels.step`): norms folded into the matmuls, fused
q/k/v and gate/up weights, split-KV attention that reads only the live context, matmul row tiles
chosen by M (16 rows for decode, up to 128/256 for batched verification; tables by rows in
:data:`~specpilot.fastpath.tables.DEFAULT_CONFIGS`). Row-independent, so verifying a block, alone or
in a batch of any size, gives bit-identical logits to decoding its tokens one by one (checked on the
GPU by ``specpilot bench verify`` for M = 1 .. 384). Token trees (<= 64 nodes) run in the same step
with ancestor bits or ancestor paths (:func:`specpilot.engine.verify.tree_inputs`). The step itself
holds no CUDA graph: :mod:`specpilot.fastpath.graphs` captures it. Spirit: gpt-fast's model.py,
with the kernels written out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..kernels import step as kstep
from ..models.qwen3 import Transformer
from ..tuning.select import select_checked
from ..tuning.timing import median_ms
from .tables import (CHECKED_CUBLAS_MIN_ROWS, CUBLAS, CUBLAS_PAD_ROWS, DEFAULT_ATTN_ROWS, DEFAULT_CONFIGS,
                     LINEAR_ROLES, PREFILL_CUBLAS_MIN_ROWS, PaddedCublas, config_key, config_tiers, tier_for)
from .w12 import W12Roles


@torch.no_grad()
def fuse_layer_weights(layers) -> None:
    """Store each layer's q/k/v weights in one tensor (``layer.fused_qkv``) and gate/up in another
    (``layer.fused_gate_up``), in place, once per layer.

    ``layers``: modules with ``self_attn.{q,k,v}_proj`` and ``mlp.{gate,up}_proj`` linears (the
    target's decoder layers, or a DFlash drafter's). The HF-named parameters (``q_proj.weight``,
    ...) become views into the fused tensors, so the eager forward and ``state_dict`` keep
    working unchanged and no memory is duplicated.
    """
    for layer in layers:
        if getattr(layer, "fused_qkv", None) is not None:
            continue
        layer.fused_qkv = fuse_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
        layer.fused_gate_up = fuse_linears(layer.mlp, ("gate_proj", "up_proj"))


@torch.no_grad()
def fuse_linears(owner: nn.Module, names) -> torch.Tensor:
    """Concatenate the weights of ``owner``'s linears ``names`` (in order) into one tensor
    [sum of out features, in features] and make each linear's ``weight`` a view into it (no
    memory duplicated; the eager forward and ``state_dict`` keep working). Returns the tensor."""
    parts = [getattr(owner, n) for n in names]
    w = torch.cat([m.weight for m in parts], 0)
    o = 0
    for m in parts:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[o:o + n], requires_grad=False)
        o += n
    return w


def fuse_weights(model: Transformer) -> None:
    """:func:`fuse_layer_weights` over every decoder layer of a target (in place, once)."""
    if getattr(model, "_fused_weights", False):
        return
    fuse_layer_weights(model.model.layers)
    model._fused_weights = True


def weight_bytes_per_step(model: Transformer, rows: int) -> int:
    """Bytes of weights one step reads: every parameter except the embedding table (of which only
    ``rows`` rows are gathered); a tied LM head is read in full as the LM head."""
    seen, total = set(), 0
    emb = model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if not model.config.tie_word_embeddings:
        total -= emb.numel() * emb.element_size()
    return total + rows * emb.shape[1] * emb.element_size()


def kv_bytes_per_step(model: Transformer, rows: int, context: int, T: int = 1) -> int:
    """KV-cache bytes one step reads: K and V of ``context + T`` slots per row and layer."""
    c = model.config
    return rows * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * (context + T) * 2


@dataclass
class _Workspace:
    tok: torch.Tensor
    qkv: torch.Tensor
    q: torch.Tensor
    attn: torch.Tensor
    h: torch.Tensor
    logits: torch.Tensor
    feats: torch.Tensor | None
    attn_ws: object
    xn: torch.Tensor | None = None
    gu: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)  # more buffers: FastDrafter's, the family step's, w12's
    rows: int = 0  # the step's rows (B x T, padded for explicit cuBLAS); buffers may hold slack beyond (0: none)


class FastTarget:
    """Decode / chain-verify forward of a :class:`Transformer` through the Triton kernels.

    Same contract as ``Transformer.forward`` for a chain block (``depth=None``): writes K/V at
    slots ``start .. start+T-1`` and returns logits [B, T, vocab] and captured features. Needs
    CUDA (or ``TRITON_INTERPRET=1`` on the CPU for tests). Outputs live in per-shape workspace
    buffers, overwritten by the next call of the same shape.

    ``configs`` maps each matmul role (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``) to a
    Triton block config (:class:`~specpilot.fastpath.tables.LinearConfig` or its key), to
    ``"cublas"``, or to a table by rows ``{max_rows: config}`` (JSON keys may be strings): a
    matmul of M rows (M = batch x block length) uses the entry with the smallest ``max_rows`` >= M,
    the largest entry beyond them all. With ``"cublas"`` that matmul runs through ``torch.mm``
    (cuBLAS) with the norm, SwiGLU and residual as separate kernels. The key ``attn_rows`` sets the
    query rows per attention program (as ``attn_rows=``) (residual through the GEMM's
    beta = 1). cuBLAS picks its algorithm by shape, so with any cuBLAS entry the rows are padded to
    a multiple of 16, and rows are then not independent of M beyond 16 (token forcing's near-tie
    classification covers that). Row independence of Triton entries: see
    :mod:`specpilot.kernels.step` (checked on the GPU by ``specpilot bench verify``).

    **Checked cuBLAS** (``checked_cublas``, default on; CUDA only). cuBLAS runs a batched verify's
    GEMMs (M = 128-384 rows) 25-45 % faster than these Triton kernels (H200, BENCHMARKS.md), and
    on most shapes its rows are bit-equal to the decode kernels' (its algorithm reduces over K in
    the same order); on some (split-K) they are not. So the first call of each (role, M, weight
    shape) of at least 64 rows checks the options on a probe against the decode config and keeps
    the fastest bit-equal one (:func:`specpilot.tuning.select.select_checked`, recorded in :attr:`selection`): the table's Triton
    entry, cuBLAS, and cuBLAS over 16 or 32 rows more (:class:`PaddedCublas`; the workspaces of
    such steps keep that slack), since cuBLAS picks its algorithm by shape. Row independence
    holds on any GPU and library, by check rather than by assumption, and no shape is faster by
    being inexact. Below 64 rows (bound by weight bandwidth) the tuned Triton configs were as fast.
    Prefill matmuls (``forward(last_only=True)``, >= 64 rows) run cuBLAS unchecked: a
    prompt is prefilled by the same calls in every engine and in token forcing, so it only needs
    to be deterministic. ``checked_cublas=False`` keeps the tables' Triton entries everywhere.

    Raises SpecpilotError for an unknown role or a malformed config.
    """


    roles: tuple[str, ...] = LINEAR_ROLES  # the matmul roles ``configs`` may name
    default_configs: dict = DEFAULT_CONFIGS

    def __init__(self, model: Transformer, configs: dict | None = None, attn_rows: int | None = None,
                 checked_cublas: bool = True):
        self.k = kstep
        self.model = model
        # query rows per attention program (0: by block length, see kernels.step.AttnWorkspace)
        self.attn_rows = DEFAULT_ATTN_ROWS if attn_rows is None else attn_rows
        self.checked_cublas = bool(checked_cublas)
        self.w12: W12Roles | None = None  # roles run by the 12-bit kernel (fastpath.w12; none by default)
        self._chosen: dict[tuple, object] = {}  # (role, M, weight shape, ...) -> checked config
        self.selection: dict[str, dict] = {}  # what the checked-cuBLAS selection found per shape (records, benchmarks)
        self._prefilling = False
        self._fuse_weights()
        self.configs = {role: config_tiers(self.default_configs[role]) for role in self.roles}
        self._ws: dict[tuple, _Workspace] = {}
        self.set_configs(configs or {})

    def _fuse_weights(self) -> None:
        """Fuse the model's projection weights the way this step reads them (once, in place)."""
        fuse_weights(self.model)

    def set_configs(self, configs: dict) -> bool:
        """Set block configs per role (and ``attn_rows``); returns True when something changed.

        Raises SpecpilotError for an unknown role or a malformed config."""
        changed = False
        for role, c in configs.items():
            if role == "attn_rows":  # query rows per attention program (not a matmul)
                changed |= self.attn_rows != int(c)
                self.attn_rows = int(c)
                self._ws.clear()
                continue
            if role not in self.roles:
                raise SpecpilotError(f"unknown linear role {role!r}; roles: {', '.join(self.roles)}")
            t = config_tiers(c)
            changed |= self.configs[role] != t
            self.configs[role] = t
        if changed:
            self._chosen.clear()
            self.selection.clear()
        return changed

    def config_for(self, role: str, rows: int):
        """The config (LinearConfig or ``"cublas"``) a matmul of ``role`` uses for ``rows`` rows."""
        return tier_for(self.configs[role], rows)

    def config_keys(self) -> dict:
        """The role tables as JSON: ``{role: key}`` for one entry, else ``{role: {max_rows: key}}``."""
        out = {}
        for r, t in self.configs.items():
            out[r] = config_key(t[0][1]) if len(t) == 1 else {str(m): config_key(c) for m, c in t}
        return out

    @property
    def pad(self) -> int:
        """Rows are padded to a multiple of this (16 with any cuBLAS entry, else 1)."""
        return 16 if any(c == CUBLAS for t in self.configs.values() for _, c in t) else 1

    def _dims(self) -> tuple:
        """(config, KV-cache slots, device, dtype) the workspaces are sized for."""
        m = self.model
        return m.config, m.cache.max_seq, m.lm_head.weight.device, m.lm_head.weight.dtype

    def _workspace(self, B: int, T: int, n_capture: int, keep: bool = True) -> _Workspace:
        """The buffers of a (B, T) step: kept per shape (``keep``; overwritten by the next step of
        that shape, as a captured graph's are), or fresh and owned by the caller alone (``keep``
        False: a prefill, whose lengths vary; it never shares, nor drops, a captured step's)."""
        c, max_seq, dev, dt = self._dims()
        pad = self.pad
        key = (B, T, n_capture, max_seq, pad, self.attn_rows)
        ws = self._ws.get(key) if keep else None
        if ws is None:
            rows = -(-B * T // pad) * pad
            M = rows + (self._slack(rows) if keep else 0)
            nq, nkv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            z = dict(dtype=dt, device=dev)
            ws = _Workspace(
                tok=torch.zeros(M, dtype=torch.long, device=dev),
                qkv=torch.zeros(M, nq + 2 * nkv, **z), q=torch.zeros(M, nq, **z), attn=torch.zeros(M, nq, **z),
                h=torch.zeros(M, c.intermediate_size, **z), logits=torch.zeros(M, c.vocab_size, **z),
                feats=torch.zeros(M, n_capture * c.hidden_size, **z) if n_capture else None,
                attn_ws=self.k.AttnWorkspace(B, T, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                             max_seq, dev, self.attn_rows))
            ws.xn = torch.zeros(M, c.hidden_size, **z)
            ws.rows = rows
            if self.w12 is not None and keep:  # the w12 matmul's output before SwiGLU / the residual add
                ws.extra["w12y"] = torch.zeros(M * max(nq + 2 * nkv, 2 * c.intermediate_size, c.hidden_size), **z)
            if pad > 1:
                ws.gu = torch.zeros(M, 2 * c.intermediate_size, **z)
            if keep:
                self._ws[key] = ws
        return ws

    def _slack(self, rows: int) -> int:
        """Workspace rows beyond a step's ``rows`` for :class:`PaddedCublas` options."""
        return max(CUBLAS_PAD_ROWS) if self.checked_cublas and rows >= CHECKED_CUBLAS_MIN_ROWS else 0

    def _linear(self, role, x, w, out, ws, norm=None, residual=None, swiglu=False):
        """One matmul role on x [M, K] into ``out`` with the config :meth:`_pick` chooses for it.

        ``x`` / ``out`` may be whole workspace buffers: only the step's ``ws.rows`` rows are
        computed, but for a :class:`PaddedCublas` choice, which runs over the slack rows too.
        ``residual`` is ``out`` itself or None."""
        n = min(x.shape[0], ws.rows) if getattr(ws, "rows", 0) else x.shape[0]
        room = min(x.shape[0], out.shape[0])
        xr, outr = x[:n], out[:n]
        if self.w12 is not None and not self._prefilling:
            done = self.w12.apply(self, role, xr, w, outr, ws, norm, outr if residual is not None else None, swiglu)
            if done is not None:
                return done
        cfg = self._pick(role, xr, w, norm, residual, swiglu, room)
        if isinstance(cfg, PaddedCublas):
            xr, outr = x[:cfg.rows], out[:cfg.rows]
            cfg = CUBLAS
        return self._apply(cfg, xr, w, outr, ws, norm, outr if residual is not None else None, swiglu)

    def _apply(self, cfg, x, w, out, ws, norm=None, residual=None, swiglu=False):
        """``out = epilogue(norm(x) @ w.T)`` through ``cfg`` (a LinearConfig or ``"cublas"``).

        The cuBLAS variant runs the norm and SwiGLU as the Triton prenorm configs do (same
        kernels, same roundings), so only the GEMM's own reduction can make its rows differ."""
        M = x.shape[0]
        eps = self.model.config.rms_norm_eps
        if cfg != CUBLAS:
            if cfg.prenorm and norm is not None:
                x, norm = self.k.rmsnorm(x, norm, ws.xn[:M], eps), None
            return self.k.linear(x, w, out, cfg=cfg, norm=norm, eps=eps, residual=residual, swiglu=swiglu)
        if norm is not None:
            x = self.k.rmsnorm(x, norm, ws.xn[:M], eps)
        if residual is not None:  # out is the residual: out += x @ w.T in the GEMM epilogue
            return out.addmm_(x, w.t())
        if swiglu:
            if ws.gu is None or ws.gu.shape[0] < M or ws.gu.shape[1] != w.shape[0]:
                ws.gu = torch.empty(max(M, ws.xn.shape[0]), w.shape[0], dtype=x.dtype, device=x.device)
            gu = torch.mm(x, w.t(), out=ws.gu[:M])
            return self.k.silu_mul(gu, out)
        return torch.mm(x, w.t(), out=out)


    def use_w12(self, choice: dict) -> None:
        """Run the roles of ``choice`` (``{role: W12Role}``, :func:`specpilot.fastpath.w12.parse_choice`)
        with the 12-bit tensor-core kernel at every decode / verify M (one K split per role, so a
        row's bits do not depend on M); prefill matmuls and the other roles stay bf16. Packs each
        chosen role's weight of every layer (lossless) once; an empty choice turns w12 off.

        Raises:
            SpecpilotError: a role outside the w12 roles, or a launch the kernel library lacks."""
        self.w12 = W12Roles(self.model.model.layers, choice) if choice else None
        self._ws.clear()

    @contextlib.contextmanager
    def prefilling(self, on: bool = True):
        """Within the block, matmuls are a prefill's (:meth:`_pick`)."""
        before, self._prefilling = self._prefilling, bool(on)
        try:
            yield
        finally:
            self._prefilling = before

    def _pick(self, role, x, w, norm, residual, swiglu, room: int = 0):
        """The config of one matmul call (see :attr:`checked_cublas`).

        The table's entry for M = x's rows, except on a CUDA device: a prefill matmul
        (``forward(last_only=True)``) of at least :data:`PREFILL_CUBLAS_MIN_ROWS` rows runs cuBLAS
        (deterministic for a given prompt and chunk, which is all a prefill needs: every engine and
        token forcing prefill a prompt through the same calls); a decode / verify matmul of at least
        :data:`CHECKED_CUBLAS_MIN_ROWS` rows runs whatever :meth:`_select` found fastest among the
        options whose every row is bit-equal to the same row computed by the decode config.
        """
        M = x.shape[0]
        cfg = self.config_for(role, M)
        if cfg == CUBLAS or not self.checked_cublas or not self._on_gpu(x):
            return cfg
        if self._prefilling:
            return CUBLAS if M >= PREFILL_CUBLAS_MIN_ROWS else cfg
        if M < CHECKED_CUBLAS_MIN_ROWS:
            return cfg
        pads = tuple(M + p for p in CUBLAS_PAD_ROWS if M + p <= room)
        key = (role, M, tuple(w.shape), norm is not None, residual is not None, bool(swiglu), pads)
        c = self._chosen.get(key)
        if c is None:
            if torch.cuda.is_current_stream_capturing():  # no probing inside a capture: the table's (invariant) entry
                return cfg
            c = self._chosen[key] = self._select(key, cfg, w, norm, residual is not None, swiglu)
        return c

    @staticmethod
    def _on_gpu(x: torch.Tensor) -> bool:
        """Whether matmuls on ``x`` may run cuBLAS (a CUDA tensor; the CPU interpreter never does)."""
        return x.is_cuda

    @staticmethod
    def _time(cfg, fn) -> float:
        """Median device milliseconds of ``fn`` (one call of option ``cfg``) for :meth:`_select`."""
        return median_ms(fn)

    def _select(self, key, table_cfg, w, norm, residual: bool, swiglu: bool):
        """The checked-cuBLAS choice of one (role, M, weight shape) matmul
        (:func:`~specpilot.tuning.select.select_checked` with this step's matmul and timer),
        recorded in :attr:`selection`."""
        best, rec = select_checked(self._apply, self._time, key, table_cfg, self.config_for(key[0], 1), w, norm,
                                   residual, swiglu)
        self.selection[f"{key[0]}:{key[1]}:{'x'.join(map(str, w.shape))}"] = rec
        return best

    def _layer(self, x, layer, kc, vc, cos, sin, start, T: int, M: int, ws: _Workspace, anc_bits=None, depth=None,
               path=None):
        """One pre-norm attention + SwiGLU layer on the residual stream ``x`` [>= M, hidden] (in place).

        Writes the block's K/V to slots start .. start+T-1 of ``kc``/``vc`` (one layer's cache,
        (B, Hkv, S, D)); ``anc_bits``/``depth``: tree visibility and RoPE depths (None: a chain);
        ``path``: a target tree's ancestors by depth (:func:`~specpilot.kernels.step.tree_paths`),
        which the attention reads in position order (then ``anc_bits`` is not used).
        """
        K, a, eps = self.k, layer.self_attn, self.model.config.rms_norm_eps
        self._linear("qkv", x, layer.fused_qkv, ws.qkv, ws, norm=layer.input_layernorm.weight)
        K.qk_rope_cache(ws.qkv[:M], ws.q, kc, vc, a.q_norm.weight if a.q_norm is not None else None,
                        a.k_norm.weight if a.k_norm is not None else None, cos, sin, start, T,
                        a.n_heads, a.n_kv, a.head_dim, eps, depth=depth)
        K.attention(ws.q, kc, vc, start, T, a.n_heads, a.n_kv, a.head_dim, ws.attn, ws.attn_ws, anc_bits=anc_bits,
                    path=path, depth=depth if path is not None else None)
        self._linear("o", ws.attn, a.o_proj.weight, x, ws, residual=x)
        self._linear("gate_up", x, layer.fused_gate_up, ws.h, ws, norm=layer.post_attention_layernorm.weight,
                     swiglu=True)
        self._linear("down", ws.h, layer.mlp.down_proj.weight, x, ws, residual=x)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, capture: tuple[int, ...] = (),
                tree: tuple[torch.Tensor, torch.Tensor] | None = None, rows: slice | None = None,
                last_only: bool = False, write: bool = False):
        """Logits [B, T, vocab] and captured features of block ``tokens`` [B, T] at ``start`` [B].

        ``tree``: (ancestor bits int64 [B, T], depth int32 [B, T], ancestors by depth int32
        [B, T, 64]) from :func:`tree_inputs` for a token tree (T <= 64): node t attends to the
        prefix and its ancestors read in position order (bit-equal to a decode of its path
        whatever the tree's node order), RoPE at start + depth;
        its K/V go to slot start + t (compact the accepted path with :func:`compact_path_`).
        ``rows``: the block is for these cache rows only (B = their count; e.g. one newcomer's
        prompt prefilled beside running requests without touching their rows). ``last_only``:
        logits of each row's last block position only ([B, 1, vocab]; a prefill), in a fresh
        workspace that is not kept (prompt lengths vary; a kept workspace per length would pile
        up, and a prompt as long as a captured step's block must not write, or drop, that step's
        buffers): the outputs stay valid until the caller drops them. ``write``: part of the step
        interface (:class:`~specpilot.fastpath.family.FastFamilyTarget` advances recurrent state
        with it); a dense target has none, so it changes nothing here.
        """
        K, m, c = self.k, self.model, self.model.config
        if m.cache is None:
            raise SpecpilotError("setup_cache() must be called before the forward")
        B, T = tokens.shape
        M, H = B * T, c.hidden_size
        ws = self._workspace(B, T, len(capture), keep=not last_only)
        if ws.tok.shape[0] == M:
            x = F.embedding(tokens.reshape(M), m.model.embed_tokens.weight)
        else:  # padded rows embed token 0 and are never read back
            ws.tok[:M].copy_(tokens.reshape(M))
            x = F.embedding(ws.tok, m.model.embed_tokens.weight)
        rows = rows if rows is not None else slice(None)
        if m.cache.k[rows].shape[0] != B:
            raise SpecpilotError(f"a block of {B} rows for cache rows {rows} of a batch of {m.cache.k.shape[0]}")
        with self.prefilling(last_only):
            for i, layer in enumerate(m.model.layers):
                self._layer(x, layer, m.cache.k[rows, i], m.cache.v[rows, i], m.cos, m.sin, start, T, M, ws,
                            anc_bits=tree[0] if tree else None, depth=tree[1] if tree else None,
                            path=tree[2] if tree and len(tree) > 2 else None)
                if i in capture:
                    j = capture.index(i)
                    ws.feats[:, j * H:(j + 1) * H].copy_(x)
            feats = ws.feats[:M].view(B, T, -1) if capture else None
            if last_only:
                self._linear("lm_head", x[:M].view(B, T, H)[:, -1], m.lm_head.weight, ws.logits[:B], ws,
                             norm=m.model.norm.weight)
                return ws.logits[:B].view(B, 1, -1), feats
        self._linear("lm_head", x, m.lm_head.weight, ws.logits, ws, norm=m.model.norm.weight)
        return ws.logits[:M].view(B, T, -1), feats

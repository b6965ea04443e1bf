"""The GPU fast path of the hybrid (Qwen3.5 / 3.8: Gated DeltaNet + gated attention) and the
Muse-Glimmer (sliding window + global NoPE, sandwich norms, softcapped head) targets.

:class:`FastFamilyTarget` is :class:`~specpilot.fastpath.dense.FastTarget` (same matmul kernels,
configs by rows, workspaces, CUDA graphs through :class:`~specpilot.fastpath.graphs.StepGraphs`)
with a forward built by layer type from the checkpoint's config:

- attention layers (full, sliding, NoPE): one fused projection ``[q (+ interleaved gate) | k | v
  (| gate_proj)]`` with the input norm, :func:`specpilot.kernels.family.attn_prep` (q/k norm, partial or no
  RoPE, K/V into the KV cache or, for sliding layers, the model's ring), the split-KV attention
  (windowed over the ring), the output gate, ``o_proj`` (+ the post-attention norm when the
  family uses sandwich norms);
- Gated DeltaNet layers: one fused projection ``[qkv | z | b | a]``, the conv, the recurrence and
  the gated norm kernels of :mod:`specpilot.kernels.family`, ``out_proj``;
- SwiGLU MLP (+ pre/post feed-forward norms), final norm, LM head, output multiplier and softcap.

State: the forward reads and writes the model's own :class:`~specpilot.models.state.TargetState`
(KV cache, rings, GDN conv / recurrent states), so the eager forward, rollback and row resets keep
working on the same tensors. A chain verify (``write=False``) leaves the GDN state as it is and
keeps every GDN layer's projections (the tape); :meth:`FastFamilyTarget.commit_recurrent` then
re-runs each row's accepted tokens from the committed state (checkpoint + re-run) in two kernel
launches for all layers. Decode and prefill (``write=True``) advance the state directly.
Token trees (static trees, spine + side-leaf trees, any node count up to depth 64) verify in the
same step by their paths: attention reads each node's ancestors in position order (a sliding layer
through the ring, inside the window of the node's position), a GDN layer runs its conv and delta
rule along each node's path, so every node's logits are bit-equal to a decode of its path; the
runner compacts the accepted path's K/V (KV cache and ring) and :meth:`commit_recurrent` re-runs
the accepted path's tokens into the recurrent state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..kernels import family as kfamily
from ..models.layers import RMSNorm
from ..models.norms import ScalelessRMSNorm, WeightedRMSNorm
from .dense import FastTarget, _Workspace, fuse_linears
from .support import family_support


def norm_scale(mod: nn.Module, dim: int, device) -> torch.Tensor:
    """The effective per-channel scale (fp32 [dim]) of a norm module: ``1 + w`` (zero-centred
    weights), ``w``, or ones (weightless)."""
    if isinstance(mod, WeightedRMSNorm):
        w = mod.weight.detach().float()
        return (1.0 + w) if mod.offset else w
    if isinstance(mod, RMSNorm):
        return mod.weight.detach().float()
    if isinstance(mod, ScalelessRMSNorm) or mod is None:
        return torch.ones(dim, dtype=torch.float32, device=device)
    raise SpecpilotError(f"no fast-path form for the norm {type(mod).__name__}")


def fuse_family_weights(model) -> None:
    """Fused projection weights per layer, in place, once: attention ``fused_qkv``
    (q | k | v [| gate_proj]), GDN ``fused_in`` (qkv | z | b | a), MLP ``fused_gate_up``."""
    if getattr(model, "_fused_family", False):
        return
    for layer in model.model.layers:
        if layer.kind == "linear_attention":
            layer.fused_in = fuse_linears(layer.linear_attn, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])
        else:
            a = layer.self_attn
            layer.fused_qkv = fuse_linears(a, ["q_proj", "k_proj", "v_proj"] + (["gate_proj"] if a.gate == "proj" else []))
        layer.fused_gate_up = fuse_linears(layer.mlp, ["gate_proj", "up_proj"])
    model._fused_family = True


class FastFamilyTarget(FastTarget):
    """Decode / chain-verify / prefill forward of a hybrid or Muse-Glimmer :class:`Transformer`
    through Triton kernels (see the module docstring). Same contract as
    :meth:`FastTarget.forward` plus ``write`` (advance the recurrent state: decode, prefill);
    after a verify (``write=False``) call :meth:`commit_recurrent` with the accepted counts.

    Raises SpecpilotError when the model is not supported (:func:`~specpilot.fastpath.support.family_support`).
    """

    def __init__(self, model, configs: dict | None = None, attn_rows: int | None = None):
        why = family_support(model)
        if why:
            raise SpecpilotError(f"the family fast path cannot run this target: {why}")
        self.f = kfamily
        super().__init__(model, configs, attn_rows)
        self._params()
        self._last = None  # (B, T, rows, workspace) of the last verify on a recurrent target

    def _fuse_weights(self) -> None:
        fuse_family_weights(self.model)

    def use_w12(self, choice: dict) -> dict:
        """:meth:`FastTarget.use_w12`, then the per-layer parameters re-read (the converted
        ``o_proj`` / ``out_proj`` weights)."""
        stats = super().use_w12(choice)
        self._params()
        return stats

    # ---------------------------------------------------------------- parameters
    @torch.no_grad()
    def _params(self) -> None:
        m, c = self.model, self.model.config
        dev = m.lm_head.weight.device
        H = c.hidden_size
        self.P = []
        gdn = []
        for i, layer in enumerate(m.model.layers):
            p = {"kind": layer.kind, "layer": i, "in": norm_scale(layer.input_layernorm, H, dev)}
            if layer.sandwich:
                p["post_attn"] = norm_scale(layer.post_attention_layernorm, H, dev)
                p["pre_ff"] = norm_scale(layer.pre_feedforward_layernorm, H, dev)
                p["post_ff"] = norm_scale(layer.post_feedforward_layernorm, H, dev)
            else:
                p["post"] = norm_scale(layer.post_attention_layernorm, H, dev)
            if layer.kind == "linear_attention":
                g = layer.linear_attn
                p.update(slot=g.slot, conv_w=g.conv1d.weight.detach()[:, 0].contiguous(), norm_w=g.norm.weight.detach(),
                         conv_dim=g.conv_dim, z_off=g.conv_dim, b_off=g.conv_dim + g.hv * g.dv,
                         a_off=g.conv_dim + g.hv * g.dv + g.hv, out_w=g.out_proj.weight)
                gdn.append((g.A_log.detach().float(), g.dt_bias.detach().float()))
            else:
                a = layer.self_attn
                D, nq, nkv = a.head_dim, a.n_heads * a.head_dim, a.n_kv * a.head_dim
                qcols = 2 * nq if a.gate == "interleaved" else nq
                if a.q_norm is not None:
                    norm, qn, kn = (self.f.NORM_WEIGHTED, norm_scale(a.q_norm, D, dev), norm_scale(a.k_norm, D, dev))
                elif a.qk_norm is not None:
                    norm, qn, kn = self.f.NORM_SCALELESS, None, None
                else:
                    norm, qn, kn = self.f.NORM_NONE, None, None
                gate = None
                if a.gate == "interleaved":
                    gate = (2 * D, D)  # (stride between heads, offset of head 0's gate)
                elif a.gate == "proj":
                    gate = (D, qcols + 2 * nkv)
                p.update(slot=a.slot, window=a.window or 0, rot=c.rotary_dim if a.rope else 0, norm=norm,
                         q_norm=qn, k_norm=kn, qscale=float(a.qk_scale),
                         q_stride=2 * D if a.gate == "interleaved" else D, k_off=qcols, v_off=qcols + nkv,
                         gate=gate, o_w=a.o_proj.weight)
            self.P.append(p)
        self.final = norm_scale(m.model.norm, H, dev)
        self.embed_scale = norm_scale(m.model.embed_norm, H, dev) if m.model.embed_norm is not None else None
        if gdn:
            self.a_log = torch.stack([a for a, _ in gdn]).contiguous()
            self.dt_bias = torch.stack([d for _, d in gdn]).contiguous()
        self.gdn0 = next((p for p in self.P if p["kind"] == "linear_attention"), None)  # GDN offsets (all equal)
        attn = [layer.fused_qkv.shape[0] for layer in m.model.layers if layer.kind != "linear_attention"]
        self.attn_cols = max(attn) if attn else 0
        self.n_gdn = len(gdn)

    # ---------------------------------------------------------------- buffers
    def _dims(self) -> tuple:
        m = self.model
        return m.config, m._state_key[1], m.lm_head.weight.device, m.lm_head.weight.dtype

    def _family_ws(self, B: int, T: int, n_capture: int, keep: bool, write: bool) -> _Workspace:
        c, max_seq, dev, dt = self._dims()
        pad = self.pad
        key = ("family", B, T, n_capture, max_seq, pad, self.attn_rows, write)
        ws = self._ws.get(key) if keep else None
        if ws is not None:
            return ws
        M = -(-B * T // pad) * pad
        z = dict(dtype=dt, device=dev)
        nq = c.num_attention_heads * c.head_dim
        ws = _Workspace(
            tok=torch.zeros(M, dtype=torch.long, device=dev), qkv=torch.zeros(M, max(self.attn_cols, 1), **z),
            q=torch.zeros(M, nq, **z), attn=torch.zeros(M, nq, **z), h=torch.zeros(M, c.intermediate_size, **z),
            logits=torch.zeros(M, c.vocab_size, **z),
            feats=torch.zeros(M, n_capture * c.hidden_size, **z) if n_capture else None,
            attn_ws=self.k.AttnWorkspace(B, T, c.num_attention_heads, c.num_key_value_heads, c.head_dim, max_seq,
                                         dev, self.attn_rows))
        ws.xn = torch.zeros(M, c.hidden_size, **z)
        if pad > 1:
            ws.gu = torch.zeros(M, 2 * c.intermediate_size, **z)
        ws.extra["tmp"] = torch.zeros(M, c.hidden_size, **z)
        if self.n_gdn:
            g = self.gdn0
            n_in = g["a_off"] + c.linear_num_value_heads
            vd = c.linear_num_value_heads * c.linear_value_head_dim
            L = 1 if write else self.n_gdn  # a verify keeps every layer's projections for the commit re-run
            ws.extra["proj"] = torch.zeros(L, M, n_in, **z)
            ws.extra["mixed"] = torch.zeros(L, M, g["conv_dim"], **z)
            ws.extra["o"] = torch.zeros(M, vd, **z)
            ws.extra["y"] = torch.zeros(M, vd, **z)
        if keep:
            self._ws[key] = ws
        return ws

    # ---------------------------------------------------------------- layers
    def _attention(self, x, p, st, rows, start, T, M, ws, tree=None):
        c, f = self.model.config, self.f
        depth, path = (tree[1], tree[2]) if tree is not None else (None, None)
        self._linear("qkv", x, self.model.model.layers[p["layer"]].fused_qkv, ws.qkv, ws, norm=p["in"])
        if p["window"]:
            ring = st.ring
            kc, vc, R = ring.k[rows, p["slot"]], ring.v[rows, p["slot"]], ring.R
        else:
            kc, vc, R = st.kv.k[rows, p["slot"]], st.kv.v[rows, p["slot"]], 0
        f.attn_prep(ws.qkv[:M], ws.q, kc, vc, start, T, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                    q_stride=p["q_stride"], k_off=p["k_off"], v_off=p["v_off"], norm=p["norm"], q_norm=p["q_norm"],
                    k_norm=p["k_norm"], qscale=p["qscale"], eps=c.rms_norm_eps, cos=self.model.cos,
                    sin=self.model.sin, rot=p["rot"], ring=R, depth=depth)
        self.k.attention(ws.q, kc, vc, start, T, c.num_attention_heads, c.num_key_value_heads, c.head_dim, ws.attn,
                         ws.attn_ws, window=p["window"], ring=R, path=path, depth=depth)
        if p["gate"] is not None:
            f.gate_mul(ws.attn[:M], ws.qkv[:M], c.num_attention_heads, c.head_dim, *p["gate"])
        if "post_attn" in p:
            self._linear("o", ws.attn, p["o_w"], ws.extra["tmp"], ws)
            f.add_rmsnorm(x, ws.extra["tmp"], p["post_attn"], c.post_norm_eps)
        else:
            self._linear("o", ws.attn, p["o_w"], x, ws, residual=x)

    def _gdn(self, x, p, st, rows, start, T, M, ws, write: bool, tree=None):
        c, f = self.model.config, self.f
        depth, path = (tree[1], tree[2]) if tree is not None else (None, None)
        j = 0 if write else p["slot"]
        proj, mixed = ws.extra["proj"][j], ws.extra["mixed"][j]
        self._linear("qkv", x, self.model.model.layers[p["layer"]].fused_in, proj, ws, norm=p["in"])
        conv = st.gdn.conv[rows]
        rec = st.gdn.rec[rows]
        s = p["slot"]
        f.gdn_conv(proj, conv[:, s], p["conv_w"], mixed, T, depth, path)
        f.gdn_recurrent(ws.extra["mixed"][j:j + 1], ws.extra["proj"][j:j + 1], self.a_log[s:s + 1],
                        self.dt_bias[s:s + 1], rec[:, s:s + 1], ws.extra["o"], T,
                        n_key_heads=c.linear_num_key_heads, a_off=p["a_off"], b_off=p["b_off"], write=write,
                        depth=depth, path=path)
        if write:
            f.gdn_conv_commit(ws.extra["proj"][j:j + 1], conv[:, s:s + 1], T)
        f.gated_rmsnorm(ws.extra["o"], proj, p["z_off"], p["norm_w"], ws.extra["y"], c.linear_num_value_heads,
                        c.linear_value_head_dim, c.rms_norm_eps)
        self._linear("o", ws.extra["y"], p["out_w"], x, ws, residual=x)

    def _mlp(self, x, p, layer, ws):
        c = self.model.config
        if "pre_ff" in p:
            self._linear("gate_up", x, layer.fused_gate_up, ws.h, ws, norm=p["pre_ff"], swiglu=True)
            self._linear("down", ws.h, layer.mlp.down_proj.weight, ws.extra["tmp"], ws)
            self.f.add_rmsnorm(x, ws.extra["tmp"], p["post_ff"], c.post_norm_eps)
        else:
            self._linear("gate_up", x, layer.fused_gate_up, ws.h, ws, norm=p["post"], swiglu=True)
            self._linear("down", ws.h, layer.mlp.down_proj.weight, x, ws, residual=x)

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, capture: tuple[int, ...] = (),
                tree=None, rows: slice | None = None, last_only: bool = False, write: bool = False):
        """Logits [B, T, vocab] (or [B, 1, vocab] with ``last_only``) and captured features of the
        block ``tokens`` [B, T] at ``start`` [B] (see :meth:`FastTarget.forward`): a chain, or a
        token tree given ``tree`` = (ancestor bits, depth int32 [B, T], ancestors by depth int32
        [B, T, 64]) from :func:`~specpilot.engine.verify.tree_inputs` with ``paths=True``: each node
        attends to the prefix and its ancestors in position order (a sliding layer: those inside
        the window of its position start + depth), RoPE at start + depth, and a GDN layer runs its
        conv and delta rule along the node's path from the committed state, so a node's logits are
        bit-equal to a decode of its path (any node count, depth <= 64); its K/V go to block slot
        start + t (the runner compacts the accepted path; :meth:`commit_recurrent` with the path).

        ``write``: advance the GDN state by the whole block (decode, prefill); else keep the
        projections for :meth:`commit_recurrent`. Sliding layers need T <= the ring's reserve
        when the ring wraps (:meth:`TargetRunner.prefill_row` prefills in pieces no wider).
        Raises SpecpilotError for a tree without paths or with ``write``, a missing state, or a
        block wider than the ring allows.
        """
        m, c = self.model, self.model.config
        if tree is not None and (len(tree) < 3 or write):
            raise SpecpilotError("the family step verifies a token tree by its paths (tree_inputs(parents, "
                                 "paths=True)) and never writes a tree into the recurrent state")
        st = m.state
        if st is None:
            raise SpecpilotError("setup_cache() must be called before the forward")
        B, T = tokens.shape
        if st.ring is not None and st.ring.R < m._state_key[1] and T > st.ring.reserve:
            raise SpecpilotError(f"a block of {T} tokens is wider than the {st.ring.reserve} tokens the sliding-window "
                                 f"ring was sized for (the engine's verify width sizes the runner)")
        M, H = B * T, c.hidden_size
        rows = rows if rows is not None else slice(None)
        ws = self._family_ws(B, T, len(capture), keep=not last_only, write=write)
        if ws.tok.shape[0] == M:
            x = F.embedding(tokens.reshape(M), m.model.embed_tokens.weight)
        else:
            ws.tok[:M].copy_(tokens.reshape(M))
            x = F.embedding(ws.tok, m.model.embed_tokens.weight)
        if self.embed_scale is not None:
            x = self.k.rmsnorm(x, self.embed_scale, x, c.rms_norm_eps)  # row-wise: in place is safe
        with self.prefilling(last_only):
            for i, layer in enumerate(m.model.layers):
                p = self.P[i]
                if p["kind"] == "linear_attention":
                    self._gdn(x, p, st, rows, start, T, M, ws, write, tree)
                else:
                    self._attention(x, p, st, rows, start, T, M, ws, tree)
                self._mlp(x, p, layer, ws)
                if i in capture:
                    j = capture.index(i)
                    ws.feats[:, j * H:(j + 1) * H].copy_(x)
            feats = ws.feats[:M].view(B, T, -1) if capture else None
            self._last = (B, T, rows, ws) if (self.n_gdn and not write) else None
            if last_only:
                logits = ws.logits[:B]
                self._linear("lm_head", x[:M].view(B, T, H)[:, -1], m.lm_head.weight, logits, ws, norm=self.final)
                self._cap(logits)
                return logits.view(B, 1, -1), feats
        self._linear("lm_head", x, m.lm_head.weight, ws.logits, ws, norm=self.final)
        self._cap(ws.logits[:M])
        return ws.logits[:M].view(B, T, -1), feats

    def _cap(self, logits: torch.Tensor) -> None:
        c = self.model.config
        if c.output_multiplier != 1.0:
            logits.mul_(c.output_multiplier)
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits.div_(cap).tanh_().mul_(cap)

    @torch.no_grad()
    def commit_recurrent(self, counts: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """After a verify (``write=False``): advance every GDN layer's recurrent and conv state by
        the first ``counts[b]`` (int64 [B], on the device) block tokens of each row (a tree: the
        accepted path's block indices ``path`` int64 [B, P] in order), re-run from the committed
        state in two launches. A no-op without a pending verify."""
        if self._last is None:
            return
        B, T, rows, ws = self._last
        self._last = None
        c, st = self.model.config, self.model.state.gdn
        g = self.gdn0
        counts = counts.to(ws.tok.device)
        index = path.to(ws.tok.device).long().contiguous() if path is not None else None
        self.f.gdn_recurrent(ws.extra["mixed"], ws.extra["proj"], self.a_log, self.dt_bias, st.rec[rows], None, T,
                             n_key_heads=c.linear_num_key_heads, a_off=g["a_off"], b_off=g["b_off"], write=True,
                             counts=counts, index=index)
        self.f.gdn_conv_commit(ws.extra["proj"], st.conv[rows], T, counts, index)

    def note_verify(self, B: int, T: int, n_capture: int) -> None:
        """A chain verify of (B, T) over all rows just ran (a graph replay runs no Python, so the
        runner says so): :meth:`commit_recurrent` re-runs from that shape's kept workspace."""
        ws = self._family_ws(B, T, n_capture, keep=True, write=False)
        self._last = (B, T, slice(None), ws)

    def discard(self) -> None:
        """Forget a pending verify (the runner rolled it back)."""
        self._last = None

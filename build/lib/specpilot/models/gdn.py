"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv 2412.06464), the recurrent mixer of Qwen3.5 / 3.6 / 3.8 (transformers
``Qwen3_5GatedDeltaNet``; tensor names match it so checkpoints load by name).

Per value head the state S [Dk, Dv] (fp32) follows, for each token with key k, value v, query q
(q, k L2-normalised, q scaled by 1/sqrt(Dk)), decay g <= 0 and write strength beta in (0, 1):

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

Pure-torch forms here: :func:`recurrent` (token by token; chains and trees, a tree node starting
from its parent's state) and :func:`chunked` (the WY/UT chunk form of DeltaNet, Yang et al.,
arXiv 2406.06484, for long prefills and training). On CUDA, when the ``fla`` package (fla-core) is
installed, chain verify/decode and prefill use its Triton kernels instead (:func:`use_fla`).
A token with ``g = 0`` and ``beta = 0`` leaves S exactly unchanged: padding and rejected drafts are
masked that way.

Layer math (as the checkpoint defines it): ``in_proj_qkv`` -> causal depthwise conv (kernel K,
SiLU) over the token's ancestors -> split q, k, v; beta = sigmoid(in_proj_b x);
g = -exp(A_log) softplus(in_proj_a x + dt_bias); value head i reads key head i // (HV / H);
output = out_proj(GatedRMSNorm(o, in_proj_z x)).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.nn import functional as F

from .config import TargetConfig
from .norms import GatedRMSNorm

_FLA = None


def use_fla(device: torch.device) -> bool:
    """True when GDN runs through fla's Triton kernels: a CUDA device and ``fla`` importable.

    fla is imported only here, only for CUDA tensors (transformers would use it even on the CPU).
    """
    global _FLA
    if device.type != "cuda":
        return False
    if _FLA is None:
        _FLA = importlib.util.find_spec("fla") is not None
    return _FLA


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fp32 in, fp32 out)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One delta-rule update. S [B, HV, Dk, Dv]; k [B, HV, Dk]; v [B, HV, Dv]; g, beta [B, HV] (fp32)."""
    S = S * g.exp()[..., None, None]
    u = (v - (S * k[..., None]).sum(-2)) * beta[..., None]
    return S + k[..., None] * u[..., None, :]


def recurrent(q, k, v, g, beta, S0: torch.Tensor, parents: torch.Tensor | None = None,
              final: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule over a chain or a tree.

    Args:
        q, k: fp32 [B, N, HV, Dk] (normalised, q scaled); v fp32 [B, N, HV, Dv]; g, beta fp32 [B, N, HV].
        S0: fp32 [B, HV, Dk, Dv], the committed state (not modified).
        parents: int64 [B, N] block index of each node's parent (-1 = starts from S0), or None for a
            chain. Parents precede children.
        final: also return the state after the last token (chain only).
    Returns:
        o fp32 [B, N, HV, Dv] and the final state (or None).
    """
    B, N = q.shape[:2]
    out = q.new_empty(B, N, v.shape[2], v.shape[3])
    if parents is None:
        S = S0
        for t in range(N):
            S = step(S, k[:, t], v[:, t], g[:, t], beta[:, t])
            out[:, t] = (S * q[:, t, ..., None]).sum(-2)
        return out, (S if final else None)
    stack = S0.new_empty(B, N + 1, *S0.shape[1:])  # stack[:, i + 1] = state after node i
    stack[:, 0] = S0
    rows = torch.arange(B, device=q.device)
    for t in range(N):
        S = step(stack[rows, parents[:, t] + 1], k[:, t], v[:, t], g[:, t], beta[:, t])
        stack[:, t + 1] = S
        out[:, t] = (S * q[:, t, ..., None]).sum(-2)
    return out, None


def chunked(q, k, v, g, beta, S0: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (UT-transform) gated delta rule over a chain; same math as :func:`recurrent`.

    Within a chunk with cumulative log decay G_t, the writes u solve the unit lower-triangular
    system (I + A) U = beta V - beta exp(G) K S0 with A[t, s] = beta_t exp(G_t - G_s) k_t.k_s (s < t);
    outputs o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s, and the state
    carried to the next chunk is exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T.
    Shapes as :func:`recurrent`; differentiable (training). Returns o and the final state.
    """
    B, N, HV, Dk = k.shape
    pad = (-N) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    C = chunk
    # [B, HV, n, C, D]
    q, k, v = (x.transpose(1, 2).reshape(B, HV, -1, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(B, HV, -1, C) for x in (g, beta))
    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., t, s]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * diff
    A = A.tril(-1)  # strictly lower part
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    M = eye + A
    rhs_v = v * beta[..., None]
    rhs_k = kb * G.exp()[..., None]
    Wv = torch.linalg.solve_triangular(M, rhs_v, upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(M, rhs_k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * diff
    S = S0
    outs = []
    for i in range(q.shape[2]):
        U = Wv[:, :, i] - Wk[:, :, i] @ S
        o = (q[:, :, i] * G[:, :, i, :, None].exp()) @ S + qk[:, :, i] @ U
        outs.append(o)
        last = G[:, :, i, -1]
        kd = k[:, :, i] * (last[..., None] - G[:, :, i]).exp()[..., None]
        S = S * last.exp()[..., None, None] + kd.transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, HV, -1, v.shape[-1])[:, :, :N].transpose(1, 2)
    return o, S


def conv_gather_index(depth: torch.Tensor, parents: torch.Tensor | None, K: int) -> torch.Tensor:
    """Columns of ``cat(conv_state [K-1 cols], block [N cols])`` each node's conv reads.

    Args: depth int64 [B, N] (node depth below the committed prefix), parents int64 [B, N] or None.
    Returns int64 [B, N, K]; entry t is the t-th input back along the node's ancestor path
    (t = 0 the node itself), falling back into the committed conv state past the root.
    """
    B, N = depth.shape
    dev = depth.device
    idx = torch.empty(B, N, K, dtype=torch.long, device=dev)
    node = torch.arange(N, device=dev).expand(B, N).clone()
    cur = node.clone()
    valid = torch.ones(B, N, dtype=torch.bool, device=dev)
    for t in range(K):
        back = depth - t  # depth of the t-th ancestor; < 0 -> committed column K-1 + back
        col = torch.where(valid & (back >= 0), K - 1 + cur, K - 1 + back.clamp(min=-(K - 1)))
        idx[:, :, t] = col
        if parents is None:
            cur = cur - 1
        else:
            nxt = torch.gather(parents, 1, cur.clamp(min=0))
            cur = torch.where(cur >= 0, nxt, cur)
        valid = valid & (cur >= 0)
    return idx


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet mixer; reads/writes its slot of :class:`specpilot.models.state.GDNState`.

    Forward x [B, N, hidden] -> [B, N, hidden] (model dtype). With a cache context, chain or tree
    verify leaves the committed state untouched and records the block's inputs on the state's
    tape (replayed on commit); prefill and decode (``ctx.write``) write the state directly.
    """

    def __init__(self, cfg: TargetConfig, layer: int, slot: int):
        super().__init__()
        self.layer, self.slot = layer, slot
        self.h, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.h * self.dk, self.hv * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False,
                                padding=self.K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)

    def _split(self, mixed: torch.Tensor, x: torch.Tensor):
        """Post-conv [B, N, C] and the layer input -> q, k (key heads), v, g, beta (fp32)."""
        B, N, _ = mixed.shape
        kd = self.h * self.dk
        q, k, v = mixed.float().split([kd, kd, self.hv * self.dv], -1)
        q = l2norm(q.reshape(B, N, self.h, self.dk)) * self.dk ** -0.5
        k = l2norm(k.reshape(B, N, self.h, self.dk))
        v = v.reshape(B, N, self.hv, self.dv)
        beta = self.in_proj_b(x).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return q, k, v, g, beta

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """Key-head tensor [B, N, H, D] -> value-head layout [B, N, HV, D] (head i // (HV/H))."""
        r = self.hv // self.h
        return t if r == 1 else t.repeat_interleave(r, dim=2)

    def _finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, N = x.shape[:2]
        z = self.in_proj_z(x).reshape(B, N, self.hv, self.dv)
        y = self.norm(o.to(x.dtype), z)
        return self.out_proj(y.reshape(B, N, -1))

    def forward_causal(self, x: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward from a zero state (training, teacher forcing)."""
        B, N, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(1, 2)
        mixed = F.silu(F.conv1d(mixed, self.conv1d.weight, None, padding=self.K - 1, groups=self.conv_dim)[..., :N])
        q, k, v, g, beta = self._split(mixed.transpose(1, 2), x)
        S0 = x.new_zeros(B, self.hv, self.dk, self.dv, dtype=torch.float32)
        o, _ = chunked(self.expand(q), self.expand(k), v, g, beta, S0)
        return self._finish(o, x)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        st = ctx.state.gdn
        B, N, _ = x.shape
        conv_state = st.conv[:, self.slot]  # [B, C, K-1]
        S0 = st.rec[:, self.slot]
        pre = self.in_proj_qkv(x)  # [B, N, C]
        seq = torch.cat([conv_state, pre.transpose(1, 2).to(conv_state.dtype)], -1)  # [B, C, K-1+N]
        w = self.conv1d.weight[:, 0]  # [C, K]
        if ctx.parents is None and N > 1:
            mixed = F.conv1d(seq.to(w.dtype), w[:, None], None, groups=self.conv_dim)  # [B, C, N]
        else:
            idx = ctx.conv_index(self.K)  # [B, N, K], t = 0 is the node itself
            cols = torch.gather(seq, 2, idx.reshape(B, 1, N * self.K).expand(-1, seq.shape[1], -1))
            cols = cols.reshape(B, -1, N, self.K).flip(-1)  # oldest first, like the conv weight
            mixed = (cols.to(w.dtype) * w[:, None, :]).sum(-1)
        mixed = F.silu(mixed).transpose(1, 2).to(x.dtype)
        q, k, v, g, beta = self._split(mixed, x)
        if ctx.lengths is not None:  # prefill padding: identity updates
            keep = (torch.arange(N, device=x.device)[None, :] < ctx.lengths[:, None])[..., None]
            g, beta = g * keep, beta * keep
        qe, ke = self.expand(q), self.expand(k)
        if ctx.write:  # prefill / decode: the whole (valid) block is committed
            if use_fla(x.device) and ctx.parents is None:
                o, S = _fla_forward(qe, ke, v, g, beta, S0, N)
            elif N > 16:
                o, S = chunked(qe, ke, v, g, beta, S0)
            else:
                o, S = recurrent(qe, ke, v, g, beta, S0, final=True)
            st.rec[:, self.slot] = S
            ends = (ctx.lengths if ctx.lengths is not None else torch.full((B,), N, device=x.device)).long()
            take = ends[:, None] + torch.arange(self.K - 1, device=x.device)[None, :]  # [B, K-1]
            st.conv[:, self.slot] = torch.gather(seq, 2, take[:, None, :].expand(-1, seq.shape[1], -1))
        else:  # verify: record the tape; the committed state stays as it is
            if use_fla(x.device) and ctx.parents is None:
                o, _ = _fla_forward(qe, ke, v, g, beta, S0, N, final=False)
            else:
                o, _ = recurrent(qe, ke, v, g, beta, S0, ctx.parents)
            st.record(self.slot, pre.to(conv_state.dtype), k, v, g, beta)
        return self._finish(o, x)


def _fla_forward(q, k, v, g, beta, S0, N, final=True):
    """fla Triton kernels (inputs already normalised and scaled; fla's own scale set to 1)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    fn = fused_recurrent_gated_delta_rule if N <= 64 else chunk_gated_delta_rule
    o, S = fn(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale=1.0,
              initial_state=S0.contiguous(), output_final_state=final)
    return o.float(), S

"""CUDA graphs for the decode / verify / draft steps, and the Triton fast path of the target.

On a CUDA device the runner and the DFlash proposer replay one captured CUDA graph per step
shape instead of launching hundreds of kernels from Python (gpt-fast gets the same effect from
``torch.compile(mode="reduce-overhead")``; capturing by hand costs well under a second per shape
instead of minutes of compilation):

- target step, one graph per (batch, block length T, captured layers): T = 1 for AR decode, the
  block size for chain verification. Inputs: static token [B, T] and start [B] buffers; outputs:
  static logits [B, T, vocab] and captured hidden states [B, T, F] (valid until the next replay
  of the same shape). Prefill (variable length) runs without a graph: with the Triton kernels
  every prompt goes row by row through the same step (``TargetRunner.prefill`` and the
  continuous-batching refills both call ``TargetRunner.prefill_row``), so a prompt's K/V and first
  token do not depend on the batch it arrives in; with the torch kernels it stays eager. Token trees (<= 64 nodes) run in the
  Triton step too (``StepGraphs.run(..., tree=tree_inputs(parents))``, the accepted path then
  compacted on the device by :func:`compact_path_`): the runner verifies a dense target's trees
  this way (``TargetRunner.tree_fast``; tests/test_gpu_path.py checks them against the eager tree
  forward under the interpreter and against AR on a GPU). Hybrid (GDN) and Muse-Glimmer targets
  run :class:`~specpilot.engine.fast_family.FastFamilyTarget` in the same graphs (chain steps;
  their trees stay eager).
- drafter steps, one graph per shape: ``draft`` (anchor [B], start [B]) and ``add_context``
  (features [B, T, F], start [B]).

Two step implementations (``kernels``):

- ``"triton"`` (default on CUDA with bf16 weights): :class:`FastTarget`, 7 Triton kernels per
  layer (:mod:`specpilot.engine.triton_step`): norms folded into the matmuls, fused q/k/v and
  gate/up weights, split-KV attention that reads only the live context, matmul row tiles chosen
  by M (16 rows for decode, up to 128/256 for batched verification; tables by rows in
  ``DEFAULT_CONFIGS``). Row-independent, so verifying a block, alone or in a batch of any size,
  gives bit-identical logits to decoding its tokens one by one (checked on the GPU by
  ``benchmarks/bench_verify.py`` for M = 1 .. 384).
- ``"torch"``: the eager :class:`~specpilot.models.qwen3.Transformer` forward (cuBLAS, SDPA)
  captured as is.

No step synchronizes the host: every input lives on the device and is copied into the static
buffers by the stream. Graphs are keyed on the KV-cache storage, and :meth:`Transformer.setup_cache`
reuses a cache of the same shape, so graphs survive from one batch of requests to the next.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import SpecpilotError
from ..models.layers import chain_ancestors
from ..models.qwen3 import Transformer

KERNELS = ("auto", "triton", "torch")
LINEAR_ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# Matmul block configs per role for up to 16 rows (AR decode, 16-token verify), tuned on an H200 for
# the Qwen3-8B shape (benchmarks/bench_engine.py, 2026-11-30; kernels/tuned/engine_h200.json), with
# 16-row tiles for every M: the configs of the fast path before M-aware row tiles.
DECODE_CONFIGS = {"qkv": "bn64-bk256-w4-s3", "o": "bn32-bk256-w4-s4", "gate_up": "bn128-bk64-w4-s4-p",
                  "down": "bn32-bk512-w4-s3", "lm_head": "bn64-bk128-w4-s4-p"}
# The default tables by rows (M = batch x block length; FastTarget picks the smallest max_rows >= M):
# the fastest configs whose every output row was bit-equal to the same row computed alone (M = 1),
# per row bucket, from benchmarks/bench_verify.py on an H200 (2026-12-01, run 2,
# benchmarks/verify_h200_2026-12-01_run2.json). qkv runs prenorm: with the fused-norm prologue
# its rows differed between configs (the sum of squares reduces in a tile-dependent layout).
DEFAULT_CONFIGS = {
    "qkv": {"16": "bn32-bk128-w4-s6-p", "32": "bn64-bk256-w4-s3-p-m32", "64": "bn64-bk128-w4-s4-p-m64", "128": "bn64-bk128-w4-s3-p-m64", "256": "bn128-bk64-w8-s5-p-m128", "384": "bn128-bk64-w8-s3-p-m256"},
    "o": {"16": "bn32-bk256-w4-s4", "32": "bn32-bk256-w4-s4-m32", "64": "bn32-bk256-w4-s4-m64", "128": "bn64-bk64-w4-s6-m64", "256": "bn64-bk128-w4-s3-m128", "384": "bn128-bk64-w8-s5-m128"},
    "gate_up": {"16": "bn128-bk64-w4-s4-p", "32": "bn128-bk64-w8-s4-p-m32", "64": "bn128-bk64-w8-s4-p-m64", "128": "bn128-bk64-w8-s4-p-m128", "256": "bn64-bk128-w4-s3-p-m128", "384": "bn128-bk64-w8-s3-p-m128"},
    "down": {"16": "bn32-bk512-w4-s3", "32": "bn32-bk256-w4-s4-m32", "64": "bn32-bk256-w4-s4-m64", "128": "bn64-bk64-w4-s6-m64", "256": "bn64-bk128-w4-s3-m128", "384": "bn128-bk64-w8-s5-m128"},
    "lm_head": {"16": "bn64-bk128-w4-s4-p", "32": "bn64-bk128-w4-s4-p-m32", "64": "bn128-bk128-w4-s3-p-m64", "128": "bn128-bk64-w8-s5-p-m128", "256": "bn128-bk64-w8-s4-p-m256", "384": "bn128-bk64-w8-s3-p-m128"},
}
# The draft step's context-injection matmuls (FastDrafter.add_context): ctx_fc = the fc projection
# (K = n_layers x hidden, N = hidden), ctx_kv = every layer's k/v rows (K = hidden, N = 2 L Hkv D).
# The tables of the target roles of the nearest shape, but for ctx_kv at <= 16 rows (one request's
# block): bn64-bk128-w4-s4, 22.4 us against 24.9 us for the qkv entry, the fastest of 15 configs
# checked against cuBLAS (gpu_bench/bench_draft.py, H200, 2026-12-02, draft_h200_2026-12-02_run4.json);
# for ctx_fc the down entry was the fastest (44.0 us, 91 % of copy bandwidth).
DRAFTER_CONTEXT_CONFIGS = {"ctx_fc": DEFAULT_CONFIGS["down"],
                           "ctx_kv": {**DEFAULT_CONFIGS["qkv"], "16": "bn64-bk128-w4-s4"}}
DEFAULT_ATTN_ROWS = 0  # query rows per attention program: 0 = 16 for decode, 64 for blocks (AttnWorkspace)
FAST_LINEAR_MAX_M = 64  # above this many rows (prefill) the plain F.linear (cuBLAS) is used
PREFILL_CUBLAS_MIN_ROWS = 64  # a prefill matmul of this many rows or more runs cuBLAS (FastTarget._pick)
# a decode / verify matmul of this many rows or more may run cuBLAS where it is checked bit-equal
# (FastTarget._select). Below it the step is bound by weight bandwidth and the tuned Triton configs
# were as fast or faster on the H200 (1 x 32 verify 5.02 ms Triton vs 5.07 with cuBLAS; AR at
# 20 / 24 rows 5.31 / 5.40 vs 5.35 / 5.46 ms; gpu_bench/verify_h200_2026-12-02_checked-cublas.json)
CHECKED_CUBLAS_MIN_ROWS = 64
# a checked matmul may also run cuBLAS on up to this many rows more than the step has (the
# workspaces keep that slack): cuBLAS picks its algorithm by shape, and at some M (e.g. the down
# projection of 16 x 16 = 256 rows) only a slightly larger M reduces in the decode kernels' order
# (gpu_bench/verify_h200_2026-12-02_checked-cublas.json: down at 256 rows not bit-equal, at 272 bit-equal)
CUBLAS_PAD_ROWS = (16, 32)


def _cfg_key(c) -> str:
    return c if isinstance(c, str) else c.key()


@dataclass(frozen=True)
class PaddedCublas:
    """cuBLAS over ``rows`` rows for a matmul of fewer (the step's rows, then workspace slack whose
    outputs nothing reads); chosen by :meth:`FastTarget._select` only where it is bit-equal."""

    rows: int

    def key(self) -> str:
        return f"cublas@{self.rows}"


_L2_FLUSH: list = []  # a buffer twice the L2 cache, written before each timed call of median_ms


def median_ms(fn, iters: int = 5, warmup: int = 2, flush_l2: bool = True) -> float:
    """Median device milliseconds of ``fn()`` over ``iters`` calls (CUDA events), after ``warmup``.

    ``flush_l2``: overwrite the L2 cache before each timed call, so a matmul reads its weight from
    device memory as it does in a step over every layer (a probe on one layer's weight would
    otherwise find it in L2 and favour whichever option is more bound by bandwidth)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if flush_l2 and not _L2_FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or (64 << 20)
        _L2_FLUSH.append(torch.empty(2 * l2, dtype=torch.uint8, device="cuda"))
    times = []
    for _ in range(iters):
        if flush_l2:
            _L2_FLUSH[0].zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def with_decode_configs(decode: dict, tables: dict | None = None) -> dict:
    """Tables by rows with their up-to-16-rows entry replaced by ``decode`` {role: config key}.

    For tuners that time one row (benchmarks/bench_engine.py): the row buckets above 16 keep the
    table's configs. A decode config is taken only where it keeps the role's norm placement
    (prenorm or not) of the other buckets, or is ``"cublas"`` (then the role runs cuBLAS for every
    M): a fused-norm prologue and a separate norm round differently, which would make a row's bits
    depend on M. Returns a new dict; unknown roles pass through for FastTarget to reject.
    """
    tables = DEFAULT_CONFIGS if tables is None else tables
    out = {}
    for role, key in decode.items():
        t = tables.get(role)
        if key == CUBLAS or not isinstance(t, dict):
            out[role] = key
            continue
        others = [v for k, v in t.items() if int(k) > 16 and v != CUBLAS]
        pre = key.split("-")[4:5] == ["p"]
        if all((o.split("-")[4:5] == ["p"]) == pre for o in others):
            out[role] = {**t, "16": key}
        else:
            out[role] = dict(t)
    return out


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Triton path
        return False
    return True


def resolve_kernels(kernels: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``triton`` on CUDA with bf16 weights when Triton imports, else ``torch``."""
    kernels = kernels or "auto"
    if kernels not in KERNELS:
        raise SpecpilotError(f"unknown kernels {kernels!r}; use {', '.join(KERNELS)}")
    if kernels == "auto":
        ok = device.type == "cuda" and dtype == torch.bfloat16 and triton_available()
        return "triton" if ok else "torch"
    if kernels == "triton" and not triton_available():
        raise SpecpilotError("kernels 'triton' requested but triton is not installed")
    return kernels


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def fast_path_supported(model: Transformer) -> bool:
    """True when every projection is a plain ``nn.Linear`` (not e.g. a w12 module), all layers are full
    attention, and head_dim is a power of two (the Triton attention and RoPE kernels tile by it)."""
    hd = model.config.head_dim
    if hd & (hd - 1):
        return False
    for layer in model.model.layers:
        mods = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        if any(type(m) is not nn.Linear for m in mods):
            return False
    return type(model.lm_head) is nn.Linear and set(model.config.layer_types) <= {"full_attention"}


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


# ---------------------------------------------------------------------------------------------
# the Triton step
# ---------------------------------------------------------------------------------------------


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
    extra: dict = field(default_factory=dict)  # FastDrafter's buffers (context, K/V projections, tree bits)
    rows: int = 0  # the step's rows (B x T, padded for explicit cuBLAS); buffers may hold slack beyond (0: none)


CUBLAS = "cublas"


class FastTarget:
    """Decode / chain-verify forward of a :class:`Transformer` through the Triton kernels.

    Same contract as ``Transformer.forward`` for a chain block (``depth=None``): writes K/V at
    slots ``start .. start+T-1`` and returns logits [B, T, vocab] and captured features. Needs
    CUDA (or ``TRITON_INTERPRET=1`` on the CPU for tests). Outputs live in per-shape workspace
    buffers, overwritten by the next call of the same shape.

    ``configs`` maps each matmul role (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``) to a
    Triton block config (:class:`~specpilot.engine.triton_step.LinearConfig` or its key), to
    ``"cublas"``, or to a table by rows ``{max_rows: config}`` (JSON keys may be strings): a
    matmul of M rows (M = batch x block length) uses the entry with the smallest ``max_rows`` >= M,
    the largest entry beyond them all. With ``"cublas"`` that matmul runs through ``torch.mm``
    (cuBLAS) with the norm, SwiGLU and residual as separate kernels. The key ``attn_rows`` sets the
    query rows per attention program (as ``attn_rows=``) (residual through the GEMM's
    beta = 1). cuBLAS picks its algorithm by shape, so with any cuBLAS entry the rows are padded to
    a multiple of 16, and rows are then not independent of M beyond 16 (token forcing's near-tie
    classification covers that). Row independence of Triton entries: see
    :mod:`specpilot.engine.triton_step` (checked on the GPU by ``benchmarks/bench_verify.py``).

    **Checked cuBLAS** (``checked_cublas``, default on; CUDA only). cuBLAS runs a batched verify's
    GEMMs (M = 128-384 rows) 25-45 % faster than these Triton kernels (H200, BENCHMARKS.md), and
    on most shapes its rows are bit-equal to the decode kernels' (its algorithm reduces over K in
    the same order); on some (split-K) they are not. So the first call of each (role, M, weight
    shape) of at least 64 rows checks the options on a probe against the decode config and keeps
    the fastest bit-equal one (:meth:`_select`, recorded in :attr:`selection`): the table's Triton
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
    w12_roles: dict = {}  # role -> W12Role: roles run by the w12 kernel (use_w12; none by default)

    def __init__(self, model: Transformer, configs: dict | None = None, attn_rows: int | None = None,
                 checked_cublas: bool = True):
        from . import triton_step

        self.k = triton_step
        self.model = model
        # query rows per attention program (0: by block length, see triton_step.AttnWorkspace)
        self.attn_rows = DEFAULT_ATTN_ROWS if attn_rows is None else attn_rows
        self.checked_cublas = bool(checked_cublas)
        self._chosen: dict[tuple, object] = {}  # (role, M, weight shape, ...) -> checked config
        self.selection: dict[str, dict] = {}  # what _select found per shape (for records and benchmarks)
        self._prefilling = False
        self._fuse_weights()
        self.configs = {role: self._tiers(self.default_configs[role]) for role in self.roles}
        self._ws: dict[tuple, _Workspace] = {}
        self.set_configs(configs or {})

    def _fuse_weights(self) -> None:
        """Fuse the model's projection weights the way this step reads them (once, in place)."""
        fuse_weights(self.model)

    def _one(self, c):
        if isinstance(c, self.k.LinearConfig) or c == CUBLAS:
            return c
        try:
            return self.k.LinearConfig.parse(c)
        except (ValueError, TypeError) as e:
            raise SpecpilotError(f"bad matmul config {c!r}: {e}") from None

    def _tiers(self, c) -> tuple:
        """Normalize a role's config to ((max_rows, config), ...) sorted by max_rows."""
        if isinstance(c, dict):
            try:
                items = sorted((int(k), v) for k, v in c.items())
            except ValueError:
                raise SpecpilotError(f"matmul config table keys must be row counts, got {list(c)}") from None
            if not items or items[0][0] < 1:
                raise SpecpilotError(f"matmul config table needs row counts >= 1, got {list(c)}")
            return tuple((k, self._one(v)) for k, v in items)
        return ((1 << 30, self._one(c)),)

    def set_configs(self, configs: dict) -> bool:
        """Set block configs per role; returns True when something changed."""
        changed = False
        for role, c in configs.items():
            if role == "attn_rows":  # query rows per attention program (not a matmul)
                changed |= self.attn_rows != int(c)
                self.attn_rows = int(c)
                self._ws.clear()
                continue
            if role not in self.roles:
                raise SpecpilotError(f"unknown linear role {role!r}; roles: {', '.join(self.roles)}")
            t = self._tiers(c)
            changed |= self.configs[role] != t
            self.configs[role] = t
        if changed:
            self._chosen.clear()
            self.selection.clear()
        return changed

    def config_for(self, role: str, rows: int):
        """The config (LinearConfig or ``"cublas"``) a matmul of ``role`` uses for ``rows`` rows."""
        tiers = self.configs[role]
        for max_rows, c in tiers:
            if rows <= max_rows:
                return c
        return tiers[-1][1]

    def config_keys(self) -> dict:
        def key(c):
            return c if c == CUBLAS else c.key()

        out = {}
        for r, t in self.configs.items():
            out[r] = key(t[0][1]) if len(t) == 1 else {str(m): key(c) for m, c in t}
        return out

    @property
    def pad(self) -> int:
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
            if self.w12_roles and keep:  # the w12 matmul's output before SwiGLU / the residual add
                ws.w12y = torch.zeros(M * max(nq + 2 * nkv, 2 * c.intermediate_size, c.hidden_size), **z)
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
        rc = self.w12_roles.get(role) if not self._prefilling else None
        if rc is not None:
            f = self._w12.get(w.data_ptr())
            if f is not None:
                return self._w12_apply(rc, f, xr, outr, ws, norm, outr if residual is not None else None, swiglu)
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
        """Run the roles of ``choice`` (``{role: W12Role}``, :mod:`specpilot.engine.w12_fast`) with the
        12-bit tensor-core kernel at every decode / verify M (one K split per role, so a row's bits
        do not depend on M); prefill matmuls and the other roles stay bf16. Packs each chosen
        role's weight of every layer into the fragment layout (lossless) once; CUDA only.

        Raises:
            SpecpilotError: a role outside the w12 roles, or a weight the layout cannot hold."""
        from ..kernels.w12_mma import frag_pack
        from ..w12 import pack
        from .w12_fast import ROLES, role_weights

        bad = [r for r in choice if r not in ROLES]
        if bad:
            raise SpecpilotError(f"w12 roles must be among {ROLES}, got {bad}")
        from ..kernels.w12_mma import valid

        for role, w in role_weights(self.model.model.layers[0]).items():
            rc = choice.get(role)
            # each launch at its bucket's rows (valid there: valid at fewer), the last also at 64
            # (it runs every 64-row chunk beyond the table)
            checks = [(min(r, 64), c) for r, c in rc.tiers] + [(64, rc.tiers[-1][1])] if rc is not None else []
            for m, (tn, warps, unroll) in checks:
                if not valid(m, rc.split, tn, warps, unroll, w.shape[1]):
                    raise SpecpilotError(f"w12 role {role}: no kernel for split {rc.split}, tiles {tn}, warps "
                                         f"{warps}, unroll {unroll} at {m} rows (K = {w.shape[1]}); see w12_mma.valid")
        self._w12 = {}
        for layer in self.model.model.layers:
            for role, w in role_weights(layer).items():
                if role in choice:
                    self._w12[w.data_ptr()] = frag_pack(pack(w.detach()))
        self.w12_roles = dict(choice)
        self._ws.clear()

    def _w12_apply(self, rc, f, x, out, ws, norm=None, residual=None, swiglu=False):
        """``out = epilogue(norm(x) @ W.T)`` with W in w12 (``f``, a FragW12) through launch family
        ``rc`` (W12Role): the RMSNorm and SwiGLU kernels of the bf16 cuBLAS variant, the w12
        tensor-core matmul into ``ws.w12y``, then SwiGLU or ``out += y`` (``residual`` is ``out``)."""
        from ..kernels import w12_mma

        M = x.shape[0]
        if norm is not None:
            x = self.k.rmsnorm(x, norm, ws.xn[:M], self.model.config.rms_norm_eps)
        launch = rc.launch(M)
        if residual is None and not swiglu:
            return w12_mma.matmul(x, f, rc.split, *launch, out=out)
        need = M * f.shape[0]
        buf = getattr(ws, "w12y", None)  # flat: the kernel writes rows of exactly N columns
        if buf is None or buf.numel() < need:
            buf = ws.w12y = torch.empty(need, dtype=x.dtype, device=x.device)
        y = buf[:need].view(M, f.shape[0])
        w12_mma.matmul(x, f, rc.split, *launch, out=y)
        if swiglu:
            return self.k.silu_mul(y, out)
        return out.add_(y)

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

    @torch.inference_mode()
    def _select(self, key, table_cfg, w, norm, residual: bool, swiglu: bool):
        """Check and time the options of one (role, M, weight shape) matmul; returns the fastest
        option whose output is bit-equal, row for row, to the decode config's (the config of
        M <= 16 rows, whose 16-row tiles compute each row exactly as a one-row decode does).

        Options: the table's Triton entry for M, cuBLAS (``torch.mm``) on the M rows, and cuBLAS on
        M + 16 / M + 32 rows (:class:`PaddedCublas`, where the caller's buffers have that slack:
        ``key[-1]``). Each is checked on a random probe x (and residual) with the role's real
        weight and norm, its first M rows against the decode config's; whichever fails is never
        used for this shape, so a row's logits stay those of the row decoded alone (row
        independence) on any GPU and library version, whatever cuBLAS's heuristics pick. Records
        the outcome in :attr:`selection` (key string -> dict). Falls back to the decode config
        when no option is bit-equal.
        """
        import types

        role, M, pads = key[0], key[1], key[-1]
        dev, dt = w.device, w.dtype
        Kd = w.shape[1]
        N = w.shape[0] // 2 if swiglu else w.shape[0]
        P = max((M,) + pads)
        g = torch.Generator(device=dev).manual_seed(1234 + M)
        x = torch.randn(P, Kd, generator=g, device=dev, dtype=dt)
        r = torch.randn(P, N, generator=g, device=dev, dtype=dt) if residual else None
        ws = types.SimpleNamespace(xn=torch.empty(P, Kd, dtype=dt, device=dev), gu=None)
        base = self.config_for(role, 1)

        def run(cfg, out=None):
            n = cfg.rows if isinstance(cfg, PaddedCublas) else M
            if out is None:
                out = r[:n].clone() if r is not None else torch.empty(n, N, dtype=dt, device=dev)
            self._apply(CUBLAS if isinstance(cfg, PaddedCublas) else cfg, x[:n], w, out, ws, norm,
                        out if r is not None else None, swiglu)
            return out

        ref = run(base)
        opts = [c for c in (table_cfg, CUBLAS, *(PaddedCublas(p) for p in pads)) if c != base]
        rec = {"rows": M, "weight": list(w.shape), "decode_config": _cfg_key(base), "options": {}}
        best, best_t = base, None
        for c in opts:
            try:
                ok = bool(torch.equal(run(c)[:M], ref))
                t = self._time(c, lambda c=c, o=run(c): run(c, o)) if ok else None
            except Exception as e:  # noqa: BLE001 - an option that cannot run is not an option
                rec["options"][_cfg_key(c)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                continue
            rec["options"][_cfg_key(c)] = {"bit_equal": ok, "ms": t}
            if ok and (best_t is None or t < best_t):
                best, best_t = c, t
        rec["chosen"] = _cfg_key(best)
        self.selection[f"{role}:{M}:{'x'.join(map(str, w.shape))}"] = rec
        return best

    def _layer(self, x, layer, kc, vc, cos, sin, start, T: int, M: int, ws: _Workspace, anc_bits=None, depth=None,
               path=None):
        """One pre-norm attention + SwiGLU layer on the residual stream ``x`` [>= M, hidden] (in place).

        Writes the block's K/V to slots start .. start+T-1 of ``kc``/``vc`` (one layer's cache,
        (B, Hkv, S, D)); ``anc_bits``/``depth``: tree visibility and RoPE depths (None: a chain);
        ``path``: a target tree's ancestors by depth (:func:`~specpilot.engine.triton_step.tree_paths`),
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
        interface (:class:`~specpilot.engine.fast_family.FastFamilyTarget` advances recurrent state
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


def fast_drafter_supported(drafter) -> bool:
    """True when :class:`FastDrafter` can run ``drafter``: a plain DFlash network (not a DFlash2 /
    DSpark subclass), every layer non-causal without a window (the DFlash default), plain linears
    without bias and a power-of-two head_dim."""
    from ..models.dflash import DFlashDrafter

    cfg = drafter.config
    hd = cfg.head_dim
    if type(drafter) is not DFlashDrafter or hd & (hd - 1):
        return False
    if any(cfg.layer_causal(i) or cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers)):
        return False
    for layer in drafter.layers:
        if layer.attention_conv is not None or layer.mlp_conv is not None:
            return False
    lin = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
    return all(type(m) is nn.Linear and m.bias is None for m in lin)


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
    checked by the target. Needs :func:`fast_drafter_supported`; the draft cache must hold
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
        if not fast_drafter_supported(drafter):
            raise SpecpilotError("the Triton draft step needs a plain DFlash drafter (full non-causal layers, "
                                 "plain linears, power-of-two head_dim)")
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


FAST_LINEAR_CONFIG = {"key": "bn32-bk256-w4-s4"}  # block config of use_fast_linears / FastLinear


def set_fast_linear_config(key: str) -> None:
    """Block config (:class:`~specpilot.engine.triton_step.LinearConfig` key) of the drafter's Triton matmuls."""
    FAST_LINEAR_CONFIG["key"] = key


def _fast_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from . import triton_step

    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16 and self.bias is None \
            and 0 < rows <= FAST_LINEAR_MAX_M and self.weight.is_contiguous():
        cfg = triton_step.LinearConfig.parse(FAST_LINEAR_CONFIG["key"])
        y = triton_step.linear(x.reshape(rows, K), self.weight, cfg=cfg)
        return y.view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, self.weight, self.bias)


def use_fast_linears(module: nn.Module, enable: bool = True) -> nn.Module:
    """Route every ``nn.Linear`` of ``module`` with few rows (<= 64) through the Triton matmul
    (``enable=False`` restores ``F.linear``)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            if enable:
                m.forward = types.MethodType(_fast_linear_forward, m)
            else:
                m.__dict__.pop("forward", None)
    return module


class FastLinear(nn.Module):
    """``x @ weight.T`` through the Triton matmul for few rows; shares (does not own) ``weight``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight_ref = [weight]
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_ref[0]

    def forward(self, x):
        return _fast_linear_forward(self, x)


# ---------------------------------------------------------------------------------------------
# graph capture
# ---------------------------------------------------------------------------------------------


@dataclass
class _Captured:
    graph: object
    inputs: list
    output: object


@dataclass
class GraphCache:
    """One CUDA graph per key: ``run(key, fn, inputs)`` copies ``inputs`` into the static input
    buffers of the key's graph (capturing ``fn(*static_inputs)`` on first use) and replays it.

    Capture runs ``fn`` twice on a side stream first (Triton compilation, cuBLAS workspaces); those
    warm-up runs see the real inputs, so side effects (KV-cache writes) are the ones the replay
    repeats. A step whose side effects do not repeat harmlessly (a decode that advances recurrent
    state) passes ``guard`` = (save, restore): ``restore(save())`` puts the state back after the
    warm-ups, so the replay applies the step once. ``token`` (e.g. the KV cache's address) invalidates every graph when it changes. Each
    graph has its own memory pool, so graphs may be replayed in any order.
    """

    entries: dict = field(default_factory=dict)
    token: object = None
    captures: int = 0

    def run(self, key, fn: Callable, inputs: tuple, token=None, prepare: Callable | None = None,
            guard: tuple[Callable, Callable] | None = None):
        if token != self.token:
            self.entries.clear()
            self.token = token
        e = self.entries.get(key)
        if e is None:
            if prepare is not None:
                prepare()
            saved = guard[0]() if guard is not None else None
            e = self._capture(fn, inputs)
            if guard is not None:
                guard[1](saved)
            self.entries[key] = e
        for s, x in zip(e.inputs, inputs):
            s.copy_(x)
        e.graph.replay()
        return e.output

    def _capture(self, fn, inputs) -> _Captured:
        static = [x.detach().clone().contiguous() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(*static)
        self.captures += 1
        return _Captured(g, static, out)


class StepGraphs:
    """Captured target steps of one model (see the module docstring); one per (model, kernels)."""

    def __init__(self, model: Transformer, kernels: str = "triton", configs: dict | None = None):
        self.model = model
        self.kernels = kernels
        self.fast = None
        if kernels == "triton":
            if model.config.is_dense:
                self.fast = FastTarget(model, configs)
            else:
                from .fast_family import FastFamilyTarget

                self.fast = FastFamilyTarget(model, configs)
        self.cache = GraphCache()

    def step(self, tokens: torch.Tensor, start: torch.Tensor, capture: tuple[int, ...] = (),
             tree: tuple[torch.Tensor, torch.Tensor] | None = None, write: bool = False):
        """One chain (or tree, see :meth:`FastTarget.forward`) step without a graph (the captured
        function). ``write``: a decode that advances recurrent state (hybrid targets)."""
        if self.fast is not None:
            return self.fast.forward(tokens, start, capture, tree, write=write)
        if tree is not None:
            raise SpecpilotError("tree steps under CUDA graphs need the Triton kernels")
        B, T = tokens.shape
        with torch.inference_mode():
            return self.model(tokens, start, chain_ancestors(B, T, tokens.device), capture=capture)

    def run(self, tokens: torch.Tensor, start: torch.Tensor, capture: tuple[int, ...] = (),
            tree: tuple[torch.Tensor, torch.Tensor] | None = None, write: bool = False):
        """Replay (capturing on first use) the step for ``tokens`` [B, T] at ``start`` [B].

        ``tree`` (from :func:`tree_inputs`) is an input of the graph like the tokens: one graph per
        (B, T) serves every tree shape of that size. ``write``: the step advances recurrent state
        (a decode of a hybrid target; its own graph); a verify of such a target leaves the state
        for :meth:`FastFamilyTarget.commit_recurrent`.
        """
        if self.model.state is None:
            raise SpecpilotError("setup_cache() must be called before the forward")
        key = (tuple(tokens.shape), tuple(capture), 0 if tree is None else len(tree), write)
        token = (self.model.state.data_ptrs(), self.model.cos.data_ptr())
        with torch.inference_mode():
            if write:
                return self.cache.run(key, lambda t, s: self.step(t, s, capture, write=True), (tokens, start), token,
                                      guard=_state_guard(self.model))
            if tree is None:
                return self.cache.run(key, lambda t, s: self.step(t, s, capture), (tokens, start), token)
            return self.cache.run(key, lambda t, s, *tr: self.step(t, s, capture, tuple(tr)),
                                  (tokens, start, *tree), token)


def _state_guard(model: Transformer) -> tuple[Callable, Callable] | None:
    """(save, restore) of a target's recurrent state around a capture's warm-up runs (None: no
    recurrent state, nothing to guard)."""
    g = model.state.gdn
    if g is None:
        return None

    def save():
        return g.conv.clone(), g.rec.clone()

    def restore(saved):
        g.conv.copy_(saved[0])
        g.rec.copy_(saved[1])

    return save, restore


def tree_inputs(parents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(ancestor bits int64 [B, T], depth int32 [B, T], ancestors by depth int32 [B, T, 64]) of a
    token tree for :meth:`FastTarget.forward` (the attention reads each node's ancestors in the
    order of their positions: :func:`~specpilot.engine.triton_step.tree_paths`). A tree whose
    nodes have their ancestors at the slots of their depths (chains, spine + side-leaf trees)
    gets the first two only: its ancestor bits sum the keys in the decode's tiles already, at the
    chain verify's cost (one program per row tile, not per node).

    ``parents`` int64 [B, T]: block index of each node's parent (< its own index), -1 for the root
    (:func:`specpilot.models.layers.tree_ancestors`). T <= 64; raises SpecpilotError otherwise.
    """
    from ..models.layers import tree_ancestors
    from .triton_step import tree_bits, tree_paths

    if parents.shape[1] > 64:
        raise SpecpilotError(f"tree blocks in the fast path hold at most 64 nodes, got {parents.shape[1]}")
    anc, depth = tree_ancestors(parents)
    bits, depth = tree_bits(anc), depth.to(torch.int32).contiguous()
    paths = tree_paths(anc)
    # a tree whose every node has its ancestor of depth d at block slot d (a chain, the spine +
    # side-leaf trees) sums its keys in the decode's tiles already: the ancestor bits serve it
    on_slots = torch.arange(64, device=parents.device, dtype=torch.int32)[None, None, :] < depth[..., None]
    if bool((paths == torch.arange(64, device=parents.device, dtype=torch.int32)).logical_or(~on_slots).all()):
        return bits, depth
    return bits, depth, paths


@torch.no_grad()
def compact_path_(cache, length: torch.Tensor, counts: torch.Tensor, path_slots: torch.Tensor) -> None:
    """Move each row's accepted tree path to contiguous slots, on the device (no host sync).

    Row b keeps ``counts[b]`` nodes; node ``path_slots[b, j]`` (block index, increasing along the
    path) moves from slot ``length[b] + path_slots[b, j]`` to ``length[b] + j`` in every layer's
    K and V of ``cache`` (a :class:`~specpilot.models.qwen3.KVCache`). Entries j >= counts[b] are
    left as they are. Same result as the runner's host-side ``cache.move`` compaction; gathers all
    sources before writing, so overlapping moves are safe. Graph-capturable (fixed shapes).
    """
    B, P = path_slots.shape
    dev = cache.k.device
    j = torch.arange(P, device=dev)[None, :]
    base = length.to(dev)[:, None]
    src = base + path_slots.to(dev)
    dst = base + j
    keep = j < counts.to(dev)[:, None]
    src = torch.where(keep, src, dst)  # rows past counts copy their own slot onto itself
    rows = torch.arange(B, device=dev)[:, None].expand(B, P)
    for buf in (cache.k, cache.v):  # (B, L, H, S, D): gather [B, P, L, H, D], then scatter
        vals = buf[rows, :, :, src]
        buf[rows, :, :, dst] = vals


def step_graphs(model: Transformer, kernels: str | None = "auto", configs: dict | None = None) -> StepGraphs:
    """The :class:`StepGraphs` of ``model`` for ``kernels`` (created once and kept on the model)."""
    w = model.lm_head.weight
    if w.device.type != "cuda":
        raise SpecpilotError("CUDA graphs need the model on a CUDA device")
    asked = kernels or "auto"
    kernels = resolve_kernels(kernels, w.device, w.dtype)
    if not model.config.is_dense:
        from .fast_family import family_fast_supported

        why = family_fast_supported(model)
        if why or kernels != "triton":
            raise SpecpilotError(f"CUDA graphs of a hybrid / sliding-window target need the Triton kernels"
                                 f"{': ' + why if why else ''}")
    elif kernels == "triton" and not fast_path_supported(model):
        if asked == "triton":
            raise SpecpilotError("kernels 'triton' need plain linear layers (not another weight format) and a power-of-two head_dim")
        kernels = "torch"
    store = model.__dict__.setdefault("_step_graphs", {})
    if kernels not in store:
        store[kernels] = StepGraphs(model, kernels, configs)
    elif configs and store[kernels].fast is not None and store[kernels].fast.set_configs(configs):
        store[kernels].cache.entries.clear()  # other kernels: recapture
    return store[kernels]


def matmul_choices(model) -> dict[str, str]:
    """What the checked-cuBLAS selection of ``model``'s fast step chose so far: ``"role:M:NxK"`` ->
    ``"cublas"`` or a Triton config key (empty when the model runs no Triton step; see
    :meth:`FastTarget._select`). For a DFlash drafter, its draft step's choices."""
    out = {}
    for g in list(model.__dict__.get("_step_graphs", {}).values()) + list(model.__dict__.get("_drafter_graphs", {}).values()):
        fast = getattr(g, "fast", None)
        if fast is not None:
            out.update({k: v["chosen"] for k, v in fast.selection.items()})
    return out


class DrafterGraphs:
    """Captured DFlash drafter steps: ``draft`` and ``add_context`` per shape."""

    def __init__(self, drafter, embed: nn.Embedding, lm_head: nn.Module, kernels: str = "triton"):
        self.drafter = drafter
        self.embed = embed
        self.kernels = kernels
        self.lm_head = FastLinear(lm_head.weight) if kernels == "triton" else lm_head
        self.cache = GraphCache()
        # the whole draft step in the Triton kernels where the network allows it (plain DFlash);
        # else the eager network with its linears through the Triton matmul
        self.fast = FastDrafter(drafter, embed.weight, lm_head.weight) \
            if kernels == "triton" and fast_drafter_supported(drafter) and type(lm_head) is nn.Linear else None

    def _prepare(self):  # the drafter's linears as this graph set wants them, before a capture
        use_fast_linears(self.drafter, self.kernels == "triton" and self.fast is None)

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


def drafter_graphs(drafter, embed: nn.Embedding, lm_head: nn.Module, kernels: str | None = "auto") -> DrafterGraphs:
    """The :class:`DrafterGraphs` of ``drafter`` (kept on the drafter; rebuilt for another target)."""
    w = drafter.fc.weight
    if w.device.type != "cuda":
        raise SpecpilotError("CUDA graphs need the drafter on a CUDA device")
    kernels = resolve_kernels(kernels, w.device, w.dtype)
    store = drafter.__dict__.setdefault("_drafter_graphs", {})
    key = (kernels, id(embed), id(lm_head))
    if key not in store:
        store[key] = DrafterGraphs(drafter, embed, lm_head, kernels)
    return store[key]

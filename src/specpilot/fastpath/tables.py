"""The fast path's matmul configurations: block configs, the default tables by rows, and the
row thresholds where a matmul changes implementation (no Triton import: the backend decision, the
kernels rule and the tuners read these on any machine).

A matmul role (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``; the drafter step adds ``ctx_fc``
and ``ctx_kv``) runs, for a step of M rows (batch x block length), the entry of its table with the
smallest ``max_rows`` >= M: a :class:`LinearConfig` key of the Triton matmul
(:func:`specpilot.kernels.step.linear`), ``"cublas"`` (:data:`CUBLAS`), or, chosen at run time by the
checked-cuBLAS selection (:mod:`specpilot.tuning.select`), cuBLAS over a few more rows
(:class:`PaddedCublas`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SpecpilotError

BM = 16  # fewest rows per matmul tile (tensor-core minimum)
ROW_TILES = (16, 32, 64, 128, 256)  # row tiles a matmul may use: the smallest covering M, capped by cfg.bm
# the row buckets of DEFAULT_CONFIGS the matmul tuner re-tunes (specpilot.tuning.matmul): AR decode and one
# request's verify (16), small batches (32, 64), the batched regime's verify (c16 x block 8 = 128, x 16 = 256)
TUNE_ROWS = (16, 32, 64, 128, 256)
DEFAULT_TUNE_ROWS = (16, 32, 64)  # the buckets tuned when none are named (config kernel_agent.engine_rows)
TREE_BIT_NODES = 64  # trees of up to this many nodes may verify by ancestor bits (one int64 per node)
TREE_FAST_NODES = 256  # trees of up to this many nodes verify in the Triton step (wider than the bits: by paths)


@dataclass(frozen=True)
class LinearConfig:
    """Block config of :func:`linear`: output columns per program, K step, warps, pipeline stages.

    ``prenorm``: for matmuls that follow an RMSNorm, run the norm as its own kernel
    (:func:`rmsnorm`) instead of folding it into the matmul's prologue (the fold costs element-wise
    work in every program, which pays only when programs own many output columns).

    ``bm``: the most rows per tile (one of :data:`ROW_TILES`); M rows use the smallest row tile
    that covers M, at most ``bm`` (:func:`row_tile`). 16 reproduces the fixed 16-row tiles.
    Key: ``bn{bn}-bk{bk}-w{warps}-s{stages}[-p][-m{bm}]`` (no ``-m`` part: ``bm`` = 16).
    """

    bn: int = 16
    bk: int = 512
    warps: int = 4
    stages: int = 3
    prenorm: bool = False
    bm: int = 16

    def __post_init__(self):
        if self.bm not in ROW_TILES:
            raise ValueError(f"bm must be one of {ROW_TILES}, got {self.bm}")

    def key(self) -> str:
        return (f"bn{self.bn}-bk{self.bk}-w{self.warps}-s{self.stages}" + ("-p" if self.prenorm else "")
                + (f"-m{self.bm}" if self.bm != BM else ""))

    @classmethod
    def parse(cls, key: str) -> "LinearConfig":
        """Inverse of :meth:`key`; raises ValueError naming a malformed key."""
        m = re.fullmatch(r"bn(\d+)-bk(\d+)-w(\d+)-s(\d+)(-p)?(?:-m(\d+))?", key)
        if m is None:
            raise ValueError(f"bad linear config key {key!r}")
        bn, bk, w, s = map(int, m.groups()[:4])
        return cls(bn, bk, w, s, m.group(5) is not None, int(m.group(6) or BM))


def row_tile(M: int, cap: int) -> int:
    """Rows per matmul tile for M rows: the smallest of :data:`ROW_TILES` >= M, at most ``cap``."""
    for bm in ROW_TILES:
        if bm >= M or bm >= cap:
            return min(bm, cap)
    return cap


CANDIDATES = (
    LinearConfig(16, 512, 4, 3),
    LinearConfig(16, 256, 4, 4),
    LinearConfig(32, 256, 4, 4),
    LinearConfig(32, 256, 4, 3),
    LinearConfig(32, 128, 4, 6),
    LinearConfig(32, 512, 4, 3),
    LinearConfig(64, 128, 4, 4),
    LinearConfig(64, 256, 4, 3),
    LinearConfig(64, 128, 8, 4),
    LinearConfig(128, 64, 4, 4),
)


KERNELS = ("auto", "triton", "torch")
LINEAR_ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# Matmul block configs per role for up to 16 rows (AR decode, 16-token verify), tuned on an H200 for
# the Qwen3-8B shape (specpilot bench engine, 2026-11-30; kernels/tuned/engine_h200.json), with
# 16-row tiles for every M: the configs of the fast path before M-aware row tiles.
DECODE_CONFIGS = {"qkv": "bn64-bk256-w4-s3", "o": "bn32-bk256-w4-s4", "gate_up": "bn128-bk64-w4-s4-p",
                  "down": "bn32-bk512-w4-s3", "lm_head": "bn64-bk128-w4-s4-p"}
# The default tables by rows (M = batch x block length; FastTarget picks the smallest max_rows >= M):
# the fastest configs whose every output row was bit-equal to the same row computed alone (M = 1),
# per row bucket, from specpilot bench verify on an H200 (2026-12-01, run 2,
# BENCHMARKS.md). qkv runs prenorm: with the fused-norm prologue
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
# checked against cuBLAS (specpilot bench draft, H200, 2026-12-02, BENCHMARKS.md);
# for ctx_fc the down entry was the fastest (44.0 us, 91 % of copy bandwidth).
DRAFTER_CONTEXT_CONFIGS = {"ctx_fc": DEFAULT_CONFIGS["down"],
                           "ctx_kv": {**DEFAULT_CONFIGS["qkv"], "16": "bn64-bk128-w4-s4"}}
DEFAULT_ATTN_ROWS = 0  # query rows per attention program: 0 = 16 for decode, 64 for blocks (AttnWorkspace)
FAST_LINEAR_MAX_M = 64  # above this many rows (prefill) the plain F.linear (cuBLAS) is used
PREFILL_CUBLAS_MIN_ROWS = 64  # a prefill matmul of this many rows or more runs cuBLAS (fastpath.dense.FastTarget._pick)
# a decode / verify matmul of this many rows or more may run cuBLAS where it is checked bit-equal
# (tuning.select). Below it the step is bound by weight bandwidth and the tuned Triton configs
# were as fast or faster on the H200 (1 x 32 verify 5.02 ms Triton vs 5.07 with cuBLAS; AR at
# 20 / 24 rows 5.31 / 5.40 vs 5.35 / 5.46 ms; BENCHMARKS.md)
CHECKED_CUBLAS_MIN_ROWS = 64
# a checked matmul may also run cuBLAS on up to this many rows more than the step has (the
# workspaces keep that slack): cuBLAS picks its algorithm by shape, and at some M (e.g. the down
# projection of 16 x 16 = 256 rows) only a slightly larger M reduces in the decode kernels' order
# (BENCHMARKS.md: down at 256 rows not bit-equal, at 272 bit-equal)
CUBLAS_PAD_ROWS = (16, 32)
# the block config of the drafter network's plain linears routed through the Triton matmul
# (fastpath.drafter.TritonLinear: DFlash2 / DSpark networks drafting under CUDA graphs)
FAST_LINEAR_KEY = "bn32-bk256-w4-s4"
CUBLAS = "cublas"


def config_key(c) -> str:
    """The key string of a config (a :class:`LinearConfig`, :class:`PaddedCublas` or a key)."""
    return c if isinstance(c, str) else c.key()


@dataclass(frozen=True)
class PaddedCublas:
    """cuBLAS over ``rows`` rows for a matmul of fewer (the step's rows, then workspace slack whose
    outputs nothing reads); chosen by :meth:`FastTarget._select` only where it is bit-equal."""

    rows: int

    def key(self) -> str:
        return f"cublas@{self.rows}"


def parse_config(c):
    """One role's config as the step uses it: a :class:`LinearConfig` or :data:`CUBLAS`.

    Raises SpecpilotError naming a malformed key."""
    if isinstance(c, LinearConfig) or c == CUBLAS:
        return c
    try:
        return LinearConfig.parse(c)
    except (ValueError, TypeError) as e:
        raise SpecpilotError(f"bad matmul config {c!r}: {e}") from None


def config_tiers(c) -> tuple:
    """A role's config (a key, a LinearConfig, ``"cublas"`` or a table ``{max_rows: config}`` whose
    JSON keys may be strings) as ((max_rows, config), ...) sorted by max_rows; one entry covers
    every M. Raises SpecpilotError for a malformed table or config."""
    if isinstance(c, dict):
        try:
            items = sorted((int(k), v) for k, v in c.items())
        except ValueError:
            raise SpecpilotError(f"matmul config table keys must be row counts, got {list(c)}") from None
        if not items or items[0][0] < 1:
            raise SpecpilotError(f"matmul config table needs row counts >= 1, got {list(c)}")
        return tuple((k, parse_config(v)) for k, v in items)
    return ((1 << 30, parse_config(c)),)


def tier_for(tiers: tuple, rows: int):
    """The config of ``tiers`` (from :func:`config_tiers`) for a matmul of ``rows`` rows: the entry
    with the smallest max_rows >= rows, the largest entry beyond them all."""
    for max_rows, c in tiers:
        if rows <= max_rows:
            return c
    return tiers[-1][1]


def with_decode_configs(decode: dict, tables: dict | None = None) -> dict:
    """Tables by rows with their up-to-16-rows entry replaced by ``decode`` {role: config key}.

    For tuners that time one row (specpilot bench engine): the row buckets above 16 keep the
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


def role_layout(role: str) -> tuple[bool, bool, bool]:
    """(norm before, residual epilogue, SwiGLU epilogue) of a matmul role, as the dense step runs it
    (:meth:`~specpilot.fastpath.dense.FastTarget._layer`).

    Raises SpecpilotError for an unknown role."""
    layouts = {"qkv": (True, False, False), "o": (False, True, False), "gate_up": (True, False, True),
               "down": (False, True, False), "lm_head": (True, False, False)}
    if role not in layouts:
        raise SpecpilotError(f"unknown linear role {role!r}; roles: {', '.join(LINEAR_ROLES)}")
    return layouts[role]

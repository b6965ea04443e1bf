"""FastTarget's checked cuBLAS (issue 15): a batched verify's matmul runs cuBLAS only where every
row is bit-equal to the decode kernel's, else the table's Triton entry, else the decode config.

The GPU half (real cuBLAS against the Triton kernels, whole steps bit-equal) runs in
specpilot bench verify; here the selection and routing logic is checked on the CPU with a
stand-in for the kernels whose outputs the test controls.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _fast():
    from specpilot.fastpath.dense import FastTarget
    from specpilot.models.config import TargetConfig
    from specpilot.models.qwen3 import Transformer
    from specpilot.models.random_checkpoint import fill_random_

    cfg = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return FastTarget(fill_random_(Transformer(cfg), 0).eval())


class Kernels:
    """Stand-in for FastTarget._apply: the exact product, with chosen options perturbed in one
    element (a different reduction order) or failing; and a timing table per option."""

    def __init__(self, differs=(), fails=(), ms=None):
        self.differs, self.fails, self.ms = set(differs), set(fails), ms or {}
        self.calls = []

    @staticmethod
    def key(cfg):
        return cfg if isinstance(cfg, str) else cfg.key()

    def name(self, cfg, x) -> str:
        """The option a call stands for (subclasses tell apart calls of one config)."""
        return self.key(cfg)

    def apply(self, cfg, x, w, out, ws, norm=None, residual=None, swiglu=False):
        k = self.name(cfg, x)
        self.calls.append((k, x.shape[0], out.shape[0]))
        if k in self.fails:
            raise RuntimeError(f"{k} cannot run this shape")
        y = (x.double() @ w.double().t())
        if residual is not None:
            y = y + residual.double()
        y = y.to(out.dtype)
        if k in self.differs:
            y[3, 1] = torch.nextafter(y[3, 1], torch.tensor(float("inf"), dtype=y.dtype))
        out.copy_(y)
        return out

    def time(self, cfg, fn):
        fn()
        return self.ms[self.key(cfg)]


def _select(fast, kern, M=80, residual=False, pads=()):
    fast._apply = kern.apply
    fast._time = kern.time
    w = fast.model.model.layers[0].self_attn.o_proj.weight if residual else fast.model.model.layers[0].fused_qkv
    role = "o" if residual else "qkv"
    key = (role, M, tuple(w.shape), False, residual, False, pads)
    return fast._select(key, fast.config_for(role, M), w, None, residual, False), fast.selection


def test_cublas_is_chosen_only_when_bit_equal_and_faster():
    fast = _fast()
    table = fast.config_for("qkv", 80).key()
    kern = Kernels(ms={table: 2.0, "cublas": 1.0})
    chosen, sel = _select(fast, kern)
    assert chosen == "cublas"
    rec = sel["qkv:80:" + "x".join(map(str, fast.model.model.layers[0].fused_qkv.shape))]
    assert rec["chosen"] == "cublas" and rec["options"]["cublas"] == {"bit_equal": True, "ms": 1.0}
    assert rec["decode_config"] == fast.config_for("qkv", 1).key()
    # slower but exact: the table's Triton entry wins
    fast = _fast()
    chosen, _ = _select(fast, Kernels(ms={table: 1.0, "cublas": 3.0}))
    assert chosen != "cublas" and chosen.key() == table


def test_an_inexact_cublas_is_never_chosen_however_fast():
    fast = _fast()
    table = fast.config_for("o", 80).key()
    chosen, sel = _select(fast, Kernels(differs={"cublas"}, ms={table: 5.0, "cublas": 0.1}), residual=True)
    assert chosen.key() == table
    rec = next(iter(sel.values()))
    assert rec["options"]["cublas"] == {"bit_equal": False, "ms": None}


def test_no_exact_option_falls_back_to_the_decode_config():
    fast = _fast()
    table = fast.config_for("qkv", 80).key()
    chosen, sel = _select(fast, Kernels(differs={table}, fails={"cublas"}, ms={table: 1.0}))
    assert chosen.key() == fast.config_for("qkv", 1).key()
    rec = next(iter(sel.values()))
    assert rec["options"][table]["bit_equal"] is False and "error" in rec["options"]["cublas"]


def test_pick_routes_prefill_decode_and_capture(monkeypatch):
    from specpilot.fastpath import tables as graphs

    fast = _fast()
    kern = Kernels(ms={fast.config_for("qkv", 80).key(): 2.0, "cublas": 1.0})
    fast._apply, fast._time = kern.apply, kern.time
    w = fast.model.model.layers[0].fused_qkv
    x = lambda M: torch.zeros(M, w.shape[1])  # noqa: E731
    # the CPU never runs cuBLAS: the table's entry
    assert fast._pick("qkv", x(80), w, None, None, False) == fast.config_for("qkv", 80)
    monkeypatch.setattr(fast, "_on_gpu", lambda t: True)
    assert fast._pick("qkv", x(63), w, None, None, False) == fast.config_for("qkv", 63)  # bandwidth-bound: as tuned
    with fast.prefilling():
        assert fast._pick("qkv", x(graphs.PREFILL_CUBLAS_MIN_ROWS), w, None, None, False) == "cublas"
        assert fast._pick("qkv", x(8), w, None, None, False) == fast.config_for("qkv", 8)
    assert not fast._prefilling
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fast._pick("qkv", x(80), w, None, None, False) == fast.config_for("qkv", 80)  # no probe in a capture
    assert not fast._chosen
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert fast._pick("qkv", x(80), w, None, None, False) == "cublas"
    n = len(kern.calls)
    assert fast._pick("qkv", x(80), w, None, None, False) == "cublas" and len(kern.calls) == n  # probed once
    fast.set_configs({"qkv": "bn16-bk512-w4-s3"})  # new tables: probe again
    assert not fast._chosen and not fast.selection
    fast.checked_cublas = False
    assert fast._pick("qkv", x(80), w, None, None, False).key() == "bn16-bk512-w4-s3"


class PaddedKernels(Kernels):
    """cuBLAS whose rows are exact only when it runs on more rows than the step has (its algorithm
    choice depends on the shape): M rows perturbed, M + 16 exact."""

    def __init__(self, M, **kw):
        super().__init__(**kw)
        self.M = M

    def name(self, cfg, x) -> str:
        k = self.key(cfg)
        return "cublas-exact-rows" if k == "cublas" and x.shape[0] == self.M else k


def test_padded_cublas_is_chosen_where_only_more_rows_are_exact():
    from specpilot.fastpath.tables import PaddedCublas

    fast = _fast()
    table = fast.config_for("o", 80).key()
    kern = PaddedKernels(80, differs={"cublas-exact-rows"}, ms={table: 3.0, "cublas": 1.0, "cublas@96": 1.5,
                                                              "cublas@112": 2.0})
    chosen, sel = _select(fast, kern, residual=True, pads=(96, 112))
    assert chosen == PaddedCublas(96)
    rec = next(iter(sel.values()))
    assert rec["chosen"] == "cublas@96" and rec["options"]["cublas"]["bit_equal"] is False
    assert rec["options"]["cublas@96"] == {"bit_equal": True, "ms": 1.5}
    # the probe ran the padded option over the padded rows, and compared the first 80
    assert ("cublas", 96, 96) in kern.calls


def test_linear_runs_the_step_rows_and_padded_cublas_over_the_slack(monkeypatch):
    from specpilot.fastpath.tables import CUBLAS_PAD_ROWS, PaddedCublas

    fast = _fast()
    kern = PaddedKernels(80, differs={"cublas-exact-rows"})
    fast._apply = kern.apply
    monkeypatch.setattr(fast, "_on_gpu", lambda t: True)
    w = fast.model.model.layers[0].self_attn.o_proj.weight
    slack = max(CUBLAS_PAD_ROWS)
    assert fast._slack(80) == slack and fast._slack(63) == 0
    import types

    ws = types.SimpleNamespace(rows=80, xn=torch.zeros(80 + slack, w.shape[1]), gu=None)
    x = torch.randn(80 + slack, w.shape[1])
    out = torch.randn(80 + slack, w.shape[0])
    key = ("o", 80, tuple(w.shape), False, True, False, (96, 112))
    fast._chosen[key] = PaddedCublas(96)
    fast._linear("o", x, w, out, ws, residual=out)
    assert kern.calls[-1] == ("cublas", 96, 96)  # over the step's 80 rows and 16 of slack
    fast._chosen[key] = fast.config_for("o", 80)
    fast._linear("o", x, w, out, ws, residual=out)
    assert kern.calls[-1] == (fast.config_for("o", 80).key(), 80, 80)  # the step's rows only

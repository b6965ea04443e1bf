"""``specpilot bench verify --part widths`` times the steps it names (issue 63: its token buffer was
64 wide, so the steps named 1x128 and 1x256 were 64-token steps)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from specpilot.bench import verify
from specpilot.errors import SpecpilotError

V = 11


class FakeStep:
    """A step that records the tokens of each call and returns logits of their shape (or ``cut``
    columns fewer: a step that drops tokens)."""

    def __init__(self, cut: int = 0):
        self.calls, self.cut, self.selection = [], cut, {}

    def forward(self, tokens, start, rows):
        self.calls.append((tuple(tokens.shape), int(start[0]), rows))
        return (torch.zeros(tokens.shape[0], tokens.shape[1] - self.cut, V),)


class FakeRun:
    def __init__(self):
        self.device, self.cuda, self.dry, self.R, self.timed = torch.device("cpu"), False, True, {}, []

    def graph_s(self, fn):
        n = len(STEP.calls)
        fn()
        self.timed.append(STEP.calls[n][0])  # what the timed call ran
        return 1e-3 * STEP.calls[n][0][1]

    def save(self):
        pass


STEP = FakeStep()


def widths(monkeypatch, shapes, step):
    global STEP
    STEP = step
    monkeypatch.setattr(verify.E, "fastpath", lambda: (SimpleNamespace(FastTarget=lambda m, cfg, checked_cublas: step),))
    monkeypatch.setattr(verify.E, "weight_bytes_per_step", lambda m, rows: 1)
    monkeypatch.setattr(verify.E, "kv_bytes_per_step", lambda m, rows, ctx: 1)
    cache = SimpleNamespace(k=torch.zeros(2), v=torch.zeros(2))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=V), cache=cache,
                            setup_cache=lambda B, S: setattr(model, "S", S))
    args = argparse.Namespace(shapes=shapes, context=40, checked_cublas="off", kernel_configs=None)
    w = verify.Widths(FakeRun(), args, model)
    w.bw = 1.0
    monkeypatch.setattr(w, "invariance", lambda fast: {})
    return w, model


def test_widths_times_the_tokens_it_names(monkeypatch):
    w, model = widths(monkeypatch, ["1x1", "1x16", "1x128", "2x256"], FakeStep())
    res = w.measure()
    assert w.run.timed == [(1, 1), (1, 16), (1, 128), (2, 256)]
    assert res["timed_shape"]["default-triton"] == {"1x1": [1, 1], "1x16": [1, 16], "1x128": [1, 128],
                                                    "2x256": [2, 256]}
    assert res["step_ms"]["default-triton"]["1x128"] == 128 and model.S >= 40 + 256
    assert any("1x128 128.000" in ln for ln in verify.table(w.run.R))


def test_widths_refuses_a_step_that_did_not_run_its_tokens(monkeypatch):
    w, _ = widths(monkeypatch, ["1x128"], FakeStep(cut=64))
    with pytest.raises(SpecpilotError, match="1x128: the step ran"):
        w.measure()
    R = {"widths": {"step_ms": {"d": {"1x64": 1.0, "1x128": 1.0}}, "timed_shape": {"d": {"1x64": [1, 64]}},
                    "x_ar": {"d": {}}, "mbu": {}, "invariance": {}}}
    line = verify.table(R)[0]  # a result without its checked shape is not printed
    assert "1x64" in line and "1x128" not in line

"""CUDA graphs of the target's steps: one captured graph per step shape (:class:`StepGraphs`).

On a CUDA device the runner replays one captured CUDA graph per step shape instead of launching
hundreds of kernels from Python (gpt-fast gets the same effect from
``torch.compile(mode="reduce-overhead")``; capturing by hand costs well under a second per shape
instead of minutes of compilation): one graph per (batch, block length T, captured layers,
tree or chain, state write): T = 1 for AR decode, the block size for chain verification. Inputs:
static token [B, T] and start [B] buffers (and a tree's ancestor inputs); outputs: static logits
[B, T, vocab] and captured hidden states [B, T, F] (valid until the next replay of the same shape).
Prefill (variable length) runs without a graph. No step synchronizes the host: every input lives on
the device and is copied into the static buffers by the stream. Graphs are keyed on the state's
storage, and :meth:`Transformer.setup_cache` reuses a cache of the same shape, so graphs survive from
one batch of requests to the next.

The step a graph captures is the backend's: the Triton dense step, the Triton family step, or the
eager forward (``kernels`` "torch": cuBLAS, SDPA) captured as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SpecpilotError
from ..models.layers import chain_ancestors
from ..models.qwen3 import Transformer


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
    """Captured target steps of one model (see the module docstring): the step of ``fast`` (a Triton
    step) or, without one, the model's eager forward. Built by the backend, one per model."""

    def __init__(self, model: Transformer, fast=None):
        self.model = model
        self.fast = fast  # the Triton step (FastTarget / FastFamilyTarget), or None: the eager forward
        self.kernels = "torch" if fast is None else "triton"
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

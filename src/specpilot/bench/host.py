"""``specpilot bench host``: the engine's host work per decode step, the target's forward replaced by
a stand-in that computes nothing (issue 54: host time <= 0.10 ms for a chain at c1, 0.15 ms for a
63-node lattice tree at c1, 0.30 ms for a chain at c16).

Host time is the CPU's critical path between device launches. On a GPU under CUDA graphs the
target's step is one graph replay whose launch costs microseconds and whose device time overlaps
nothing the host does (the host waits for the acceptance); everything else a step does on the host
is what this benchmark times: the engine's real serving loop (:class:`~specpilot.engine.scheduler.Scheduler`,
profiling off, as ``specpilot serve`` runs it), the replay drafter's proposals (chains of the
``study_stock`` profile, lattice trees of the measured ``tiny_dflash2_lattice`` profile), the
runner's verify inputs (a tree's ancestor inputs), the acceptance, the commit (a tree's path
compaction) and the bookkeeping, on the CPU with a tiny target (its cache ops cost what their
launches cost). The stand-in (:class:`OracleSteps`) returns logits whose argmax is each row's
reference continuation at every node, so the replay drafter's profile drives the acceptance
exactly as on the real target (every output equals the reference: checked); its own time is
measured and left out of the host time.

Cells: AR at c1 and c16 first (the baseline: the AR engine's host work through the same loop),
then the chain at c1, the 63-node lattice tree at c1 (its parents tensor static, as the replay
proposes it), the chain at c16 and the same tree as a new tree every step (``tree63_dynamic_c1``:
a new parents tensor with a depth bound, as the DFlash2 lattice proposer makes it), then the batched
chain step per target family (issue 62: ``chain_c16_hybrid``, the Gated DeltaNet hybrid, whose runner
records each verify and commits the recurrent state every step, the stand-in's commit being device
work only; ``chain_c16_muse``, Muse-Glimmer's sliding-window rings), each after AR of its family at
c16, each also as a multiple of AR's at its concurrency and family (``x_ar``: the machine's load cancels). Each cell: the median over
``--repeats`` interleaved runs of ``--new`` tokens per request of the host milliseconds per step,
on this thread's CPU time (``--clock cpu``: a busy shared machine inflates the wall clock with time
spent descheduled; ``--clock wall`` on a quiet one), and from one more run the parts (``propose``:
the drafter's proposal, a tree's build included; ``verify_inputs``: the runner's verify around the
step (tree inputs); ``accept``: the acceptance decision and its host read; ``commit``: the runner's
commit (path compaction) and the drafter's observation; ``bookkeeping``: the rest of the loop),
each call wrapped with the clock (whose reads add their own cost to that run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..drafters.lattice_profile import LatticeReplayProposer
from ..drafters.proposal import Proposal
from ..drafters.replay import ReplayProposer, load_profile
from ..engine import verify as V
from ..engine.backend import Backend
from ..engine.runner import TargetRunner
from ..engine.scheduler import Request, Scheduler, slots_needed
from . import _engine as E
from ._common import Run, add_common, fmt

CHAIN_PROFILE, LATTICE_PROFILE = "study_stock", "tiny_dflash2_lattice"
# (cell, concurrency, proposer kind, tree nodes[, target family]); the AR cells first: the baseline. The
# family cells (issue 62): the batched chain step's host work on the Gated DeltaNet hybrid (the runner's
# recurrent commit: note_verify, commit_recurrent) and on Muse-Glimmer (sliding-window rings), each
# against AR of the same family at c16
CELLS = (("ar_c1", 1, "ar", 0), ("ar_c16", 16, "ar", 0), ("chain_c1", 1, "chain", 0),
         ("tree63_c1", 1, "lattice", 63), ("chain_c16", 16, "chain", 0), ("tree63_dynamic_c1", 1, "dynamic", 63),
         ("ar_c16_hybrid", 16, "ar", 0, "hybrid"), ("chain_c16_hybrid", 16, "chain", 0, "hybrid"),
         ("ar_c16_muse", 16, "ar", 0, "muse"), ("chain_c16_muse", 16, "chain", 0, "muse"))
FAMILIES = {"dense": "tiny", "hybrid": "tiny-hybrid", "muse": "tiny-muse"}  # family -> the stand-in's model shape
BARS_MS = {"chain_c1": 0.10, "tree63_c1": 0.15, "chain_c16": 0.30}
PARTS = ("propose", "verify_inputs", "accept", "commit")
VOCAB = 64  # the stand-in's vocabulary: its logits' argmax costs what a launch costs
# the clock: this thread's CPU time (the host work itself, robust on a shared machine; ``--clock
# wall`` for the wall clock, which a busy machine inflates with time spent descheduled)
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
now = CLOCKS["cpu"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "host")
    p.add_argument("--new", type=int, default=256, help="new tokens per request")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="runs per cell (median)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="thread CPU time (default) or wall clock")
    p.add_argument("--cells", nargs="+", default=[c[0] for c in CELLS], help="cells to run (default all)")


class OracleSteps:
    """A stand-in of the target's steps (:class:`~specpilot.fastpath.graphs.StepGraphs` and its
    Triton step): no model, logits [B, T, vocab] one-hot at each row's reference continuation.

    Row b's reference ``refs[b]`` is its AR output (first token included) after a prompt of
    ``prompt_lens[b]`` tokens; a block at committed length L whose node t sits at depth d (the
    anchor, output token L - P, at depth 0) gets the argmax ``refs[b][L - P + d + 1]``, what the
    real target computes for a node on the reference path (off-path nodes are never reached by the
    acceptance). A prefill's last position gets ``refs[b][0]``. Device tensors only: no host read.
    """

    def __init__(self, model, refs: list[list[int]], prompt_lens: list[int], vocab: int):
        dev = model.lm_head.weight.device
        self.model, self.vocab, self.fast = model, vocab, self
        width = max(map(len, refs)) + 300
        self.R = torch.tensor([r + [r[-1]] * (width - len(r)) for r in refs], dtype=torch.long, device=dev)
        self.P = torch.tensor(prompt_lens, dtype=torch.long, device=dev)
        self.seconds = 0.0  # time spent in the stand-in (left out of the host time)
        self.calls = 0
        self.recurrent_commits = 0  # commit_recurrent calls (a recurrent target's runner: one per step)

    def _logits(self, R: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        tgt = R.gather(1, idx.clamp(0, R.shape[1] - 1))
        self.calls += 1
        return torch.zeros(*tgt.shape, self.vocab, device=tgt.device).scatter_(2, tgt[..., None], 1.0)

    def run(self, tokens: torch.Tensor, start: torch.Tensor, capture=(), tree=None, write: bool = False):
        """A verify / decode step: (logits [B, T, vocab], None)."""
        t = now()
        T = tokens.shape[1]
        depth = tree[1].long() if tree is not None else torch.arange(T, device=tokens.device)[None, :]
        out = self._logits(self.R, (start - self.P)[:, None] + depth + 1)
        self.seconds += now() - t
        return out, None

    def forward(self, tokens, start, capture=(), tree=None, rows=None, last_only=False, write=False):
        """A prefill of one row (``rows``; the runner's row prefill): (logits [1, 1, vocab], None)."""
        b = rows.start if rows is not None else 0
        return self._logits(self.R[b:b + 1], torch.zeros(1, 1, dtype=torch.long, device=tokens.device)), None

    def note_verify(self, B: int, T: int, n_capture: int) -> None:
        """The family step's record of a verify (a recurrent target's runner calls it): nothing to keep."""

    def commit_recurrent(self, counts: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """The family step's recurrent commit: device work (two kernel launches on the GPU), none here."""
        self.recurrent_commits += 1


class PartClock:
    """Seconds (the module's clock) spent in wrapped calls, by part (nested calls are not double
    counted: a call inside a timed call counts for the outer part only)."""

    def __init__(self):
        self.s = dict.fromkeys(PARTS, 0.0)
        self.depth = 0

    def wrap(self, part: str, fn):
        def timed(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t = now()
            try:
                return fn(*a, **k)
            finally:
                self.s[part] += now() - t
                self.depth -= 1
        return timed


def _requests(B: int, prompt_len: int, new: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist(), new,
                    torch.randint(0, VOCAB, (new,), generator=g).tolist()) for _ in range(B)]


class DynamicLatticeReplay(LatticeReplayProposer):
    """The lattice replay proposing each step's tree as a new parents tensor with its depth bound,
    as the DFlash2 lattice proposer (:mod:`specpilot.drafters.lattice`) does: the verify builds the
    tree's inputs and the acceptance runs on the device every step."""

    def proposal(self, handle, last):
        p = super().proposal(handle, last)
        return Proposal(p.tokens, p.parents.clone(), max_depth=self.block_size - 1)


def _proposer(kind: str, nodes: int, refs: list[list[int]]):
    """The replay drafter of a cell (None: AR)."""
    if kind == "chain":
        return ReplayProposer(refs, load_profile(CHAIN_PROFILE), VOCAB)
    if kind in ("lattice", "dynamic"):
        cls = LatticeReplayProposer if kind == "lattice" else DynamicLatticeReplay
        return cls(refs, load_profile(LATTICE_PROFILE), VOCAB, nodes=nodes)
    return None


def _instrument(clk: PartClock, runner, prop) -> None:
    """Wrap the step's parts with ``clk`` (``accept``: :func:`specpilot.engine.verify.decide`, put
    back by the caller)."""
    if prop is not None:
        prop.propose = clk.wrap("propose", prop.propose)
        prop.observe = clk.wrap("commit", prop.observe)
    runner.verify = clk.wrap("verify_inputs", runner.verify)
    runner.commit = clk.wrap("commit", runner.commit)
    V.decide = clk.wrap("accept", V.decide)


def run_cell(model, B: int, kind: str, nodes: int, new: int, prompt_len: int, seed: int,
             parts: bool = False) -> dict:
    """One serving run of B requests (B slots, no refills) with the stand-in target: its host
    milliseconds per decode step (the loop's time less the stand-in's), and whether every output
    equals its reference. ``parts``: the step's parts timed too (:class:`PartClock`; each clock
    read adds its own cost, so the total of such a run is not reported)."""
    reqs = _requests(B, prompt_len, new, seed)
    oracle = OracleSteps(model, [r.reference for r in reqs], [prompt_len] * B, VOCAB)
    path = "triton-dense" if model.config.is_dense else "triton-family"
    backend = Backend(model, path, "host benchmark: a stand-in target (no model)", False, "triton", oracle)
    prop = _proposer(kind, nodes, [r.reference for r in reqs])
    width = prop.verify_width if prop is not None else 1
    runner = TargetRunner(model, B, slots_needed(reqs, width, B > 1), backend=backend, verify_width=width)
    sched = Scheduler(runner, prop, profile=False)
    clk, decide, loop = PartClock(), V.decide, {}
    if parts:
        _instrument(clk, runner, prop)

    def timed_loop(fn):
        def run(*a, **k):  # the decode loop only: the prefill and the set-up are not steps
            oracle.seconds = 0.0
            t = now()
            fn(*a, **k)
            loop["s"], loop["stand_in_s"] = now() - t, oracle.seconds
        return run

    sched._loop, sched._loop_ar = timed_loop(sched._loop), timed_loop(sched._loop_ar)
    try:
        rows = sched.run(reqs)
    finally:
        V.decide = decide
    steps, host = sched.steps, loop["s"] - loop["stand_in_s"]
    out = {"batch": B, "kind": kind, "nodes": nodes, "steps": steps, "loop_s": loop["s"],
           "stand_in_s": loop["stand_in_s"], "host_ms_per_step": host / steps * 1e3,
           "recurrent_commits": oracle.recurrent_commits,
           "tau": statistics.mean(sum(r.committed_per_step) / max(1, len(r.committed_per_step)) for r in rows),
           "outputs_equal_reference": all(r.output_ids == q.reference for r, q in zip(rows, reqs))}
    if parts:
        p = dict(clk.s)
        p["verify_inputs"] -= loop["stand_in_s"]  # the stand-in's time is not host work
        out["parts_ms_per_step"] = {k: v / steps * 1e3 for k, v in p.items()}
        out["parts_ms_per_step"]["bookkeeping"] = (host - sum(p.values())) / steps * 1e3
    return out


def measure(run: Run, args: argparse.Namespace) -> dict:
    """Every cell of ``--cells`` (the AR baseline first): ``--repeats`` runs each, interleaved, for
    the host time (median), then one run each with the parts timed."""
    cells = [(*c, "dense")[:5] for c in CELLS if c[0] in args.cells]
    models = {f: E.dry_target(FAMILIES[f], sizes={**E.DRY_SIZES, "vocab_size": VOCAB}, seed=args.seed)
              for f in dict.fromkeys(c[4] for c in cells)}
    runs: dict[str, list[dict]] = {c[0]: [] for c in cells}
    for rep in range(args.repeats):
        for name, B, kind, nodes, fam in cells:
            runs[name].append(run_cell(models[fam], B, kind, nodes, args.new, args.prompt_len, args.seed + rep))
    out = {}
    for name, B, kind, nodes, fam in cells:
        rs = runs[name]
        med = sorted(rs, key=lambda r: r["host_ms_per_step"])[len(rs) // 2]
        part = run_cell(models[fam], B, kind, nodes, args.new, args.prompt_len, args.seed, parts=True)
        out[name] = {"host_ms_per_step": med["host_ms_per_step"], "runs_ms": [r["host_ms_per_step"] for r in rs],
                     "parts_ms_per_step": part["parts_ms_per_step"], "parts_run_ms": part["host_ms_per_step"],
                     "steps": med["steps"], "tau": med["tau"], "batch": B, "nodes": nodes, "family": fam,
                     "recurrent_commits": med["recurrent_commits"],
                     "stand_in_ms_per_step": med["stand_in_s"] / med["steps"] * 1e3,
                     "outputs_equal_reference": all(r["outputs_equal_reference"] for r in rs + [part])}
        ar = out.get(f"ar_c{B}" + ("" if fam == "dense" else f"_{fam}"))
        if ar is not None:  # against the AR baseline at the same concurrency, same run (load cancels)
            out[name]["x_ar"] = out[name]["host_ms_per_step"] / ar["host_ms_per_step"]
        if name in BARS_MS:
            out[name]["bar_ms"] = BARS_MS[name]
        run.R["cells"] = out
        run.save()
    return out


def table(cells: dict) -> list[str]:
    L = ["host ms per step (stand-in target; parts: " + ", ".join(PARTS + ("bookkeeping",)) + ")"]
    for name, c in cells.items():
        bar = c.get("bar_ms")
        verdict = f"  bar <= {bar:.2f}: {'met' if c['host_ms_per_step'] <= bar else 'MISSED'}" if bar else ""
        parts = " ".join(f"{k} {fmt(v, '{:.4f}')}" for k, v in c["parts_ms_per_step"].items())
        L.append(f"  {name:<10} {fmt(c['host_ms_per_step'], '{:.4f}')} ms  {fmt(c.get('x_ar'), '{:.2f}')}x AR's  "
                 f"(tau {c['tau']:.2f}, {c['steps']} steps; "
                 f"{parts}; outputs = reference {c['outputs_equal_reference']}){verdict}")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.new, args.repeats = 24, 1
    rn = Run("host", args)
    torch.set_num_threads(1)
    global now
    now = CLOCKS[args.clock]
    rn.R["clock"] = args.clock
    cells = rn.phase("cells", lambda: measure(rn, args))
    return rn.finish(table(cells or {}))

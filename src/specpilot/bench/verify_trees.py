"""The tree part of ``specpilot bench verify``: tree verify steps against the AR step, and their
bit-exact checks against chain verifies (issue 16's bars: 32 / 64 tree nodes <= 1.10x / 1.25x an
AR step at batch 1).

The trees are the engine's "spine + side branches" proposals
(:func:`specpilot.drafters.proposal.spine_tree_parents`; DFlash block B: the anchor and B - 1
drafts are the spine, ``branch`` leaves at each of the first ``depth`` draft positions, hanging
off the spine node before each; width B + branch x min(depth, B - 1)), with the ancestor inputs of
:func:`specpilot.engine.verify.tree_inputs`. Each step runs the drafter's captured target layers
(what the stock engine's verify runs) but the AR step, which captures none (what the AR engine runs).
Each is captured as a CUDA graph, as the runner captures it, and timed over ``--replays`` replays in
``--rounds`` rounds (shapes interleaved, so drift shows as spread).

Issue 54: each lattice tree against the chain of its rows (63 / 127 / 255 nodes against 64 / 128
/ 256 tokens, ``x_chain``; issue 63's bars 1.02x / 1.03x / 1.06x), what the tree adds outside the captured step (its inputs
built from its parents, its acceptance against the chain's; ``host_side_ms``) and, on the GPU,
device time per kernel of each tree and its chain (``--kernels``, after the timings). Each step
keeps every tensor its graph reads (:class:`Step`): a CUDA graph holds addresses, not references.

A side leaf's own K/V sit at its block slot in the tree but at slot start + depth in a chain (and
in AR), so its attention sums its keys in other tiles whenever those slots fall in different
64-key tiles or 128-slot chunks: the checks run at several block starts (``--check-starts``)
chosen so that blocks cross those boundaries, as they do in serving.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from ..drafters.proposal import Proposal
from ..engine.verify import decide
from ..tuning import timing
from . import _engine as E
from ._common import Run, fmt, kernel_profile

# (name, DFlash block B = spine nodes, branch, depth); branch 0 = a chain of B tokens; branch -1 = a
# lattice tree of ``depth`` nodes over B - 1 drafts in the geometry of the packaged measured lattice
# profile (LATTICE_PROFILE's mean nodes per depth; the path form, as the engine runs a lattice tree)
SHAPES = (("chain16", 16, 0, 0), ("chain32", 32, 0, 0), ("chain64", 64, 0, 0), ("chain128", 128, 0, 0),
          ("chain256", 256, 0, 0),
          ("tree32_s16", 16, 2, 8), ("tree61_s16", 16, 3, 15), ("tree64_s16", 16, 4, 12), ("tree64_s32", 32, 2, 16),
          ("lattice63", 12, -1, 63), ("lattice127", 12, -1, 127), ("lattice255", 12, -1, 255))
DRY_SHAPES = (("chain4", 4, 0, 0), ("tree8_s4", 4, 2, 2), ("lattice20", 12, -1, 20))
BARS = {"tree32_s16": 1.10, "tree64_s16": 1.25, "tree64_s32": 1.25,  # issue 16's bar per tree size
        "lattice127": 1.25, "lattice255": 1.60}  # issue 47's
LATTICE_PROFILE = "tiny_dflash2_lattice"
# a tree of N nodes verified against a chain of the same rows (N + 1 with the root): issue 63's bars
# (issue 54's were 1.05x each)
VS_CHAIN = {"lattice63": ("chain64", 1.02), "lattice127": ("chain128", 1.03), "lattice255": ("chain256", 1.06),
            "lattice20": ("chain4", None)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tree part's options."""
    p.add_argument("--replays", type=int, default=200, help="graph replays per round and tree step")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the tree steps' timing")
    p.add_argument("--draws", type=int, default=3, help="random token draws per tree check")
    p.add_argument("--check-starts", type=int, nargs="+", default=[512, 509, 541, 600, 637],
                   help="block starts of the tree checks (blocks across 64-key tiles and 128-slot chunks)")
    p.add_argument("--max-leaves", type=int, default=0, help="side leaves checked per tree and start (0: all)")
    p.add_argument("--kernels", choices=("on", "off"), default="on",
                   help="per-kernel device time of each lattice tree and its chain (CUDA; after the timings)")


@dataclass
class Step:
    """One captured tree / chain step and every tensor it reads or writes (kept alive with it)."""

    run: Callable[[], object]  # a graph replay (CUDA) or the step itself
    tok: torch.Tensor  # static tokens [1, T]
    out: torch.Tensor  # output logits [1, T, V] (a workspace buffer)
    graph: object  # the CUDA graph, or None
    tree: tuple | None  # the tree's inputs (tree_inputs), None for a chain


class Trees:
    """Tree and chain steps of one target at batch 1 (see the module docstring)."""

    def __init__(self, run: Run, args: argparse.Namespace, model):
        self.run, self.a, self.m = run, args, model
        self.dev = run.device
        if run.dry:
            args.replays, args.rounds, args.draws, args.check_starts, args.max_leaves = 1, 1, 1, [59], 1
        self.fast = E.fastpath()[0].FastTarget(model, checked_cublas=run.cuda)
        n = model.config.num_hidden_layers  # the drafter's captured target layers (a dry run: first, last)
        self.capture = (0, n - 1) if run.dry else tuple(E.drafter_config(args.shape).target_layer_ids)
        S = max(args.context, *args.check_starts) + 384  # room for a 256-node block at every start
        model.setup_cache(1, S)
        g = torch.Generator(device=self.dev).manual_seed(args.seed + 1)
        for buf in (model.cache.k, model.cache.v):  # the context: random K/V, never zeros
            buf.normal_(generator=g)
        self.gen = torch.Generator(device=self.dev).manual_seed(args.seed + 2)
        self.start = torch.full((1,), args.context, dtype=torch.long, device=self.dev)
        self.steps: dict[str, Step] = {}
        self.R = {"context": args.context, "capture_layers": list(self.capture), "trees": {}, "step_ms": {},
                  "x_ar": {}, "x_chain": {}, "checks": {}, "kernels": {}, "host_side_ms": {}}

    def tokens(self, T: int) -> torch.Tensor:
        return torch.randint(0, self.m.config.vocab_size, (1, T), generator=self.gen, device=self.dev)

    def build(self) -> None:
        """One step per shape (a CUDA graph on the GPU), its static token buffer and its output."""
        for name, B, br, d in [("ar", 1, 0, 0)] + list(DRY_SHAPES if self.run.dry else SHAPES):
            tree = None
            if br < 0:  # a lattice tree: built as the engine builds one that changes every step
                par, spine = E.shape_parents(E.lattice_of(E.load_profile(LATTICE_PROFILE)).counts(d))
                tree = E.tree_inputs(torch.tensor([par], dtype=torch.long, device=self.dev), B - 1)
                self.R["trees"][name] = {"nodes": len(par), "block": B, "lattice": True, "spine": spine,
                                         "parents": par}
            elif br:
                par = E.spine_tree_parents(B - 1, br, d)
                tree = E.tree_inputs(torch.tensor([par], dtype=torch.long, device=self.dev))
                self.R["trees"][name] = {"nodes": len(par), "block": B, "branch": br, "depth": min(d, B - 1),
                                         "side_leaves": len(par) - B, "parents": par}
            tok = self.tokens(len(self.R["trees"][name]["parents"]) if br else B)
            cap = () if name == "ar" else self.capture

            def fn(tok=tok, tree=tree, cap=cap):
                return self.fast.forward(tok, self.start, cap, tree=tree)[0]

            out = fn()  # the workspace the step (and its graph) writes
            g = self.graph(fn) if self.run.cuda else None
            # the step keeps every tensor its graph reads: a CUDA graph holds their addresses, not
            # references, and a tree's inputs freed after the capture were reused by later
            # allocations (token ids read as depths: RoPE rows far past the table, an illegal
            # memory access at the first replay; issue 54)
            self.steps[name] = Step(g.replay if g is not None else fn, tok, out, g, tree)

    @staticmethod
    def graph(fn):
        """A CUDA graph of ``fn`` (:func:`timing.capture_graph`; a CPU test stands in its own)."""
        return timing.capture_graph(fn)

    def replay(self, name: str) -> torch.Tensor:
        """Run step ``name`` once and return its logits [T, vocab] (a copy)."""
        st = self.steps[name]
        st.run()
        return st.out[0].clone()

    def times(self) -> None:
        rounds = {name: [] for name in self.steps}
        for r in range(self.a.rounds):
            for name in (list(self.steps) if r % 2 == 0 else list(reversed(self.steps))):
                rounds[name].append(self.run.median_s(self.steps[name].run, self.a.replays) * 1e3)
        ar = statistics.median(rounds["ar"])
        for name, v in rounds.items():
            self.R["step_ms"][name] = {"ms": statistics.median(v), "rounds_ms": v}
            self.R["x_ar"][name] = statistics.median(v) / ar
        for name, (chain, _) in VS_CHAIN.items():
            if name in self.R["step_ms"] and chain in self.R["step_ms"]:
                self.R["x_chain"][name] = self.R["step_ms"][name]["ms"] / self.R["step_ms"][chain]["ms"]
        length = self.start.clone()
        for P in (16, 32):  # the commit's compaction of an accepted path of P nodes of a 64-node block
            path = torch.tensor([[0] + list(range(64 - P + 1, 64))], dtype=torch.long, device=self.dev)
            counts = torch.full((1,), P, dtype=torch.long, device=self.dev)
            ms = self.run.median_s(lambda: E.compact_path_(self.m.cache, length, counts, path), 50) * 1e3
            self.R["step_ms"][f"compact_path_P{P}"] = {"ms": ms, "eager": True}

    def check(self, name: str, info: dict) -> dict:
        """Spine vs the chain of the spine (each draw) and side leaves vs their path chains (first
        draw), bit for bit, at every check start."""
        B, par = info["block"], info["parents"]
        if info.get("lattice"):  # no contiguous spine: its spine, its last nodes and every 16th, as leaves
            chain, B = None, 0
            leaves = sorted(set(info["spine"] + list(range(len(par) - 3, len(par))) + list(range(1, len(par), 16))))
        else:
            chain = next(n for n, b, br, _ in (DRY_SHAPES if self.run.dry else SHAPES) if b == B and not br)
            leaves = list(range(B, len(par)))
        if self.a.max_leaves:  # the first leaf and the deepest ones
            leaves = leaves[:1] + leaves[::-1][:self.a.max_leaves - 1]
        res = {"spine_vs": chain, "starts": self.a.check_starts, "per_start": {}}
        for st in self.a.check_starts:
            self.start.fill_(st)  # the captured steps read this buffer
            ps = {"spine_bit_equal": True, "spine_max_abs_diff": 0.0, "leaves_checked": 0, "leaves_bit_equal": 0,
                  "leaf_max_abs_diff": 0.0, "tree_logits_finite": True}
            for draw in range(self.a.draws):
                tok = self.tokens(len(par))
                self.steps[name].tok.copy_(tok)
                lt = self.replay(name)
                if chain is not None:
                    self.steps[chain].tok.copy_(tok[:, :B])
                    lc = self.replay(chain)
                    ps["spine_bit_equal"] &= bool(torch.equal(lt[:B], lc))
                    ps["spine_max_abs_diff"] = max(ps["spine_max_abs_diff"],
                                                   float((lt[:B].float() - lc.float()).abs().max()))
                ps["tree_logits_finite"] &= bool(torch.isfinite(lt.float()).all())
                for j in (leaves if draw == 0 else ()):
                    path, n = [], j
                    while n >= 0:
                        path.append(n)
                        n = par[n]
                    lp = self.fast.forward(tok[:, path[::-1]].contiguous(), self.start, self.capture)[0][0, -1]
                    ps["leaves_checked"] += 1
                    ps["leaves_bit_equal"] += bool(torch.equal(lp, lt[j]))
                    ps["leaf_max_abs_diff"] = max(ps["leaf_max_abs_diff"], float((lp.float() - lt[j].float()).abs().max()))
            res["per_start"][str(st)] = ps
            timing.log(f"check {name} @ {st}: {ps}")
        self.start.fill_(self.a.context)  # the timed steps run at the context
        for k in ("spine_bit_equal", "tree_logits_finite"):
            res[k] = all(ps[k] for ps in res["per_start"].values())
        for k in ("leaves_checked", "leaves_bit_equal"):
            res[k] = sum(ps[k] for ps in res["per_start"].values())
        for k in ("spine_max_abs_diff", "leaf_max_abs_diff"):
            res[k] = max(ps[k] for ps in res["per_start"].values())
        return res

    def side_work(self) -> None:
        """What a lattice tree's step adds outside the captured step, against its chain's (eager,
        per call): the tree's inputs built from its parents (:func:`tree_inputs` with a depth bound,
        as for a tree that changes every step) and the engine's acceptance decision of each
        (:func:`decide`: the tree's on the host up to 256 nodes, else on the device)."""
        V = self.m.config.vocab_size
        for name, (chain, _) in VS_CHAIN.items():
            info = self.R["trees"].get(name)
            if info is None or chain not in self.steps:
                continue
            par = torch.tensor([info["parents"]], dtype=torch.long, device=self.dev)
            N, T = par.shape[1], self.steps[chain].tok.shape[1]
            lt = torch.randn(1, N, V, device=self.dev, dtype=self.run.dtype)
            lc = torch.randn(1, T, V, device=self.dev, dtype=self.run.dtype)
            tok, ctok = self.tokens(N), self.tokens(T)
            depth = info["block"] - 1
            prop, tprop = Proposal(ctok), Proposal(tok, par, max_depth=depth)
            self.R["host_side_ms"][name] = {k: self.run.median_s(f, 50) * 1e3 for k, f in (
                ("tree_inputs", lambda: E.tree_inputs(par.clone(), depth)),  # a new tree: built anew
                ("accept_tree", lambda: decide(tprop, lt)),
                ("accept_chain", lambda: decide(prop, lc)))}

    def kernels(self) -> None:
        """Device time per kernel of each lattice tree's step and its chain's (torch.profiler over
        graph replays; after the timings: the profiler slows every later call)."""
        for name, (chain, _) in VS_CHAIN.items():
            for n in (name, chain):
                if n in self.steps and n not in self.R["kernels"]:
                    self.R["kernels"][n] = kernel_profile(self.steps[n].run)

    def measure(self) -> dict:
        self.build()
        for name, info in self.R["trees"].items():  # first: fresh random tokens into every step
            self.R["checks"][name] = self.check(name, info)
            self.run.R["trees"] = self.R
            self.run.save()
        self.times()
        self.side_work()
        if self.run.cuda and self.a.kernels == "on":
            self.run.save()
            self.kernels()
        return self.R


def table(T: dict) -> list[str]:
    """The tree part's lines of the table."""
    if not T.get("step_ms"):
        return []
    L = [f"trees, batch 1, context {T['context']}:  step  nodes  ms  x AR  (issue 16 bar)"]
    for name, v in T["step_ms"].items():
        if name.startswith("compact"):
            L.append(f"  {name:<13} {fmt(v['ms']):>7} ms (eager, at commit)")
            continue
        nodes = T["trees"].get(name, {}).get("nodes") or (1 if name == "ar" else int(name[5:]))
        bar = BARS.get(name)
        verdict = f"<= {bar:.2f}: {'met' if T['x_ar'][name] <= bar else 'MISSED'}" if bar else ""
        L.append(f"  {name:<13} {nodes:>5} {fmt(v['ms']):>7} {fmt(T['x_ar'][name]):>6}  {verdict}")
    for name, x in T.get("x_chain", {}).items():
        chain, bar = VS_CHAIN[name]
        verdict = f"  (issue 63 bar <= {bar:.2f}: {'met' if x <= bar else 'MISSED'})" if bar else ""
        L.append(f"  {name} / {chain}: {fmt(x)}{verdict}")
    for name, h in T.get("host_side_ms", {}).items():
        L.append(f"  {name} outside the step (eager ms): " + ", ".join(f"{k} {fmt(v, '{:.4f}')}" for k, v in h.items()))
    K = T.get("kernels", {})
    for name, (chain, _) in VS_CHAIN.items():
        if name in K and chain in K:
            kt, kc = K[name]["kernels"], K[chain]["kernels"]
            L.append(f"  kernels {name} vs {chain} (ms): sum {fmt(K[name]['kernel_sum_ms'])} vs {fmt(K[chain]['kernel_sum_ms'])}; "
                     + ", ".join(f"{k[:40]} {fmt(kt.get(k, {}).get('ms'), '{:.4f}')}/{fmt(kc.get(k, {}).get('ms'), '{:.4f}')}"
                                 for k in list(dict.fromkeys(list(kt)[:6] + list(kc)[:6]))))
    for name, c in T.get("checks", {}).items():
        L.append(f"  check {name}: spine = {c['spine_vs']} {c['spine_bit_equal']}; leaves = their path chains "
                 f"{c['leaves_bit_equal']}/{c['leaves_checked']} (max abs diff {fmt(c['leaf_max_abs_diff'], '{:.3g}')})")
    return L

#!/usr/bin/env python
"""Tree verification on the GPU against the AR step (issue 16: "8B shape, c1: verify of 32 / 64
tree nodes <= 1.10x / 1.25x an AR step"), in one run.

On a random-weight target of the Qwen3-8B shape (``specpilot.models.random_checkpoint``, bf16, built
on the GPU), batch 1, context ``--context`` (512), through the engine's Triton step
(:class:`~specpilot.engine.graphs.FastTarget` with its defaults: the tables of ``DEFAULT_CONFIGS``,
checked cuBLAS on), each step captured in a CUDA graph the way ``TargetRunner`` captures it:

1. step times (median of ``--replays`` graph replays, each between two CUDA events; two rounds,
   the shapes interleaved, so the spread shows): the AR decode step (1 token, no captured layers:
   what the AR engine runs), chain verifies of 16 / 32 / 64 tokens and tree verifies, each with the
   drafter's captured target layers (what the stock engine's verify runs), as ratios to the AR step.
   The trees are the engine's "spine + side branches" proposals
   (:func:`specpilot.drafters.proposal.spine_tree_parents`; DFlash block B: the anchor and B - 1
   drafts are the spine, ``branch`` leaves at each of the first ``depth`` draft positions, hanging
   off the spine node before it; width B + branch x min(depth, B - 1)), ancestor bits from
   :func:`specpilot.engine.graphs.tree_inputs`:

   - ``tree32_s16``: B 16, branch 2, depth 8 (32 nodes);
   - ``tree61_s16``: B 16, branch 3, depth 15 (61 nodes: the serving variant ``tree_branch`` 3, ``tree_depth`` 15);
   - ``tree64_s16``: B 16, branch 4, depth 12 (64 nodes);
   - ``tree64_s32``: B 32, branch 2, depth 16 (64 nodes);

   plus the commit's compaction of an accepted path (:func:`~specpilot.engine.graphs.compact_path_`,
   eager as in ``TargetRunner.commit``, a path of B nodes);
2. correctness on fresh random tokens, through the same graph replays, at several block starts
   (``--check-starts``: 512, then starts whose block crosses a 64-key tile or a 128-slot attention
   chunk boundary, as blocks do in serving): the tree verify's logits at the spine nodes against a
   chain verify of the spine alone, and each side leaf's logits against a chain verify of its
   root-to-leaf path, bit for bit (max abs differences reported). A leaf's own K/V sit at its block
   slot in the tree but at slot start + depth in the chain (and in AR), so its attention sums its
   keys in other tiles / chunks whenever those slots fall into different ones: at start 512 a
   block of <= 64 nodes lies in one tile, which would hide that (the first H200 run, 2026-12-02,
   checked start 512 alone: all bit-equal, while the serving run's tree cell diverged from AR).

Writes ``tree_verify.json`` under ``--out-dir`` (default $OUT) and prints a table last. On the GPU
machine, from the repository root::

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 gpu_bench/bench_tree_verify.py

``--dry-run``: the tiny shape in fp32 under Triton's CPU interpreter, no graphs, a few calls, smaller
blocks (chains of 4 / 8 / 16, trees ``tree8_s4`` = B 4, branch 2, depth 2 and ``tree16_s8`` = B 8,
branch 2, depth 4): checks the script and the checks' logic; its times mean nothing, and its fp32
logits need not be bit-equal across block lengths (the interpreter's dot is numpy's BLAS, whose
reduction order may depend on the row count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(Path(__file__).resolve().parent)]

from _timing import LOG, T0, capture_graph, event_times, log, wall_times  # noqa: E402

# (name, DFlash block B = spine nodes, branch, depth); branch 0 = a chain of B tokens
SHAPES = (("chain16", 16, 0, 0), ("chain32", 32, 0, 0), ("chain64", 64, 0, 0),
          ("tree32_s16", 16, 2, 8), ("tree61_s16", 16, 3, 15), ("tree64_s16", 16, 4, 12), ("tree64_s32", 32, 2, 16))
# the dry run (Triton's CPU interpreter, ~1 s per tiny step): smaller blocks, the same kinds of shape
DRY_SHAPES = (("chain4", 4, 0, 0), ("chain8", 8, 0, 0), ("chain16", 16, 0, 0),
              ("tree8_s4", 4, 2, 2), ("tree16_s8", 8, 2, 4))
BARS = {"tree32_s16": 1.10, "tree64_s16": 1.25, "tree64_s32": 1.25}  # issue 16's bar per tree size


def tree_parents(block: int, branch: int, depth: int) -> list[int]:
    """The engine's spine + side-branch tree of a DFlash block ``block`` (k = block - 1 drafts)."""
    from specpilot.drafters.proposal import spine_tree_parents

    return spine_tree_parents(block - 1, branch, depth)


class Bench:
    def __init__(self, args):
        import torch

        from specpilot.engine.graphs import FastTarget
        from specpilot.models.random_checkpoint import build_target, drafter_config

        self.torch, self.args = torch, args
        self.cuda = not args.dry_run
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.dt = torch.bfloat16 if self.cuda else torch.float32  # the interpreter has no bf16 constants
        t = time.time()
        self.model = build_target(args.shape, device=self.dev, dtype=self.dt, seed=args.seed)
        self.c = self.model.config
        # the product's step: FastTarget with its default tables (checked cuBLAS on CUDA)
        self.fast = FastTarget(self.model)
        self.capture = tuple(drafter_config(args.shape).target_layer_ids)
        self.S = max(args.context, *args.check_starts) + 128  # room for a 64-node block at every start
        self.model.setup_cache(1, self.S)
        g = torch.Generator(device=self.dev).manual_seed(args.seed + 1)
        for buf in (self.model.cache.k, self.model.cache.v):  # the context: random K/V, never zeros
            buf.normal_(generator=g)
        self.gen = torch.Generator(device=self.dev).manual_seed(args.seed + 2)
        self.start = torch.full((1,), args.context, dtype=torch.long, device=self.dev)
        self.R = {"date": time.strftime("%Y-%m-%d"), "shape": args.shape, "batch": 1, "context": args.context,
                  "dtype": str(self.dt), "dry_run": args.dry_run, "capture_layers": list(self.capture),
                  "replays": args.replays, "rounds": args.rounds, "errors": [], "log": LOG,
                  "trees": {}, "step_ms": {}, "ratio_to_ar": {}, "checks": {}}
        if self.cuda:
            p = torch.cuda.get_device_properties(0)
            self.R["gpu"] = {"name": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
                             "triton": __import__("triton").__version__}
        log(f"target {args.shape} ({self.dt}) built in {time.time() - t:.1f}s; capture layers {self.capture}")
        self.steps = {}  # name -> (fn, static token buffer, tree inputs or None)

    def dump(self):
        out = Path(self.args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        p = out / "tree_verify.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.R, indent=1, default=str))
        tmp.replace(p)

    def tokens(self, T: int):
        return self.torch.randint(0, self.c.vocab_size, (1, T), generator=self.gen, device=self.dev)

    # --- the steps, as the runner replays them ---------------------------------------------------
    def build(self):
        from specpilot.engine.graphs import tree_inputs

        torch = self.torch
        names = [("ar", 1, 0, 0)] + list(DRY_SHAPES if self.args.dry_run else SHAPES)
        for name, B, br, d in names:
            par = None
            if br:
                par = tree_parents(B, br, d)
                T = len(par)
                tree = tree_inputs(torch.tensor([par], dtype=torch.long, device=self.dev))
                self.R["trees"][name] = {"nodes": T, "block": B, "spine_nodes": B, "branch": br,
                                         "depth": min(d, B - 1), "side_leaves": T - B, "parents": par}
            else:
                T, tree = B, None
            tok = self.tokens(T)
            cap = () if name == "ar" else self.capture

            def fn(tok=tok, tree=tree, cap=cap):
                return self.fast.forward(tok, self.start, cap, tree=tree)

            t = time.time()
            if self.cuda:
                # two warm-up calls (compiles, the checked-cuBLAS choice), then the capture; the graph
                # reads ``tok`` / ``tree`` (static inputs) and writes the workspace of its (B, T)
                g = capture_graph(fn)
                self.steps[name] = (g.replay, tok, tree, g)
            else:
                self.steps[name] = (fn, tok, tree, None)
            log(f"step {name}: T={T} {'tree' if br else 'chain'} ready in {time.time() - t:.1f}s")
        if self.cuda and self.fast.selection:
            self.R["checked_cublas_selection"] = {k: v.get("chosen") for k, v in self.fast.selection.items()}

    def replay(self, name: str):
        """Run step ``name`` once (a graph replay on CUDA) and return its logits [T, vocab] (a clone)."""
        run, tok, tree, _ = self.steps[name]
        T = tok.shape[1]
        run()
        ws = self.fast._workspace(1, T, 0 if name == "ar" else len(self.capture))
        return ws.logits[:T].clone()

    # --- times ----------------------------------------------------------------------------------
    def times(self):
        torch = self.torch
        rounds = {name: [] for name in self.steps}
        for r in range(self.args.rounds):
            order = list(self.steps) if r % 2 == 0 else list(reversed(self.steps))
            for name in order:
                run = self.steps[name][0]
                for _ in range(3 if self.cuda else 1):
                    run()
                if self.cuda:
                    torch.cuda.synchronize()
                    ts, _ = event_times(run, self.args.replays)
                else:
                    ts, _ = wall_times(run, self.args.replays)
                rounds[name].append(statistics.median(ts) * 1e3)
        ar = statistics.median(rounds["ar"])
        for name, v in rounds.items():
            ms = statistics.median(v)
            self.R["step_ms"][name] = {"ms": ms, "rounds_ms": v}
            self.R["ratio_to_ar"][name] = ms / ar
        # the commit's compaction of an accepted tree path (eager, as TargetRunner.commit runs it)
        from specpilot.engine.graphs import compact_path_

        length = self.start.clone()
        for P in (16, 32):
            # an accepted path of P nodes of a 64-node block: the root, then the block's last P - 1 nodes
            path = torch.tensor([[0] + list(range(64 - P + 1, 64))], dtype=torch.long, device=self.dev)
            counts = torch.full((1,), P, dtype=torch.long, device=self.dev)
            fn = lambda: compact_path_(self.model.cache, length, counts, path)  # noqa: E731
            for _ in range(3 if self.cuda else 1):
                fn()
            if self.cuda:
                torch.cuda.synchronize()
                ts, _ = event_times(fn, 50)
            else:
                ts, _ = wall_times(fn, 2)
            self.R["step_ms"][f"compact_path_P{P}"] = {"ms": statistics.median(ts) * 1e3, "eager": True}
        self.dump()

    # --- correctness ----------------------------------------------------------------------------
    def checks(self):
        """At each block start of ``--check-starts`` (the first is the timed context, 512: a block of
        <= 64 nodes then lies in one 64-key tile; the others put the block across a tile or a
        128-slot chunk boundary, as in serving, where every start occurs): the tree's spine logits
        vs a chain verify of the spine (each draw), and every side leaf's logits (or
        ``--max-leaves``) vs a chain verify of its root-to-leaf path (first draw), bit for bit."""
        torch = self.torch
        starts = self.args.check_starts
        for name, info in self.R["trees"].items():
            B, par = info["spine_nodes"], info["parents"]
            chain_name = f"chain{B}"
            leaves = list(range(B, len(par)))
            if self.args.max_leaves:  # the first leaf and the deepest ones
                leaves = leaves[:1] + leaves[::-1][:self.args.max_leaves - 1]
            res = {"spine_vs": chain_name, "draws": self.args.draws, "starts": starts, "spine_bit_equal": True,
                   "spine_max_abs_diff": 0.0, "spine_rows_differing": 0, "tree_logits_finite": True,
                   "leaves_checked": 0, "leaves_bit_equal": 0, "leaf_max_abs_diff": 0.0, "per_start": {}}
            for st in starts:
                self.start.fill_(st)  # the captured steps read this buffer
                ps = {"spine_bit_equal": True, "spine_max_abs_diff": 0.0, "leaves_checked": 0,
                      "leaves_bit_equal": 0, "leaf_max_abs_diff": 0.0, "leaves_differing": []}
                for draw in range(self.args.draws):
                    tok = self.tokens(info["nodes"])
                    # the tree, then the spine alone as a chain verify, both through their captured steps
                    self.steps[name][1].copy_(tok)
                    lt = self.replay(name)
                    self.steps[chain_name][1].copy_(tok[:, :B])
                    lc = self.replay(chain_name)
                    ps["spine_bit_equal"] &= bool(torch.equal(lt[:B], lc))
                    ps["spine_max_abs_diff"] = max(ps["spine_max_abs_diff"], float((lt[:B].float() - lc.float()).abs().max()))
                    res["spine_rows_differing"] = max(res["spine_rows_differing"], int((lt[:B] != lc).any(1).sum()))
                    res["tree_logits_finite"] &= bool(torch.isfinite(lt.float()).all())
                    if draw:
                        continue
                    # side leaves vs a chain verify of their root-to-leaf path (the leaf's own K/V
                    # sit at block slot j in the tree, at slot depth(j) in the chain)
                    for j in leaves:
                        path, n = [], j
                        while n >= 0:
                            path.append(n)
                            n = par[n]
                        ptok = tok[:, path[::-1]].contiguous()
                        lp = self.fast.forward(ptok, self.start, self.capture)[0][0, -1]
                        eq = bool(torch.equal(lp, lt[j]))
                        ps["leaves_checked"] += 1
                        ps["leaves_bit_equal"] += eq
                        ps["leaf_max_abs_diff"] = max(ps["leaf_max_abs_diff"], float((lp.float() - lt[j].float()).abs().max()))
                        if not eq:
                            ps["leaves_differing"].append(j)
                res["per_start"][str(st)] = ps
                res["spine_bit_equal"] &= ps["spine_bit_equal"]
                res["spine_max_abs_diff"] = max(res["spine_max_abs_diff"], ps["spine_max_abs_diff"])
                res["leaves_checked"] += ps["leaves_checked"]
                res["leaves_bit_equal"] += ps["leaves_bit_equal"]
                res["leaf_max_abs_diff"] = max(res["leaf_max_abs_diff"], ps["leaf_max_abs_diff"])
                log(f"check {name} @ start {st}: spine vs {chain_name} bit-equal {ps['spine_bit_equal']} "
                    f"(max abs diff {ps['spine_max_abs_diff']:.3g}); leaves vs path chains "
                    f"{ps['leaves_bit_equal']}/{ps['leaves_checked']} bit-equal (max abs diff {ps['leaf_max_abs_diff']:.3g}"
                    + (f"; differing {ps['leaves_differing'][:12]}" if ps["leaves_differing"] else "") + ")")
            self.R["checks"][name] = res
        self.start.fill_(self.args.context)  # the timed steps run at the context
        self.dump()

    def summary(self) -> str:
        R = self.R
        lines = [f"tree verify, {R['shape']} ({R['dtype']}), batch 1, context {R['context']}"
                 + (f", {R['gpu']['name']}" if "gpu" in R else " (dry run: times mean nothing)")]
        if R["step_ms"]:
            lines.append(f"  {'step':12s} {'nodes':>5s} {'ms':>8s} {'x AR':>6s}  rounds ms          bar")
            for name, v in R["step_ms"].items():
                if name.startswith("compact"):
                    lines.append(f"  {name:12s} {'':>5s} {v['ms']:8.3f}        (eager, the commit of a tree step)")
                    continue
                T = R["trees"].get(name, {}).get("nodes") or (1 if name == "ar" else int(name[5:]))
                x = R["ratio_to_ar"][name]
                bar = BARS.get(name)
                verdict = f"<= {bar:.2f}x: {'pass' if x <= bar else 'FAIL'}" if bar and not R["dry_run"] else ""
                rr = "/".join(f"{t:.3f}" for t in v["rounds_ms"])
                lines.append(f"  {name:12s} {T:5d} {v['ms']:8.3f} {x:6.3f}  {rr:17s} {verdict}")
        for name, t in R["trees"].items():
            lines.append(f"  {name}: block {t['block']} (spine), branch {t['branch']}, depth {t['depth']} "
                         f"-> {t['nodes']} nodes ({t['side_leaves']} side leaves)")
        for name, c in R["checks"].items():
            bad = [st for st, ps in c["per_start"].items() if ps["leaves_bit_equal"] < ps["leaves_checked"]]
            lines.append(f"  check {name} (starts {', '.join(map(str, c['starts']))}): spine vs {c['spine_vs']} "
                         f"bit-equal {c['spine_bit_equal']} (max abs diff {c['spine_max_abs_diff']:.3g}, {c['draws']} "
                         f"draws); leaves vs path chains {c['leaves_bit_equal']}/{c['leaves_checked']} bit-equal "
                         f"(max abs diff {c['leaf_max_abs_diff']:.3g}" + (f"; unequal at starts {', '.join(bad)}" if bad else "")
                         + ")")
        if R["errors"]:
            lines.append("errors: " + "; ".join(R["errors"][:10]))
        return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replays", type=int, default=200, help="graph replays per round and step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draws", type=int, default=3, help="random token draws per correctness check")
    ap.add_argument("--check-starts", type=int, nargs="+", default=[512, 509, 541, 600, 637],
                    help="block starts of the correctness checks (the first is the context; the others put the "
                         "block across a 64-key tile or 128-slot chunk boundary)")
    ap.add_argument("--max-leaves", type=int, default=0, help="side leaves checked per tree and start (0: all)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape, fp32, Triton's CPU interpreter")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.shape, args.context, args.replays, args.rounds, args.draws = "tiny", 48, 1, 1, 1
        args.check_starts, args.max_leaves = [48, 59], 2
        sys.path.insert(0, str(REPO / "tests"))
        from triton_interp import patch_interpreter

        patch_interpreter()
    import torch

    torch.set_grad_enabled(False)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    b = Bench(args)
    try:
        b.build()
        b.checks()  # first: fresh random tokens into every captured step
        b.times()
    except Exception as e:  # noqa: BLE001
        import traceback

        b.R["errors"].append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    b.R["wall_s"] = time.time() - T0
    b.dump()
    s = b.summary()
    Path(args.out_dir, "tree_verify_table.txt").write_text(s + "\n")
    print(s)
    return 1 if b.R["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

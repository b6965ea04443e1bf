"""``specpilot bench verify``: batched verify steps and token trees against the AR step, with the
bit-exact checks that make speculative outputs equal AR's.

On a random-weight target of ``--shape`` (default the Qwen3-8B shape, bf16, built on the GPU),
through the engine's Triton step (:class:`FastTarget` with its default tables, checked cuBLAS on
unless ``--checked-cublas off``; ``--kernel-configs`` times a table of your own beside it):

``--part widths`` (1 and 2 below) and ``--part trees`` (3 and 4); both by default:

1. step times (median of CUDA-graph replays, context ~512) for each batch x block of ``--shapes``
   (default 1x1 1x16 1x32 1x64 16x1 16x16 20x1 20x16 24x1 24x16; any T: each step runs once first
   and its tokens and logits are checked to be B x T, ``timed_shape``), as multiples of the AR step
   at the same batch, and the AR steps' MBU (weights + KV read / step / copy bandwidth);
2. batch invariance, bit for bit (``torch.equal`` on logits): a batch's first rows against the
   same rows in smaller batches (T = 16 and 1); a 64-token verify against shorter verifies and 64
   one-token decodes; rows of the 256- and 384-row steps against the row alone (its cache moved
   to row 0), as a verify and as a decode; and the relative error against the eager forward;
3. tree verify steps at batch 1 against the AR step (:mod:`.verify_trees`: the engine's
   spine + side-branch trees and chains, each with the drafter's captured layers), and the
   compaction of an accepted path;
4. each tree's logits at its spine nodes bit-equal to a chain verify of the spine, and each side
   leaf's bit-equal to a chain verify of its root-to-leaf path, at block starts across 64-key tiles
   and 128-slot chunks.

Replaces gpu_bench/bench_verify.py (its tables sweep is the tuner's job now:
``specpilot.tuning.matmul``) and gpu_bench/bench_tree_verify.py.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..errors import SpecpilotError
from ..tuning import timing
from . import _engine as E
from . import verify_trees
from ._common import Run, add_common, fmt

SHAPES = "1x1 1x16 1x32 1x64 16x1 16x16 20x1 20x16 24x1 24x16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "verify")
    p.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape (default qwen3-8b)")
    p.add_argument("--part", choices=("widths", "trees", "all"), default="all")
    p.add_argument("--shapes", nargs="+", default=SHAPES.split(), help="steps to time, BxT (batch x block)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--checked-cublas", choices=("on", "off", "both"), default="on",
                   help="FastTarget's checked cuBLAS (the product default: on)")
    p.add_argument("--kernel-configs", help="JSON {role: config or {max_rows: config}} timed beside the default")
    verify_trees.add_arguments(p)


class Widths:
    """Step times and invariance checks of one or more tables (see the module docstring)."""

    def __init__(self, run: Run, args: argparse.Namespace, model):
        self.run, self.a, self.m = run, args, model
        self.dev = run.device
        self.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
        self.Bmax = max(b for b, _ in self.shapes)
        self.Tmax = max(t for _, t in self.shapes)
        self.S = args.context + max(512, self.Tmax)  # the invariance checks reach context + 304
        self.V = model.config.vocab_size

    def tables(self) -> dict[str, tuple[dict | None, bool]]:
        """name -> (configs, checked cuBLAS) of every step variant to time."""
        checked = {"on": (True,), "off": (False,), "both": (True, False)}[self.a.checked_cublas]
        out = {}
        for c in checked:
            out["default" + ("" if c else "-triton")] = (None, c and self.run.cuda)
        if self.a.kernel_configs:
            with open(self.a.kernel_configs) as f:
                out["given"] = (json.load(f), checked[0] and self.run.cuda)
        return out

    def measure(self) -> dict:
        m, g = self.m, torch.Generator(device=self.dev).manual_seed(2)
        m.setup_cache(self.Bmax, self.S)
        for buf in (m.cache.k, m.cache.v):
            buf.normal_(generator=g)
        # as wide as the widest step timed (the invariance checks read 64 columns)
        self.tok = torch.randint(0, self.V, (self.Bmax, max(64, self.Tmax)), generator=g, device=self.dev)
        res = {"step_ms": {}, "x_ar": {}, "mbu": {}, "invariance": {}, "selection": {}, "timed_shape": {}}
        for name, (cfg, chk) in self.tables().items():
            fast = E.fastpath()[0].FastTarget(m, cfg, checked_cublas=chk)
            res["invariance"][name] = self.invariance(fast)
            timing.log(f"invariance {name}: {json.dumps(res['invariance'][name])}")
            ms = res["step_ms"][name] = {}
            shp = res["timed_shape"][name] = {}
            for B, T in self.shapes:
                ms[f"{B}x{T}"], shp[f"{B}x{T}"] = self.step_ms(fast, B, T)
            res["x_ar"][name] = {k: v / ms[f"{k.split('x')[0]}x1"] for k, v in ms.items() if f"{k.split('x')[0]}x1" in ms}
            res["mbu"][name] = {k: (E.weight_bytes_per_step(m, int(k[:-2])) + E.kv_bytes_per_step(m, int(k[:-2]),
                                    self.a.context)) / (v / 1e3) / self.bw for k, v in ms.items() if k.endswith("x1")}
            res["selection"][name] = {k: v.get("chosen") for k, v in fast.selection.items()}
            timing.log(f"step ms {name}: " + " ".join(f"{k}={v:.3f}" for k, v in ms.items()))
            self.run.R["widths"] = res
            self.run.save()
        return res

    def step_ms(self, fast, B: int, T: int) -> tuple[float, list[int]]:
        """(median ms of one CUDA-graph replay of a B x T step at start = ``--context``, [rows, tokens]
        of the logits it produced): the step runs once first and its tokens and logits are checked
        to be B x T (an issue-63 bug timed 64-token steps under the names 1x128 and 1x256).

        Raises:
            SpecpilotError: the step did not run (or return) B x T tokens.
        """
        start = torch.full((B,), self.a.context, device=self.dev, dtype=torch.long)
        tb = self.tok[:B, :T].contiguous()
        shape = list(fast.forward(tb, start, rows=slice(0, B))[0].shape[:2])
        if list(tb.shape) != [B, T] or shape != [B, T]:
            raise SpecpilotError(f"--shapes {B}x{T}: the step ran {list(tb.shape)} tokens into {shape} logits rows, "
                                 f"not {B} x {T}")
        return self.run.graph_s(lambda: fast.forward(tb, start, rows=slice(0, B))) * 1e3, shape

    def invariance(self, fast) -> dict:
        """The bit-exact checks of one step variant (dry run: a reduced set of the same checks)."""
        m, dev, res, dry = self.m, self.dev, {}, self.run.dry
        tok = self.tok

        def fwd(t, s):  # a batch of b rows runs on the cache's first b rows
            return fast.forward(t.contiguous(), s, rows=slice(0, t.shape[0]))[0].clone()

        smaller = (2, 1) if dry else (24, 17, 16, 4, 2, 1)
        s_all = torch.arange(self.Bmax, device=dev) * 3 + self.a.context - 32
        for T in ((4,) if dry else (16, 1)):
            ref = fwd(tok[:, :T], s_all)
            res[f"subset_T{T}"] = all(torch.equal(fwd(tok[:b, :T], s_all[:b]), ref[:b])
                                      for b in smaller if b < self.Bmax)
        Tm, st = (2 if dry else 64), torch.tensor([self.a.context + 88], device=dev)
        ref = fwd(tok[:1, :Tm], st)
        res["verify_prefixes"] = all(torch.equal(fwd(tok[:1, :T], st), ref[:, :T]) for T in (32, 17, 16, 4, 2, 1) if T < Tm)
        dec = [fwd(tok[:1, t:t + 1], st + t) for t in range(Tm)]
        res["decode_chain_rows_differing"] = sum(not torch.equal(d[:, 0], ref[:, t]) for t, d in enumerate(dec))
        res["decode_chain"] = res["decode_chain_rows_differing"] == 0
        se = torch.full((self.Bmax,), self.a.context + 288, device=dev, dtype=torch.long)
        with torch.inference_mode():  # the eager forward needs the cache's whole batch
            le = m(tok[:, :4 if dry else 16].contiguous(), se, E.chain_ancestors(self.Bmax, 4 if dry else 16, dev))[0]
        res["rel_err_vs_eager"] = timing.rel_err(fwd(tok[:, :le.shape[1]], se), le)
        if self.run.cuda and self.Bmax >= 24:
            res["rows_alone_M256_M384"] = self.rows_alone(fwd)
        return res

    def rows_alone(self, fwd) -> bool:
        """Rows 0, 5, B-1 of the 24 x 16 and 16 x 16 steps against the row alone (cache row moved to 0)."""
        m, tok, ok = self.m, self.tok, True
        k0, v0 = m.cache.k[0].clone(), m.cache.v[0].clone()
        s7 = torch.full((self.Bmax,), self.a.context + 188, device=self.dev, dtype=torch.long)
        for B in (24, 16):
            ref = fwd(tok[:B, :16], s7[:B])
            for b in (0, 5, B - 1):
                if b:
                    m.cache.k[0].copy_(m.cache.k[b])
                    m.cache.v[0].copy_(m.cache.v[b])
                one, d1 = fwd(tok[b:b + 1, :16], s7[:1]), fwd(tok[b:b + 1, :1], s7[:1])
                ok &= torch.equal(one[0], ref[b]) and torch.equal(d1[0, 0], ref[b, 0])
                m.cache.k[0].copy_(k0)
                m.cache.v[0].copy_(v0)
        return bool(ok)


def table(R: dict) -> list[str]:
    L = []
    w = R.get("widths", {})
    for name, ms in w.get("step_ms", {}).items():
        shp = w.get("timed_shape", {}).get(name, {})  # each step's logits were checked to be its B x T
        ms = {k: v for k, v in ms.items() if shp.get(k) == [int(x) for x in k.split("x")]}
        L.append(f"{name}: step ms (x AR at the same batch): " + "  ".join(
            f"{k} {fmt(v)} ({fmt(w['x_ar'][name].get(k), '{:.2f}')}x)" for k, v in ms.items()))
        L.append("  AR MBU: " + ", ".join(f"{k} {fmt(v * 100, '{:.1f}')}%" for k, v in w["mbu"].get(name, {}).items()))
        inv = w["invariance"].get(name, {})
        L.append("  bit-exact checks: " + ", ".join(f"{k} {v}" for k, v in inv.items() if isinstance(v, bool))
                 + f"; rel err vs eager {fmt(inv.get('rel_err_vs_eager'), '{:.4f}')}")
    L += verify_trees.table(R.get("trees", {}))
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.shape = "tiny" if args.shape == "qwen3-8b" else args.shape
        args.shapes, args.context = ["1x1", "2x4"], 48
    rn = Run("verify", args)
    built = {}

    def build():
        built["model"] = E.dry_target(args.shape, seed=args.seed) if rn.dry else \
            E.build_target(args.shape, rn.device, rn.dtype, args.seed)
        return {"shape": args.shape, "params": sum(p.numel() for p in built["model"].parameters())}

    rn.phase("build", build)
    model = built.get("model")
    if model is None:
        return rn.finish([])
    if args.part in ("widths", "all"):
        w = Widths(rn, args, model)
        w.bw = rn.phase("copy_bw_Bps", rn.copy_bandwidth) or float("nan")
        rn.phase("widths", w.measure)
    if args.part in ("trees", "all"):
        rn.phase("trees", lambda: verify_trees.Trees(rn, args, model).measure())
    return rn.finish(table(rn.R))

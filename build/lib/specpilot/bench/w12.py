"""``specpilot bench w12``: the product's 12-bit weight paths against bf16 (issue 17's bars: w12 >=
1.25x at M = 1, 4, 16 and >= 1.10x at M = 64 over a 36-layer Qwen3-8B step).

1. ``kernels``: the ``kernels`` rule's command (``specpilot kernels``): on a GPU it builds the w12
   tensor-core library with nvcc for the device and checks every K split (manifest beside the
   result); on the CPU it records that nothing applies;
2. ``choice`` (CUDA): per M of ``--ms``, what the kernel sub-agent's tuner picks
   (:func:`tune_w12_choice`: per role, one K split at every M, w12 where the role's whole engine
   call beats the bf16 call the step makes at that width), with each role's bf16 and w12 times on
   a one-layer copy;
3. ``step`` (CUDA): the engine's fast step (:class:`TargetRunner` under CUDA graphs, Triton step,
   ``--shape``'s every layer, batch 1, M tokens, context ``--context``) in bf16 against the same
   step with M's choice installed (:func:`install_w12_choice`), alternating rounds; before timing,
   with every role in w12: a block's logits bit-equal to its one-token decodes, and the argmax
   agreement and largest logit difference against bf16;
4. ``linear``: the eager w12 engine's kernel (``W12Linear``'s fused Triton decode + matmul) against
   bf16 (cuBLAS) per linear shape of the eager Qwen3-8B layer and M: the packing bit-exact, the
   relative error of both against the fp32 product, and their times (CUDA graphs over weight
   copies beyond the L2 cache; under Triton's interpreter on a dry run).

Replaces gpu_bench/bench_w12_fast.py (1-3) and gpu_bench/bench_w12.py (4; its config sweep is the
kernel sub-agent's job). The tensor-core kernel's own sweep (gpu_bench/bench_w12_mma.py) and the
main-loop variants were one-off scripts (git history: commit 7392204, archive/gpu_bench/).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ..cli import main as specpilot_main
from ..io import read_json
from ..tuning import timing
from ..w12 import W12Linear, unpack
from . import _engine as E
from ._common import Run, add_common, fmt

# the eager engine's unfused Qwen3-8B linears (W12Linear replaces each nn.Linear): name -> (N, K)
LINEARS = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288)}
DRY_LINEARS = {"dry": (128, 128)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "w12")
    p.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape of the step (default qwen3-8b)")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per matmul (verify widths)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3, help="alternating bf16 / w12 rounds of the step timing")
    p.add_argument("--part", choices=("fast", "linear", "all"), default="all",
                   help="fast: kernels, choice and step; linear: the eager kernel")


class W12:
    def __init__(self, run: Run, a: argparse.Namespace):
        self.run, self.a, self.dev = run, a, run.device
        self.kdir = run.out.with_name(run.out.stem + "_kernels")

    def kernels(self) -> dict:
        """The kernels rule's command, in this process; the manifest it wrote."""
        rc = specpilot_main(["kernels", "--gpu", self.run.gpu, "--out-dir", str(self.kdir)])
        if rc:
            raise RuntimeError(f"specpilot kernels exited {rc}")
        self.manifest = read_json(self.kdir / "manifest.json")
        if self.run.cuda:
            E.use_w12_library(self.manifest, self.kdir / "manifest.json")
        return {k: self.manifest.get(k) for k in ("applies", "note", "w12_mma")}

    def choice(self) -> dict:
        self.choices, out = {}, {}
        for m in self.a.ms:
            res = E.tune_w12_choice(E.target_config(self.a.shape), (m,), log=timing.log)
            self.choices[m] = res["w12_choice"]
            out[str(m)] = {"w12_choice": res["w12_choice"], "summary": res["w12_choice_summary"],
                           "checks_ok": {r: [s for s, c in v.items() if c["ok"]]
                                         for r, v in res["w12_choice_checks"].items()}}
        return out

    def step(self) -> dict:
        a = self.a
        model = E.build_target(a.shape, self.dev, torch.bfloat16, a.seed)
        for i, layer in enumerate(model.model.layers[:2]):  # escapes, as real checkpoints have: plant some
            for lin in (layer.mlp.gate_proj, layer.self_attn.o_proj):
                E.plant_escapes(lin.weight, seed=i)
        S, V = a.context + 256, model.config.vocab_size
        g = torch.Generator(device=self.dev).manual_seed(7)

        def use(choice: dict):
            sg = E.step_graphs(model, "triton")
            if choice:
                E.install_w12_choice(model, E.parse_choice(choice))
            else:
                sg.fast.use_w12({})
                sg.cache.entries.clear()

        def step_ms(M: int) -> float:
            r = E.runner(model, 1, S, (), True, "triton")
            for t in (model.cache.k, model.cache.v):
                t.normal_(generator=g)
            r.length.fill_(a.context)
            r._bound = a.context
            tok = torch.randint(0, V, (1, M), device=self.dev, generator=g)
            return self.run.median_s(lambda: r.verify(tok), 30, 3) * 1e3

        res = {"correctness": self.correctness(model, use, S, V), "steps": []}
        for M in a.ms:
            ch, times = self.choices.get(M) or {}, {"bf16": [], "w12": []}
            for _ in range(a.rounds):
                for name, c in (("bf16", {}), ("w12", ch)):
                    if name == "w12" and not ch:
                        continue
                    use(c)
                    times[name].append(step_ms(M))
            bf = statistics.median(times["bf16"])
            w = statistics.median(times["w12"]) if times["w12"] else bf
            res["steps"].append({"M": M, "roles": sorted(ch), "bf16_ms": bf, "w12_ms": w, "speedup": bf / w,
                                 "rounds_ms": times})
            timing.log(f"step M={M}: bf16 {bf:.3f} ms, w12 {sorted(ch)} {w:.3f} ms, x{bf / w:.3f}")
        use({})
        return res

    def correctness(self, model, use, S: int, V: int) -> dict:
        """Every role in w12 (split 1): a 16-token block against its 16 one-token decodes, and
        against bf16 (argmax agreement, largest logit difference, bf16's smallest top-2 margin)."""
        every = {r: {"split": 1, "launch": {"64": "t1-w4-u2"}} for r in ("qkv", "o", "gate_up", "down")}
        toks = torch.randint(0, V, (1, 16), device=self.dev, generator=torch.Generator(device=self.dev).manual_seed(3))
        out, logits = {}, {}
        for name, ch in (("bf16", {}), ("w12", every)):
            use(ch)
            fast = E.step_graphs(model, "triton").fast
            model.setup_cache(1, S)
            for t in (model.cache.k, model.cache.v):
                t.normal_(generator=torch.Generator(device=self.dev).manual_seed(3))
            start = torch.full((1,), self.a.context, dtype=torch.long, device=self.dev)
            blk = fast.forward(toks, start)[0].clone()
            one = torch.cat([fast.forward(toks[:, i:i + 1], start + i)[0].clone() for i in range(16)], 1)
            logits[name] = blk.float()[0]
            out[name] = {"block_equals_decodes": bool(torch.equal(blk, one))}
        a, b = logits["bf16"], logits["w12"]
        top2 = a.topk(2, -1).values
        out["w12_vs_bf16"] = {"argmax_equal": int((a.argmax(-1) == b.argmax(-1)).sum()), "positions": a.shape[0],
                              "max_abs_logit_diff": float((a - b).abs().max()),
                              "bf16_top2_margin_min": float((top2[:, 0] - top2[:, 1]).min())}
        return out

    def linear(self) -> dict:
        """W12Linear's Triton kernel against bf16 per (shape, M): exactness, error, time."""
        K, rows = E.w12_triton(), []
        for name, (n, k) in (DRY_LINEARS if self.run.dry else LINEARS).items():
            g = torch.Generator(device=self.dev).manual_seed(n + k)
            l2 = torch.cuda.get_device_properties(self.dev).L2_cache_size if self.run.cuda else 0
            copies = max(1, min(8, -(-4 * l2 // (2 * n * k))))
            ws = [(torch.randn(n, k, device=self.dev, generator=g) * 0.02).to(torch.bfloat16) for _ in range(copies)]
            E.plant_escapes(ws[0], seed=1)
            lins = [W12Linear.from_linear(self._linear(w)) for w in ws]
            exact = bool(torch.equal(unpack(lins[0].packed()).view(torch.int16), ws[0].view(torch.int16)))

            def w12(i, x):
                L = lins[i]
                esc = K.EscapeCSR(L._esc_rowptr, L._esc_row, L._esc_col, L._esc_val)
                return K.matmul(x, L.w12_mant, L.w12_codes, L.base, esc)

            for M in self.a.ms:
                x = torch.randn(M, k, device=self.dev, generator=g).to(torch.bfloat16)
                ref = x.float() @ ws[0].float().T
                d = {"shape": name, "N": n, "K": k, "M": M, "packing_exact": exact,
                     "w12_rel_err": timing.rel_err(w12(0, x), ref), "bf16_rel_err": timing.rel_err(x @ ws[0].T, ref)}
                if self.run.cuda:
                    d["w12_us"] = timing.graph_time_us(lambda i: w12(i, x), copies)[0]
                    d["bf16_us"] = timing.graph_time_us(lambda i: torch.mm(x, ws[i].t()), copies)[0]
                else:
                    d["w12_us"] = self.run.median_s(lambda: w12(0, x)) * 1e6
                    d["bf16_us"] = self.run.median_s(lambda: torch.mm(x, ws[0].t())) * 1e6
                d["speedup"] = d["bf16_us"] / d["w12_us"]
                rows.append(d)
                timing.log(f"linear {name} M={M}: bf16 {d['bf16_us']:.1f} us, w12 {d['w12_us']:.1f} us, "
                           f"err {d['w12_rel_err']:.2e} / {d['bf16_rel_err']:.2e}")
        return {"rows": rows}

    def _linear(self, w: torch.Tensor) -> torch.nn.Linear:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=self.dev, dtype=torch.bfloat16)
        lin.weight.copy_(w)
        return lin


def table(R: dict) -> list[str]:
    L = []
    k = R.get("kernels")
    if k:
        L.append(f"kernels rule: {str(k.get('note'))[:160]}")
    for m, c in R.get("choice", {}).items():
        L.append(f"choice M={m}: w12 roles {sorted(c['w12_choice'])}")
    st = R.get("step", {})
    for s in st.get("steps", []):
        L.append(f"step M={s['M']}: bf16 {fmt(s['bf16_ms'])} ms, w12 choice {s['roles']} {fmt(s['w12_ms'])} ms, "
                 f"{fmt(s['speedup'])}x")
    if st.get("correctness"):
        c = st["correctness"]
        L.append(f"every role w12: block = decodes {c['w12']['block_equals_decodes']} (bf16 "
                 f"{c['bf16']['block_equals_decodes']}); argmax = bf16 {c['w12_vs_bf16']['argmax_equal']}/16")
    rows = R.get("linear", {}).get("rows", [])
    if rows:
        L.append("eager W12Linear kernel:  shape   M   bf16 us   w12 us  speedup  err w12 / bf16  exact")
        for d in rows:
            L.append(f"  {d['shape']:<8} {d['M']:>3} {fmt(d['bf16_us'], '{:.2f}'):>9} {fmt(d['w12_us'], '{:.2f}'):>8} "
                     f"{fmt(d['speedup'], '{:.2f}'):>7}x {d['w12_rel_err']:.1e} / {d['bf16_rel_err']:.1e}  {d['packing_exact']}")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.ms = [1, 16]  # a gemv and a tensor-core kind
    rn = Run("w12", args)
    b = W12(rn, args)
    if args.part in ("fast", "all"):
        rn.phase("kernels", b.kernels)
        if rn.cuda:
            rn.phase("choice", b.choice)
            rn.phase("step", b.step)
        else:
            rn.R["choice"] = rn.R["step"] = {"skipped": "the fast path's w12 roles run the CUDA tensor-core kernel"}
    if args.part in ("linear", "all"):
        rn.phase("linear", b.linear)
    return rn.finish(table({k: v for k, v in rn.R.items() if not (isinstance(v, dict) and "skipped" in v)}))

#!/usr/bin/env python
"""Hybrid and Muse-Glimmer targets at hardware speed (issue 14): AR MBU, verify cost, stock e2e.

For each shape (default: ``qwen3.8-27b``, the 48 GDN + 16 gated-attention hybrid, and
``muse-glimmer-30b``, 39 sliding + 13 global NoPE layers), on random weights built directly on the
GPU (bf16, :func:`specpilot.models.random_checkpoint.build_target`; no checkpoint files):

1. copy bandwidth (bytes read + written / time), the MBU denominator;
2. GDN backend: fla-core's Triton kernels when ``fla`` is importable on CUDA, else pure torch
   (recorded); a correctness check first: prefill + decode logits vs one block forward, and the
   fla path vs the pure-torch path on the same prompt (relative error); a failing fla path is
   switched off and the error recorded;
3. AR decode step at batch 1 and 16, context 512: with ``--path fast`` (default) through the
   product's runner (:class:`specpilot.engine.fast_family.FastFamilyTarget`, CUDA graphs; also the
   fast verify of a block against its own decodes: row independence); with ``--path eager``
   eager and as a CUDA graph of the eager step; MBU = (weights + KV/ring read + GDN state
   read and written) / step time / copy bandwidth;
4. verify-16 step (and verify + commit, where GDN commit replays the accepted tokens) as a
   multiple of the AR step, batch 1;
5. stock with the replay drafter (the package's replay profiles; a random DFlash drafter of the real shape
   runs each step): tau, speedup over AR, outputs equal AR, and the formula
   tau x AR step / (verify + commit + draft step);
6. state memory per request: live state by kind, the transient verify tape, and what per-position
   GDN snapshots would take instead.

Writes ``targets.json`` under ``--out-dir`` (default $OUT or .) and prints a table. Run on the GPU
machine from the repository root::

    PYTHONUNBUFFERED=1 python gpu_bench/bench_targets.py --budget-s 500            # the fast path
    PYTHONUNBUFFERED=1 python gpu_bench/bench_targets.py --path eager --budget-s 500

``--quick`` runs the same logic on the CPU with the tiny-hybrid and tiny-muse shapes (fp32,
no graphs): it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(Path(__file__).resolve().parent)]

from _timing import capture_graph, copy_bandwidth  # noqa: E402

T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:7.1f}s] " + " ".join(str(x) for x in a), flush=True)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


class Bench:
    def __init__(self, args):
        import torch

        self.torch, self.args = torch, args
        self.dev = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
        self.cuda = self.dev.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.R = {"device": torch.cuda.get_device_name() if self.cuda else "cpu", "torch": torch.__version__,
                  "quick": args.quick, "shapes": {}, "errors": []}
        self.out = Path(args.out_dir or os.environ.get("OUT") or ".")
        self.out.mkdir(parents=True, exist_ok=True)
        self.ctx = 32 if args.quick else 512
        self.batches = (1, 2) if args.quick else (1, 16)

    # ---------------------------------------------------------------- timing
    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def median(self, fn, iters=10, warmup=2) -> float:
        if self.args.quick:
            iters, warmup = min(iters, 3), 1
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def graph_median(self, fn, iters=10) -> float:
        return self.median(capture_graph(fn).replay, iters, 2)

    def left(self) -> float:
        return self.args.budget_s - (time.time() - T0)

    def save(self):
        tmp = self.out / ".targets.json.tmp"
        tmp.write_text(json.dumps(self.R, indent=2, default=str) + "\n")
        tmp.replace(self.out / "targets.json")

    # ---------------------------------------------------------------- pieces
    def copy_bw(self):
        torch = self.torch
        n = (2 ** 31 if self.cuda else 2 ** 22) // 2
        a = torch.empty(n, dtype=torch.bfloat16, device=self.dev).normal_()
        self.R["copy_bw_Bps"] = copy_bandwidth(a, lambda fn: self.median(fn, 10, 3))
        log(f"copy bandwidth {self.R['copy_bw_Bps'] / 1e12:.3f} TB/s")
        del a

    @property
    def fast(self) -> bool:
        return self.args.path == "fast" and self.cuda

    def runner(self, model, B, S, capture=()):
        from specpilot.engine.runner import TargetRunner

        if self.fast:  # the product's runner: FastFamilyTarget under CUDA graphs
            r = TargetRunner(model, B, S, capture, graphs=True, kernels="triton")
            if r.graphs is None or r.graphs.fast is None:
                raise RuntimeError("the runner did not take the family fast path")
            return r
        return TargetRunner(model, B, S, capture, graphs=False)

    def step_bytes(self, model, B, ctx) -> dict:
        """Bytes one decode step moves: weights, attention K/V read, GDN state read + written."""
        from specpilot.engine.graphs import weight_bytes_per_step

        c, st = model.config, model.state
        esz = 2 if self.dtype == self.torch.bfloat16 else 4
        kv = 0
        if st.kv is not None:
            kv += B * st.kv.k.shape[1] * 2 * c.num_key_value_heads * (ctx + 1) * c.head_dim * esz
        if st.ring is not None:
            kv += B * st.ring.k.shape[1] * 2 * c.num_key_value_heads * (st.ring.R + 1) * c.head_dim * esz
        gdn = 2 * B * st.gdn.nbytes_per_row() if st.gdn is not None else 0
        return {"weights": weight_bytes_per_step(model, B), "kv": kv, "gdn_state_rw": gdn}

    def memory(self, model, block) -> dict:
        c = model.config
        m = dict(model.state_bytes_per_row())
        if c.is_recurrent:
            n = c.layer_types.count("linear_attention")
            conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            esz = 2 if self.dtype == self.torch.bfloat16 else 4
            per_tok = (conv_dim * esz + 4 * (c.linear_num_key_heads * c.linear_key_head_dim
                                             + c.linear_num_value_heads * c.linear_value_head_dim
                                             + 2 * c.linear_num_value_heads))
            rec = n * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
            m.update(verify_tape_bytes=n * per_tok * block, per_position_snapshots_bytes=rec * block,
                     recurrent_bytes=rec)
        return m

    def correctness(self, model, name) -> dict:
        torch = self.torch
        from specpilot.models import gdn
        from specpilot.models.layers import chain_ancestors

        V = model.config.vocab_size
        g = torch.Generator(device="cpu").manual_seed(3)
        ids = torch.randint(0, V, (1, 80), generator=g).to(self.dev)
        d = {}
        model.setup_cache(1, 128)
        with torch.inference_mode():
            full, _ = model(ids, torch.zeros(1, dtype=torch.long, device=self.dev), chain_ancestors(1, 80, self.dev),
                            write=True)
        r = self.runner(model, 1, 128)
        r.prefill([ids[0, :60].tolist()])
        dec = torch.stack([r.decode(ids[:, t]).clone() for t in range(60, 80)], 1)  # graph outputs: copy
        d["prefill_decode_vs_block_rel_err"] = rel_err(dec, full[:, 60:80])
        d["argmax_agree_decode_vs_block"] = float((dec.argmax(-1) == full[:, 60:80].argmax(-1)).float().mean())
        if self.fast:  # the fast path's verify of the 20 tokens vs its own decodes: row independence
            r.prefill([ids[0, :60].tolist()])
            ver, _ = r.verify(ids[:, 60:80])
            d["fast_verify_vs_decode_max_abs"] = float((ver.float() - dec.float()).abs().max())
            d["fast_verify_vs_decode_bit_equal"] = bool(torch.equal(ver, dec))
            if not d["fast_verify_vs_decode_bit_equal"]:  # attention tiles of 16 query rows for every width?
                r.graphs.fast.set_configs({"attn_rows": 16})
                r.graphs.cache.entries.clear()
                r.prefill([ids[0, :60].tolist()])
                dec16 = torch.stack([r.decode(ids[:, t]).clone() for t in range(60, 80)], 1)
                r.prefill([ids[0, :60].tolist()])
                ver16, _ = r.verify(ids[:, 60:80])
                d["attn_rows16_verify_vs_decode_bit_equal"] = bool(torch.equal(ver16, dec16))
                r.graphs.fast.set_configs({"attn_rows": 0})
                r.graphs.cache.entries.clear()
        if model.config.is_recurrent and gdn.use_fla(self.dev):
            try:
                gdn._FLA = False
                r.prefill([ids[0, :60].tolist()])
                ref = torch.stack([r.decode(ids[:, t]).clone() for t in range(60, 80)], 1)
                d["fla_vs_torch_rel_err"] = rel_err(dec, ref)
            except Exception as e:  # noqa: BLE001
                d["fla_error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                gdn._FLA = None
        elif model.config.is_recurrent and self.cuda:
            d["fla"] = "not installed: GDN runs the pure-torch forms"
        log(f"{name} correctness {d}")
        return d

    def ar(self, model, B) -> dict:
        torch = self.torch
        ctx = self.ctx
        S = ctx + 128
        r = self.runner(model, B, S)
        g = torch.Generator(device="cpu").manual_seed(5)
        r.prefill([torch.randint(0, model.config.vocab_size, (ctx,), generator=g).tolist() for _ in range(B)])
        tok = torch.randint(0, model.config.vocab_size, (B,), generator=g).to(self.dev)
        base = r.length.clone()

        def step():
            r.length.copy_(base)
            r._bound = int(ctx)
            r.decode(tok)

        d = {"B": B, "ctx": ctx, "eager_s": self.median(step), "path": "fast" if self.fast else "eager"}
        if self.fast:
            d["graph_s"] = d.pop("eager_s")  # runner.decode replays the captured fast step
        elif self.cuda:
            from specpilot.models.layers import chain_ancestors

            anc = chain_ancestors(B, 1, self.dev)

            def raw():
                r.length.copy_(base)
                model(tok[:, None], r.length, anc, write=True)
            try:
                with torch.inference_mode():
                    d["graph_s"] = self.graph_median(raw)
            except Exception as e:  # noqa: BLE001
                d["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        t = d["graph_s"] if "graph_s" in d else d["eager_s"]
        b = self.step_bytes(model, B, ctx)
        bw = self.R.get("copy_bw_Bps", float("nan"))
        d.update(step_s=t, bytes=b, tok_s=B / t, mbu=sum(b.values()) / t / bw, mbu_weights_only=b["weights"] / t / bw)
        if "eager_s" in d:
            d["mbu_eager"] = sum(b.values()) / d["eager_s"] / bw
        return d

    def verify(self, model, block) -> dict:
        torch = self.torch
        ctx = self.ctx
        r = self.runner(model, 1, ctx + 128)
        g = torch.Generator(device="cpu").manual_seed(6)
        r.prefill([torch.randint(0, model.config.vocab_size, (ctx,), generator=g).tolist()])
        blk = torch.randint(0, model.config.vocab_size, (1, block), generator=g).to(self.dev)
        one = blk[:, :1]
        counts = torch.full((1,), block, dtype=torch.long)

        def v():
            r.verify(blk)

        base = r.length.clone()

        def vc():
            r.verify(blk)
            if self.fast:  # the runner's commit: the fast path replays the accepted tokens
                r.commit(counts.to(self.dev))
                r.length.copy_(base)
                r._bound = int(ctx)
            else:
                r.model.commit(r.length, counts)  # replay all: the worst case; length stays

        def dec():
            r.decode(one[:, 0])
            r.length.copy_(base)
            r._bound = int(ctx)

        d = {"ar_verify1_s": self.median(lambda: r.verify(one)), "verify_s": self.median(v),
             "verify_commit_s": self.median(vc), "path": "fast" if self.fast else "eager"}
        if self.fast:
            d["ar_decode_s"] = self.median(dec)
            d["graph_x_ar"] = d["verify_s"] / d["ar_decode_s"]
            d["commit_x_ar_decode"] = d["verify_commit_s"] / d["ar_decode_s"]
        elif self.cuda:
            try:
                from specpilot.models.layers import chain_ancestors

                anc1, ancb = chain_ancestors(1, 1, self.dev), chain_ancestors(1, block, self.dev)
                with torch.inference_mode():
                    d["graph_ar_s"] = self.graph_median(lambda: model(one, r.length, anc1, write=True))
                    d["graph_verify_s"] = self.graph_median(lambda: model(blk, r.length, ancb))
                d["graph_x_ar"] = d["graph_verify_s"] / d["graph_ar_s"]
            except Exception as e:  # noqa: BLE001
                d["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        d.update(x_ar=d["verify_s"] / d["ar_verify1_s"], commit_x_ar=d["verify_commit_s"] / d["ar_verify1_s"])
        return d

    def tune(self, model) -> dict:
        """Per matmul role, the fastest Triton block config at M = 1 (decode; every M <= 16 uses it, so
        a verify of 16 rows stays bit-equal to its decodes) for this shape's weights, timed with
        its epilogue (norm prologue, residual, SwiGLU) as the step runs it; the runner then uses
        them (``step_graphs(model, configs=...)``). Shapes other than the 8B one the defaults were
        tuned on have other wave counts (e.g. 2 x 17408 gate/up rows in 128-column programs = 136
        programs on 132 SMs)."""
        torch = self.torch
        import triton

        from specpilot.engine import triton_step as K
        from specpilot.engine.graphs import DEFAULT_CONFIGS, step_graphs
        from specpilot.engine.fast_family import fuse_family_weights

        fuse_family_weights(model)
        layers = model.model.layers
        gdn = next((l for l in layers if l.kind == "linear_attention"), None)
        att = next(l for l in layers if l.kind != "linear_attention")
        n = {k: sum(1 for l in layers if (l.kind == "linear_attention") == (k == "gdn")) for k in ("gdn", "att")}
        H = model.config.hidden_size
        nw = torch.ones(H, dtype=torch.float32, device=self.dev)
        jobs = {"qkv": [(att.fused_qkv, n["att"])] + ([(gdn.fused_in, n["gdn"])] if gdn is not None else []),
                "o": [(att.self_attn.o_proj.weight, n["att"])]
                + ([(gdn.linear_attn.out_proj.weight, n["gdn"])] if gdn is not None else []),
                "gate_up": [(att.fused_gate_up, len(layers))], "down": [(att.mlp.down_proj.weight, len(layers))],
                "lm_head": [(model.lm_head.weight, 1)]}
        kinds = {"qkv": "norm", "o": "res", "gate_up": "swiglu", "down": "res", "lm_head": "norm"}
        extra = [K.LinearConfig(16, 256, 4, 4), K.LinearConfig(16, 512, 4, 4), K.LinearConfig(32, 128, 4, 4),
                 K.LinearConfig(64, 64, 4, 4)]
        chosen, report = {}, {}
        for role, ws in jobs.items():
            default = K.LinearConfig.parse(DEFAULT_CONFIGS[role]["16"])
            best = None
            for c in list(K.CANDIDATES) + extra:
                c = K.LinearConfig(c.bn, c.bk, c.warps, c.stages, default.prenorm)
                total = 0.0
                try:
                    for w, count in ws:
                        N = w.shape[0] // 2 if kinds[role] == "swiglu" else w.shape[0]
                        x = torch.randn(1, w.shape[1], dtype=w.dtype, device=self.dev)
                        out = torch.empty(1, N, dtype=w.dtype, device=self.dev)
                        norm = nw[: w.shape[1]] if kinds[role] == "norm" or role == "gate_up" else None
                        if c.prenorm:
                            norm = None
                        fn = lambda: K.linear(x, w, out, cfg=c, norm=norm, residual=out if kinds[role] == "res" else None,  # noqa: E731
                                              swiglu=kinds[role] == "swiglu")
                        total += count * triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") / 1e3
                except Exception as e:  # noqa: BLE001  (a config that does not compile is no candidate)
                    report.setdefault(role + "_errors", []).append(f"{c.key()}: {type(e).__name__}")
                    continue
                report.setdefault(role, {})[c.key()] = total
                if best is None or total < best[1]:
                    best = (c, total)
            chosen[role] = {**DEFAULT_CONFIGS[role], "16": best[0].key()}
            report[role + "_best"] = (best[0].key(), best[1], report[role].get(default.key()))
        step_graphs(model, "triton", chosen)
        log("tuned", {r: report[r + "_best"] for r in jobs})
        return {"chosen_16": {r: chosen[r]["16"] for r in jobs}, "report": report}

    def profile(self, model) -> dict:
        """Device time per kernel of the fast AR decode step (batch 1, context 512; torch.profiler
        over 5 uncaptured steps): where the step's time goes beyond streaming the weights."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        ctx = self.ctx
        r = self.runner(model, 1, ctx + 128)
        g = torch.Generator(device="cpu").manual_seed(5)
        r.prefill([torch.randint(0, model.config.vocab_size, (ctx,), generator=g).tolist()])
        tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=g).to(self.dev)
        fast = r.graphs.fast
        for _ in range(2):
            fast.forward(tok, r.length, write=True)
        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fast.forward(tok, r.length, write=True)
            self.sync()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t:
                rows.append((e.key[:60], e.count // 5, t / 5 / 1e3))
        rows.sort(key=lambda x: -x[2])
        total = sum(x[2] for x in rows)
        return {"per_step_ms_total": total, "kernels": [{"name": n, "per_step": c, "ms": round(t, 4)}
                                                         for n, c, t in rows[:20]]}

    def e2e(self, model, drafter, block) -> dict:
        from specpilot.engine.generate import generate_ar, generate_speculative
        from specpilot.engine.proposers import DFlashProposer
        from specpilot.engine.replay import ReplayProposer, expected_tau, load_profile

        torch = self.torch
        ctx, n_new = self.ctx, (24 if self.args.quick else 192)
        S = ctx + n_new + 2 * block
        g = torch.Generator(device="cpu").manual_seed(7)
        prompt = torch.randint(0, model.config.vocab_size, (ctx,), generator=g).tolist()
        capture = tuple(drafter.config.target_layer_ids)
        r = self.runner(model, 1, S)
        generate_ar(r, [prompt], 4)  # warm-up: captures the decode graph for this cache size
        ar_row = generate_ar(r, [prompt], n_new)[0]
        t_ar = ar_row.decode_s / max(1, n_new - 1)
        res = {"ctx": ctx, "new_tokens": n_new, "block": block, "ar_step_s_loop": t_ar}
        for name in self.args.profiles:
            prof = load_profile(name)
            rs = self.runner(model, 1, S, capture)
            net = DFlashProposer(drafter, True, "triton") if self.fast else DFlashProposer(drafter, False, "torch")
            # warm-up: the first steps capture the drafter's graphs and compile its Triton kernels
            # (seconds) that would otherwise be counted as draft time
            generate_speculative(rs, ReplayProposer([ar_row.output_ids], prof, model.config.vocab_size, net, seed=1),
                                 [prompt], 2 * block, block, profile=True)
            prop = ReplayProposer([ar_row.output_ids], prof, model.config.vocab_size, net, seed=0)
            row = generate_speculative(rs, prop, [prompt], n_new, block, profile=True)[0]
            steps = row.committed_per_step
            tau = sum(steps) / len(steps)
            t_draft = row.draft_s / len(steps)
            t_vc = row.verify_s / len(steps)  # verify + acceptance + commit (GDN replay)
            formula = tau * t_ar / (t_vc + t_draft)
            speed = ar_row.decode_s / row.decode_s
            res[prof.name] = {"tau": tau, "expected_tau": expected_tau(prof, block), "speedup": speed,
                              "formula_speedup": formula, "measured_over_formula": speed / formula,
                              "outputs_equal_ar": row.output_ids == ar_row.output_ids,
                              "draft_step_s": t_draft, "verify_commit_step_s": t_vc, "synthetic": True}
        return res

    def shape(self, name):
        torch = self.torch
        from specpilot.models.random_checkpoint import build_drafter, build_target

        t = time.time()
        model = build_target(name, self.dev, self.dtype, self.args.seed)
        drafter = build_drafter(name, self.dev, self.dtype, self.args.seed, block_size=self.args.block)
        self.sync()
        R = self.R["shapes"][name] = {
            "params": sum(p.numel() for p in model.parameters()), "build_s": time.time() - t,
            "layer_types": {k: model.config.layer_types.count(k) for k in set(model.config.layer_types)}}
        log(f"{name}: {R['params'] / 1e9:.2f} B params built in {R['build_s']:.1f}s")
        phases = [("tune", lambda: self.tune(model))] if (self.fast and self.args.tune) else []
        phases += [("correctness", lambda: self.correctness(model, name))]
        phases += [(f"ar_b{B}", lambda B=B: self.ar(model, B)) for B in self.batches]
        phases += [(f"verify{self.args.block}", lambda: self.verify(model, self.args.block)),
                   ("e2e", lambda: self.e2e(model, drafter, self.args.block))]
        if self.fast and self.args.profile:
            phases.append(("kernel_profile", lambda: self.profile(model)))
        for key, fn in phases:
            if self.left() < (10 if self.args.quick else 45):
                R.setdefault("skipped", []).append(key)
                log(f"SKIP {name} {key} (budget)")
                continue
            try:
                R[key] = fn()
                log(f"{name} {key}: {json.dumps(R[key], default=str)[:400]}")
            except Exception as e:  # noqa: BLE001
                self.R["errors"].append(f"{name} {key}: {type(e).__name__}: {e}"[:500])
                log(traceback.format_exc())
            self.save()
        model.setup_cache(self.batches[-1], self.ctx + 128)
        R["state_memory_per_request"] = self.memory(model, self.args.block)
        self.save()
        del model, drafter
        if self.cuda:
            torch.cuda.empty_cache()

    def table(self) -> str:
        lines = ["shape              | AR B1 ms | MBU B1 | AR B16 tok/s | MBU B16 | verify16/AR | +commit | e2e tau/speedup/formula"]
        for name, R in self.R["shapes"].items():
            b1, b16 = R.get(f"ar_b{self.batches[0]}", {}), R.get(f"ar_b{self.batches[1]}", {})
            v = R.get(f"verify{self.args.block}", {})
            e = next((x for k, x in R.get("e2e", {}).items() if isinstance(x, dict)), {})
            f = lambda x, s="{:.3f}": s.format(x) if isinstance(x, (int, float)) else "-"  # noqa: E731
            lines.append(f"{name:18s} | {f(b1.get('step_s', 0) * 1e3, '{:.2f}')} | {f(b1.get('mbu'), '{:.1%}')} | "
                         f"{f(b16.get('tok_s'), '{:.0f}')} | {f(b16.get('mbu'), '{:.1%}')} | "
                         f"{f(v.get('graph_x_ar', v.get('x_ar')))} | {f(v.get('commit_x_ar'))} | "
                         f"{f(e.get('tau'), '{:.2f}')}/{f(e.get('speedup'), '{:.2f}')}/{f(e.get('formula_speedup'), '{:.2f}')}")
        return "\n".join(lines)

    def run(self):
        self.copy_bw()
        for name in self.args.shapes:
            if self.left() < 30:
                self.R.setdefault("skipped_shapes", []).append(name)
                continue
            self.shape(name)
        self.R["table"] = self.table()
        self.R["seconds"] = time.time() - T0
        self.save()
        print(self.R["table"])
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=None)
    p.add_argument("--quick", action="store_true", help="CPU dry run on tiny shapes (checks the script)")
    p.add_argument("--budget-s", type=float, default=None, help="wall budget [s] (default 540; --quick 3000)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--profiles", nargs="+", default=["study_stock"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", choices=["fast", "eager"], default="fast",
                   help="fast: the product's runner (FastFamilyTarget under CUDA graphs); eager: the eager forward")
    p.add_argument("--profile", action="store_true", help="fast path: device time per kernel of the AR step")
    p.add_argument("--tune", action="store_true", help="fast path: tune each matmul role's M <= 16 config per shape first")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 3000.0 if args.quick else 540.0
    if args.shapes is None:
        args.shapes = ["tiny-hybrid", "tiny-muse"] if args.quick else ["qwen3.8-27b", "muse-glimmer-30b"]
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())

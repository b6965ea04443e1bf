"""``specpilot bench targets``: the hybrid (Gated DeltaNet) and Muse-Glimmer target families at
hardware speed (issue 14's bars: AR MBU >= 75 % at batch 1, verify-16 <= 1.15x an AR step).

For each shape of ``--shapes`` (default ``qwen3.8-27b``: 48 Gated DeltaNet + 16 gated attention
layers, and ``muse-glimmer-30b``: 39 sliding-window + 13 global NoPE layers), random bf16 weights
built on the GPU, context 512, through the engine's runner (``--path fast``: the family fast path,
:class:`FastFamilyTarget` under CUDA graphs; ``--path eager``: the eager forward):

1. ``tune`` (``--tune``, fast path): per matmul role the fastest Triton block config at one row for
   this shape's weights (every M <= 16 uses it, so verify-16 stays bit-equal to its decodes),
   timed by :func:`timing.graph_us`, installed before everything below;
2. ``correctness``: prefill + decodes against one block forward (relative error); on the fast path
   the verify of 20 tokens bit-equal to decoding them one by one (row independence);
3. ``ar_b{B}``: the AR decode step, tok/s and MBU = (weights + KV / ring read + GDN state read and
   written) / step / copy bandwidth;
4. ``verify{block}``: the verify step and verify + commit (GDN: the accepted tokens replayed into
   the state) as multiples of the AR step;
5. ``e2e``: stock with the replay drafter (a random DFlash drafter of the shape runs each step)
   against AR: tau, speedup, outputs equal AR, tau x AR step / (verify + commit + draft step);
6. ``state_memory``: state per request by kind, the transient verify tape, and what per-position
   GDN snapshots would take instead;
7. ``kernel_profile`` (``--profile``, fast path): device time per kernel of the AR step.

Replaces gpu_bench/bench_targets.py (its fla-against-torch check and attention-rows retry are gone).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..tuning import timing
from . import _engine as E
from ._common import Run, add_common, fmt, kernel_profile, random_tokens



def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "targets")
    p.add_argument("--shapes", nargs="+", default=["qwen3.8-27b", "muse-glimmer-30b"])
    p.add_argument("--path", choices=("fast", "eager"), default="fast",
                   help="fast: the family fast path under CUDA graphs; eager: the eager forward")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--new", type=int, default=192, help="new tokens of the e2e phase")
    p.add_argument("--profiles", nargs="+", default=["study_stock"])
    p.add_argument("--tune", action="store_true", help="fast path: tune each role's one-row config for the shape first")
    p.add_argument("--profile", action="store_true", help="fast path: device time per kernel of the AR step")


class Target:
    """The phases over one target shape (see the module docstring)."""

    def __init__(self, run: Run, a: argparse.Namespace, shape: str):
        self.run, self.a, self.shape, self.dev = run, a, shape, run.device
        self.fast = a.path == "fast" and run.cuda
        t = time.time()
        self.model, self.drafter = E.target_and_drafter(run, shape, a.block, a.seed)
        c = self.model.config
        self.V = c.vocab_size
        self.info = {"params": sum(p.numel() for p in self.model.parameters()), "build_s": time.time() - t,
                     "layer_types": {k: c.layer_types.count(k) for k in set(c.layer_types)}}

    def runner(self, B: int, S: int, capture=()):
        if self.fast:
            r = E.runner(self.model, B, S, capture, True, "triton")
            if E.step_fast(r) is None:
                raise RuntimeError("the runner did not take the family fast path")
            return r
        return E.runner(self.model, B, S, capture, False)

    def tune(self) -> dict:
        """The fastest Triton config per role at one row for this shape (see the module docstring)."""
        K, m = E.triton_step(), self.model
        self.runner(1, 64)  # builds the family step (fused weights)
        layers = m.model.layers
        gdn = next((l for l in layers if l.kind == "linear_attention"), None)
        att = next(l for l in layers if l.kind != "linear_attention")
        n = {k: sum((l.kind == "linear_attention") == (k == "gdn") for l in layers) for k in ("gdn", "att")}
        jobs = {"qkv": [(att.fused_qkv, n["att"])] + ([(gdn.fused_in, n["gdn"])] if gdn is not None else []),
                "o": [(att.self_attn.o_proj.weight, n["att"])]
                + ([(gdn.linear_attn.out_proj.weight, n["gdn"])] if gdn is not None else []),
                "gate_up": [(att.fused_gate_up, len(layers))], "down": [(att.mlp.down_proj.weight, len(layers))],
                "lm_head": [(m.lm_head.weight, 1)]}
        kind = {"qkv": "norm", "o": "res", "gate_up": "swiglu", "down": "res", "lm_head": "norm"}
        extra = [K.LinearConfig(16, 256, 4, 4), K.LinearConfig(16, 512, 4, 4), K.LinearConfig(32, 128, 4, 4),
                 K.LinearConfig(64, 64, 4, 4)]
        chosen, report = {}, {}
        for role, ws in jobs.items():
            default = K.LinearConfig.parse(E.DEFAULT_CONFIGS[role]["16"])
            times = report[role] = {}
            for c in list(K.CANDIDATES) + extra:
                c = K.LinearConfig(c.bn, c.bk, c.warps, c.stages, default.prenorm)
                try:
                    times[c.key()] = sum(count * timing.graph_us([self._call(K, c, w, kind[role])]) for w, count in ws)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is no candidate
                    times[c.key()] = f"{type(e).__name__}"
            ok = {k: v for k, v in times.items() if isinstance(v, float)}
            best = min(ok, key=ok.get)
            chosen[role] = {**E.DEFAULT_CONFIGS[role], "16": best}
            timing.log(f"tune {self.shape} {role}: {best} {ok[best]:.1f} us (default {ok.get(default.key(), 0):.1f} us)")
        E.step_graphs(m, "triton", chosen)  # the runners after this one use them
        return {"chosen_16": {r_: c["16"] for r_, c in chosen.items()}, "us_per_step": report}

    def _call(self, K, c, w, kind: str):
        swiglu = kind == "swiglu"
        x = torch.randn(1, w.shape[1], dtype=w.dtype, device=self.dev)
        out = torch.empty(1, w.shape[0] // 2 if swiglu else w.shape[0], dtype=w.dtype, device=self.dev)
        norm = None if c.prenorm or kind == "res" else torch.ones(w.shape[1], dtype=torch.float32, device=self.dev)
        return lambda: K.linear(x, w, out, cfg=c, norm=norm, residual=out if kind == "res" else None, swiglu=swiglu)

    def correctness(self) -> dict:
        m, dev = self.model, self.dev
        ids = torch.tensor([random_tokens(80, self.V, 3)], device=dev)
        m.setup_cache(1, 128)
        full, _ = m(ids, torch.zeros(1, dtype=torch.long, device=dev), E.chain_ancestors(1, 80, dev), write=True)
        full = full.clone()
        r = self.runner(1, 128)
        r.prefill([ids[0, :60].tolist()])
        dec = torch.stack([r.decode(ids[:, t]).clone() for t in range(60, 80)], 1)
        d = {"prefill_decode_vs_block_rel_err": timing.rel_err(dec, full[:, 60:80]),
             "argmax_agree_decode_vs_block": float((dec.argmax(-1) == full[:, 60:80].argmax(-1)).float().mean())}
        if self.fast:  # the fast verify of the 20 tokens against its own decodes: row independence
            r.prefill([ids[0, :60].tolist()])
            ver, _ = r.verify(ids[:, 60:80])
            d["fast_verify_vs_decode_bit_equal"] = bool(torch.equal(ver, dec))
        return d

    def bytes_per_step(self, B: int) -> dict:
        """Bytes one decode step moves: weights, attention K/V (full and ring) read, GDN state read + written."""
        c, st, ctx = self.model.config, self.model.state, self.a.context
        esz = self.model.lm_head.weight.element_size()
        kv = 0
        if st.kv is not None:
            kv += B * st.kv.k.shape[1] * 2 * c.num_key_value_heads * (ctx + 1) * c.head_dim * esz
        if st.ring is not None:
            kv += B * st.ring.k.shape[1] * 2 * c.num_key_value_heads * (st.ring.R + 1) * c.head_dim * esz
        gdn = 2 * B * st.gdn.nbytes_per_row() if st.gdn is not None else 0
        return {"weights": E.weight_bytes_per_step(self.model, B), "kv": kv, "gdn_state_rw": gdn}

    def ar(self, B: int) -> dict:
        ctx = self.a.context
        r = self.runner(B, ctx + 128)
        r.prefill([random_tokens(ctx, self.V, 5 + b) for b in range(B)])
        tok = torch.tensor(random_tokens(B, self.V, 6), device=self.dev)
        base = r.length.clone()

        def step():
            r.length.copy_(base)
            r._bound = ctx
            r.decode(tok)

        t = self.run.median_s(step, 10, 2)
        b = self.bytes_per_step(B)
        return {"B": B, "ctx": ctx, "path": "fast" if self.fast else "eager", "step_s": t, "bytes": b, "tok_s": B / t,
                "mbu": sum(b.values()) / t / self.bw, "mbu_weights_only": b["weights"] / t / self.bw}

    def verify(self) -> dict:
        ctx, block = self.a.context, self.a.block
        r = self.runner(1, ctx + 128)
        r.prefill([random_tokens(ctx, self.V, 6)])
        blk = torch.tensor([random_tokens(block, self.V, 7)], device=self.dev)
        counts = torch.full((1,), block, dtype=torch.long, device=self.dev)
        base = r.length.clone()

        def reset():
            r.length.copy_(base)
            r._bound = ctx

        def verify_commit():  # the worst case: every token accepted (GDN: all replayed)
            r.verify(blk)
            r.commit(counts)
            reset()

        def decode():
            r.decode(blk[:, 0])
            reset()

        d = {"ar_s": self.run.median_s(decode), "verify_s": self.run.median_s(lambda: r.verify(blk)),
             "verify_commit_s": self.run.median_s(verify_commit)}
        d.update(x_ar=d["verify_s"] / d["ar_s"], commit_x_ar=d["verify_commit_s"] / d["ar_s"])
        return d

    def e2e(self) -> dict:
        a, block = self.a, self.a.block
        S = a.context + a.new + 2 * block + 64
        prompt = random_tokens(a.context, self.V, 7)
        r = self.runner(1, S)
        E.generate_ar(r, [prompt], 4)  # warm-up: the decode graph of this cache size
        ar = E.generate_ar(r, [prompt], a.new)[0]
        t_ar = ar.decode_s / max(1, a.new - 1)
        rs = self.runner(1, S, tuple(self.drafter.config.target_layer_ids))
        net = E.DFlashProposer(self.drafter, block_size=block)  # drafts as the runner's backend runs
        res = {"ctx": a.context, "new_tokens": a.new, "block": block, "ar_step_s_loop": t_ar}
        for name in a.profiles:
            prof = E.load_profile(name)
            # warm-up: the first steps capture the drafter's graphs and compile its kernels
            E.replay_generate(rs, ar.output_ids, prompt, prof, self.V, net, 2 * block, block, 1)
            row = E.replay_generate(rs, ar.output_ids, prompt, prof, self.V, net, a.new, block, 0, True)
            n = len(row.committed_per_step)
            tau = sum(row.committed_per_step) / n
            formula = tau * t_ar / (row.verify_s / n + row.draft_s / n)
            res[prof.name] = {"tau": tau, "expected_tau": E.expected_tau(prof, block),
                              "speedup": ar.decode_s / row.decode_s, "formula_speedup": formula,
                              "outputs_equal_ar": row.output_ids == ar.output_ids, "draft_step_s": row.draft_s / n,
                              "verify_commit_step_s": row.verify_s / n, "synthetic": True}
        return res

    def memory(self) -> dict:
        c, m = self.model.config, self.model
        m.setup_cache(1, self.a.context + 128)
        out = dict(m.state_bytes_per_row())
        if c.is_recurrent:
            n = c.layer_types.count("linear_attention")
            kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
            esz = m.lm_head.weight.element_size()
            per_tok = (2 * kd + vd) * esz + 4 * (kd + vd + 2 * c.linear_num_value_heads)
            rec = n * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
            out.update(verify_tape_bytes=n * per_tok * self.a.block, recurrent_bytes=rec,
                       per_position_snapshots_bytes=rec * self.a.block)
        return out

    def profile(self) -> dict:
        r = self.runner(1, self.a.context + 128)
        r.prefill([random_tokens(self.a.context, self.V, 5)])
        tok = torch.tensor([random_tokens(1, self.V, 6)], device=self.dev)
        return kernel_profile(lambda: E.step_fast(r).forward(tok, r.length, write=True))

    def measure(self) -> dict:
        phases = [("tune", self.tune)] if self.fast and self.a.tune else []
        phases += [("correctness", self.correctness)] + [(f"ar_b{B}", lambda B=B: self.ar(B)) for B in self.a.batches]
        phases += [(f"verify{self.a.block}", self.verify), ("e2e", self.e2e), ("state_memory", self.memory)]
        if self.fast and self.a.profile:
            phases.append(("kernel_profile", self.profile))
        shapes = self.run.R.setdefault("shapes", {})
        shapes[self.shape] = self.info
        for key, fn in phases:
            v = self.run.phase(f"{self.shape}:{key}", fn, keep=False)
            if v is not None:
                self.info[key] = v
        return self.info


def table(R: dict, batches: list[int], block: int) -> list[str]:
    L = [f"shape              AR B{batches[0]} ms  MBU   | AR B{batches[-1]} tok/s  MBU   | verify{block}/AR  +commit "
         f"| stock tau / speedup (formula), = AR"]
    for name, S in R.get("shapes", {}).items():
        b1, bn, v = S.get(f"ar_b{batches[0]}", {}), S.get(f"ar_b{batches[-1]}", {}), S.get(f"verify{block}", {})
        e = next((x for x in S.get("e2e", {}).values() if isinstance(x, dict)), {})
        L.append(f"{name:<18} {fmt(b1.get('step_s', 0) * 1e3, '{:.2f}'):>8} {fmt(b1.get('mbu', 0) * 100, '{:.1f}')}% | "
                 f"{fmt(bn.get('tok_s'), '{:.0f}'):>10} {fmt(bn.get('mbu', 0) * 100, '{:.1f}')}% | "
                 f"{fmt(v.get('x_ar')):>10} {fmt(v.get('commit_x_ar')):>8} | {fmt(e.get('tau'), '{:.2f}')} / "
                 f"{fmt(e.get('speedup'), '{:.2f}')}x ({fmt(e.get('formula_speedup'), '{:.2f}')}x), "
                 f"{e.get('outputs_equal_ar', '-')}")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        if args.shapes == ["qwen3.8-27b", "muse-glimmer-30b"]:
            args.shapes = ["tiny-hybrid", "tiny-muse"]
        args.context, args.batches, args.block, args.new = 24, [1, 2], 4, 10
    rn = Run("targets", args)
    bw = rn.phase("copy_bw_Bps", rn.copy_bandwidth) or float("nan")
    for shape in args.shapes:
        t = rn.phase(f"{shape}:build", lambda shape=shape: Target(rn, args, shape), keep=False)
        if t is not None:
            t.bw = bw
            t.measure()
            del t
            if rn.cuda:
                torch.cuda.empty_cache()
    return rn.finish(table(rn.R, args.batches, args.block))

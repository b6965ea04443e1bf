"""``specpilot bench engine``: the engine's decode and verify steps at hardware speed, and stock
end to end with the replay drafter, on one target.

On a random-weight target of ``--shape`` (default the Qwen3-8B shape, built on the device: no
files) or a checkpoint folder (``--target``, e.g. a tiny build on the CPU), through the engine's
runner (:class:`TargetRunner`: CUDA graphs and the Triton step on a GPU, the eager forward on the
CPU):

1. ``copy_bw``: device copy bandwidth (bytes read + written / time), the MBU denominator;
2. ``correctness`` (the Triton step): a CUDA-graph replay bit-equal to the same step without a
   graph (1 and 16 tokens); each verify width's first row bit-equal to decoding that token alone
   (row independence: why speculative outputs equal AR's); the step's logits against the eager
   forward (relative error);
3. ``ar``: the AR decode step per batch x context (median of CUDA-event times of the runner's
   step), tok/s and MBU = (weights + live KV read per step) / step / copy bandwidth; on a GPU also
   the PyTorch-ops graph and the eager step for contrast;
4. ``verify``: the verify step of each ``--widths`` tokens at batch 1 as a multiple of the AR step,
   and 16 tokens with the drafter's captured layers (what the stock engine runs);
5. ``e2e``: stock with the replay drafter (``--profiles``; a random DFlash drafter of the shape
   runs each step for its cost) against AR on the same prompts: tau, speedup, outputs equal AR,
   and the no-hidden-overhead check measured / (tau x AR step / (verify + draft step)), the
   verify and draft steps from the run's own phase times;
6. ``profile`` (``--profile``, CUDA): device time per kernel of the AR step against the step;
7. ``peer`` (``--peer``): transformers ``generate`` on the same random tensors (dynamic cache,
   static cache, static cache with its ``torch.compile`` on a GPU): decode tok/s.

Replaces gpu_bench/bench_engine.py and cpu_step_costs.py (``--target`` on the CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..tuning import timing
from . import _engine as E
from ._common import Run, add_common, fmt, kernel_profile, random_tokens



def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "engine")
    p.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape (default qwen3-8b)")
    p.add_argument("--target", help="a target checkpoint folder instead of a random shape (no e2e, no peer)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="committed tokens before the step")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="verify widths at batch 1")
    p.add_argument("--block", type=int, default=16, help="stock's block (verify width) in the e2e phase")
    p.add_argument("--new", type=int, default=256, help="new tokens per e2e prompt")
    p.add_argument("--prompts", type=int, default=2, help="e2e prompts (batch 1, one after the other)")
    p.add_argument("--profiles", nargs="+", default=["study_stock", "dflash_qwen3_8b_gsm8k"],
                   help="replay profiles of the e2e phase")
    p.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto", help="the runner's kernels")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--no-contrast", dest="contrast", action="store_false",
                   help="skip the PyTorch-ops graph and eager steps (GPU)")
    p.add_argument("--profile", action="store_true", help="device time per kernel of the AR step (CUDA)")
    p.add_argument("--peer", action="store_true", help="transformers generate on the same random model")


class Engine:
    """The phases of the engine benchmark over one target (see the module docstring)."""

    def __init__(self, run: Run, args: argparse.Namespace):
        self.run, self.a = run, args
        self.dev, self.dt = run.device, run.dtype
        self.kernels = "torch" if run.dry or not run.cuda else args.kernels
        self.ctx = args.contexts[0]

    def build(self) -> dict:
        a, t = self.a, time.time()
        if a.target:
            self.model = E.load_target(a.target, device=self.dev, dtype=self.dt)
            self.drafter = None
        elif self.run.dry:
            self.model = E.dry_target(a.shape, seed=a.seed)
            self.drafter = E.dry_drafter(self.model, a.shape, a.block, seed=a.seed)
        else:
            self.model = E.build_target(a.shape, self.dev, self.dt, a.seed)
            self.drafter = E.build_drafter(a.shape, self.dev, self.dt, a.seed, a.block)
        self.run.sync()
        params = sum(p.numel() for p in self.model.parameters())
        self.vocab = self.model.config.vocab_size
        timing.log(f"target {a.target or a.shape}: {params / 1e9:.3f} B parameters in {time.time() - t:.1f} s")
        return {"target": a.target or a.shape, "params": params, "dtype": str(self.model.lm_head.weight.dtype),
                "weight_bytes_per_step_b1": E.weight_bytes_per_step(self.model, 1), "build_s": time.time() - t}

    def runner(self, B: int, S: int, capture=(), kernels: str | None = None, graphs: bool | None = None):
        graphs = self.run.cuda if graphs is None else graphs
        return E.runner(self.model, B, S, capture, graphs, kernels or self.kernels)

    def at_context(self, r, ctx: int, seed: int):
        """Random K/V in the cache (never time on zeros) and every row's length set to ``ctx``."""
        g = torch.Generator(device=self.dev).manual_seed(seed)
        for buf in (self.model.cache.k, self.model.cache.v):
            buf.normal_(generator=g)
        r.length.fill_(ctx)
        r._bound = ctx
        return g

    # -- phases ------------------------------------------------------------------------------
    def correctness(self) -> dict:
        """Graph replay = no graph, row independence, error against the eager forward (Triton step)."""
        ctx = self.ctx
        r = E.fast_runner(self.model, 1, ctx + 64)
        fast = E.step_fast(r)
        g = self.at_context(r, ctx, 5)
        T = max(w for w in self.a.widths if w <= 16)
        blk = torch.randint(0, self.vocab, (1, T), device=self.dev, generator=g)
        with torch.inference_mode():
            gT, g1 = r.verify(blk)[0].clone(), r.verify(blk[:, :1])[0].clone()
            # without a graph (on the CPU the runner's step is already uncaptured: the same call)
            fT, f1 = (fast.forward(blk, r.length)[0].clone(), fast.forward(blk[:, :1], r.length)[0].clone()) \
                if self.run.cuda else (gT, g1)
            eager = self.model(blk, r.length, E.chain_ancestors(1, T, self.dev))[0]
            rows = {str(T): bool(torch.equal(fT[:, 0], f1[:, 0]))}
            for w in self.a.widths:
                if w in (1, T):
                    continue
                b = torch.randint(0, self.vocab, (1, w), device=self.dev, generator=g)
                b[:, 0] = blk[:, 0]
                rows[str(w)] = bool(torch.equal(fast.forward(b, r.length)[0][:, 0], f1[:, 0]))
        d = {"width": T, "graph_equals_nograph": bool(torch.equal(gT, fT) and torch.equal(g1, f1)),
             "row_independent": rows, "rel_err_vs_eager": timing.rel_err(fT, eager),
             "argmax_agree_vs_eager": float((fT.argmax(-1) == eager.argmax(-1)).float().mean())}
        d["ok"] = d["graph_equals_nograph"] and all(rows.values())
        timing.log(f"correctness: {d}")
        return d

    def ar_step(self, B: int, ctx: int, kernels: str | None = None, graphs: bool | None = None) -> dict:
        """Median AR decode step (the runner's one-token step) at context ``ctx``, with its MBU."""
        r = self.runner(B, ctx + 256, kernels=kernels, graphs=graphs)
        g = self.at_context(r, ctx, 7)
        tok = torch.randint(0, self.vocab, (B, 1), device=self.dev, generator=g)
        t = self.run.median_s(lambda: r.verify(tok))
        wb, kvb = E.weight_bytes_per_step(self.model, B), E.kv_bytes_per_step(self.model, B, ctx)
        return {"B": B, "ctx": ctx, "step_s": t, "tok_s": B / t, "weight_bytes": wb, "kv_bytes": kvb,
                "mbu": (wb + kvb) / t / self.bw}

    def ar(self) -> dict:
        res = {}
        for ctx in self.a.contexts:
            for B in self.a.batches:
                d = res[f"b{B}_ctx{ctx}"] = self.ar_step(B, ctx)
                timing.log(f"AR {self.kernels} B={B} ctx={ctx}: {d['step_s'] * 1e3:.3f} ms, {d['tok_s']:.1f} tok/s, "
                           f"MBU {d['mbu'] * 100:.1f}%")
        if self.run.cuda and self.a.contrast and self.kernels != "torch":
            for B in self.a.batches:
                res[f"torch_graph_b{B}_ctx{self.ctx}"] = self.ar_step(B, self.ctx, kernels="torch")
            res[f"eager_b1_ctx{self.ctx}"] = self.ar_step(1, self.ctx, kernels="torch", graphs=False)
        return res

    def verify(self) -> dict:
        """Verify step of each width at batch 1 as a multiple of the 1-token step."""
        ctx, row = self.ctx, {}
        r = self.runner(1, ctx + max(self.a.widths) + 64)
        g = self.at_context(r, ctx, 9)
        for T in self.a.widths:
            blk = torch.randint(0, self.vocab, (1, T), device=self.dev, generator=g)
            row[str(T)] = {"s": self.run.median_s(lambda: r.verify(blk), 15)}
        if self.drafter is not None:
            cap = tuple(self.drafter.config.target_layer_ids)
            r2 = self.runner(1, ctx + self.a.block + 64, capture=cap)
            self.at_context(r2, ctx, 9)
            blk = torch.randint(0, self.vocab, (1, self.a.block), device=self.dev, generator=g)
            row[f"{self.a.block}_capture"] = {"s": self.run.median_s(lambda: r2.verify(blk), 15)}
        one = row[str(self.a.widths[0])]["s"]
        for v in row.values():
            v["x_ar"] = v["s"] / one
        timing.log("verify: " + ", ".join(f"T={T}: {v['s'] * 1e3:.3f} ms ({v['x_ar']:.3f}x)" for T, v in row.items()))
        return {"ctx": ctx, "kernels": self.kernels, "steps": row}

    def e2e(self) -> dict:
        """Stock (replay drafter) against AR, batch 1, prompt after prompt; formula check."""
        a, ctx = self.a, self.ctx
        S = ctx + a.new + 2 * a.block + 64
        prompts = [random_tokens(ctx, self.vocab, a.seed + 100 + i) for i in range(a.prompts)]
        r = self.runner(1, S)
        E.generate_ar(r, [prompts[0]], 8)  # warm-up: graph captures
        ar = [E.generate_ar(r, [p], a.new)[0] for p in prompts]
        ar_s = sum(x.decode_s for x in ar)
        t_ar = self.run.R.get("verify", {}).get("steps", {}).get("1", {}).get("s") or ar_s / (a.prompts * (a.new - 1))
        res = {"ctx": ctx, "new_tokens": a.new, "block": a.block, "prompts": a.prompts, "ar_decode_s": ar_s,
               "ar_step_s": t_ar, "ar_step_s_loop": ar_s / (a.prompts * (a.new - 1)), "profiles": {}}
        cap = tuple(self.drafter.config.target_layer_ids)
        rs = self.runner(1, S, capture=cap)
        net = E.DFlashProposer(self.drafter, block_size=a.block)  # drafts as the runner's backend runs
        for name in a.profiles:
            prof = E.load_profile(name)
            E.replay_generate(rs, ar[0].output_ids, prompts[0], prof, self.vocab, net, 2 * a.block, a.block, 99)
            rows = [E.replay_generate(rs, ar[i].output_ids, p, prof, self.vocab, net, a.new, a.block, i, True)
                    for i, p in enumerate(prompts)]
            steps = [c for x in rows for c in x.committed_per_step]
            tau = sum(steps) / len(steps)
            t_verify = sum(x.verify_s for x in rows) / len(steps)
            t_draft = sum(x.draft_s for x in rows) / len(steps)
            speed = ar_s / sum(x.decode_s for x in rows)
            formula = tau * t_ar / (t_verify + t_draft)
            d = res["profiles"][prof.name] = {
                "expected_tau": E.expected_tau(prof, a.block), "tau": tau, "verify_steps": len(steps),
                "speedup": speed, "verify_step_s": t_verify, "draft_step_s": t_draft, "formula_speedup": formula,
                "measured_over_formula": speed / formula, "synthetic": True,
                "outputs_equal_ar": all(x.output_ids == y.output_ids for x, y in zip(rows, ar))}
            timing.log(f"e2e {prof.name}: tau {tau:.2f} (expected {d['expected_tau']:.2f}), speedup {speed:.2f}x, "
                       f"formula {formula:.2f}x, equal AR {d['outputs_equal_ar']}")
        return res

    def profile(self) -> dict:
        r = self.runner(1, self.ctx + 64)
        g = self.at_context(r, self.ctx, 3)
        tok = torch.randint(0, self.vocab, (1, 1), device=self.dev, generator=g)
        d = kernel_profile(lambda: r.verify(tok))
        step = self.run.R.get("ar", {}).get(f"b1_ctx{self.ctx}", {}).get("step_s")
        if step:
            d["step_ms"], d["gap_ms"] = step * 1e3, step * 1e3 - d["kernel_sum_ms"]
        return d


def peer(run: Run, a: argparse.Namespace) -> dict:
    """transformers ``generate`` on a model of the same shape and random tensors (by name and
    seed), batch 1, a prompt of the first context: decode tok/s from the difference of two
    generation lengths (prefill excluded), per cache mode."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    d = E.hf_config(E.target_config(a.shape))
    d.pop("architectures", None)
    if run.dry:
        d.update(num_hidden_layers=E.DRY_LAYERS, layer_types=d.get("layer_types", [])[:E.DRY_LAYERS] or None)
        d = {k: v for k, v in d.items() if v is not None}
    with torch.device(run.device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d), dtype=run.dtype)
    E.fill_random_(model, a.seed)
    ids = torch.tensor([random_tokens(a.contexts[0], d["vocab_size"], a.seed)], device=run.device)

    def gen(n, **kw):
        run.sync()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, **kw)
        run.sync()
        return time.perf_counter() - t

    small, big = (2, 6) if run.dry else (16, 144)
    modes = {"dynamic_eager": {}, "static_no_compile": {"cache_implementation": "static", "disable_compile": True}}
    if run.cuda:
        modes["static_compile"] = {"cache_implementation": "static"}
    res = {"transformers": transformers.__version__}
    for name, kw in modes.items():
        gen(big, **kw)  # warm-up (compile, cudagraph recording)
        tb, ts = min(gen(big, **kw) for _ in range(2)), min(gen(small, **kw) for _ in range(2))
        per = (tb - ts) / (big - small)
        res[name] = {"decode_tok_s": 1 / per, "total_tok_s": big / tb}
        timing.log(f"peer {name}: {1 / per:.1f} tok/s decode")
    return res


def table(R: dict, kernels: str) -> list[str]:
    L = [f"target {R.get('build', {}).get('target')}, kernels {kernels}, copy bandwidth "
         f"{fmt(R.get('copy_bw_Bps', 0) / 1e12)} TB/s", "AR step               ms     tok/s    MBU"]
    for k, d in R.get("ar", {}).items():
        L.append(f"  {k:<20} {fmt(d['step_s'] * 1e3):>7} {fmt(d['tok_s'], '{:.1f}'):>8} {fmt(d['mbu'] * 100, '{:.1f}'):>6}%")
    v = R.get("verify", {}).get("steps", {})
    if v:
        L.append("verify / AR (batch 1): " + "  ".join(f"{T}: {fmt(x['x_ar'])}" for T, x in v.items()))
    c = R.get("correctness")
    if c:
        L.append(f"correctness: graph = no graph {c['graph_equals_nograph']}, rows independent "
                 f"{all(c['row_independent'].values())}, rel err vs eager {fmt(c['rel_err_vs_eager'], '{:.4f}')}")
    for name, d in R.get("e2e", {}).get("profiles", {}).items():
        L.append(f"stock e2e {name}: tau {fmt(d['tau'], '{:.2f}')} (expected {fmt(d['expected_tau'], '{:.2f}')}), "
                 f"{fmt(d['speedup'], '{:.2f}')}x AR, formula {fmt(d['formula_speedup'], '{:.2f}')}x, "
                 f"ratio {fmt(d['measured_over_formula'])}, outputs = AR {d['outputs_equal_ar']}")
    for name, d in R.get("peer", {}).items():
        if isinstance(d, dict):
            L.append(f"transformers {name}: {fmt(d['decode_tok_s'], '{:.1f}')} tok/s decode")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.shape = "tiny" if args.shape == "qwen3-8b" else args.shape
        args.batches, args.contexts, args.widths, args.block = [1, 2], [48], [1, 4], 4
        args.new, args.prompts, args.profiles = 24, 1, args.profiles[:1]
    if args.threads:
        torch.set_num_threads(args.threads)
    rn = Run("engine", args)
    b = Engine(rn, args)
    b.bw = rn.phase("copy_bw_Bps", rn.copy_bandwidth) or float("nan")
    rn.phase("build", b.build)
    if (rn.cuda and b.kernels != "torch") or rn.dry:
        rn.phase("correctness", b.correctness)
    rn.phase("ar", b.ar)
    rn.phase("verify", b.verify)
    if b.drafter is not None:
        rn.phase("e2e", b.e2e)
    if args.profile and rn.cuda:
        rn.phase("profile", b.profile)
    if args.peer and not args.target:
        rn.phase("peer", lambda: peer(rn, args))
    return rn.finish(table(rn.R, b.kernels))

"""``specpilot bench w12``: lossless 12-bit weights in the engine's fast path against bf16 (issue
48: the bf16 kernel with a 12-bit loader, bit-identical outputs, speed where weights dominate).

Parts (``--part``, default all):

1. ``roles``: per matmul role of ``--shape`` (its fused shapes, every layer kind) and row count of
   ``--ms``: the step's call with the role's table config through the bf16 loader and through the
   12-bit loader (:func:`specpilot.kernels.step.linear` on tile planes, escapes planted), bit for
   bit; on CUDA their device times (CUDA graphs over weight copies beyond the L2 cache), bytes
   read and achieved bandwidth;
2. ``code``: instructions per weight of the matmul's main loop, both loaders, each role's table
   config at 1 and 16 rows, from the machine code (sm_90 SASS compiled on this machine,
   :mod:`specpilot.kernels.inspect`; no GPU needed);
3. ``choice`` (CUDA): the kernel sub-agent's tuner (:func:`tune_w12_choice`) over ``--ms``;
4. ``step``: the engine's step (:class:`TargetRunner`, Triton step under CUDA graphs; the dry run
   uncaptured under the interpreter), batch 1, a ``--context``-token prompt prefilled, a verify of
   M tokens per M of ``--ms``: in bf16 first (``--rounds`` timings each, logits kept), then the
   same model converted in place to 12 bits (the tuned choice, or every role; no bf16 copy where a
   role runs w12 at every M) and the same calls: prefill and step logits bit-equal to bf16's,
   step times, weight bytes per step and achieved bandwidth.

End to end (AR, stock and stock in w12 through the product CLI, token-forced against the bf16
teacher pass) is ``specpilot bench serving --variant 'w12={"weight_format": "w12"}'``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics

import torch

from ..tuning import timing
from . import _engine as E
from ._common import Run, add_common, fmt, random_tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "w12")
    p.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape (default qwen3-8b)")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per matmul (verify widths)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens prefilled before the step")
    p.add_argument("--rounds", type=int, default=5, help="timings per (format, M) of the step")
    p.add_argument("--part", nargs="+", choices=("roles", "code", "choice", "step", "all"), default=["all"],
                   help="parts to run, in this order: roles code choice step (default all)")
    p.add_argument("--choice", choices=("tuned", "every"), default="tuned",
                   help="the step's w12 roles: the choice phase's (tuned) or every role at every M")


class W12:
    def __init__(self, run: Run, a: argparse.Namespace):
        self.run, self.a, self.dev = run, a, run.device
        self.cfg = E.target_config(a.shape) if not run.dry else E.dry_target(a.shape).config
        self.tuned: dict | None = None

    def roles(self) -> dict:
        """Per role, shape and M: bf16 loader against 12-bit loader, bit for bit; times on CUDA."""
        K, W = E.triton_step(), E.tuning_w12()
        l2 = torch.cuda.get_device_properties(self.dev).L2_cache_size if self.run.cuda else 0
        rows, bw = [], (self.run.copy_bandwidth() if self.run.cuda else None)
        for role, shapes in W.role_shapes(self.cfg).items():
            cfgs = E.config_tiers(E.DEFAULT_CONFIGS[role])
            for j, (n, k, layers) in enumerate(shapes):
                p = W._Probe(role, n, k, self.dev, l2, self.a.seed + j)
                for m in self.a.ms:
                    c = E.tier_for(cfgs, m)
                    a, b = p.call(K, c, m), p.call(K, c, m, w12=True)
                    d = {"role": role, "N": n, "K": k, "layers": layers, "M": m, "config": c.key(),
                         "bit_equal": bool(torch.equal(a.view(torch.int16), b.view(torch.int16))),
                         "bytes_bf16": 2 * n * k, "bytes_w12": p.ps[0].nbytes(), "escape_groups": p.ps[0].escape_groups}
                    if self.run.cuda:
                        d["bf16_us"] = p.timed(K, c, m, False, timing.graph_us)
                        d["w12_us"] = p.timed(K, c, m, True, timing.graph_us)
                        d["speedup"] = d["bf16_us"] / d["w12_us"]
                        d["bf16_bw_frac"] = d["bytes_bf16"] / (d["bf16_us"] * 1e-6) / bw
                        d["w12_bw_frac"] = d["bytes_w12"] / (d["w12_us"] * 1e-6) / bw
                    rows.append(d)
                    timing.log(f"role {role} {n}x{k} M={m} {c.key()}: bit-equal {d['bit_equal']}"
                               + (f", bf16 {d['bf16_us']:.1f} us, w12 {d['w12_us']:.1f} us, x{d['speedup']:.3f}"
                                  if self.run.cuda else ""))
                del p
        return {"rows": rows, "all_bit_equal": all(d["bit_equal"] for d in rows), "copy_bandwidth": bw}

    def code(self) -> dict:
        """Instructions per weight of the main loop (sm_90 SASS), both loaders, each role's table
        config at 1 and 16 rows."""
        roles = {}
        for role in E.W12_ROLES:
            norm, res, swiglu = E.role_layout(role)
            for m in (1, 16):
                roles[f"{role}@{m}"] = (E.tier_for(E.config_tiers(E.DEFAULT_CONFIGS[role]), m).key(), norm, res, swiglu)
        rows = []
        for p in E.kernel_inspect().role_profiles(roles, (1, 16)):
            role, m = p.pop("role").split("@")
            if int(m) != p["M"]:
                continue  # each role's config at its own row count
            p["role"] = role
            rows.append(p)
            timing.log(f"code {role} M={p['M']} {p['config']} {p['loader']}: {p['thread_instructions_per_weight']:.2f} "
                       f"instructions/weight, {p['registers']} registers, mma {p['mma']}, kWidth {p['kwidth']}")
        return {"rows": rows}

    def choice(self) -> dict:
        self.run.need_cuda("the w12 choice tuning")
        res = E.tune_w12_choice(self.cfg, tuple(self.a.ms), log=timing.log)
        self.tuned = res["w12_choice"]
        return res

    def step(self) -> dict:
        a, dry = self.a, self.run.dry
        model = (E.dry_target(a.shape, seed=a.seed) if dry
                 else E.build_target(a.shape, self.dev, torch.bfloat16, a.seed))
        for i, layer in enumerate(model.model.layers[:2]):  # escapes, as real checkpoints have: plant some
            for lin in (layer.mlp.gate_proj, layer.mlp.down_proj):
                E.plant_escapes(lin.weight, seed=i)
        if dry:  # the interpreter computes in fp32: matrices holding bf16 values, so both formats hold them exactly
            for prm in model.parameters():
                if prm.dim() == 2:
                    prm.data.copy_(prm.data.to(torch.bfloat16))
        V, ctx = model.config.vocab_size, (24 if dry else a.context)
        prompt = random_tokens(ctx, V, a.seed + 5)
        toks = {m: torch.randint(0, V, (1, m), generator=torch.Generator().manual_seed(m)).to(self.dev) for m in a.ms}
        bf16_bytes = E.weight_bytes_per_step(model, 1)
        res = {"bf16": self._phase(model, None, prompt, toks), "weight_bytes_bf16": bf16_bytes}
        choice = E.parse_choice(self.tuned) if (a.choice == "tuned" and self.tuned) else E.every_w12_role()
        res["w12_choice"] = E.choice_json(choice)
        res["w12"] = self._phase(model, choice, prompt, toks)
        w12_bytes = E.weight_bytes_per_step(model, 1)
        res["weight_bytes_w12"] = w12_bytes
        res["prefill_bit_equal"] = res["bf16"].pop("prefill") == res["w12"].pop("prefill")
        steps = []
        for m in a.ms:
            b, w = res["bf16"]["steps"][str(m)], res["w12"]["steps"][str(m)]
            d = {"M": m, "bit_equal": b.pop("logits") == w.pop("logits"), "bf16_ms": b["ms"], "w12_ms": w["ms"]}
            if self.run.cuda:
                d.update(speedup=b["ms"] / w["ms"], bf16_weight_tb_s=bf16_bytes / b["ms"] / 1e9,
                         w12_weight_tb_s=w12_bytes / w["ms"] / 1e9)
            steps.append(d)
            timing.log(f"step M={m}: bit-equal {d['bit_equal']}, bf16 {fmt(b['ms'])} ms, w12 {fmt(w['ms'])} ms"
                       + (f", x{d['speedup']:.3f}" if self.run.cuda else ""))
        res["steps"] = steps
        return res

    def _phase(self, model, choice, prompt: list[int], toks: dict) -> dict:
        """Prefill + verify of every M in one format (choice None: bf16): logit hashes and times."""
        r = E.w12_runner(model, len(prompt) + max(toks) + 8, choice, graphs=self.run.cuda)
        out = {"prepared": r.backend.w12_stats if choice else None}
        last, _, _ = r.prefill([prompt])
        out["prefill"] = _digest(last)
        out["steps"] = {}
        for m, t in toks.items():
            logits = r.verify(t)[0]
            d = {"logits": _digest(logits)}
            rounds = 1 if self.run.dry else self.a.rounds
            times = [self.run.median_s(lambda: r.verify(t), 20, 3) * 1e3 for _ in range(rounds)]
            d["ms"] = statistics.median(times)
            out["steps"][str(m)] = d
        r.model.state = None  # the cache of this phase's runner
        return out


def _digest(t: torch.Tensor) -> str:
    """A bit-exact fingerprint of a tensor (its bytes hashed on the host)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()


def table(R: dict) -> list[str]:
    L = []
    ro = R.get("roles", {})
    if ro:
        L.append(f"roles: every role x shape x M bit-equal: {ro.get('all_bit_equal')}")
        for d in ro.get("rows", []):
            if "speedup" in d:
                L.append(f"  {d['role']:<7} {d['N']}x{d['K']} M={d['M']:<3} {d['config']:<22} "
                         f"bf16 {fmt(d['bf16_us'], '{:.1f}')} "
                         f"us ({fmt(d['bf16_bw_frac'], '{:.2f}')} of copy bw), w12 {fmt(d['w12_us'], '{:.1f}')} us "
                         f"({fmt(d['w12_bw_frac'], '{:.2f}')}), {fmt(d['speedup'])}x")
    for d in R.get("code", {}).get("rows", []):
        L.append(f"code {d['role']:<7} M={d['M']:<2} {d['config']:<22} {d['loader']:<4} "
                 f"{d['thread_instructions_per_weight']:.2f} instr/weight, {d['registers']} regs, mma {d['mma']}")
    ch = R.get("choice", {})
    if ch.get("w12_choice") is not None:
        L.append(f"choice: {ch['w12_choice']} (lean: {ch.get('w12_choice_lean')})")
    st = R.get("step", {})
    if st.get("steps"):
        L.append(f"step: prefill bit-equal {st.get('prefill_bit_equal')}; weight bytes per step bf16 "
                 f"{st['weight_bytes_bf16'] / 1e9:.2f} GB, w12 {st['weight_bytes_w12'] / 1e9:.2f} GB")
        for d in st["steps"]:
            L.append(f"  M={d['M']:<3} bit-equal {d['bit_equal']}  bf16 {fmt(d['bf16_ms'])} ms  "
                     f"w12 {fmt(d['w12_ms'])} ms  "
                     f"{fmt(d.get('speedup'))}x  weights {fmt(d.get('bf16_weight_tb_s'), '{:.2f}')} / "
                     f"{fmt(d.get('w12_weight_tb_s'), '{:.2f}')} TB/s")
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.ms = [1, 4]
        args.shape = "tiny" if args.shape == "qwen3-8b" else args.shape
    rn = Run("w12", args)
    b = W12(rn, args)
    parts = [p for p in ("roles", "code", "choice", "step") if p in args.part or "all" in args.part]
    for part in parts:
        if part == "choice" and not rn.cuda:
            rn.R["choice"] = {"skipped": "the choice is timed on a GPU"}
            continue
        rn.phase(part, getattr(b, part))
    return rn.finish(table({k: v for k, v in rn.R.items() if not (isinstance(v, dict) and "skipped" in v)}))

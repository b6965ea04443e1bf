#!/usr/bin/env python
"""The engine at hardware speed on the GPU (issue 7): one run measures everything, side by side.

What it does, in one go, under a hard time budget (``--budget-s``), on a random-weight target of a
realistic shape (default Qwen3-8B, built directly on the GPU: no checkpoint files):

0. starts the peer in a second process: transformers ``generate`` on the *same* random model
   (same tensors by name and seed) and the same prompt: dynamic cache (eager), static cache
   without compile, then static cache with its automatic ``torch.compile`` (the warm-up runs while
   this process works; it is skipped with a note if it would overrun the budget); the peer's timed
   runs never overlap our timings (they hand over through files);
1. ceilings: device-to-device copy bandwidth (bytes read + written / time);
2. the Triton matmul configs: compiled in parallel worker processes, checked against an fp32
   reference, timed over all 36 layers' weights (rotating beyond L2) at 1 row; the fastest per
   role (qkv, o, gate_up, down, lm_head) is used from then on; cuBLAS (F.linear) timed alike;
3. correctness before timing: Triton step vs the eager PyTorch step (relative error of logits),
   graph replay vs the same step without a graph (bit-identical), a 16-token block vs decoding its
   first token alone (bit-identical: row independence), greedy outputs of the graph path vs the
   eager path for dozens of tokens (both the Triton and the PyTorch step);
4. (a) AR decode step time, tok/s and MBU (weights + KV read per step / time / copy bandwidth),
   batch 1 and 16, context 512 and 4096; the PyTorch-ops graph and the eager step for contrast;
5. (b) verify-step time for blocks of 1, 2, 4, 8, 16, 32 tokens as a multiple of the AR step;
6. a profile of one step: kernel time per kernel kind (torch.profiler over graph replays) against
   the step's wall time, and the matmul bandwidth per role;
7. (c) stock end-to-end speedup over AR with the replay drafter (acceptance profiles under
   config/profiles, a random DFlash drafter of the real shape running each step), tau measured,
   outputs checked equal to AR, and the no-hidden-overhead check: measured speedup vs
   tau x AR step / (verify step + draft step);
8. (d) the peer's numbers; our AR step re-timed after the peer has exited.

Writes ``engine.json`` (all numbers) and ``engine_table.txt`` under ``--out-dir`` (default $OUT)
and prints the table last. Run on the GPU machine from the repository root::

    PYTHONUNBUFFERED=1 python benchmarks/bench_engine.py --budget-s 280

``--dry-run`` runs the same logic on the CPU with the tiny shape (PyTorch kernels, no graphs, no
compile): it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(Path(__file__).resolve().parent)]

from _timing import (LOG, T0, capture_graph, compile_linear, copy_bandwidth, event_times, log,  # noqa: E402
                     rel_err, wall_times)


def make_prompt(length: int, vocab: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def wait_file(path: Path, deadline: float, proc=None) -> bool:
    while time.time() < deadline:
        if path.exists():
            return True
        if proc is not None and proc.poll() is not None:
            return path.exists()
        time.sleep(0.2)
    return path.exists()


# =============================================================================================
# the peer: transformers generate on the same random model
# =============================================================================================


def hf_worker(args) -> int:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from specpilot.models.random_checkpoint import fill_random_, hf_config, target_config

    sig = Path(args.sig_dir)
    res: dict = {"transformers": transformers.__version__}
    out = sig / "hf.json"

    def save():
        out.write_text(json.dumps(res, indent=1))

    dev = "cuda" if not args.dry_run else "cpu"
    dtype = torch.bfloat16 if not args.dry_run else torch.float32

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    t = time.time()
    d = hf_config(target_config(args.shape))
    d.pop("architectures", None)
    cfg = AutoConfig.for_model(**d)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    fill_random_(model, args.seed)
    model.eval()
    res["build_s"] = time.time() - t
    prompt = make_prompt(args.prompt_len, cfg.vocab_size, args.seed)
    ids = torch.tensor([prompt], device=dev)
    mask = torch.ones_like(ids)

    def gen(n, **kw):
        sync()
        t0 = time.perf_counter()
        o = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, **kw)
        sync()
        return time.perf_counter() - t0, o[0, ids.shape[1]:].tolist()

    def mode(name, small, big, reps=1, **kw):
        ts, tb = [], []
        for _ in range(reps):
            tb.append(gen(big, **kw)[0])
            ts.append(gen(small, **kw)[0])
        t_big, t_small = min(tb), min(ts)
        per_tok = (t_big - t_small) / (big - small)
        res[name] = {"new_tokens": big, "total_s": t_big, "tok_s_total": big / t_big,
                     "decode_s_per_token": per_tok, "decode_tok_s": 1.0 / per_tok,
                     "prefill_plus_first_s": t_small - (small - 1) * per_tok}
        log(f"hf {name}: {1 / per_tok:.1f} tok/s decode, {big / t_big:.1f} tok/s total")

    (sig / "hf_built").write_text("1")
    save()
    if not wait_file(sig / "go_eager", time.time() + 600):
        return 1
    try:
        gen(4)  # warm-up (cuBLAS handles, allocator)
        mode("dynamic_eager", 8, 24)
        mode("static_no_compile", 8, 24, cache_implementation="static", disable_compile=True)
    except Exception as e:  # noqa: BLE001
        res["eager_error"] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    save()
    (sig / "hf_eager_done").write_text("1")
    if args.dry_run or args.no_compile:
        res["static_compile"] = {"skipped": "dry run / --no-compile"}
        save()
        (sig / "hf_ready").write_text("1")
        return 0
    big, small = 144, 16
    try:
        t = time.time()
        gen(big, cache_implementation="static")  # compiles (the ~2-minute warm-up)
        res["compile_warmup_s"] = time.time() - t
        t = time.time()
        gen(big, cache_implementation="static")  # cudagraph recording settles
        gen(small, cache_implementation="static")
        res["compile_warmup2_s"] = time.time() - t
        log(f"hf compile warm-up {res['compile_warmup_s']:.1f} s + {res['compile_warmup2_s']:.1f} s")
    except Exception as e:  # noqa: BLE001
        res["compile_error"] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    save()
    (sig / "hf_ready").write_text("1")
    if "compile_error" in res or not wait_file(sig / "go_compiled", time.time() + 600):
        return 0
    try:
        mode("static_compile", small, big, reps=2, cache_implementation="static")
        res["static_compile"]["first_tokens"] = gen(32, cache_implementation="static")[1]
    except Exception as e:  # noqa: BLE001
        res["compile_error"] = f"{type(e).__name__}: {e}"
    save()
    return 0


# =============================================================================================
# compile workers: fill Triton's cache in parallel
# =============================================================================================


def compile_worker(args) -> int:
    import torch

    from specpilot.engine import triton_step as K

    jobs = json.loads(args.compile_jobs)
    dev = "cuda"
    torch.manual_seed(0)
    n, k = 256, 512
    x = torch.randn(3, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2 * n, k, device=dev, dtype=torch.bfloat16) * 0.02
    nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(3, n, device=dev, dtype=torch.bfloat16)
    xn = torch.empty_like(x)
    K.rmsnorm(x, nw, xn, 1e-6)
    for variant, key in jobs:
        compile_linear(K, variant, key, x, w, out, nw)
    return 0


def precompile(out_dir: Path, workers: int = 8) -> list:
    from specpilot.engine import triton_step as K

    jobs = [(v, c.key()) for c in K.CANDIDATES for v in ("norm", "res", "swiglu", "swiglu_pre", "plain")]
    procs = []
    for i in range(workers):
        share = jobs[i::workers]
        if not share:
            continue
        logf = open(out_dir / f".compile_{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--compile-worker", json.dumps(share)],
                                       stdout=logf, stderr=subprocess.STDOUT), logf))
    return procs


# =============================================================================================
# timing helpers
# =============================================================================================


class Timer:
    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def median(self, fn, iters: int = 20, warmup: int = 3) -> tuple[float, float]:
        """(median seconds per call, mean seconds per call back to back) of ``fn``."""
        for _ in range(warmup):
            fn()
        self.sync()
        times, total = event_times(fn, iters) if self.cuda else wall_times(fn, iters)
        return statistics.median(times), total / iters

    def graph(self, fn, iters: int = 10) -> float:
        """Median seconds of one replay of a CUDA graph of ``fn``."""
        return self.median(capture_graph(fn).replay, iters, 2)[0]


# =============================================================================================
# main benchmark
# =============================================================================================


class Bench:
    def __init__(self, args):
        import torch

        self.args = args
        self.torch = torch
        self.R: dict = {"date": time.strftime("%Y-%m-%d"), "shape": args.shape, "budget_s": args.budget_s,
                        "log": LOG, "errors": []}
        self.out = Path(args.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.sig = Path(args.sig_dir)
        self.sig.mkdir(parents=True, exist_ok=True)
        for f in self.sig.glob("*"):
            f.unlink()
        self.dev = torch.device("cpu" if args.dry_run else "cuda")
        self.dtype = torch.float32 if args.dry_run else torch.bfloat16
        self.timer = Timer(self.dev)
        self.kernels = "torch" if args.dry_run else "triton"
        self.graphs = not args.dry_run
        self.hf = None
        self.draft_kernels = self.kernels

    # -- bookkeeping ---------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget_s - (time.time() - T0)

    def save(self):
        (self.out / "engine.json").write_text(json.dumps(self.R, indent=1, default=str))

    def phase(self, name, fn, need_s: float = 0.0):
        if self.left() < need_s:
            log(f"SKIP {name}: {self.left():.0f} s left, needs ~{need_s:.0f} s")
            self.R.setdefault("skipped", []).append(name)
            return None
        t = time.time()
        log(f"== {name}")
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001
            log(f"ERROR in {name}: {type(e).__name__}: {e}")
            log(traceback.format_exc())
            self.R["errors"].append({"phase": name, "error": f"{type(e).__name__}: {e}"})
            r = None
        self.R.setdefault("phase_s", {})[name] = round(time.time() - t, 2)
        self.save()
        return r

    # -- phases ------------------------------------------------------------------------------
    def start_peer(self):
        if self.args.skip_hf:
            return
        cmd = [sys.executable, __file__, "--hf-worker", "--shape", self.args.shape, "--sig-dir", str(self.sig),
               "--seed", str(self.args.seed), "--prompt-len", "512" if not self.args.dry_run else "48"]
        if self.args.dry_run:
            cmd.append("--dry-run")
        if self.args.no_compile:
            cmd.append("--no-compile")
        self.hf_log = open(self.out / "hf_worker.log", "w")
        self.hf = subprocess.Popen(cmd, stdout=self.hf_log, stderr=subprocess.STDOUT)
        log(f"peer started (pid {self.hf.pid})")

    def env(self):
        torch = self.torch
        import transformers

        e = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__}
        try:
            import triton

            e["triton"] = triton.__version__
        except Exception:  # noqa: BLE001
            e["triton"] = None
        if self.dev.type == "cuda":
            p = torch.cuda.get_device_properties(0)
            e.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,power.limit",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
                e["nvidia_smi"] = q.stdout.strip()
            except Exception:  # noqa: BLE001
                pass
        self.R["env"] = e
        log(json.dumps(e))

    def copy_bw(self):
        torch = self.torch
        n = (2**31 if self.dev.type == "cuda" else 2**24) // 2
        a = torch.empty(n, dtype=torch.bfloat16, device=self.dev).normal_()
        bw = copy_bandwidth(a, lambda fn: self.timer.median(fn, 10, 3)[0])
        self.R["copy_bw_Bps"] = bw
        log(f"copy bandwidth {bw / 1e12:.3f} TB/s ({2 * n * 2 / 2**30:.0f} GiB moved per copy)")

    def build(self):
        torch = self.torch
        from specpilot.engine.graphs import weight_bytes_per_step
        from specpilot.models.random_checkpoint import build_drafter, build_target

        t = time.time()
        self.model = build_target(self.args.shape, self.dev, self.dtype, self.args.seed)
        self.drafter = build_drafter(self.args.shape, self.dev, self.dtype, self.args.seed)
        self.sync()
        params = sum(p.numel() for p in self.model.parameters())
        self.R["model"] = {"params": params, "bytes": params * (2 if self.dtype == torch.bfloat16 else 4),
                           "weight_bytes_read_per_step_b1": weight_bytes_per_step(self.model, 1),
                           "drafter_params": sum(p.numel() for p in self.drafter.parameters()),
                           "build_s": time.time() - t}
        log(f"built target ({params / 1e9:.2f} B params) and drafter in {time.time() - t:.1f} s")

    def sync(self):
        self.timer.sync()

    def tune(self, procs):
        """Pick the Triton matmul config per role (correct + fastest at one row)."""
        torch = self.torch
        from torch.nn import functional as F

        from specpilot.engine import triton_step as K
        from specpilot.engine.graphs import fuse_weights

        for p, logf in procs:
            try:
                p.wait(timeout=max(5.0, min(150.0, self.left() - 120)))
            except subprocess.TimeoutExpired:
                p.kill()
            logf.close()
        clog = "".join((self.out / f".compile_{i}.log").read_text() for i in range(len(procs))
                       if (self.out / f".compile_{i}.log").exists())
        self.R["precompile_log"] = clog.splitlines()
        for i in range(len(procs)):
            (self.out / f".compile_{i}.log").unlink(missing_ok=True)
        m = self.model
        fuse_weights(m)
        c = m.config
        layers = m.model.layers
        H = c.hidden_size
        g = torch.Generator(device=self.dev).manual_seed(1)

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=self.dev, dtype=self.dtype)

        roles = {
            "qkv": dict(ws=[l.fused_qkv for l in layers], norms=[l.input_layernorm.weight for l in layers], K=H),
            "o": dict(ws=[l.self_attn.o_proj.weight for l in layers], res=True, K=c.num_attention_heads * c.head_dim),
            "gate_up": dict(ws=[l.fused_gate_up for l in layers], norms=[l.post_attention_layernorm.weight for l in layers],
                            swiglu=True, K=H),
            "down": dict(ws=[l.mlp.down_proj.weight for l in layers], res=True, K=c.intermediate_size),
            "lm_head": dict(ws=[m.lm_head.weight], norms=[m.model.norm.weight], K=H),
        }
        result, chosen = {}, {}
        for role, d in roles.items():
            Kdim = d["K"]
            N = d["ws"][0].shape[0] // (2 if d.get("swiglu") else 1)
            nbytes = sum(w.numel() * w.element_size() for w in d["ws"])
            rows = {}
            for M in (1, 16):
                x = rnd(M, Kdim)
                r0 = rnd(M, N)
                out = torch.empty(M, N, dtype=self.dtype, device=self.dev)
                # fp32 reference on layer 0
                w0 = d["ws"][0].float()
                xf = x.float()
                if d.get("norms"):
                    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * d["norms"][0].float()
                if d.get("swiglu"):
                    ref = F.silu(xf @ w0[:N].T) * (xf @ w0[N:].T)
                else:
                    ref = xf @ w0.T
                if d.get("res"):
                    ref = ref + r0.float()
                del w0
                rows[M] = (x, r0, out, ref)
            xn_buf = {M: torch.empty(M, Kdim, dtype=self.dtype, device=self.dev) for M in rows}
            gu_buf = {M: torch.empty(M, 2 * N, dtype=self.dtype, device=self.dev) for M in rows}

            def call(cfg, i, x, out):
                nw = d["norms"][i] if d.get("norms") else None
                res = out if d.get("res") else None
                if cfg == "cublas":
                    if nw is not None:
                        x = K.rmsnorm(x, nw, xn_buf[x.shape[0]], c.rms_norm_eps)
                    if res is not None:
                        out.addmm_(x, d["ws"][i].t())
                    elif d.get("swiglu"):
                        torch.mm(x, d["ws"][i].t(), out=gu_buf[x.shape[0]])
                        K.silu_mul(gu_buf[x.shape[0]], out)
                    else:
                        torch.mm(x, d["ws"][i].t(), out=out)
                    return
                if cfg.prenorm and nw is not None:
                    x, nw = K.rmsnorm(x, nw, xn_buf[x.shape[0]], c.rms_norm_eps), None
                K.linear(x, d["ws"][i], out, cfg=cfg, norm=nw, eps=c.rms_norm_eps, residual=res,
                         swiglu=bool(d.get("swiglu")))

            cands = list(K.CANDIDATES)
            if d.get("norms"):
                cands += [K.LinearConfig(cf.bn, cf.bk, cf.warps, cf.stages, True) for cf in K.CANDIDATES]
            cand = {}
            for cfg in cands + ["cublas"]:
                name = cfg if cfg == "cublas" else cfg.key()
                if self.left() < 150:
                    cand[name] = {"error": "skipped (budget)"}
                    continue
                try:
                    errs = {}
                    for M, (x, r0, out, ref) in rows.items():
                        out.fill_(float("nan"))
                        if d.get("res"):
                            out.copy_(r0)
                        call(cfg, 0, x, out)
                        errs[M] = rel_err(out, ref)
                    if not all(e < 2e-2 for e in errs.values()):
                        cand[name] = {"error": f"wrong result, rel err {errs}"}
                        continue
                    x, r0, out, _ = rows[16 if cfg == "cublas" else 1]  # cuBLAS runs padded to 16 rows

                    def fn(cfg=cfg, x=x, out=out):
                        for i in range(len(d["ws"])):
                            call(cfg, i, x, out)

                    t = self.timer.graph(fn)
                    cand[name] = {"s": t, "TBps": nbytes / t / 1e12, "rel_err": errs}
                except Exception as e:  # noqa: BLE001
                    cand[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            ok = {k: v for k, v in cand.items() if "s" in v and k != "cublas"}
            if ok:
                best = min(ok, key=lambda k: ok[k]["s"])
                chosen[role] = best
            # plain cuBLAS product at 1 and 16 rows (reference)
            cub = {}
            for M in (1, 16):
                x = rnd(M, Kdim)

                def fcub(x=x):
                    for w in d["ws"]:
                        F.linear(x, w)

                t = self.timer.graph(fcub)
                cub[M] = {"s": t, "TBps": nbytes / t / 1e12}
            if "s" in cand.get("cublas", {}):
                cub["path_m16"] = cand["cublas"]
            # the chosen config at 16 rows
            best16 = None
            if role in chosen:
                cfg = K.LinearConfig.parse(chosen[role])
                x16, _, out16, _ = rows[16]

                def f16(cfg=cfg):
                    for i in range(len(d["ws"])):
                        call(cfg, i, x16, out16)

                t = self.timer.graph(f16)
                best16 = {"s": t, "TBps": nbytes / t / 1e12}
            result[role] = {"N": N, "K": Kdim, "calls": len(d["ws"]), "bytes": nbytes, "candidates": cand,
                            "chosen": chosen.get(role), "chosen_m16": best16, "cublas": cub}
            b = ok.get(chosen.get(role), {})
            cp = cand.get("cublas", {}).get("TBps", float("nan"))
            log(f"tune {role}: N={N} K={Kdim} chosen {chosen.get(role)} "
                f"{b.get('TBps', float('nan')):.2f} TB/s (M=16: {best16['TBps'] if best16 else float('nan'):.2f}); "
                f"cuBLAS {cub[1]['TBps']:.2f} TB/s (M=16: {cub[16]['TBps']:.2f}; with its norm/SwiGLU kernels {cp:.2f})")
            del rows
        self.R["matmul"] = result
        self.R["kernel_configs"] = chosen
        torch.cuda.empty_cache()
        return chosen

    def fp32_reference(self):
        """fp32 copy of the bf16 model: logits of a 16-token block after a 512-token prompt, and the
        eager bf16 path's error against them (the yardstick for the fast paths' error)."""
        if getattr(self, "_ref32", None) is not None:
            return self._ref32
        torch = self.torch
        from specpilot.models.layers import chain_ancestors
        from specpilot.models.qwen3 import Transformer

        ctx = 512
        vocab = self.model.config.vocab_size
        prompt = make_prompt(ctx, vocab, self.args.seed + 7)
        g = torch.Generator(device=self.dev).manual_seed(13)
        blk = torch.randint(0, vocab, (1, 16), device=self.dev, generator=g)
        with torch.device("meta"):
            m32 = Transformer(self.model.config)
        m32 = m32.to_empty(device=self.dev)
        sd = self.model.state_dict()
        with torch.no_grad():
            for k, p in m32.named_parameters():
                p.copy_(sd[k].float())
        m32.setup_cache(1, ctx + 64)
        pt = torch.tensor([prompt], device=self.dev)
        with torch.inference_mode():
            m32(pt, torch.zeros(1, dtype=torch.long, device=self.dev), chain_ancestors(1, ctx, self.dev))
            ref = m32(blk, torch.full((1,), ctx, dtype=torch.long, device=self.dev),
                      chain_ancestors(1, 16, self.dev))[0].float().clone()
        del m32, sd
        torch.cuda.empty_cache()
        r = self.runner(1, ctx + 256, graphs=False)
        r.prefill([prompt])
        with torch.inference_mode():
            e = self.model(blk, r.length, chain_ancestors(1, 16, self.dev))[0].float()
        self._ref32 = {"prompt": prompt, "blk": blk, "ref": ref, "eager_err": rel_err(e, ref),
                       "eager_argmax_agree": float((e.argmax(-1) == ref.argmax(-1)).float().mean())}
        self.R["fp32_reference"] = {k: v for k, v in self._ref32.items() if k.startswith("eager")}
        log(f"fp32 reference: eager bf16 rel err {self._ref32['eager_err']:.4f}, "
            f"argmax agreement {self._ref32['eager_argmax_agree']:.3f}")
        return self._ref32

    def accuracy(self, fast) -> dict:
        """The fast step's logits for the reference block (after an eager bf16 prefill) against fp32."""
        torch = self.torch

        ref = self.fp32_reference()
        r = self.runner(1, 512 + 256, graphs=False)
        r.prefill([ref["prompt"]])
        with torch.inference_mode():
            f = fast.forward(ref["blk"], r.length)[0].float()
        err = rel_err(f, ref["ref"])
        return {"rel_err_vs_fp32": err, "eager_rel_err_vs_fp32": ref["eager_err"],
                "argmax_agree_fp32": float((f.argmax(-1) == ref["ref"].argmax(-1)).float().mean()),
                "accurate": err <= 1.25 * ref["eager_err"] + 5e-3}

    def variants(self, chosen):
        """Whole-step variants at B=1 ctx 512: all-Triton matmuls, all-cuBLAS, and the per-role mix;
        each checked (row independence, graph == no graph, error vs eager); the fastest correct one
        is used for everything after."""
        torch = self.torch
        from specpilot.engine.graphs import LINEAR_ROLES, step_graphs, with_decode_configs
        from specpilot.models.layers import chain_ancestors

        mm = self.R.get("matmul", {})
        sets = {}
        if chosen and len(chosen) == len(LINEAR_ROLES):
            sets["triton"] = dict(chosen)
        sets["cublas"] = {r: "cublas" for r in LINEAR_ROLES}
        if chosen:
            mix = {}
            for r in LINEAR_ROLES:
                t = mm.get(r, {}).get("candidates", {}).get(chosen.get(r), {}).get("s")
                cb = mm.get(r, {}).get("candidates", {}).get("cublas", {}).get("s")
                mix[r] = chosen[r] if (t is not None and (cb is None or t <= cb)) else "cublas"
            if mix not in sets.values():
                sets["mixed"] = mix
        res = {}
        for name, cfgs in sets.items():
            try:
                sg = step_graphs(self.model, "triton", with_decode_configs(cfgs))
                d = self.ar_step(1, 512, iters=15)
                r = self.last_runner
                g = torch.Generator(device=self.dev).manual_seed(11)
                blk = torch.randint(0, self.model.config.vocab_size, (1, 16), device=self.dev, generator=g)
                with torch.inference_mode():
                    f16 = sg.fast.forward(blk, r.length)[0].clone()
                    f1 = sg.fast.forward(blk[:, :1], r.length)[0].clone()
                    g1 = r.verify(blk[:, :1])[0].clone()
                    ref = self.model(blk, r.length, chain_ancestors(1, 16, self.dev))[0].clone()
                chk = {"row_independent": bool(torch.equal(f16[:, 0], f1[:, 0])),
                       "graph_equals_nograph": bool(torch.equal(g1, f1)), "rel_err_vs_eager": rel_err(f16, ref)}
                chk.update(self.accuracy(sg.fast))
                chk["ok"] = chk["row_independent"] and chk["graph_equals_nograph"] and chk["accurate"]
                res[name] = {"configs": cfgs, "step_s": d["step_s"], "mbu": d["mbu"], **chk}
                log(f"variant {name}: {d['step_s'] * 1e3:.3f} ms/step, MBU {d['mbu'] * 100:.1f}%, {chk}")
            except Exception as e:  # noqa: BLE001
                res[name] = {"configs": cfgs, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"variant {name} failed: {res[name]['error']}")
                log(traceback.format_exc())
        self.R["variants"] = res
        ok = {k: v for k, v in res.items() if v.get("ok")}
        if ok:
            best = min(ok, key=lambda k: ok[k]["step_s"])
            self.cfgs = ok[best]["configs"]
            self.R["variant_used"] = best
            step_graphs(self.model, "triton", with_decode_configs(self.cfgs))
            (self.out / "kernel_configs.json").write_text(json.dumps(self.cfgs, indent=1) + "\n")
            if chosen and "o" in chosen:
                from specpilot.engine.graphs import set_fast_linear_config

                set_fast_linear_config(chosen["o"])  # the drafter's matmuls: plain, like o_proj
            log(f"using variant {best}")
        else:
            self.kernels = "torch"
            self.R["variant_used"] = "torch (no Triton variant passed)"
            log("no Triton variant passed: timing the PyTorch-ops graph path")

    def runner(self, B, S, capture=(), kernels=None, graphs=None):
        from specpilot.engine.runner import TargetRunner

        return TargetRunner(self.model, B, S, capture, graphs=self.graphs if graphs is None else graphs,
                            kernels=kernels or self.kernels)

    def correctness(self):
        torch = self.torch
        from specpilot.engine.generate import generate_ar
        from specpilot.engine.graphs import step_graphs
        from specpilot.models.layers import chain_ancestors

        R = self.R.setdefault("correctness", {})
        vocab = self.model.config.vocab_size
        ctx = 512 if not self.args.dry_run else 48
        S = ctx + 256
        prompt = make_prompt(ctx, vocab, self.args.seed)
        n_tok = 48 if not self.args.dry_run else 12
        # eager PyTorch path (no graphs): the reference
        r = self.runner(1, S, graphs=False)
        ar_eager = generate_ar(r, [prompt], n_tok)[0].output_ids
        R["tokens"] = n_tok
        if not self.graphs:
            R["note"] = "dry run: no graphs"
            self.ar_ref = ar_eager
            return
        # torch-ops graph
        r = self.runner(1, S, kernels="torch")
        ar_tgraph = generate_ar(r, [prompt], n_tok)[0].output_ids
        R["torch_graph_equals_eager"] = ar_tgraph == ar_eager
        R["torch_graph_vs_eager"] = self.mismatch(ar_tgraph, ar_eager, prompt, S)
        R["tokens_eager"] = ar_eager[:32]
        if self.kernels != "triton":
            self.ar_ref = ar_tgraph
            return
        # triton graph vs triton without graph, step by step
        r = self.runner(1, S, kernels="triton")
        ar_fast = generate_ar(r, [prompt], n_tok)[0].output_ids
        fast = step_graphs(self.model, "triton").fast
        r.prefill([prompt])
        last = torch.tensor([ar_fast[0]], device=self.dev)
        manual = [ar_fast[0]]
        with torch.inference_mode():
            for _ in range(n_tok - 1):
                logits, _ = fast.forward(last[:, None], r.length)
                last = logits[:, 0].argmax(-1)
                r.length += 1
                manual.append(int(last))
        R["triton_graph_equals_triton_eager"] = manual == ar_fast
        R["tokens_fast"] = ar_fast[:32]
        R["triton_vs_eager"] = self.mismatch(ar_fast, ar_eager, prompt, S)
        # logits: Triton step vs eager step; graph vs no graph; row independence
        r = self.runner(1, S, kernels="triton")
        r.prefill([prompt])
        g = torch.Generator(device=self.dev).manual_seed(5)
        blk = torch.randint(0, vocab, (1, 16), device=self.dev, generator=g)
        with torch.inference_mode():
            ref16, _ = self.model(blk, r.length, chain_ancestors(1, 16, self.dev))
            ref16 = ref16.clone()
            f16 = fast.forward(blk, r.length)[0].clone()
            f1 = fast.forward(blk[:, :1], r.length)[0].clone()
            g16 = r.verify(blk)[0].clone()
            g1 = r.verify(blk[:, :1])[0].clone()
        R["rel_err_triton_vs_eager_T16"] = rel_err(f16, ref16)
        R["rel_err_triton_vs_eager_T1"] = rel_err(f1, ref16[:, :1])
        R["argmax_agree_T16"] = float((f16.argmax(-1) == ref16.argmax(-1)).float().mean())
        R["graph_equals_nograph_T16"] = bool(torch.equal(g16, f16))
        R["graph_equals_nograph_T1"] = bool(torch.equal(g1, f1))
        R["row_independent_T16_vs_T1"] = bool(torch.equal(f16[:, 0], f1[:, 0]))
        for T in (2, 4, 8, 32):
            b = torch.randint(0, vocab, (1, T), device=self.dev, generator=g)
            b[:, 0] = blk[:, 0]
            with torch.inference_mode():
                R[f"row_independent_T{T}_vs_T1"] = bool(torch.equal(fast.forward(b, r.length)[0][:, 0], f1[:, 0]))
        log("correctness: " + json.dumps(R))
        R.update(self.accuracy(fast))
        ok = (R["graph_equals_nograph_T16"] and R["graph_equals_nograph_T1"] and R["accurate"]
              and R["triton_graph_equals_triton_eager"])
        R["triton_ok"] = bool(ok)
        if not ok:
            log("Triton path failed its checks: timing the PyTorch-ops graph path instead")
            self.kernels = "torch"
        self.ar_ref = ar_fast if ok else ar_tgraph

    def mismatch(self, a, b, prompt, S) -> dict:
        """First differing token of two greedy outputs and the eager path's top-2 logit margin there
        (a small margin = a near-tie that a different but legitimate summation order can flip)."""
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        d = {"equal_tokens": len(a) if first is None else first, "of": len(a)}
        if first is not None:
            from specpilot.forcing import top2_margin

            margin, t1, t2 = top2_margin(self.model, prompt, b[:first])
            d.update(margin=margin, top1=t1, top2=t2, tokens=[a[first], b[first]],
                     near_tie=margin < 0.1 and {t1, t2} == {a[first], b[first]})
            self.model.setup_cache(1, S)
        return d

    def ar_step(self, B, ctx, kernels=None, graphs=None, iters=20):
        """Median AR decode step (graph replay through the runner) at context ``ctx``."""
        torch = self.torch
        from specpilot.engine.graphs import kv_bytes_per_step, weight_bytes_per_step

        S = ctx + 256
        r = self.runner(B, S, kernels=kernels, graphs=graphs)
        self.last_runner = r
        cache = self.model.cache
        g = torch.Generator(device=self.dev).manual_seed(7)
        for t in (cache.k, cache.v):  # never time on zeros
            t.normal_(generator=g)
        r.length.fill_(ctx)
        r._bound = ctx
        tok = torch.randint(0, self.model.config.vocab_size, (B, 1), device=self.dev, generator=g)
        t, mean = self.timer.median(lambda: r.verify(tok), iters, 3)
        wb = weight_bytes_per_step(self.model, B)
        kvb = kv_bytes_per_step(self.model, B, ctx)
        bw = self.R.get("copy_bw_Bps", float("nan"))
        d = {"B": B, "ctx": ctx, "step_s": t, "step_mean_s": mean, "tok_s": B / t, "weight_bytes": wb,
             "kv_bytes": kvb, "achieved_Bps": (wb + kvb) / t, "mbu": (wb + kvb) / t / bw,
             "mbu_model_size": self.R["model"]["bytes"] * (1 / t) / bw if B == 1 else None}
        return d

    def ar_sweep(self):
        res = self.R.setdefault("ar", {})
        configs = [(1, 512), (16, 512), (1, 4096), (16, 4096)] if not self.args.dry_run else [(1, 48), (4, 48)]
        for B, ctx in configs:
            if self.left() < 40:
                log("SKIP rest of ar sweep (budget)")
                break
            d = self.ar_step(B, ctx)
            res[f"b{B}_ctx{ctx}"] = d
            log(f"AR {self.kernels} B={B} ctx={ctx}: {d['step_s'] * 1e3:.3f} ms/step, {d['tok_s']:.1f} tok/s, "
                f"MBU {d['mbu'] * 100:.1f}% ({d['achieved_Bps'] / 1e12:.2f} TB/s)")
        # contrast: the PyTorch-ops graph and the eager step at batch 1 and 16, ctx 512
        if self.graphs:
            for B in (1, 16):
                d = self.ar_step(B, 512, kernels="torch", iters=10)
                res[f"torch_graph_b{B}_ctx512"] = d
                log(f"AR torch-graph B={B} ctx=512: {d['step_s'] * 1e3:.3f} ms/step, MBU {d['mbu'] * 100:.1f}%")
            d = self.ar_step(1, 512, kernels="torch", graphs=False, iters=5)
            res["eager_b1_ctx512"] = d
            log(f"AR eager B=1 ctx=512: {d['step_s'] * 1e3:.3f} ms/step, MBU {d['mbu'] * 100:.1f}%")

    def verify_sweep(self, tag="verify", kernel_list=None):
        torch = self.torch
        res = {}
        ctx = 512 if not self.args.dry_run else 48
        S = ctx + 256
        capture = tuple(self.drafter.config.target_layer_ids)
        if kernel_list is None:
            kernel_list = [self.kernels, "torch"] if self.graphs and self.kernels != "torch" else [self.kernels]
        for kernels in kernel_list:
            r = self.runner(1, S, kernels=kernels)
            g = torch.Generator(device=self.dev).manual_seed(9)
            for t in (self.model.cache.k, self.model.cache.v):
                t.normal_(generator=g)
            r.length.fill_(ctx)
            r._bound = ctx
            row = {}
            for T in (1, 2, 4, 8, 16, 32):
                blk = torch.randint(0, self.model.config.vocab_size, (1, T), device=self.dev, generator=g)
                t, _ = self.timer.median(lambda: r.verify(blk), 15, 3)
                row[T] = {"s": t}
            # with the drafter's hidden-state capture (what the stock engine runs)
            r2 = self.runner(1, S, capture=capture, kernels=kernels)
            r2.length.fill_(ctx)
            r2._bound = ctx
            blk = torch.randint(0, self.model.config.vocab_size, (1, 16), device=self.dev, generator=g)
            row["16_capture"] = {"s": self.timer.median(lambda: r2.verify(blk), 15, 3)[0]}
            for T in row:
                row[T]["x_ar"] = row[T]["s"] / row[1]["s"]
            res[kernels] = row
            log(f"verify {kernels}: " + ", ".join(f"T={T}: {v['s'] * 1e3:.3f} ms ({v['x_ar']:.3f}x)"
                                                  for T, v in row.items()))
        self.R[tag] = res

    def profile(self):
        """Kernel time per kind in one B=1 ctx-512 decode step (torch.profiler), against the step time."""
        torch = self.torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        from specpilot.engine.graphs import step_graphs

        ctx = 512
        r = self.runner(1, ctx + 256)
        r.length.fill_(ctx)
        r._bound = ctx
        tok = torch.randint(0, self.model.config.vocab_size, (1, 1), device=self.dev)
        fast = step_graphs(self.model, self.kernels).fast
        runs = [("graph", lambda: r.verify(tok))]
        if fast is not None:
            runs.append(("no graph", lambda: fast.forward(tok, r.length)))
        out = {}
        for src, fn in runs:
            for _ in range(3):
                fn()
            self.sync()
            n = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn()
                self.sync()
            kinds: dict[str, list] = {}
            for ev in prof.key_averages():
                if getattr(ev, "device_type", None) != DeviceType.CUDA:
                    continue
                dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
                name = ev.key
                low = name.lower()
                kind = ("matmul (Triton)" if "_linear_kernel" in name else "attention" if "attn" in low or "sdpa" in low
                        or "fmha" in low or "flash" in low
                        else "qk-norm/rope/cache" if "rope" in low else "rmsnorm" if "rmsnorm" in low
                        else "silu*up" if "silu" in low
                        else "matmul (cuBLAS)" if any(t in low for t in ("gemm", "nvjet", "cutlass", "xmma", "gemv"))
                        else "copy/memcpy" if ("copy" in low or "memcpy" in low) else "other")
                k = kinds.setdefault(kind, [0.0, 0, set()])
                k[0] += dt / 1e6 / n
                k[1] += ev.count / n
                k[2].add(name[:70])
            total = sum(v[0] for v in kinds.values())
            out[src] = {"per_step_s": {k: v[0] for k, v in kinds.items()},
                        "launches_per_step": {k: v[1] for k, v in kinds.items()},
                        "names": {k: sorted(v[2])[:6] for k, v in kinds.items()}, "kernel_sum_s": total}
            log(f"profile ({src}): " + ", ".join(f"{k} {v[0] * 1e3:.3f} ms x{v[1]:.0f}" for k, v in kinds.items())
                + f"; sum {total * 1e3:.3f} ms")
        step = self.R.get("ar", {}).get("b1_ctx512", {}).get("step_s")
        out["step_s"] = step
        src = "graph" if out.get("graph", {}).get("kernel_sum_s") else "no graph"
        if step and out.get(src, {}).get("kernel_sum_s"):
            out["gap_s"] = step - out[src]["kernel_sum_s"]
            out["gap_source"] = src
        self.R["profile_b1_ctx512"] = out

    def e2e(self):
        torch = self.torch
        from specpilot.engine.generate import generate_ar, generate_speculative
        from specpilot.engine.proposers import DFlashProposer
        from specpilot.engine.replay import ReplayProposer, expected_tau, load_profile

        ctx = 512 if not self.args.dry_run else 48
        n_new = 256 if not self.args.dry_run else 40
        S = ctx + n_new + 64
        block = 16
        prompts = [make_prompt(ctx, self.model.config.vocab_size, self.args.seed + 100 + i) for i in range(2)]
        capture = tuple(self.drafter.config.target_layer_ids)
        res = self.R.setdefault("e2e", {"ctx": ctx, "new_tokens": n_new, "block": block, "prompts": len(prompts)})
        # AR reference and timing (one prompt at a time, batch 1); warm-up first (graph captures)
        ar_rows, ar_time = [], 0.0
        r = self.runner(1, S)
        generate_ar(r, [prompts[0]], 8)
        for p in prompts:
            row = generate_ar(r, [p], n_new)[0]
            ar_rows.append(row.output_ids)
            ar_time += row.decode_s
        ar_tok = len(prompts) * (n_new - 1)
        res["ar_decode_s"] = ar_time
        res["ar_tok_s"] = ar_tok / ar_time
        res["ar_step_s_loop"] = ar_time / ar_tok
        # step times for the formula
        rv = self.runner(1, S, capture=capture)
        rv.prefill([prompts[0]])
        blk = torch.randint(0, self.model.config.vocab_size, (1, block), device=self.dev)
        t_verify, _ = self.timer.median(lambda: rv.verify(blk), 15, 3)
        ra = self.runner(1, S)
        ra.prefill([prompts[0]])
        tok = blk[:, :1]
        t_ar, _ = self.timer.median(lambda: ra.verify(tok), 15, 3)
        # the draft step: add_context of a verified block + draft of the next (the drafter network),
        # with the drafter's matmuls through cuBLAS ("torch") or Triton; the faster runs the e2e
        rv.prefill([prompts[0]])
        logits, feats = rv.verify(blk)
        feats_c = feats.clone()
        with torch.inference_mode():
            _, pf, _ = rv.prefill([prompts[0]])
        counts = torch.ones(1, dtype=torch.long, device=self.dev)
        start = rv.length.clone()
        drafts = {}
        for dk in (["torch", "triton"] if self.graphs and self.kernels == "triton" else [self.kernels]):
            try:
                net = DFlashProposer(self.drafter, self.graphs, dk)
                net.start(rv, [prompts[0]], pf, blk[:, 0])

                def draft_step(net=net):
                    net.observe(feats_c, start, counts, [[0]])
                    net.propose(blk[:, 0], start + 1, block - 1)

                t_draft, _ = self.timer.median(draft_step, 15, 3)
                t_prop, _ = self.timer.median(lambda net=net: net.propose(blk[:, 0], start + 1, block - 1), 15, 3)
                drafts[dk] = {"draft_step_s": t_draft, "propose_s": t_prop, "add_context_s": t_draft - t_prop}
            except Exception as e:  # noqa: BLE001
                drafts[dk] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                log(traceback.format_exc())
        okd = {k: v for k, v in drafts.items() if "draft_step_s" in v}
        dk = min(okd, key=lambda k: okd[k]["draft_step_s"])
        self.draft_kernels = dk
        t_draft, t_prop = okd[dk]["draft_step_s"], okd[dk]["propose_s"]
        res.update(verify_step_s=t_verify, ar_step_s=t_ar, draft_step_s=t_draft, draft_propose_s=t_prop,
                   draft_add_context_s=t_draft - t_prop, drafter_backends=drafts, drafter_backend=dk)
        log(f"e2e steps: AR {t_ar * 1e3:.3f} ms, verify16 {t_verify * 1e3:.3f} ms, draft {t_draft * 1e3:.3f} ms "
            f"(propose {t_prop * 1e3:.3f}; drafter matmuls {dk}; all: {json.dumps(drafts)})")
        for name in self.args.profiles:
            prof = load_profile(name)
            rs = self.runner(1, S, capture=capture)
            # warm-up (captures the verify and drafter graphs)
            warm = ReplayProposer([ar_rows[0]], prof, self.model.config.vocab_size,
                                  DFlashProposer(self.drafter, self.graphs, self.draft_kernels), seed=99)
            generate_speculative(rs, warm, [prompts[0]], 24, block, profile=False)
            spec_time, steps, equal = 0.0, [], True
            for i, p in enumerate(prompts):
                prop = ReplayProposer([ar_rows[i]], prof, self.model.config.vocab_size,
                                      DFlashProposer(self.drafter, self.graphs, self.draft_kernels), seed=i)
                row = generate_speculative(rs, prop, [p], n_new, block, profile=False)[0]
                spec_time += row.decode_s
                steps += row.committed_per_step
                equal &= row.output_ids == ar_rows[i]
            tau = sum(steps) / len(steps)
            speed = ar_time / spec_time
            formula = tau * t_ar / (t_verify + t_draft)
            d = {"expected_tau": expected_tau(prof, block), "tau": tau, "verify_steps": len(steps),
                 "spec_decode_s": spec_time, "tok_s": ar_tok / spec_time, "speedup": speed,
                 "formula_speedup": formula, "measured_over_formula": speed / formula, "outputs_equal_ar": equal,
                 "synthetic": True}
            res[prof.name] = d
            log(f"e2e {prof.name}: tau {tau:.2f} (expected {d['expected_tau']:.2f}), speedup {speed:.2f}x, "
                f"formula {formula:.2f}x, ratio {speed / formula:.3f}, outputs equal AR: {equal}")

    def peer(self):
        if self.hf is None:
            return
        R = self.R.setdefault("peer", {})
        # wait for the peer's compile warm-up, but keep ~25 s for the timed runs and the re-timing
        deadline = T0 + self.args.budget_s - 25
        ready = wait_file(self.sig / "hf_ready", deadline, self.hf)
        if ready and self.hf.poll() is None:
            (self.sig / "go_compiled").write_text("1")
            try:
                self.hf.wait(timeout=max(5.0, T0 + self.args.budget_s - 5 - time.time()))
            except subprocess.TimeoutExpired:
                R["note"] = "peer's compiled timing ran out of budget"
        if self.hf.poll() is None:
            self.hf.kill()
            R.setdefault("note", "peer's compile warm-up did not finish within the budget: compiled mode skipped")
        self.hf.wait()
        self.hf_log.close()
        if (self.sig / "hf.json").exists():
            R.update(json.loads((self.sig / "hf.json").read_text()))
        log("peer: " + json.dumps({k: v for k, v in R.items() if k != "static_compile"})[:800])

    def wait_peer_eager(self):
        if self.hf is None:
            return
        if not wait_file(self.sig / "hf_built", T0 + 120, self.hf):
            log("peer did not build its model in time")
            return
        (self.sig / "go_eager").write_text("1")

    def wait_peer_eager_done(self):
        if self.hf is None:
            return
        ok = wait_file(self.sig / "hf_eager_done", T0 + 160, self.hf)
        log(f"peer eager runs done: {ok}")

    def retime(self):
        """AR step and the verify sweep again, with the peer gone (no other process on the machine)."""
        d = self.ar_step(1, 512 if not self.args.dry_run else 48)
        self.R["ar_final_b1_ctx512"] = d
        log(f"AR re-timed B=1 ctx=512: {d['step_s'] * 1e3:.3f} ms, MBU {d['mbu'] * 100:.1f}%")
        self.verify_sweep("verify_final", [self.kernels])

    def ar_27b(self):
        """AR decode step of the 27B-class dense shape (batch 1, ctx 512) with the same kernels."""
        torch = self.torch
        from specpilot.engine.graphs import step_graphs, with_decode_configs
        from specpilot.models.random_checkpoint import build_target

        for name in ("model", "drafter"):
            if hasattr(self, name):
                delattr(self, name)
        self.last_runner = None
        self._ref32 = None
        torch.cuda.empty_cache()
        t = time.time()
        self.model = build_target("qwen3-27b-dense", self.dev, self.dtype, self.args.seed)
        params = sum(p.numel() for p in self.model.parameters())
        self.R["model_27b"] = {"params": params, "bytes": params * 2, "build_s": time.time() - t}
        if self.kernels == "triton":
            step_graphs(self.model, "triton", with_decode_configs(getattr(self, "cfgs", None) or {}))
        self.R["model"] = dict(self.R["model"], bytes_8b=self.R["model"]["bytes"])
        saved = self.R["model"]["bytes"]
        self.R["model"]["bytes"] = params * 2
        d = self.ar_step(1, 512, iters=15)
        self.R["model"]["bytes"] = saved
        self.R["ar_27b_b1_ctx512"] = d
        log(f"27B-class AR B=1 ctx=512: {d['step_s'] * 1e3:.3f} ms/step, {d['tok_s']:.1f} tok/s, "
            f"MBU {d['mbu'] * 100:.1f}% ({params / 1e9:.1f} B params)")

    # -- summary -----------------------------------------------------------------------------
    def table(self) -> str:
        R = self.R
        L = []
        e = R.get("env", {})
        L.append(f"engine benchmark {R['date']} on {e.get('gpu', 'cpu')}: torch {e.get('torch')}, triton "
                 f"{e.get('triton')}, transformers {e.get('transformers')}; shape {R['shape']}; kernels {self.kernels}")
        bw = R.get("copy_bw_Bps")
        if bw:
            L.append(f"copy bandwidth {bw / 1e12:.3f} TB/s")
        mm = R.get("matmul", {})
        if mm:
            L.append("")
            L.append("matmuls over all layers, 1 row (TB/s of weight bytes): chosen Triton config | cuBLAS path (16 rows)")
            for role, d in mm.items():
                ch = d.get("candidates", {}).get(d.get("chosen"), {})
                cb = d.get("candidates", {}).get("cublas", {})
                L.append(f"  {role:<8} {d['N']:>6}x{d['K']:<6} {d.get('chosen')}: {ch.get('TBps', float('nan')):.2f} | "
                         f"{cb.get('TBps', float('nan')):.2f}")
        for name, v in R.get("variants", {}).items():
            if "step_s" in v:
                L.append(f"  variant {name:<7} {v['step_s'] * 1e3:.3f} ms/step  MBU {v['mbu'] * 100:.1f}%  row-indep "
                         f"{v['row_independent']}  graph==eager {v['graph_equals_nograph']}  err/fp32 "
                         f"{v.get('rel_err_vs_fp32', float('nan')):.4f} (eager {v.get('eager_rel_err_vs_fp32', float('nan')):.4f})")
            else:
                L.append(f"  variant {name}: {v.get('error')}")
        if R.get("variant_used"):
            L.append(f"  used: {R['variant_used']}")
        L.append("")
        L.append("(a) AR decode            step ms   tok/s    MBU")
        for k, d in R.get("ar", {}).items():
            L.append(f"  {k:<22} {d['step_s'] * 1e3:8.3f} {d['tok_s']:8.1f} {d['mbu'] * 100:6.1f}%")
        if "ar_final_b1_ctx512" in R:
            d = R["ar_final_b1_ctx512"]
            L.append(f"  {'b1_ctx512 re-timed':<22} {d['step_s'] * 1e3:8.3f} {d['tok_s']:8.1f} {d['mbu'] * 100:6.1f}%")
        if "ar_27b_b1_ctx512" in R:
            d = R["ar_27b_b1_ctx512"]
            L.append(f"  {'27B-class b1_ctx512':<22} {d['step_s'] * 1e3:8.3f} {d['tok_s']:8.1f} {d['mbu'] * 100:6.1f}%")
        L.append("")
        for tag in ("verify", "verify_final"):
            for kern, row in R.get(tag, {}).items():
                L.append(f"(b) verify step / AR step ({kern}{', re-timed' if tag == 'verify_final' else ''}): "
                         + "  ".join(f"T={T}: {v['x_ar']:.3f}" for T, v in row.items()))
        L.append("")
        e2 = R.get("e2e", {})
        if e2:
            L.append(f"(c) stock end-to-end, replay drafter (synthetic), block {e2.get('block')}, ctx {e2.get('ctx')}, "
                     f"{e2.get('new_tokens')} new tokens x {e2.get('prompts')} prompts")
            L.append(f"    AR step {e2.get('ar_step_s', 0) * 1e3:.3f} ms, verify16 {e2.get('verify_step_s', 0) * 1e3:.3f} ms, "
                     f"draft {e2.get('draft_step_s', 0) * 1e3:.3f} ms; AR {e2.get('ar_tok_s', 0):.1f} tok/s in the loop")
            for k, d in e2.items():
                if isinstance(d, dict) and "tau" in d:
                    L.append(f"    {k:<24} tau {d['tau']:.2f} (exp {d['expected_tau']:.2f})  speedup {d['speedup']:.2f}x  "
                             f"formula {d['formula_speedup']:.2f}x  ratio {d['measured_over_formula']:.3f}  "
                             f"equal AR {d['outputs_equal_ar']}")
        prof = R.get("profile_b1_ctx512", {})
        for src in ("graph", "no graph"):
            if src in prof:
                d = prof[src]
                L.append(f"profile b1 ctx512 ({src}): " + ", ".join(
                    f"{k} {v * 1e3:.3f} ms x{d['launches_per_step'][k]:.0f}" for k, v in d["per_step_s"].items())
                    + f"; kernels {d['kernel_sum_s'] * 1e3:.3f} ms")
        if prof.get("gap_s") is not None:
            L.append(f"  step {prof['step_s'] * 1e3:.3f} ms - kernel time = {prof['gap_s'] * 1e3:.3f} ms of gaps")
        p = R.get("peer", {})
        if p:
            L.append("")
            L.append("(d) transformers generate, same model, batch 1, prompt 512:")
            for k in ("dynamic_eager", "static_no_compile", "static_compile"):
                d = p.get(k)
                if isinstance(d, dict) and "decode_tok_s" in d:
                    L.append(f"    {k:<20} {d['decode_tok_s']:8.1f} tok/s decode ({d['tok_s_total']:.1f} total)")
                elif d:
                    L.append(f"    {k:<20} {d}")
            if p.get("note"):
                L.append(f"    note: {p['note']}")
        # goals
        L.append("")
        L.append("Done-when goals:")
        a = R.get("ar_final_b1_ctx512") or R.get("ar", {}).get("b1_ctx512")
        if a:
            L.append(f"  AR MBU >= 85% (b1 ctx512): {a['mbu'] * 100:.1f}% -> {'MET' if a['mbu'] >= 0.85 else 'MISSED'}")
        v = R.get("verify_final", {}).get(self.kernels) or R.get("verify", {}).get(self.kernels, {})
        if v:
            x = v[16]["x_ar"]
            L.append(f"  verify 16 <= 1.15x AR: {x:.3f}x -> {'MET' if x <= 1.15 else 'MISSED'}")
        if a and p:
            best = max((d.get("decode_tok_s", 0) for d in p.values() if isinstance(d, dict)), default=0)
            if best:
                ratio = a["tok_s"] / best
                L.append(f"  our AR >= 2x transformers fastest ({best:.1f} tok/s): {ratio:.2f}x -> "
                         f"{'MET' if ratio >= 2 else 'MISSED'}")
        for k, d in e2.items():
            if isinstance(d, dict) and "tau" in d:
                dev = abs(d["measured_over_formula"] - 1)
                L.append(f"  stock speedup within 10% of formula ({k}): {d['measured_over_formula']:.3f} -> "
                         f"{'MET' if dev <= 0.10 else 'MISSED'}")
        if R.get("errors"):
            L.append("")
            L.append("errors: " + "; ".join(f"{x['phase']}: {x['error'][:120]}" for x in R["errors"]))
        return "\n".join(L)

    def run_quick(self):
        """``--quick``: env, ceilings, the default configs, AR and verify, a profile (no peer, no tuning)."""
        self.phase("env", self.env)
        self.phase("build", self.build)
        self.phase("copy_bw", self.copy_bw)
        self.phase("ar", self.ar_sweep, 30)
        self.phase("verify", lambda: self.verify_sweep(kernel_list=[self.kernels]), 20)
        if self.graphs:
            self.phase("profile", self.profile, 15)
        self.R["total_s"] = time.time() - T0
        self.save()
        return 0

    def run(self):
        if self.args.quick:
            return self.run_quick()
        self.start_peer()
        procs = precompile(self.out) if not self.args.dry_run else []
        self.phase("env", self.env)
        self.phase("build", self.build)
        self.phase("copy_bw", self.copy_bw)
        chosen = self.phase("tune", lambda: self.tune(procs)) if not self.args.dry_run else {}
        if self.graphs:
            self.phase("variants", lambda: self.variants(chosen))
        self.wait_peer_eager()  # the peer's eager runs overlap our untimed correctness checks only
        self.phase("correctness", self.correctness)
        self.wait_peer_eager_done()
        self.phase("ar", self.ar_sweep, 30)
        self.phase("verify", self.verify_sweep, 20)
        self.phase("e2e", self.e2e, 30)
        if self.graphs:
            self.phase("profile", self.profile, 15)
        self.phase("peer", self.peer)
        self.phase("retime", self.retime, 3)
        if self.graphs and not self.args.skip_27b:
            self.phase("ar_27b", self.ar_27b, 45)
        self.R["total_s"] = time.time() - T0
        self.save()
        txt = self.table()
        (self.out / "engine_table.txt").write_text(txt + "\n")
        print("\n" + txt, flush=True)
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--sig-dir", default="/tmp/specpilot_bench_sig")
    ap.add_argument("--budget-s", type=float, default=280)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", nargs="+", default=["dflash_qwen3_8b_gsm8k", "study_stock"])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape: checks the script only")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="AR, verify and profile with the default configs only (no peer, no tuning)")
    ap.add_argument("--skip-27b", action="store_true", help="leave out the 27B-class AR step")
    ap.add_argument("--no-compile", action="store_true", help="peer without its torch.compile mode")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("compile_jobs", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=512, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run and args.shape == "qwen3-8b":
        args.shape = "tiny"
    if args.hf_worker:
        return hf_worker(args)
    if args.compile_worker:
        return compile_worker(args)
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())

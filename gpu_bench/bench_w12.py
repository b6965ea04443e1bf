#!/usr/bin/env python
"""Benchmark of the w12 (lossless 12-bit weight) Triton kernels against cuBLAS bf16, on one GPU.

What it does, in one go (for the issue "Lossless 12-bit weight format with fused Triton
decode+matmul kernels", issue 6):

1. ceilings: device-to-device copy bandwidth (bytes read + written over time, 2 GiB buffers);
2. compiles every candidate kernel config in parallel worker processes (each runs its config once on
   a small problem and checks it against an fp32 reference; failed configs are left out);
3. for each Qwen3-8B linear shape (q/o 4096x4096, k/v 1024x4096, gate/up 12288x4096,
   down 4096x12288, fused gate+up 24576x4096) with random bf16 weights (std 0.02, about 1.5e-4
   natural escapes, plus planted zeros/outliers in the first copy):
   - the decode kernel: bit-exact check (int16 compare) and its throughput;
   - for M = 1, 4, 16, 64, 256: correctness of every config (fp32 reference; relative error in
     norm; NaN-poisoned output; split-K repeatability), then the time of every correct config and
     of the best bf16 path (F.linear = cuBLAS, and W @ x.T), each as the median over replays of a
     CUDA graph of many calls that cycle through enough weight copies to exceed L2 several times;
   - effective weight bandwidth = weight bytes / time, and its fraction of the copy bandwidth;
4. a whole 36-layer decode step (q, k, v, o, gate, up, down per layer; M = 1, 4 and 16) with the
   best configs, w12 vs bf16, each in one CUDA graph;
5. prints a table and writes everything as JSON (``--out``, default ``$OUT/w12.json``), and the
   best config per (M bucket, N, K) as ``w12_tuned.json`` beside it (the format of
   ``src/specpilot/kernels/tuned/w12_h200.json``).

Decodes: every kernel shape is tried with the default "raw" decode (exponent 112 + c, fp32
accumulator scaled by 2**(base - 112); see src/specpilot/kernels/w12_triton.py), and a few shapes also with the
old "base" decode and the PTX "prmt" variant. Each (M, shape) row of the JSON has
``best_us_by_decode`` and ``decode_compare`` (each non-raw config against its raw twin: both times
and whether their outputs are bit-identical, which they should be).

``--quick``: M = 1 and 16 only (step too) and the short candidate list (the H200's frequent
winners plus the decode comparison), for a fast first look.

``--dry-run`` runs the same code on CPU under Triton's interpreter with tiny shapes: it checks
this script's logic and measures nothing.

Run on the GPU machine from the repository root::

    PYTHONUNBUFFERED=1 python gpu_bench/bench_w12.py --out $OUT/w12.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]

from _timing import graph_time_us  # noqa: E402  (gpu_bench/ is on sys.path: the script's folder)

SHAPES = {  # name: (N, K)
    "q_proj/o_proj": (4096, 4096),
    "k_proj/v_proj": (1024, 4096),
    "gate/up_proj": (12288, 4096),
    "down_proj": (4096, 12288),
    "gate_up_fused": (24576, 4096),
}
MLP = ("gate/up_proj", "down_proj", "gate_up_fused")
ATTN = ("q_proj/o_proj", "k_proj/v_proj")
LAYER = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
         ("gate", 12288, 4096), ("up", 12288, 4096), ("down", 4096, 12288)]
T0 = time.time()
LOG: list[str] = []
DEV = "cuda"  # "cpu" with --dry-run (Triton interpreter, tiny shapes: checks this script's logic only)
QUICK = False  # --quick: the short candidate list


def candidates(K, m, n, k):
    """The configs tried for (M, N, K): ``K.candidate_configs`` (short list with --quick)."""
    return K.candidate_configs(m, n, k, quick=QUICK)


def log(*a):
    s = " ".join(str(x) for x in a)
    print(f"[{time.time() - T0:7.1f}s] {s}", flush=True)
    LOG.append(s)


# ------------------------------------------------------------------------------------------
# worker: compile + small correctness check of a list of configs
# ------------------------------------------------------------------------------------------


def _worker(jobs):
    import torch

    from specpilot.kernels import w12_triton as K
    from specpilot.w12.format import pack

    out = []
    torch.manual_seed(0)
    n, k = (256, 2048) if DEV == "cuda" else (48, 256)
    w = (torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16)
    w[3, 5] = 0.0
    w[n - 7, 7] = 300.0
    t = pack(w)
    esc = K.prepare_escapes(t.escape_idx, t.escape_val, n, k)
    dead = False
    for cfg_d, m in jobs:
        cfg = K.Config(**cfg_d)
        if dead:
            out.append({"cfg": cfg_d, "m": m, "ok": False, "error": "not run (earlier CUDA error)"})
            continue
        try:
            t0 = time.time()
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            y = K.matmul(x, t.mant, t.codes, t.base, esc, cfg)
            if DEV == "cuda":
                torch.cuda.synchronize()
            ref = x.float() @ w.float().T
            err = ((y.float() - ref).norm() / ref.norm()).item()
            out.append({"cfg": cfg_d, "m": m, "ok": bool(err < 1e-2), "err": err, "s": time.time() - t0})
        except Exception as e:  # noqa: BLE001 - report and go on
            msg = f"{type(e).__name__}: {e}"[:400]
            out.append({"cfg": cfg_d, "m": m, "ok": False, "error": msg})
            if "CUDA" in msg or "illegal" in msg:
                dead = True
    return out


def precompile(jobs, workers):
    import multiprocessing as mp

    if not jobs:
        return []
    ctx = mp.get_context("spawn")
    chunks = [jobs[i::workers] for i in range(workers)]
    chunks = [c for c in chunks if c]
    with ctx.Pool(len(chunks)) as pool:
        parts = pool.map(_worker, chunks)
    return [r for p in parts for r in p]


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------


def time_graph(call, n_copies, min_calls=32, reps=15):
    """Median, min, max time per call (us) of ``call(i)``, i cycling over copies, in one CUDA graph
    (:func:`_timing.graph_time_us`); on the CPU (dry run) one timed call."""
    if DEV == "cpu":
        for i in range(n_copies):
            call(i)
        t0 = time.perf_counter()
        call(0)
        t = (time.perf_counter() - t0) * 1e6
        return t, t, t
    return graph_time_us(call, n_copies, min_calls, reps)


def copy_bandwidth():
    import torch

    if DEV == "cpu":
        return 1e11
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB per buffer
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1000.0)
    t = statistics.median(ts)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 2 * n / t  # bytes/s


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------


def env_info():
    import torch
    import triton

    if DEV == "cpu":
        return {"gpu": "cpu (dry run)", "sms": 0, "l2_bytes": 1 << 16, "torch": torch.__version__,
                "cuda": None, "triton": triton.__version__, "python": sys.version.split()[0]}
    p = torch.cuda.get_device_properties(0)
    info = {"gpu": torch.cuda.get_device_name(0), "sms": p.multi_processor_count,
            "l2_bytes": getattr(p, "L2_cache_size", None), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "python": sys.version.split()[0]}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = q.stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def make_weights(n, k, copies, seed, plant=True):
    import torch

    from specpilot.w12.format import pack

    g = torch.Generator(device=DEV).manual_seed(seed)
    ws, packs = [], []
    for c in range(copies):
        w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
        if plant and c == 0:
            idx = torch.randint(0, n * k, (max(8, n * k // 5000),), device=DEV, generator=g)
            vals = torch.tensor([0.0, -0.0, 1e-30, 300.0, -2e4, 1e-40, 65504.0, -1e-38], device=DEV)
            w.view(-1)[idx] = vals.repeat(idx.numel() // 8 + 1)[: idx.numel()].to(torch.bfloat16)
        ws.append(w)
        packs.append(pack(w))
    return ws, packs


def rel_err(y, ref):
    import torch

    if not torch.isfinite(y.float()).all():
        return float("inf")
    return ((y.float() - ref).norm() / ref.norm()).item()


def bench_shape(name, n, k, ms, K, cfg_ok, copy_bw, args, l2):
    import torch
    import torch.nn.functional as F

    from specpilot.w12.format import escape_rate, nbytes

    bf16_bytes = 2 * n * k
    copies = int(min(32, max(2, math.ceil(4 * l2 / bf16_bytes)))) if DEV == "cuda" else 2
    ws, packs = make_weights(n, k, copies, seed=sum(map(ord, name)))
    escs = [K.prepare_escapes(p.escape_idx, p.escape_val, n, k) for p in packs]
    w12_bytes = statistics.mean(nbytes(p, index_bytes=8) for p in packs[1:] or packs)  # int32 row + col
    res = {"name": name, "N": n, "K": k, "copies": copies, "bf16_bytes": bf16_bytes,
           "w12_bytes": w12_bytes, "escape_rate_copy0": escape_rate(packs[0]),
           "escape_rate_plain": statistics.mean(escape_rate(p) for p in packs[1:] or packs), "per_m": []}

    # decode kernel: bit-exact + throughput
    d = K.decode(packs[0].mant, packs[0].codes, packs[0].base, packs[0].escape_idx, packs[0].escape_val)
    res["decode_exact"] = bool(torch.equal(d.view(torch.int16), ws[0].view(torch.int16)))
    outs = [torch.empty(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(min(copies, 4))]
    us = time_graph(lambda i: K.decode(packs[i].mant, packs[i].codes, packs[i].base, packs[i].escape_idx,
                                       packs[i].escape_val, out=outs[i % len(outs)]), copies)[0]
    res["decode_us"] = us
    res["decode_bw_frac"] = (w12_bytes + bf16_bytes) / (us * 1e-6) / copy_bw
    log(f"{name}: {copies} copies, escapes {res['escape_rate_plain']:.2e} "
        f"(planted copy {res['escape_rate_copy0']:.2e}), decode exact={res['decode_exact']} {us:.1f} us "
        f"({res['decode_bw_frac']:.0%} of copy bw)")

    for m in ms:
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        ref = x.float() @ ws[0].float().T
        row = {"M": m, "configs": []}
        # bf16 paths
        yb = F.linear(x, ws[0])
        row["err_bf16"] = rel_err(yb, ref)
        ys = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        yt = [torch.empty(n, m, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        t_lin = time_graph(lambda i: torch.mm(x, ws[i].t(), out=ys[i]), copies)[0]
        t_wx = time_graph(lambda i: torch.mm(ws[i], x.t(), out=yt[i]), copies)[0]
        row["bf16_linear_us"], row["bf16_wx_us"] = t_lin, t_wx
        row["bf16_us"] = min(t_lin, t_wx)
        row["bf16_bw_frac"] = bf16_bytes / (row["bf16_us"] * 1e-6) / copy_bw
        best = None
        outs_ok = {}  # key -> output of each correct config (raw vs other decodes, bit for bit)
        for cfg in candidates(K, m, n, k):
            key = (cfg.key(), K.block_m(cfg, m))
            entry = {"cfg": cfg.key(), "decode": cfg.decode}
            if not cfg_ok.get(key, False):
                entry["error"] = "excluded (precompile failed)"
                row["configs"].append(entry)
                continue
            try:
                y = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
                K.matmul(x, packs[0].mant, packs[0].codes, packs[0].base, escs[0], cfg, out=y)
                err = rel_err(y, ref)
                entry["err"] = err
                ok = err <= max(4 * row["err_bf16"], 8e-3)
                if ok and cfg.split_k > 1:
                    y2 = K.matmul(x, packs[0].mant, packs[0].codes, packs[0].base, escs[0], cfg)
                    entry["repeat_equal"] = bool(torch.equal(y.view(torch.int16), y2.view(torch.int16)))
                    ok = entry["repeat_equal"]
                entry["ok"] = bool(ok)
                if ok:
                    outs_ok[cfg.key()] = y
                    t = time_graph(lambda i, cfg=cfg: K.matmul(x, packs[i].mant, packs[i].codes, packs[i].base,
                                                               escs[i], cfg, out=ys[i]), copies)
                    entry["us"], entry["us_min"], entry["us_max"] = t
                    if best is None or t[0] < best["us"]:
                        best = dict(entry, config=cfg)
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
                entry["ok"] = False
            row["configs"].append(entry)
        _compare_decodes(K, row, outs_ok)
        if best is not None:
            row["w12_us"] = best["us"]
            row["w12_cfg"] = best["cfg"]
            row["w12_config"] = dataclasses.asdict(best["config"])
            row["w12_err"] = best["err"]
            row["w12_bw_frac"] = w12_bytes / (best["us"] * 1e-6) / copy_bw
            row["w12_bf16_equiv_frac"] = bf16_bytes / (best["us"] * 1e-6) / copy_bw
            row["speedup"] = row["bf16_us"] / best["us"]
            log(f"  M={m:3d}: bf16 {row['bf16_us']:8.2f} us ({row['bf16_bw_frac']:.0%} bw)  w12 {best['us']:8.2f} us "
                f"({row['w12_bw_frac']:.0%} bw) {best['cfg']}  speedup {row['speedup']:.3f}  err {best['err']:.1e}"
                f" (bf16 {row['err_bf16']:.1e})")
            if row["decode_compare"]:
                log("         best by decode: " + "  ".join(f"{d} {u:.2f} us" for d, u in row["best_us_by_decode"].items())
                    + " | twins (other/raw time, bits equal): "
                    + "  ".join(f"{c['cfg_other']} {c['time_ratio']:.3f} {c['bits_equal']}" for c in row["decode_compare"]))
        else:
            log(f"  M={m:3d}: no correct w12 config! errors: " +
                "; ".join(f"{c['cfg']}: {c.get('error', c.get('err'))}" for c in row["configs"][:6]))
        res["per_m"].append(row)
    return res


def _compare_decodes(K, row, outs_ok):
    """Per decode the best time; each non-raw config against its raw twin (time ratio, equal bits)."""
    import torch

    timed = [c for c in row["configs"] if "us" in c]
    row["best_us_by_decode"] = {d: min(c["us"] for c in timed if c["decode"] == d)
                                for d in sorted({c["decode"] for c in timed})}
    by_key = {c["cfg"]: c for c in timed}
    row["decode_compare"] = []
    for c in timed:
        if c["decode"] == "raw":
            continue
        twin = dataclasses.replace(K.Config.from_key(c["cfg"]), decode="raw").key()
        if twin not in by_key:
            continue
        y, y_raw = outs_ok[c["cfg"]], outs_ok[twin]
        row["decode_compare"].append({
            "cfg_raw": twin, "cfg_other": c["cfg"], "decode": c["decode"], "us_raw": by_key[twin]["us"],
            "us_other": c["us"], "time_ratio": c["us"] / by_key[twin]["us"],
            "bits_equal": bool(torch.equal(y.view(torch.int16), y_raw.view(torch.int16)))})


def bench_step(K, copy_bw, ms, layers=36):
    import torch

    from specpilot.w12.format import nbytes

    ws, ps, es = [], [], []
    t0 = time.time()
    g = torch.Generator(device=DEV).manual_seed(1234)
    from specpilot.w12.format import pack

    for _ in range(layers):
        for _, n, k in LAYER:
            w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
            p = pack(w)
            ws.append(w)
            ps.append(p)
            es.append(K.prepare_escapes(p.escape_idx, p.escape_val, n, k))
    if DEV == "cuda":
        torch.cuda.synchronize()
    bf16_bytes = sum(2 * w.numel() for w in ws)
    w12_bytes = sum(nbytes(p, index_bytes=8) for p in ps)
    log(f"step: {layers} layers, {len(ws)} matrices, {bf16_bytes / 1e9:.2f} GB bf16, {w12_bytes / 1e9:.2f} GB w12 "
        f"(built in {time.time() - t0:.0f}s)")
    out = {"layers": layers, "matrices": len(ws), "bf16_bytes": bf16_bytes, "w12_bytes": w12_bytes, "per_m": []}
    for m in ms:
        x = {k: torch.randn(m, k, device=DEV).to(torch.bfloat16) for k in {kk for _, _, kk in LAYER}}
        ys = [torch.empty(m, w.shape[0], device=DEV, dtype=torch.bfloat16) for w in ws]

        def run_bf16(_):
            for i, w in enumerate(ws):
                torch.mm(x[w.shape[1]], w.t(), out=ys[i])

        def run_w12(_):
            for i, p in enumerate(ps):
                K.matmul(x[p.shape[1]], p.mant, p.codes, p.base, es[i], out=ys[i])

        tb = time_graph(run_bf16, 1, min_calls=1, reps=10)[0]
        tw = time_graph(run_w12, 1, min_calls=1, reps=10)[0]
        r = {"M": m, "bf16_ms": tb / 1000, "w12_ms": tw / 1000, "speedup": tb / tw,
             "bf16_bw_frac": bf16_bytes / (tb * 1e-6) / copy_bw, "w12_bw_frac": w12_bytes / (tw * 1e-6) / copy_bw}
        log(f"step M={m}: bf16 {r['bf16_ms']:.3f} ms ({r['bf16_bw_frac']:.0%} bw)  w12 {r['w12_ms']:.3f} ms "
            f"({r['w12_bw_frac']:.0%} bw)  speedup {r['speedup']:.3f}")
        out["per_m"].append(r)
    return out


def main(argv=None):
    global DEV, SHAPES, LAYER, QUICK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "w12.json"))
    ap.add_argument("--ms", default="1,4,16,64,256", help="rows of x to measure")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from SHAPES")
    ap.add_argument("--workers", type=int, default=0, help="compile workers (0: cores - 2, at most 14)")
    ap.add_argument("--no-step", action="store_true", help="skip the 36-layer decode step")
    ap.add_argument("--step-ms", default="1,4,16")
    ap.add_argument("--quick", action="store_true",
                    help="fast first look: M = 1 and 16 (step too), the short candidate list")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU + Triton interpreter on tiny shapes: exercises this script, measures nothing")
    args = ap.parse_args(argv)
    QUICK = args.quick
    if args.quick:
        args.ms, args.step_ms = "1,16", "1,16"
    if args.dry_run:
        DEV = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
        SHAPES = {"q_proj/o_proj": (48, 128), "down_proj": (32, 256)}
        LAYER = [("q", 48, 128), ("down", 32, 256)]
        args.ms, args.shapes, args.step_ms = ("1,17" if args.quick else "1,4,17"), ",".join(SHAPES), "1"

    import torch

    from specpilot.kernels import w12_triton as K

    if args.dry_run:
        import triton.runtime.interpreter as interp

        if hasattr(interp, "_patch_lang_tensor"):  # triton 3.6 + numpy >= 2.3 (see tests/test_w12_triton.py)
            _orig = interp._patch_lang_tensor

            def _patched(tensor, scope):
                _orig(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

            interp._patch_lang_tensor = _patched
        full = K.candidate_configs

        def few(m, n, k, **kw):  # per kind the first two raw configs, and one twin of each other decode
            cs = full(m, n, k, **kw)
            out = [c for c in cs if c.kind == "gemv" and c.decode == "raw"][:2]
            out += [c for c in cs if c.kind == "mm" and c.decode == "raw"][:2]
            mmx = [c for c in cs if c.kind == "mmx" and c.decode == "raw"][:1]
            for c in out[:1] + mmx:
                out += [dataclasses.replace(c, decode=d) for d in ("base", "prmt")]
            return out + mmx

        K.candidate_configs = few

    ms = [int(v) for v in args.ms.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "env": env_info()}
    log("env", json.dumps(result["env"]))
    l2 = result["env"]["l2_bytes"] or 50 * 2**20
    copy_bw = copy_bandwidth()
    result["copy_bw_Bps"] = copy_bw
    log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write)")

    # compile every (config, row block) once, in parallel; keep those that ran and were right
    jobs, seen = [], set()
    for name in shapes:
        n, k = SHAPES[name]
        for m in ms:
            for cfg in candidates(K, m, n, k):
                bm = K.block_m(cfg, m)
                key = (cfg.key(), bm)
                if key not in seen:
                    seen.add(key)
                    jobs.append((dataclasses.asdict(cfg), bm))
    workers = args.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    t0 = time.time()
    try:
        pre = _worker(jobs) if DEV == "cpu" else precompile(jobs, workers)
    except Exception as e:  # noqa: BLE001
        log(f"parallel precompile failed ({e}); compiling in-process")
        pre = _worker(jobs)
    cfg_ok = {}
    for r in pre:
        cfg = K.Config(**r["cfg"])
        cfg_ok[(cfg.key(), r["m"])] = r["ok"]
    bad = [r for r in pre if not r["ok"]]
    log(f"precompiled {len(jobs)} (config, block) pairs with {workers} workers in {time.time() - t0:.0f}s; "
        f"{len(bad)} failed")
    for r in bad[:12]:
        log("  failed:", K.Config(**r["cfg"]).key(), "bm", r["m"], r.get("error", r.get("err")))
    result["precompile"] = pre

    result["shapes"] = []
    tuned = {}
    for name in shapes:
        n, k = SHAPES[name]
        try:
            r = bench_shape(name, n, k, ms, K, cfg_ok, copy_bw, args, l2)
        except Exception:  # noqa: BLE001
            log(f"{name}: FAILED\n{traceback.format_exc()}")
            continue
        result["shapes"].append(r)
        if DEV == "cuda":
            torch.cuda.empty_cache()
        for row in r["per_m"]:
            if "w12_config" in row:
                tuned[f"{K.m_bucket(row['M'])},{n},{k}"] = row["w12_config"]
        _write(args.out, result, tuned)

    K.set_tuned(tuned)
    if not args.no_step:
        try:
            result["step"] = bench_step(K, copy_bw, [int(v) for v in args.step_ms.split(",")],
                                        layers=2 if DEV == "cpu" else 36)
        except Exception:  # noqa: BLE001
            log(f"step: FAILED\n{traceback.format_exc()}")
    result["goals"] = goals(result)
    _write(args.out, result, tuned)
    table(result)
    return 0


def goals(result):
    by = {s["name"]: {r["M"]: r for r in s["per_m"]} for s in result["shapes"]}
    g = {"m1_ge_1.25x": {}, "m16_ge_1.0x": {}}
    for name in list(MLP) + list(ATTN):
        if name in by:
            g["m1_ge_1.25x"][name] = by[name].get(1, {}).get("speedup")
            g["m16_ge_1.0x"][name] = by[name].get(16, {}).get("speedup")
    g["met_m1"] = all(v is not None and v >= 1.25 for v in g["m1_ge_1.25x"].values())
    g["met_m16"] = all(v is not None and v >= 1.0 for v in g["m16_ge_1.0x"].values())
    return g


def _write(path, result, tuned):
    result["tuned_configs"] = tuned
    result["log"] = LOG
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for p, obj in ((path, result), (path.with_name("w12_tuned.json"),
                                    {"gpu": result["env"]["gpu"], "triton": result["env"]["triton"],
                                     "date": result["date"], "configs": tuned})):
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(obj, indent=1, default=str))
        os.replace(tmp, p)


def table(result):
    bw = result["copy_bw_Bps"]
    print()
    print(f"GPU {result['env']['gpu']}  torch {result['env']['torch']}  triton {result['env']['triton']}  "
          f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':<16}{'NxK':>12}{'M':>5}{'bf16 us':>10}{'bf16 bw':>9}{'w12 us':>10}{'w12 bw':>8}"
          f"{'speedup':>9}  config")
    for s in result["shapes"]:
        for r in s["per_m"]:
            if "w12_us" in r:
                print(f"{s['name']:<16}{s['N']:>6}x{s['K']:<5}{r['M']:>5}{r['bf16_us']:>10.2f}{r['bf16_bw_frac']:>9.0%}"
                      f"{r['w12_us']:>10.2f}{r['w12_bw_frac']:>8.0%}{r['speedup']:>9.3f}  {r['w12_cfg']}")
            if r.get("best_us_by_decode"):
                print(f"{'':<16}{'':>12}{r['M']:>5}  best by decode: "
                      + "  ".join(f"{d} {u:.2f} us" for d, u in r["best_us_by_decode"].items())
                      + "  twins bit-equal: " + str(all(c["bits_equal"] for c in r.get("decode_compare", []))))
        print(f"{'':<16}decode kernel {s['decode_us']:.1f} us, exact={s['decode_exact']}, "
              f"{s['decode_bw_frac']:.0%} of copy bw")
    if "step" in result:
        for r in result["step"]["per_m"]:
            print(f"36-layer step M={r['M']}: bf16 {r['bf16_ms']:.3f} ms  w12 {r['w12_ms']:.3f} ms  "
                  f"speedup {r['speedup']:.3f}")
    print("goals:", json.dumps(result["goals"]))


if __name__ == "__main__":
    sys.exit(main())

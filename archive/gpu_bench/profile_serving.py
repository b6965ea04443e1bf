#!/usr/bin/env python
"""Where a closed-loop serving step's time goes at concurrency c (issue 15), in one process.

Random bf16 target of ``--shape`` and its random DFlash drafter, built on the GPU (no files);
``--requests`` random prompts of ``--prompt-len`` tokens; the product's continuous-batching
scheduler (:class:`specpilot.engine.scheduler.Scheduler`) at concurrency ``--concurrency`` for
AR, then stock (the replay drafter at ``--profile`` with the drafter network run for its cost),
then stock with overlap scheduling. Per engine: wall time, decode steps, the device time of the
draft and verify phases, prefill (first wave and refills) and what is left (host work and idle
device), per step; outputs equal AR. Then one shorter stock run under ``torch.profiler``: the
device's busy time per step against the wall, and the top host-side and device-side operators.
Writes ``profile_serving.json`` under ``--out-dir`` and prints a table last.

    PYTHONUNBUFFERED=1 python3 gpu_bench/profile_serving.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specpilot.engine.replay import load_profile  # noqa: E402
from specpilot.engine.runner import TargetRunner, clock  # noqa: E402
from specpilot.engine.scheduler import Request, Scheduler  # noqa: E402
from specpilot.engine.serve import EngineSpec, make_engine_proposer  # noqa: E402
from specpilot.models.random_checkpoint import build_drafter, build_target  # noqa: E402


def refill_profile(runner, prop, prompt: list[int], dev) -> dict:
    """What one continuous-batching refill costs: the newcomer's prefill into its own row
    (``runner.prefill_row``) and the drafter's context of it (``observe_row``), each timed alone
    (device-synchronized wall clock, best of 3), then both under torch.profiler (top operators)."""
    from torch.profiler import ProfilerActivity, profile

    def best(fn, n=3):
        ts = []
        for _ in range(n):
            t = clock(dev)
            fn()
            ts.append(clock(dev) - t)
        return min(ts) * 1e3

    box = {}

    def pre():
        box["lf"] = runner.prefill_row(0, prompt, 0)

    out = {"prompt_tokens": len(prompt), "prefill_row_ms": best(pre)}
    out["observe_row_ms"] = best(lambda: prop.observe_row(0, box["lf"][1], 0))
    out["argmax_tolist_ms"] = best(lambda: box["lf"][0].argmax(-1).tolist())
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as p:
        pre()
        prop.observe_row(0, box["lf"][1], 0)
        box["lf"][0].argmax(-1).tolist()
    ka = p.key_averages()
    out["cpu_top"] = [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 3))
                      for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:12]]
    out["cuda_top"] = [(e.key[:90], e.count, round(getattr(e, "self_device_time_total", 0) / 1e3, 3))
                       for e in sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:12]]
    print("refill: " + json.dumps({k: v for k, v in out.items() if not k.endswith("_top")}), flush=True)
    for k, cnt, ms in out["cuda_top"]:
        print(f"  dev {ms:8.3f}  x{cnt:<5d} {k}")
    for k, cnt, ms in out["cpu_top"][:8]:
        print(f"  cpu {ms:8.3f}  x{cnt:<5d} {k}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "profile_serving_out"))
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--profile", default="study_stock")
    ap.add_argument("--torch-profile", action="store_true", help="also one stock run under torch.profiler")
    ap.add_argument("--refill-profile", action="store_true", help="also time one refill's parts alone")
    ap.add_argument("--beside", action="store_true", help="also serve with refills prefilled beside the steps")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a check of the script (--shape tiny)
    t0 = time.time()
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = build_target(args.shape, dev, dt, 0)
    drafter = build_drafter(args.shape, dev, dt, 0, block_size=args.block)
    print(f"built {args.shape} target + drafter in {time.time() - t0:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    V = min(150000, target.config.vocab_size)
    prompts = [torch.randint(0, V, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    c = args.concurrency
    max_seq = args.prompt_len + args.new + args.block + 64
    prof = load_profile(args.profile)
    res = {"args": vars(args), "engines": {}}

    def serve(name: str, refs=None, overlap=False, n=None, new=None, beside=False):
        spec = EngineSpec("ar") if refs is None else EngineSpec("stock", args.block, {"overlap": overlap})
        reqs = [Request(p, new or args.new, refs[i] if refs else None) for i, p in enumerate(prompts[:n])]
        prop = make_engine_proposer(spec, target, drafter, None, None, prof if refs else None,
                                    [r.reference for r in reqs[:c]] if refs else None)
        runner = TargetRunner(target, c, max_seq, prop.capture if prop is not None else ())
        sched = Scheduler(runner, prop, profile=True, overlap=overlap, prefill_beside=beside)
        sched.run([Request(r.prompt_ids, 8, r.reference) for r in reqs[:c]])  # warm-up: captures, probes
        ta = clock(dev)
        rows = sched.run(reqs)
        wall = clock(dev) - ta
        pre = [r.prefill_s for r in rows if r.arrival_s > 0]
        first = [r.prefill_s for r in rows if r.arrival_s == 0]
        steps = sched.steps
        dec = sum(r.decode_s for r in rows) / len(rows)
        toks = [t for r in rows for t in r.committed_per_step]
        # per-request phase sums divided by its own steps: the device time of a step's draft and verify
        d_step = sum(r.draft_s / max(r.verify_steps, 1) for r in rows) / len(rows)
        v_step = sum(r.verify_s / max(r.verify_steps, 1) for r in rows) / len(rows)
        refill_total = sum(pre)
        rec = {"wall_s": wall, "steps": steps, "tau": sum(toks) / len(toks), "decode_s_mean": dec,
               "tok_s_aggregate": sum(len(r.output_ids) for r in rows) / wall,
               "first_wave_prefill_s": first[0] if first else None,
               "refills": len(pre), "refill_prefill_s_mean": refill_total / len(pre) if pre else None,
               "step_ms_wall": (wall - refill_total - (first[0] if first else 0)) / max(steps, 1) * 1e3,
               "draft_ms_step": d_step * 1e3, "verify_ms_step": v_step * 1e3,
               "stall_s_mean": sum(r.prefill_stall_s for r in rows) / len(rows),
               "overlapped": sched.overlapped, "beside": sched.beside}
        rec["other_ms_step"] = rec["step_ms_wall"] - rec["draft_ms_step"] - rec["verify_ms_step"]
        res["engines"][name] = rec
        print(f"{name}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}),
              flush=True)
        return rows, runner, prop

    from specpilot.engine.graphs import matmul_choices

    # refills with the running requests waiting for them (the default) and, with --beside, also
    # prefilled beside the running requests' steps on a second stream; AR in both regimes too
    ar_rows, _, _ = serve("ar")
    refs = [r.output_ids for r in ar_rows]
    runs = {"stock": dict(), "stock+overlap": dict(overlap=True)}
    if args.beside:
        serve("ar beside", beside=True)
        runs.update({"stock beside": dict(beside=True), "stock+overlap beside": dict(overlap=True, beside=True)})
    for name, kw in runs.items():
        rows, runner_, prop_ = serve(name, refs, **kw)
        res["engines"][name]["equal_ar"] = sum(a.output_ids == s.output_ids for a, s in zip(ar_rows, rows))
        if name == "stock" and runner_.can_prefill_rows and args.refill_profile:
            res["refill"] = refill_profile(runner_, prop_, prompts[0], dev)
    res["matmul"] = {"target": matmul_choices(target), "drafter": matmul_choices(drafter)}
    for k, e in res["engines"].items():
        ar = res["engines"]["ar beside" if k.endswith("beside") else "ar"]
        e["speedup_decode_mean"] = ar["decode_s_mean"] / e["decode_s_mean"]

    from torch.profiler import ProfilerActivity, profile

    n = c + c // 2
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    if not args.torch_profile:
        return finish(res, out, args)
    with profile(activities=acts) as p:
        serve("stock (profiled)", refs, n=n, new=min(128, args.new))
    ka = p.key_averages()
    steps = res["engines"]["stock (profiled)"]["steps"]
    kern = [e for e in ka if getattr(e, "self_device_time_total", 0) > 0]
    busy = sum(e.self_device_time_total for e in kern) / 1e3
    cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]
    cuda = sorted(kern, key=lambda e: -e.self_device_time_total)[:15]
    res["profiled"] = {
        "device_busy_ms_per_step": busy / max(steps, 1),
        "cpu_top": [(e.key[:100], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in cpu],
        "cuda_top": [(e.key[:100], e.count, round(e.self_device_time_total / 1e3, 2)) for e in cuda]}
    print("\nself device ms (profiled stock run):")
    for k, cnt, ms in res["profiled"]["cuda_top"]:
        print(f"  {ms:9.2f}  x{cnt:<6d} {k[:90]}")
    print("self CPU ms:")
    for k, cnt, ms in res["profiled"]["cpu_top"][:10]:
        print(f"  {ms:9.2f}  x{cnt:<6d} {k[:90]}")
    return finish(res, out, args)


def finish(res: dict, out: Path, args) -> int:
    """Write profile_serving.json and print the per-engine table."""
    c = args.concurrency
    (out / "profile_serving.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nc{c}, {args.requests} requests x {args.new} new tokens, prompts {args.prompt_len}")
    print("engine                  steps  tau   step ms  draft  verify  other  refill ms  stall s  decode s  tok/s  vs AR")
    for k, e in res["engines"].items():
        print(f"{k:23s} {e['steps']:5d}  {e['tau']:.2f}  {e['step_ms_wall']:6.2f}  {e['draft_ms_step']:5.2f}  "
              f"{e['verify_ms_step']:6.2f}  {e['other_ms_step']:5.2f}  {1e3 * (e['refill_prefill_s_mean'] or 0):8.1f}  "
              f"{e['stall_s_mean']:7.3f}  {e['decode_s_mean']:8.3f}  {e['tok_s_aggregate']:5.0f}  "
              f"{e.get('speedup_decode_mean', 1.0):.3f}")
    if "profiled" in res:
        print(f"device busy per profiled step: {res['profiled']['device_busy_ms_per_step']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

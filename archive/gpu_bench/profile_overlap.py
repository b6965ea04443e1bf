#!/usr/bin/env python
"""Where a stock step's time goes with and without overlap scheduling (issue 15, mechanism b).

Random bf16 target of ``--shape`` built on the GPU (no files), its random DFlash drafter, the replay
drafter at ``study_stock``; ``--batch`` prompts of ``--prompt-len`` random tokens. Runs the static
loop (:func:`specpilot.engine.generate.generate`) for ``--new`` tokens with ``overlap`` off and on
(twice each, alternating), then one run of each under ``torch.profiler``: wall time per step, and
the top host-side and device-side operators. Writes ``profile_overlap.json`` under ``--out-dir``.
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

from specpilot.drafters.dflash import DFlashProposer  # noqa: E402
from specpilot.engine.generate import generate, generate_ar  # noqa: E402
from specpilot.engine.replay import ReplayProposer, load_profile  # noqa: E402
from specpilot.engine.runner import TargetRunner  # noqa: E402
from specpilot.models.random_checkpoint import build_drafter, build_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "overlap_out"))
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    target = build_target(args.shape, dev, torch.bfloat16, 0).eval()
    drafter = build_drafter(args.shape, dev, torch.bfloat16, 0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    max_seq = args.prompt_len + args.new + 64
    ref = [r.output_ids for r in generate_ar(TargetRunner(target, args.batch, max_seq), prompts, args.new)]
    prof = load_profile("study_stock")

    def run(overlap: bool):
        net = DFlashProposer(drafter, block_size=16)
        rp = ReplayProposer(ref, prof, target.config.vocab_size, net, block_size=16)
        runner = TargetRunner(target, args.batch, max_seq, rp.capture)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rows = generate(runner, rp, prompts, args.new, overlap=overlap)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        steps = max(len(r.committed_per_step) for r in rows)
        return {"wall_s": wall, "steps": steps, "step_ms": wall / steps * 1e3,
                "equal_ar": all(r.output_ids == x for r, x in zip(rows, ref)),
                "draft_s": rows[0].draft_s, "verify_s": rows[0].verify_s}

    res = {"args": vars(args), "runs": []}
    for ov in (False, True, False, True):
        r = run(ov)
        r["overlap"] = ov
        res["runs"].append(r)
        print(f"overlap={ov}: {r['step_ms']:.2f} ms/step over {r['steps']} steps, equal AR {r['equal_ar']}, "
              f"draft {r['draft_s']:.3f} s verify {r['verify_s']:.3f} s", flush=True)
    from torch.profiler import ProfilerActivity, profile

    for ov in (False, True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            r = run(ov)
        ka = p.key_averages()
        cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]
        cuda = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:12]
        res[f"profile_overlap_{ov}"] = {
            "step_ms": r["step_ms"],
            "cpu_top": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in cpu],
            "cuda_top": [(e.key, e.count, round(getattr(e, "self_device_time_total", 0) / 1e3, 2)) for e in cuda]}
        print(f"\n== profile overlap={ov} ({r['step_ms']:.2f} ms/step under the profiler); self CPU ms:")
        for k, n, ms in res[f"profile_overlap_{ov}"]["cpu_top"]:
            print(f"  {ms:9.2f}  x{n:<6d} {k[:90]}")
        print("  self device ms:")
        for k, n, ms in res[f"profile_overlap_{ov}"]["cuda_top"][:8]:
            print(f"  {ms:9.2f}  x{n:<6d} {k[:90]}")
    (out / "profile_overlap.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

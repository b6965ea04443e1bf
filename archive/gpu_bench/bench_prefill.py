#!/usr/bin/env python
"""Prefill cost of the fast path's two prompt paths on the GPU, and their batch invariance.

``TargetRunner.prefill`` on the Triton fast path runs every prompt row by row through the Triton
step (``prefill_row``, the path every continuous-batching refill takes); before, the first batch of
a run went through one eager right-padded block (cuBLAS, ``rows=False``). For each batch size B in
``--batch``: the median wall time of both (device synchronized) over ``--reps`` runs after a
warm-up, and whether each row's first-token logits equal, bit for bit, the same prompt prefilled
alone at B = 1 (the row path: by design; the eager block: not promised). Writes ``prefill.json``
under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from specpilot.engine.runner import TargetRunner  # noqa: E402
from specpilot.models.loading import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="/tmp/specpilot_e2e/target")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "prefill_out"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 24])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=1152)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    target = load_target(args.target, dtype=torch.bfloat16, device="cuda")
    R = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "load_s": round(time.time() - t, 1), "batches": {}}
    g = torch.Generator().manual_seed(0)
    V = target.config.vocab_size
    prompts = [torch.randint(0, V, (args.prompt_len,), generator=g).tolist() for _ in range(max(args.batch))]
    alone = {}
    with torch.inference_mode():
        r1 = TargetRunner(target, 1, args.max_seq)
        for i in range(max(args.batch)):
            alone[i] = r1.prefill([prompts[i]])[0][0].clone()
        r1e = [r1.prefill([prompts[i]], rows=False)[0][0].clone() for i in range(max(args.batch))]
        del r1
        for B in args.batch:
            r = TargetRunner(target, B, args.max_seq)
            res = R["batches"][str(B)] = {"path": r.prefill_path}
            for name, rows in (("rows", True), ("eager", False)):
                r.prefill(prompts[:B], rows=rows)  # warm-up (Triton compilation, cuBLAS workspaces)
                times = []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    last = r.prefill(prompts[:B], rows=rows)[0]
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                ref = alone if rows else dict(enumerate(r1e))
                res[name] = {"median_s": statistics.median(times), "times_s": times,
                             "rows_equal_alone": sum(bool(torch.equal(last[b], ref[b])) for b in range(B))}
                print(f"B={B:3d} {name:5s} {res[name]['median_s'] * 1e3:8.1f} ms  rows bit-equal to B=1: "
                      f"{res[name]['rows_equal_alone']}/{B}", flush=True)
            res["rows_vs_eager_top1_equal"] = int((r.prefill(prompts[:B])[0].argmax(-1)
                                                   == r.prefill(prompts[:B], rows=False)[0].argmax(-1)).sum())
            del r
            torch.cuda.empty_cache()
    (out / "prefill.json").write_text(json.dumps(R, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Decode and chain-verify step times of a target on the CPU (issue 19: how much a verify row costs).

Loads a target checkpoint, prefills one prompt of ``--context`` tokens, then times the decode step
(one token, committed and rolled back so the context stays fixed) and chain verifies of each
``--widths`` rows (never committed) through :class:`specpilot.engine.runner.TargetRunner`, the
engine's own eager CPU path. Prints milliseconds per call (mean over ``--iters`` after 5 warm-up
calls) and writes ``--out`` as JSON when given.

    python gpu_bench/cpu_step_costs.py --target resources/deployments/tiny/target --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from specpilot.engine.runner import TargetRunner  # noqa: E402
from specpilot.models.loading import load_target  # noqa: E402


def mean_ms(fn, iters: int) -> float:
    """Mean wall time of ``fn()`` [ms] over ``iters`` calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=195, help="committed tokens before the timed steps")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_target(a.target)
    runner = TargetRunner(model, 1, a.context + max(a.widths) + 8, ())
    runner.prefill([[5 + i % 64 for i in range(a.context)]])
    tok = torch.tensor([7])

    def decode():
        runner.decode(tok)
        runner.rollback(runner.length - 1)

    res = {"target": a.target, "threads": a.threads, "context": a.context, "decode_ms": mean_ms(decode, a.iters),
           "verify_ms": {}}
    gen = torch.Generator().manual_seed(0)
    for n in a.widths:
        block = torch.randint(5, 100, (1, n), generator=gen)
        res["verify_ms"][str(n)] = mean_ms(lambda: runner.verify(block), a.iters)
    print(f"decode {res['decode_ms']:.2f} ms; verify " + ", ".join(f"{k} rows {v:.2f} ms" for k, v in res["verify_ms"].items()))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""The w12 tensor-core kernel's main-loop variants side by side in one call (issue 17).

    python3 gpu_bench/bench_w12_variants.py --out-dir $OUT/variants --libs .w12build/libw12mma_sm90_pipe{2,1,0}.so

Each library (built with ``specpilot.kernels.w12_mma.build(arch, dir, pipe=P)``: ``W12_PIPE`` 0 =
the 2026-12-02 loop, loads of a group of chunks then their math; 1 = register double buffering;
2 = cp.async through a shared-memory ring) runs ``bench_w12_mma.py --quick`` in its own process
(the library loads once per process), with the same bf16 baselines timed in that process; checks
before timing as there. Prints the 36-layer step per variant last; writes each variant's
``w12_mma.json`` under ``--out-dir/<library stem>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "w12var_out"))
    ap.add_argument("--libs", nargs="+", required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--timeout", type=int, default=180, help="seconds per variant")
    a = ap.parse_args(argv)
    rows = []
    for lib in a.libs:
        stem = Path(lib).stem
        out = Path(a.out_dir) / stem
        env = {**os.environ, "SPECPILOT_W12_MMA_LIB": str(Path(lib).resolve())}
        cmd = [sys.executable, str(HERE / "bench_w12_mma.py"), "--out-dir", str(out), "--quick",
               "--ms", *map(str, a.ms), "--step-ms", *map(str, a.ms)]
        print(f"== {stem}: {' '.join(cmd)}", flush=True)
        try:
            r = subprocess.run(cmd, env=env, timeout=a.timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f = out / "w12_mma.json"
        if not f.is_file():
            rows.append((stem, f"no result (rc {rc})"))
            continue
        d = json.loads(f.read_text())
        fams = {r["role"]: r["family"] for r in d["roles"]}
        fails = [f"{r['role']}:{k}" for r in d["roles"] for k, v in r["families"].items() if not v["ok"]]
        step = " ".join(f"M{s['M']} x{s['speedup']:.3f} (choice x{s['choice_speedup']:.3f}, w12 {s['w12_bw']:.0%})"
                        for s in d.get("step", {}).get("per_m", []))
        rows.append((stem, f"copy {d['copy_bw'] / 1e12:.2f} TB/s; step {step}; families {fams}; failed {fails or 'none'}"))
    print("\n== summary (36-layer step, w12 / best bf16 in the same process)")
    for stem, line in rows:
        print(f"{stem}: {line}")


if __name__ == "__main__":
    main()

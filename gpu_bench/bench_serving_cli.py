#!/usr/bin/env python
"""The product's CLI end to end on the GPU: AR and stock at several concurrencies (issues 15 / 16).

What it runs, all through ``specpilot`` subcommands (``python3 -m specpilot.cli``):

1. ``random-checkpoint --shape qwen3-8b`` (random-weight target and DFlash drafter, written to
   ``--work``, default /tmp/specpilot_e2e);
2. a prompt file of ``--requests`` random prompts of ``--prompt-len`` tokens (seeded);
3. for each concurrency c in ``--concurrency`` (default 16 1): ``run --engine ar``, then
   ``run --engine stock --replay-profile study_stock --replay-reference <ar records>`` (block
   ``--block``, ``--new`` new tokens; every cell with c > 1 serves all ``--requests`` prompts, the
   c = 1 cell only the first ``--requests-c1``; a cell with fewer than 2c requests, below issue 15's
   rule, is flagged ``below_2c``), then ``force --candidate stock --reference ar`` (with
   ``--target`` on the GPU; there the teacher-forced pass runs through the engine's Triton step,
   ``teacher_forced_path`` "triton" in the verdict);
4. AR against AR across concurrencies (batch invariance of AR), **on the requests both cells
   served** (the c = 1 cell serves a prefix of the others' requests): every AR cell's outputs
   compared with the ``--ar-reference`` cell's (default c = 16) request by request
   (``ar_equality``: common requests, equal, first divergence of each other one), and for the
   cells in ``--ar-force`` (default 1) ``force`` of that AR cell against the reference cell, both
   record files cut to their common requests first (so the reference report does not count the
   requests one cell never served as missing);
5. prints per cell: per-request speedup (geometric mean over requests of AR decode_s / stock
   decode_s), tau, aggregate tok/s (output tokens over first arrival to last finish, closed loop;
   lock-step batches for static), step time, forcing verdicts, and the AR equalities.

``--regime continuous`` (default): closed-loop serving of c slots with refills
(:mod:`specpilot.engine.scheduler`); ``static``: lock-step batches of c. Writes ``serving.json``
and the records under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sh(cmd: list[str], log: list) -> tuple[int, float, str]:
    t = time.time()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    p = subprocess.run([sys.executable, "-m", "specpilot.cli", *cmd], capture_output=True, text=True, env=env)
    dt = time.time() - t
    out = (p.stdout + p.stderr).strip()
    log.append({"cmd": "specpilot " + " ".join(cmd), "rc": p.returncode, "wall_s": round(dt, 2), "tail": out[-1500:]})
    print(f"[{dt:6.1f}s rc={p.returncode}] specpilot {' '.join(cmd)}\n    {out[-400:]}", flush=True)
    return p.returncode, dt, out


def read_records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def throughput(records: list[dict], c: int) -> float:
    """Output tokens per second of a cell: over the first arrival to the last finish when the
    records carry those times (closed-loop serving), else over lock-step batches of c."""
    tok = sum(r["new_tokens"] for r in records)
    if all(r.get("finish_s") is not None and r.get("arrival_s") is not None for r in records):
        return tok / (max(r["finish_s"] for r in records) - min(r["arrival_s"] for r in records))
    return tok / (sum(r["decode_s"] for r in records) / c)


def prefill_stats(records: list[dict]) -> dict:
    """Mean prefill_s [s] of a cell's first wave (arrival 0: prefilled together at the run's
    start) and of its refills (closed loop only; each refill's prefill step)."""
    first = [r["prefill_s"] for r in records if r.get("arrival_s") == 0.0]
    refill = [r["prefill_s"] for r in records if (r.get("arrival_s") or 0.0) > 0.0]
    return {"first_wave_n": len(first), "first_wave_prefill_s": sum(first) / len(first) if first else None,
            "refill_n": len(refill), "refill_prefill_s_mean": sum(refill) / len(refill) if refill else None}


def compare_outputs(cand: dict, ref: dict) -> dict:
    """Output ids of two cells (request_id -> record) on the requests both served."""
    common = [k for k in cand if k in ref]
    differ = []
    for k in common:
        a, b = cand[k]["output_ids"], ref[k]["output_ids"]
        if a != b:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            differ.append({"request_id": k, "first_divergence": pos})
    return {"common": len(common), "equal": len(common) - len(differ), "only_candidate": len(cand) - len(common),
            "only_reference": len(ref) - len(common), "differ": differ}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "serving_out"))
    ap.add_argument("--work", default="/tmp/specpilot_e2e")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--requests-c1", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--profile", default="study_stock")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape (tiny: a CPU check of the script)")
    ap.add_argument("--tag", default="", help="suffix of the records folder (several runs on one checkpoint)")
    ap.add_argument("--kernel-configs", help="JSON {role: config} passed to 'specpilot run'")
    ap.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json passed to 'specpilot run'")
    ap.add_argument("--kernel-agent", help="kernel-agent.json passed to 'specpilot run' and 'specpilot force'")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: also run stock with this engine config (a mechanism alone), e.g. "
                         "overlap='{\"overlap\": true}'; NAME@16,24=JSON: at those concurrencies only; repeatable")
    ap.add_argument("--regime", choices=("continuous", "static"), default="continuous",
                    help="'specpilot run --regime': closed-loop concurrency (default) or lock-step batches")
    ap.add_argument("--ar-reference", type=int, default=None,
                    help="the AR cell every other AR cell is compared with (default 16 if run, else the first c)")
    ap.add_argument("--ar-force", type=int, nargs="*", default=[1],
                    help="concurrencies whose AR cell is also 'force'd against the reference AR cell, on "
                         "their common requests (default 1; none: compare outputs only)")
    args = ap.parse_args()
    out, work = Path(args.out_dir), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log: list = []
    R = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "commands": log, "cells": {}}
    tgt, dr = work / "target", work / "drafter"
    rec = work / f"records{args.tag}"  # records and verdicts; packed into serving_records.tar.gz under --out-dir
    rec.mkdir(exist_ok=True)
    if not (tgt / "config.json").exists():
        rc, _, _ = sh(["random-checkpoint", "--shape", args.shape, "--out", str(tgt), "--drafter-out", str(dr)], log)
        if rc:
            return rc
    import random

    rng = random.Random(0)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"request_id": f"random/{i:04d}", "benchmark": "random",
                                           "prompt_ids": [rng.randrange(1000 if args.shape == "tiny" else 151000) for _ in range(args.prompt_len)]}) + "\n"
                               for i in range(args.requests)))
    extra = ["--kernel-configs", args.kernel_configs] if args.kernel_configs else []
    extra += ["--kernel-agent", args.kernel_agent] if args.kernel_agent else []
    run_extra = ["--kernels-manifest", args.kernels_manifest] if args.kernels_manifest else []
    common = ["--target", str(tgt), "--prompts", str(prompts), "--max-new-tokens", str(args.new), "--gpu", "h200",
              "--regime", args.regime, *extra, *run_extra]
    # the teacher-forced pass runs the engine's kernels (the Triton step) on the GPU: same configs
    force_common = ["--target", str(tgt), "--prompts", str(prompts), "--device", "cuda" if args.shape != "tiny" else "cpu",
                    *extra]

    def save():
        (out / "serving.json").write_text(json.dumps(R, indent=1))

    variants = {"stock": {}}
    only = {}  # variant -> the concurrencies it runs at (NAME@16,20=JSON), else all
    for v in args.variant:
        name, _, cfg = v.partition("=")
        name, _, at = name.partition("@")
        variants[name] = json.loads(cfg or "{}")
        if at:
            only[name] = {int(x) for x in at.split(",")}
    for c in args.concurrency:
        lim = [] if c > 1 else ["--limit", str(args.requests_c1)]
        ar = rec / f"ar-c{c}.jsonl"
        cell = R["cells"][f"c{c}"] = {}
        rc, cell["ar_wall_s"], _ = sh(["run", "--engine", "ar", "--out", str(ar), "--concurrency", str(c), *common, *lim], log)
        if rc:
            continue
        a = {r["request_id"]: r for r in read_records(ar)}
        cell["n_requests"] = len(a)
        cell["below_2c"] = len(a) < 2 * c
        if cell["below_2c"]:
            print(f"WARNING: c{c} serves {len(a)} requests, fewer than 2c = {2 * c} (issue 15)", flush=True)
        cell["ar_prefill"] = prefill_stats(list(a.values()))
        cell.update({"ar_decode_s_mean": sum(r["decode_s"] for r in a.values()) / len(a),
                     "ar_tok_s_per_request": sum(r["new_tokens"] / r["decode_s"] for r in a.values()) / len(a),
                     # system throughput: output tokens / wall time of the cell (closed loop: first
                     # arrival to last finish); lock-step batches: every request of a batch decodes
                     # for the batch's time
                     "ar_tok_s_aggregate": throughput(list(a.values()), c)})
        for name, vcfg in variants.items():  # stock, then stock + each mechanism alone (same replay draws)
            if name in only and c not in only[name]:
                continue
            st = rec / f"{name}-c{c}.jsonl"
            conf = []
            if vcfg:
                cf = rec / f"{name}.engine.json"
                cf.write_text(json.dumps(vcfg))
                conf = ["--engine-config", str(cf)]
            rc, wall, run_out = sh(["run", "--engine", "stock", "--drafter", str(dr), "--out", str(st),
                              "--concurrency", str(c), "--block-size", str(args.block),
                              "--replay-profile", args.profile, "--replay-reference", str(ar),
                              *conf, *common, *lim], log)
            if rc:
                continue
            # token forcing: the target teacher-forced over every output token (specpilot.forcing)
            frc, _, txt = sh(["force", "--candidate", str(st), "--reference", str(ar), *force_common,
                              "--drafter", str(dr), "--out", str(rec / f"{name}-c{c}.forcing.json")], log)
            vf = rec / f"{name}-c{c}.forcing.json"
            if vf.exists():  # kept as it comes (a run cut short still has the verdicts so far)
                R.setdefault("forcing", {})[vf.name] = json.loads(vf.read_text())
            s = {r["request_id"]: r for r in read_records(st)}
            ratios = [a[k]["decode_s"] / s[k]["decode_s"] for k in s if k in a and s[k]["decode_s"] > 0]
            taus = [t for r in s.values() for t in r["committed_per_step"]]
            cell[name] = {
                "engine_config": vcfg, "wall_s": wall, "forcing_rc": frc, "forcing": txt[-300:],
                "n_requests": len(s),
                "speedup_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                "tau": sum(taus) / len(taus) if taus else None,
                "equal_outputs": sum(a[k]["output_ids"] == s[k]["output_ids"] for k in s if k in a),
                "decode_s_mean": sum(r["decode_s"] for r in s.values()) / len(s),
                "tok_s_aggregate": throughput(list(s.values()), c),
                "draft_s_mean": sum(r.get("draft_s", 0.0) for r in s.values()) / len(s),
                "verify_s_mean": sum(r.get("verify_s", 0.0) for r in s.values()) / len(s),
                "verify_steps_mean": sum(r["verify_steps"] for r in s.values()) / len(s),
                "prefill": prefill_stats(list(s.values())),
                # the checked-cuBLAS choices of the run's fast steps (FastTarget._select), from its summary line
                "matmul": next((json.loads(ln).get("matmul") for ln in run_out.splitlines()
                                if ln.startswith('{"engine"')), None),
            }
            save()
    # AR against AR across concurrencies, on the requests both cells served
    ran = [c for c in args.concurrency if (rec / f"ar-c{c}.jsonl").exists() and f"c{c}" in R["cells"]]
    ref_c = args.ar_reference if args.ar_reference is not None else (16 if 16 in ran else (ran[0] if ran else None))
    if ref_c in ran:
        ref_recs = {r["request_id"]: r for r in read_records(rec / f"ar-c{ref_c}.jsonl")}
        R["ar_reference"] = ref_c
        for c in ran:
            if c == ref_c:
                continue
            cand = {r["request_id"]: r for r in read_records(rec / f"ar-c{c}.jsonl")}
            key = f"c{c}_vs_c{ref_c}"
            cmp = R.setdefault("ar_equality", {})[key] = compare_outputs(cand, ref_recs)
            print(f"AR {key}: {cmp['equal']}/{cmp['common']} common requests equal", flush=True)
            if c in args.ar_force and cmp["common"]:
                common = [k for k in cand if k in ref_recs]
                cf, rf = rec / f"ar-c{c}.common-c{ref_c}.jsonl", rec / f"ar-c{ref_c}.common-c{c}.jsonl"
                cf.write_text("".join(json.dumps(cand[k]) + "\n" for k in common))
                rf.write_text("".join(json.dumps(ref_recs[k]) + "\n" for k in common))
                rc, _, txt = sh(["force", "--candidate", str(cf), "--reference", str(rf), *force_common,
                                 "--out", str(rec / f"ar-{key}.forcing.json")], log)
                cmp["forcing_rc"], cmp["forcing"] = rc, txt[-300:]
            save()
    for f in sorted(rec.glob("*.forcing.json")):
        R.setdefault("forcing", {})[f.name] = json.loads(f.read_text())
    save()
    import tarfile

    with tarfile.open(out / "serving_records.tar.gz", "w:gz") as tf:
        tf.add(rec, arcname="records")
    print("\ncell  engine          n  speedup(geomean)  tau   equal  AR agg tok/s  agg tok/s  step ms  forcing_rc")
    for k, cell in R["cells"].items():
        for name in variants:
            v = cell.get(name)
            if not v or v.get("speedup_geomean") is None:
                continue
            step_ms = v["decode_s_mean"] / max(v["verify_steps_mean"], 1) * 1e3
            print(f"{k:4s}  {name:14s} {v['n_requests']:3d}  {v['speedup_geomean']:.3f}  {v['tau']:.2f}  "
                  f"{v['equal_outputs']}/{v['n_requests']}  {cell['ar_tok_s_aggregate']:.0f}  "
                  f"{v['tok_s_aggregate']:.0f}  {step_ms:.2f}  {v['forcing_rc']}")
    for key, cmp in R.get("ar_equality", {}).items():
        print(f"AR {key}: {cmp['equal']}/{cmp['common']} common requests equal"
              + (f", forcing rc {cmp['forcing_rc']}" if "forcing_rc" in cmp else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stock tau of each tiny drafter at an equal verify width, stock == AR checks, DSpark calibration.

    python gpu_bench/drafter_taus.py --deployment resources/deployments/tiny --n 20 --new 128 \
        --width 8 --out gpu_bench/drafter_taus_cpu.json

For each drafter in the deployment (dflash, dflash2 with DFlash counting block = width; dspark with
gamma = width - 1) and prompt lookup (block = width): tau = committed tokens per verify step over
all steps (bonus included; the table's ``stock_tau``), on the first ``--n`` gsm8k eval prompts with
``--new`` new tokens; every output is compared with AR token for token at concurrency 1 and
``--concurrency`` and checked by token forcing (every token teacher-forced). DSpark calibration on ``--n-cal`` held-out gsm8k calibration prompts: per draft
position j, expected survival = mean over steps of prod c_1..c_j and observed = fraction of steps
whose first j drafts were all accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from specpilot.prompts import write_prompt_file
from specpilot.drafters import make_proposer
from specpilot.engine.generate import generate
from specpilot.engine.runner import TargetRunner
from specpilot.engine.serve import EngineSpec, serve
from specpilot.forcing import check
from specpilot.io import write_json
from specpilot.models.loading import load_drafter, load_target

META = {"deployment": "tiny", "target": "tiny", "drafter": "x", "gpu": "cpu"}


def _tau(records):
    steps = [c for r in records for c in r.committed_per_step]
    return sum(steps) / len(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--n-cal", type=int, default=20)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dep = Path(a.deployment)
    data = os.environ.get("SPECPILOT_DATA_DIR")
    tmp = Path(a.out).with_suffix(".prompts")
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = write_prompt_file("gsm8k", dep / "target", tmp / "eval.jsonl", a.n, data_dir=data)
    cal = write_prompt_file("gsm8k", dep / "target", tmp / "cal.jsonl", a.n_cal, role="calibration",
                            data_dir=data)
    target = load_target(dep / "target")
    out = {"n_prompts": a.n, "new_tokens": a.new, "verify_width": a.width, "drafters": {}}
    with torch.inference_mode():
        ar = {c: serve(EngineSpec("ar"), target, None, prompts, a.new, c, META, progress=False, warmup=False)
              for c in (1, a.concurrency)}
        runs = {"lookup": (EngineSpec("lookup", a.width), None)}
        for kind in ("dflash", "dflash2", "dspark"):
            if (dep / f"drafter-{kind}").is_dir():
                net = load_drafter(dep / f"drafter-{kind}")
                runs[kind] = (EngineSpec("stock", a.width - 1 if kind == "dspark" else a.width), net)
        for name, (spec, net) in runs.items():
            row = {"block_size": spec.block_size}
            for c in (1, a.concurrency):
                t0 = time.time()
                recs = serve(spec, target, net, prompts, a.new, c, dict(META, drafter=name), progress=False,
                             warmup=False)  # the records name the drafter: forcing knows its block counting
                same = all(r.output_ids == x.output_ids for r, x in zip(recs, ar[c]))
                # token forcing: the target teacher-forced over every output token, and the references
                v = check(recs, ar[c], {q["request_id"]: q["prompt_ids"] for q in prompts}, target)
                row[f"c{c}"] = {"tau": round(_tau(recs), 4), "equals_ar": same, "wall_s": round(time.time() - t0, 1),
                                "forcing": {"passed": v["passed"], "tokens_checked": v["tokens_checked"],
                                            "tokens_generated": v["tokens_generated"], "violations": v["violations"]}}
            row["tau"] = row["c1"]["tau"]
            out["drafters"][name] = row
            print(name, json.dumps(row), flush=True)
        if "dspark" in runs:
            net = runs["dspark"][1]
            prop = make_proposer(net, a.width - 1)
            gamma = prop.gamma
            exp, obs, n = [0.0] * gamma, [0] * gamma, 0

            def on_step(p, paths):
                nonlocal n
                s = p.survival[:, 1:].tolist()
                for b, path in enumerate(paths):
                    n_acc = len(path) - 1
                    for j in range(gamma):
                        exp[j] += s[b][j]
                        obs[j] += int(n_acc >= j + 1)
                n += len(paths)

            for p in cal:
                ids = p["prompt_ids"]
                generate(TargetRunner(target, 1, len(ids) + a.new + a.width + 1, prop.capture), prop, [ids], a.new,
                         on_step=on_step, profile=False)
            out["dspark_calibration"] = {
                "prompts": len(cal), "steps": n, "gamma": gamma,
                "per_position": [{"position": j + 1, "expected_survival": round(exp[j] / n, 4),
                                  "observed_survival": round(obs[j] / n, 4)} for j in range(gamma)]}
            print(json.dumps(out["dspark_calibration"]), flush=True)
    lk = out["drafters"]["lookup"]["tau"]
    for k, v in out["drafters"].items():
        v["ratio_to_lookup"] = round(v["tau"] / lk, 3)
    write_json(a.out, out)


if __name__ == "__main__":
    main()

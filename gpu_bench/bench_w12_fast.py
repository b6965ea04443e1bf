#!/usr/bin/env python
"""12-bit weights in the engine's CUDA-graph fast path, per-role choice (issue 17 items 1 and 3).

    python3 gpu_bench/bench_w12_fast.py --out-dir $OUT/w12fast [--ms 1 4 16 64]

1. **The kernels rule's command** (``python3 -m specpilot.cli kernels --gpu h200 --out-dir
   OUT/kernels``): builds the w12 tensor-core library with nvcc for this GPU, checks every K split
   (:func:`specpilot.kernels_build.build_w12_mma`), writes manifest.json.
2. **Choice per M** (:func:`specpilot.engine.w12_fast.tune_w12_choice`, widths = (M,)): per role,
   w12 (one split, launch per bucket) or bf16 from the engine's own calls on a one-layer copy.
3. **36-layer step** of a random-weight Qwen3-8B target (``build_target``) through the engine's
   runner (``TargetRunner.verify``, CUDA graphs, Triton step) at B = 1, T = M, context 1024:
   bf16 against the same step with the M's choice installed (``install_w12_choice``), medians of
   CUDA-event times, alternating bf16 / w12 rounds. Before timing: logits of a 16-token block
   bit-equal to the 16 one-token decodes of the same tokens (the rows do not depend on M), with
   and without w12; argmax agreement and max |logit difference| of w12 against bf16.
4. writes ``kernel-agent.json`` for widths (16,) through the sub-agent's own ``tune`` (its w12
   Triton and engine-table sections off: ``w12=False, engine=False``), for the CLI run that
   follows (``bench_serving_cli.py --variant w12='{"weight_format": "w12"}' --kernels-manifest ...
   --kernel-agent ...``).

Writes ``w12_fast.json`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from _timing import LOG, copy_bandwidth, log  # noqa: E402


def step_times(torch, runner, tok, iters=30):
    for _ in range(3):
        runner.verify(tok)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.verify(tok)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "w12fast_out"))
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--work", default="/tmp/specpilot_e2e")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    R = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "log": LOG}

    def save():
        (out / "w12_fast.json").write_text(json.dumps(R, indent=1, default=str))

    # 1. the kernels rule's command
    t = time.time()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    p = subprocess.run([sys.executable, "-m", "specpilot.cli", "kernels", "--gpu", "h200", "--out-dir",
                        str(out / "kernels")], capture_output=True, text=True, env=env)
    R["kernels_rule"] = {"rc": p.returncode, "s": time.time() - t, "stdout": p.stdout[-2000:], "stderr": p.stderr[-3000:]}
    log(f"kernels rule rc {p.returncode} in {time.time() - t:.1f}s: {p.stdout.strip()[-400:]} {p.stderr.strip()[-800:]}")
    if p.returncode:
        save()
        return 1
    manifest_path = out / "kernels" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    R["manifest_w12_mma"] = manifest.get("w12_mma")
    save()
    import torch

    from specpilot.engine.runner import TargetRunner
    from specpilot.engine.w12_fast import install_w12_choice, parse_choice, tune_w12_choice
    from specpilot.kernels_build import use_w12_library
    from specpilot.models.random_checkpoint import build_target, hf_config, target_config

    use_w12_library(manifest, manifest_path)
    dev = torch.device("cuda")
    from specpilot.engine.graphs import median_ms

    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    R["copy_bw_Bps"] = copy_bandwidth(big, lambda fn: median_ms(fn, iters=10, warmup=3, flush_l2=False) / 1e3)
    del big
    log(f"copy bandwidth {R['copy_bw_Bps'] / 1e12:.2f} TB/s")
    cfg = target_config("qwen3-8b")
    # 2. the choice per M (one-layer copy)
    choices = {}
    for m in args.ms:
        t = time.time()
        res = tune_w12_choice(cfg, (m,), log=log)
        choices[m] = res["w12_choice"]
        R.setdefault("choice", {})[str(m)] = {"w12_choice": res["w12_choice"], "summary": res["w12_choice_summary"],
                                              "checks_ok": {r: [s for s, c in v.items() if c["ok"]]
                                                            for r, v in res["w12_choice_checks"].items()},
                                              "s": time.time() - t}
        log(f"M={m}: w12 roles {sorted(res['w12_choice'])} ({time.time() - t:.1f}s)")
        save()
    # 3. 36-layer step
    model = build_target("qwen3-8b", dev, torch.bfloat16, 0)
    model.eval()
    from specpilot.engine.w12_fast import plant_escapes

    for i, layer in enumerate(model.model.layers[:2]):  # escapes in real checkpoints: plant some
        for lin in (layer.mlp.gate_proj, layer.self_attn.o_proj):
            with torch.no_grad():
                plant_escapes(lin.weight, seed=i)
    S = args.ctx + 256
    g = torch.Generator(device=dev).manual_seed(7)

    def fresh_runner(B, capture=()):
        r = TargetRunner(model, B, S, capture, graphs=True, kernels="triton")
        for tt in (model.cache.k, model.cache.v):
            tt.normal_(generator=g)
        r.length.fill_(args.ctx)
        r._bound = args.ctx
        return r

    from specpilot.engine import graphs as G

    def set_choice(ch):
        sg = G.step_graphs(model, "triton")
        if ch:
            install_w12_choice(model, parse_choice(ch))
        else:
            sg.fast.use_w12({})
            sg.cache.entries.clear()

    # correctness: a 16-token block against 16 one-token decodes, bf16 and w12 (the M=16 choice, else all roles at M=1's)
    corr = {}
    toks = torch.randint(0, cfg.vocab_size, (1, 16), device=dev, generator=g)
    logits = {}
    every = {r: {"split": 1, "launch": {"64": "t1-w4-u2"}} for r in ("qkv", "o", "gate_up", "down")}
    for name, ch in (("bf16", {}), ("w12", every)):  # every role in w12 (split 1): the strictest case
        set_choice(ch)
        fast = G.step_graphs(model, "triton").fast
        model.setup_cache(1, S)
        for tt in (model.cache.k, model.cache.v):
            tt.normal_(generator=torch.Generator(device=dev).manual_seed(3))
        start = torch.full((1,), args.ctx, dtype=torch.long, device=dev)
        blk = fast.forward(toks, start)[0].clone()
        one = torch.cat([fast.forward(toks[:, i:i + 1], start + i)[0].clone() for i in range(16)], 1)
        logits[name] = blk
        corr[name] = {"roles": sorted(ch or {}), "block_equals_decodes": bool(torch.equal(blk, one)),
                      "max_abs_diff_block_vs_decodes": (blk.float() - one.float()).abs().max().item()}
    a, b = logits["bf16"].float()[0], logits["w12"].float()[0]
    top2 = a.topk(2, -1).values
    corr["w12_vs_bf16"] = {"argmax_equal": int((a.argmax(-1) == b.argmax(-1)).sum()), "positions": a.shape[0],
                           "max_abs_logit_diff": (a - b).abs().max().item(),
                           "bf16_top2_margin_min": (top2[:, 0] - top2[:, 1]).min().item()}
    R["correctness"] = corr
    log(f"correctness: {json.dumps(corr)}")
    save()
    steps = []
    for m in args.ms:
        ch = choices[m]
        r = {"M": m, "roles": sorted(ch)}
        bf, w = [], []
        for rep in range(3):
            for name, lst, c in (("bf16", bf, {}), ("w12", w, ch)):
                if name == "w12" and not ch:
                    continue
                set_choice(c)
                run = fresh_runner(1)
                tok = torch.randint(0, cfg.vocab_size, (1, m), device=dev, generator=g)
                lst.append(step_times(torch, run, tok))
                del run
        r["bf16_ms"] = statistics.median(bf)
        r["w12_ms"] = statistics.median(w) if w else r["bf16_ms"]
        r["speedup"] = r["bf16_ms"] / r["w12_ms"]
        r["all_bf16_ms"], r["all_w12_ms"] = bf, w
        log(f"36-layer step M={m}: bf16 {r['bf16_ms']:.3f} ms, w12 choice {sorted(ch)} {r['w12_ms']:.3f} ms, x{r['speedup']:.3f}")
        steps.append(r)
        R["steps"] = steps
        save()
    set_choice({})
    del model
    torch.cuda.empty_cache()
    # 4. the sub-agent's file for the CLI run (widths 16)
    from specpilot.agent.kernel_agent import tune

    work = Path(args.work)
    tgt = work / "kernel_agent_target"  # only config.json is read: the shapes
    tgt.mkdir(parents=True, exist_ok=True)
    (tgt / "config.json").write_text(json.dumps(hf_config(cfg)))
    ceil = out / "ceilings.json"
    ceil.write_text(json.dumps({"memory_bandwidth_bytes_per_s": R["copy_bw_Bps"]}))
    t = time.time()
    ka = tune(str(tgt), "h200", str(ceil), out / "kernel-agent.json", manifest=manifest,
              manifest_path=str(manifest_path), w12=False, engine=False, w12_widths=(16,))
    R["kernel_agent"] = {"w12_choice": ka.get("w12_choice"), "reason": ka.get("w12_choice_reason"),
                         "summary": ka.get("w12_choice_summary"), "s": time.time() - t}
    log(f"kernel-agent.json: w12 roles {sorted(ka.get('w12_choice') or {})} {ka.get('w12_choice_reason', '')}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

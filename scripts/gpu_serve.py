"""Issue 55 on one GPU (H100 or H200), one call of <= 10 minutes: ``specpilot serve`` on the Triton
fast path under CUDA graphs (the online scheduler's engine thread replaying graphs captured at
warm-up), on a lazy random Qwen3-8B-shape deployment (weights drawn from the seed on the GPU,
byte-level tokenizer):

1. ``specpilot run --engine ar`` at c16 over 32 random 512-token prompts, 128 new tokens (reference);
2. ``specpilot serve --engine stock --max-concurrency 16 --record``; ``specpilot bench client`` at
   c1 and c16 (completions of the prompt ids, ignore_eos): throughput, TTFT, ITL;
3. every served record's output equal to AR's for its prompt, token for token (one line);
4. ``specpilot force`` on the server's records (teacher-forced pass, re-execution);
5. ``specpilot bench serve-vs-run`` (2 rounds, ``{"block_size": 16}`` as the engine config).

One line per figure at the end; raw results under $OUT (default results/gpu_serve).
CPU plumbing check: ``DRY=1 python scripts/gpu_serve.py`` (tiny shape, a few tokens, CPU).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

DRY = os.environ.get("DRY") == "1"
OUT = Path(os.environ.get("OUT", "results/gpu_serve"))
T0, DEADLINE = time.time(), float(os.environ.get("DEADLINE", 560))
SHAPE, N, PLEN, NEW, C = ("tiny", 4, 16, 8, 2) if DRY else ("qwen3-8b", 32, 512, 128, 16)
DEVICE = ["--device", "cpu", "--threads", "1"] if DRY else []
PY = [sys.executable, "-m", "specpilot"]
LINES: list[str] = []


def sh(cmd: list[str], need: float, log: str) -> bool:
    """Run ``cmd`` within the time left (skipped, saying so, when less than ``need`` is left)."""
    left = DEADLINE - (time.time() - T0)
    if left < need:
        LINES.append(f"SKIPPED ({left:.0f} s left, needs {need:.0f}): {' '.join(cmd)[:160]}")
        return False
    with open(OUT / log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0:
        LINES.append(f"rc={rc}: {' '.join(cmd)[:160]} (log {OUT / log})")
    return rc == 0


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path("src").resolve()))
    from specpilot.bench.client import free_port, start_server

    dep = Path("/tmp/gpu_serve_dep")
    if not (dep / "build.json").is_file():
        subprocess.run([sys.executable, "-m", "specpilot.deployment_random", "--name", "serve", "--shape", SHAPE,
                        "--seed", "0", "--block-size", "16", "--out", str(dep)], check=True, stdout=subprocess.DEVNULL)
    target, drafter = str(dep / "target"), str(dep / "drafter-dflash")
    rng = random.Random(0)
    rows = [{"request_id": f"rand/{i:04d}", "benchmark": "rand", "prompt_ids": [rng.randrange(3, 256) for _ in range(PLEN)]}
            for i in range(N)]
    prompts = OUT / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sh(PY + ["run", "--engine", "ar", "--target", target, "--prompts", str(prompts), "--out", str(OUT / "ar.jsonl"),
             "--max-new-tokens", str(NEW), "--concurrency", str(C), *DEVICE], 60, "run_ar.log")
    port, rec = free_port(), OUT / "served"
    shutil.rmtree(rec, ignore_errors=True)  # the records of this run only
    server = start_server(["--target", target, "--drafter", drafter, "--engine", "stock", "--max-concurrency", str(C),
                           "--max-seq", str(PLEN + NEW + 64), "--record", str(rec), "--model-name", "rand", *DEVICE],
                          port, OUT / "server.log")
    try:
        sh(PY + ["bench", "client", "--base-url", f"http://127.0.0.1:{port}/v1", "--prompts", str(prompts),
                 "--concurrency", f"1,{C}", "--max-tokens", str(NEW), "--out", str(OUT / "client.json")], 60,
           "client.log")
    finally:
        server.terminate()
        server.wait(timeout=60)
    client = json.loads((OUT / "client.json").read_text()) if (OUT / "client.json").is_file() else {}
    for c in (1, C):
        r = client.get(f"c{c}")
        if r:
            LINES.append(f"served stock c{c}: {r['output_tok_s']:.1f} tok/s, TTFT p50/p99 {r['ttft_ms_p50']:.1f}/"
                         f"{r['ttft_ms_p99']:.1f} ms, ITL p50/p99 {r['itl_ms_p50'] or 0:.1f}/{r['itl_ms_p99'] or 0:.1f} ms")
    if (OUT / "ar.jsonl").is_file() and (rec / "records.jsonl").is_file():
        ar = {tuple(r["prompt_ids"]): json.loads(x)["output_ids"]
              for r, x in zip(rows, (OUT / "ar.jsonl").read_text().splitlines())}
        served_prompts = [json.loads(x)["prompt_ids"] for x in (rec / "prompts.jsonl").read_text().splitlines()]
        recs = [json.loads(x) for x in (rec / "records.jsonl").read_text().splitlines()]
        same = sum(ar.get(tuple(p)) == r["output_ids"] for p, r in zip(served_prompts, recs))
        LINES.append(f"served records equal to AR token for token: {same}/{len(recs)}")
        sh(PY + ["force", "--candidate", str(rec / "records.jsonl"), "--target", target, "--drafter", drafter,
                 "--prompts", str(rec / "prompts.jsonl"), "--out", str(OUT / "forcing.json"),
                 "--device", "cpu" if DRY else "cuda"], 60, "force.log")
        if (OUT / "forcing.json").is_file():
            v = json.loads((OUT / "forcing.json").read_text())
            LINES.append(f"token forcing on served records: {'pass' if v['passed'] else 'FAIL'} "
                         f"({v['tokens_checked']}/{v['tokens_generated']} tokens, replay "
                         f"{v['replay']['reproduced']}/{v['replay']['requests']})")
    (OUT / "engine.json").write_text('{"block_size": 16}')
    if sh(PY + ["bench", "serve-vs-run", "--target", target, "--drafter", drafter, "--engine-config",
                str(OUT / "engine.json"), "--prompts", str(prompts), "--limit", str(min(N, 8)), "--max-new-tokens",
                str(NEW), "--rounds", "1" if DRY else "2", "--concurrency-high", str(C), "--out",
                str(OUT / "serve_vs_run.json")], 150, "serve_vs_run.log"):
        s = json.loads((OUT / "serve_vs_run.json").read_text()).get("summary", {})
        LINES.append(f"serve-vs-run: served/run c1 {s.get('served_over_run_c1', float('nan')):.3f}, "
                     f"c{C}/c1 {s.get(f'c{C}_over_c1', float('nan')):.2f}")
    print("\n".join(LINES))
    return 0


if __name__ == "__main__":
    sys.exit(main())

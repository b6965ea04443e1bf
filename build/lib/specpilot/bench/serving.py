"""``specpilot bench serving``: AR and stock (and engine-config variants) through the product's
CLI at several concurrencies, each against AR in the same run, every cell checked by token forcing.

All through ``specpilot`` subcommands (each in its own process, as the workflow runs them;
``--in-process`` calls them in this one, as the dry run does):

1. ``random-checkpoint --shape`` (a random-weight target and DFlash drafter under ``--work``),
   unless ``--target`` and ``--drafter`` name checkpoints;
2. a prompt file of ``--requests`` random prompts of ``--prompt-len`` tokens (seeded);
3. per concurrency c of ``--concurrency`` (default 16 1): ``run --engine ar``, then ``run --engine
   stock --replay-profile P --replay-reference <ar records>`` (block ``--block``) and each
   ``--variant`` (stock with an engine config: a mechanism alone), each followed by ``force``
   against the AR cell. A cell with c > 1 serves every request, the c = 1 cell the first
   ``--requests-c1``; a cell with fewer than 2c requests is flagged ``below_2c`` (issue 15);
4. AR against AR across concurrencies on the requests both served (batch invariance of AR), and
   ``force`` of the ``--ar-force`` cells against the ``--ar-reference`` cell on those requests;
5. per cell: per-request speedup (geometric mean over requests of AR decode_s / engine decode_s),
   tau, aggregate tok/s (output tokens from first arrival to last finish; lock-step batches for
   ``--regime static``), step ms (decode_s / verify steps) with its draft and verify parts, and
   the forcing verdict.

The records and verdicts are kept beside the result (``<out>_records/``). Replaces
gpu_bench/bench_serving_cli.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from ..cli import main as specpilot_main
from ..errors import SpecpilotError
from ..io import read_jsonl, write_json, write_jsonl
from ..tuning import timing
from ._common import Run, add_common, fmt



def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "serving")
    p.add_argument("--shape", default="qwen3-8b", help="random-checkpoint shape (default qwen3-8b)")
    p.add_argument("--target", help="target checkpoint folder (default: a random one of --shape under --work)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint folder (with --target)")
    p.add_argument("--work", default="/tmp/specpilot_bench_serving", help="where the random checkpoint goes")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--requests-c1", type=int, default=8, help="requests of the c = 1 cell")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=512, help="new tokens per request")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--profile", default="study_stock", help="replay profile of the stock cells")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 1])
    p.add_argument("--regime", choices=("continuous", "static"), default="continuous")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=JSON: also stock with this engine config, e.g. 'sp10={\"block_size\": 10, "
                        "\"overlap\": true}'; NAME@16,24=JSON: at those concurrencies only; repeatable")
    p.add_argument("--kernel-configs", help="JSON {role: config} passed to 'specpilot run'")
    p.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json passed to 'specpilot run'")
    p.add_argument("--kernel-agent", help="kernel-agent.json passed to 'specpilot run' and 'specpilot force'")
    p.add_argument("--ar-reference", type=int, help="the AR cell the others are compared with (default 16 if run)")
    p.add_argument("--ar-force", type=int, nargs="*", default=[1], help="AR cells also 'force'd against the reference")
    p.add_argument("--in-process", action="store_true", help="call the subcommands in this process (dry run: on)")
    p.add_argument("--code", help="a checkout (its src/) whose 'specpilot' the subcommands run, e.g. an earlier "
                   "commit's, to measure two versions of the engine in one run on one machine")


def parse_variants(specs: list[str]) -> tuple[dict, dict]:
    """{name: engine config} (stock first, empty) and {name: concurrencies it runs at} from
    ``NAME[@c,c]=JSON`` strings. Raises SpecpilotError naming a malformed one."""
    variants, only = {"stock": {}}, {}
    for v in specs:
        name, _, cfg = v.partition("=")
        name, _, at = name.partition("@")
        try:
            variants[name] = json.loads(cfg or "{}")
            if at:
                only[name] = {int(x) for x in at.split(",")}
        except ValueError as e:
            raise SpecpilotError(f"--variant {v!r}: expected NAME[@c,c]=JSON ({e})") from e
    return variants, only


def throughput(records: list[dict], c: int) -> float:
    """Output tokens per second of a cell: first arrival to last finish (closed loop), else
    lock-step batches of c."""
    tok = sum(r["new_tokens"] for r in records)
    if all(r.get("finish_s") is not None and r.get("arrival_s") is not None for r in records):
        return tok / (max(r["finish_s"] for r in records) - min(r["arrival_s"] for r in records))
    return tok / (sum(r["decode_s"] for r in records) / c)


def verdict(path: Path) -> dict | None:
    """The headline of a forcing verdict file (None when it was not written)."""
    if not path.exists():
        return None
    v = json.loads(path.read_text())
    return {k: v.get(k) for k in ("passed", "tokens_checked", "violations", "near_ties", "max_near_tie_margin",
                                  "teacher_forced_path")}


def by_id(path: Path) -> dict:
    return {r["request_id"]: r for r in read_jsonl(path)}


class Serving:
    """The CLI calls of one serving run (see the module docstring)."""

    def __init__(self, run: Run, a: argparse.Namespace):
        self.run, self.a = run, a
        self.rec = run.out.with_name(run.out.stem + "_records")
        self.rec.mkdir(parents=True, exist_ok=True)
        self.commands: list = run.R.setdefault("commands", [])
        self.variants, self.only = parse_variants(a.variant)

    def cli(self, cmd: list[str]) -> tuple[int, str]:
        """Run ``specpilot CMD``; its exit status and the tail of its output (kept in the result)."""
        t = time.time()
        if self.a.in_process:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                rc = specpilot_main(cmd)
            out = buf.getvalue()
        else:
            env = dict(os.environ)
            if self.a.code:
                env["PYTHONPATH"] = str(Path(self.a.code).resolve() / "src")
            p = subprocess.run([sys.executable, "-m", "specpilot.cli", *cmd], capture_output=True, text=True, env=env)
            rc, out = p.returncode, p.stdout + p.stderr
        self.commands.append({"cmd": "specpilot " + " ".join(cmd), "rc": rc, "wall_s": round(time.time() - t, 2),
                              "tail": out.strip()[-800:]})
        timing.log(f"rc={rc} {time.time() - t:6.1f}s specpilot {' '.join(cmd[:3])} ... {out.strip()[-200:]}")
        return rc, out

    def setup(self) -> dict:
        a, work = self.a, Path(self.a.work)
        if a.target:
            self.tgt, self.dr = Path(a.target), Path(a.drafter)
        else:
            self.tgt, self.dr = work / f"{a.shape}-target", work / f"{a.shape}-drafter"
            if not (self.tgt / "config.json").exists():
                rc, _ = self.cli(["random-checkpoint", "--shape", a.shape, "--out", str(self.tgt),
                                  "--drafter-out", str(self.dr), "--seed", str(a.seed)])
                if rc:
                    raise RuntimeError("random-checkpoint failed")
        vocab = json.loads((self.tgt / "config.json").read_text())["vocab_size"]
        rng = random.Random(a.seed)
        self.prompts = self.rec / "prompts.jsonl"
        write_jsonl(self.prompts, [{"request_id": f"random/{i:04d}", "benchmark": "random",
                                    "prompt_ids": [rng.randrange(vocab) for _ in range(a.prompt_len)]}
                                   for i in range(a.requests)])
        extra = (["--kernel-configs", a.kernel_configs] if a.kernel_configs else []) \
            + (["--kernel-agent", a.kernel_agent] if a.kernel_agent else [])
        self.common = ["--target", str(self.tgt), "--prompts", str(self.prompts), "--max-new-tokens", str(a.new),
                       "--gpu", self.run.gpu, "--regime", a.regime, *extra] \
            + (["--kernels-manifest", a.kernels_manifest] if a.kernels_manifest else [])
        self.force_common = ["--target", str(self.tgt), "--prompts", str(self.prompts),
                             "--device", "cuda" if self.run.cuda else "cpu", *extra]
        return {"target": str(self.tgt), "drafter": str(self.dr), "prompts": str(self.prompts)}

    def cell(self, c: int) -> dict | None:
        lim = [] if c > 1 else ["--limit", str(self.a.requests_c1)]
        ar = self.rec / f"ar-c{c}.jsonl"
        rc, _ = self.cli(["run", "--engine", "ar", "--out", str(ar), "--concurrency", str(c), *self.common, *lim])
        if rc:
            raise RuntimeError(f"AR at c{c} failed")
        A = by_id(ar)
        cell = {"n_requests": len(A), "below_2c": len(A) < 2 * c, "ar_tok_s_aggregate": throughput(list(A.values()), c),
                "ar_decode_s_mean": sum(r["decode_s"] for r in A.values()) / len(A)}
        for name, cfg in self.variants.items():
            if name in self.only and c not in self.only[name]:
                continue
            cell[name] = self.stock(name, cfg, c, ar, A, lim)
            self.run.save()
        return cell

    def stock(self, name: str, cfg: dict, c: int, ar: Path, A: dict, lim: list[str]) -> dict:
        """One stock cell (with engine config ``cfg``) and its forcing verdict against AR."""
        a, out = self.a, self.rec / f"{name}-c{c}.jsonl"
        conf = []
        if cfg:
            write_json(self.rec / f"{name}.engine.json", cfg)
            conf = ["--engine-config", str(self.rec / f"{name}.engine.json")]
        rc, run_out = self.cli(["run", "--engine", "stock", "--drafter", str(self.dr), "--out", str(out),
                                "--concurrency", str(c), "--block-size", str(a.block), "--replay-profile", a.profile,
                                "--replay-reference", str(ar), *conf, *self.common, *lim])
        if rc:
            raise RuntimeError(f"{name} at c{c} failed")
        vf = self.rec / f"{name}-c{c}.forcing.json"
        self.cli(["force", "--candidate", str(out), "--reference", str(ar), *self.force_common, "--drafter", str(self.dr),
                  "--out", str(vf)])
        S = by_id(out)
        ratios = [A[k]["decode_s"] / S[k]["decode_s"] for k in S if k in A and S[k]["decode_s"] > 0]
        taus = [t for r in S.values() for t in r["committed_per_step"]]
        steps = sum(r["verify_steps"] for r in S.values())
        return {"engine_config": cfg, "n_requests": len(S),
                "speedup_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                "tau": sum(taus) / len(taus) if taus else None,
                "equal_outputs": sum(A[k]["output_ids"] == S[k]["output_ids"] for k in S if k in A),
                "tok_s_aggregate": throughput(list(S.values()), c),
                "step_ms": sum(r["decode_s"] for r in S.values()) / max(steps, 1) * 1e3,
                "draft_ms": sum(r.get("draft_s", 0.0) for r in S.values()) / max(steps, 1) * 1e3,
                "verify_ms": sum(r.get("verify_s", 0.0) for r in S.values()) / max(steps, 1) * 1e3,
                "forcing": verdict(vf),
                "matmul": next((json.loads(ln).get("matmul") for ln in run_out.splitlines()
                                if ln.startswith('{"engine"')), None)}

    def ar_equality(self) -> dict:
        """AR cells against the reference AR cell on their common requests; ``force`` of the
        ``--ar-force`` cells against it on those requests."""
        ran = [c for c in self.a.concurrency if (self.rec / f"ar-c{c}.jsonl").exists()]
        ref = self.a.ar_reference if self.a.ar_reference is not None else (16 if 16 in ran else max(ran))
        R = {"reference": ref}
        if ref not in ran:
            return R
        refs = by_id(self.rec / f"ar-c{ref}.jsonl")
        for c in (c for c in ran if c != ref):
            cand = by_id(self.rec / f"ar-c{c}.jsonl")
            common = [k for k in cand if k in refs]
            d = R[f"c{c}_vs_c{ref}"] = {"common": len(common),
                                        "equal": sum(cand[k]["output_ids"] == refs[k]["output_ids"] for k in common)}
            if c in self.a.ar_force and common:
                cf, rf = self.rec / f"ar-c{c}.common.jsonl", self.rec / f"ar-c{ref}.common-c{c}.jsonl"
                write_jsonl(cf, [cand[k] for k in common])
                write_jsonl(rf, [refs[k] for k in common])
                vf = self.rec / f"ar-c{c}-vs-c{ref}.forcing.json"
                self.cli(["force", "--candidate", str(cf), "--reference", str(rf), *self.force_common, "--out", str(vf)])
                d["forcing"] = verdict(vf)
        return R


def table(R: dict) -> list[str]:
    L = ["cell engine            n  speedup  tau   = AR   agg tok/s (AR)    step ms (draft/verify)  forcing"]
    for k, cell in R.get("cells", {}).items():
        for name, v in cell.items():
            if not isinstance(v, dict) or "speedup_geomean" not in v:
                continue
            f = v.get("forcing") or {}
            L.append(f"{k:<4} {name:<14} {v['n_requests']:>4}  {fmt(v['speedup_geomean'])}x {fmt(v['tau'], '{:.2f}')} "
                     f"{v['equal_outputs']}/{v['n_requests']}  {fmt(v['tok_s_aggregate'], '{:.0f}')} "
                     f"({fmt(cell['ar_tok_s_aggregate'], '{:.0f}')})  {fmt(v['step_ms'], '{:.2f}')} "
                     f"({fmt(v['draft_ms'], '{:.2f}')}/{fmt(v['verify_ms'], '{:.2f}')})  "
                     f"{'pass' if f.get('passed') else 'FAIL'} ({f.get('violations')} violations, "
                     f"{f.get('near_ties')} near ties, {f.get('teacher_forced_path')})")
    for k, d in R.get("ar_equality", {}).items():
        if isinstance(d, dict):
            L.append(f"AR {k}: {d['equal']}/{d['common']} common requests equal"
                     + (f", forcing {'pass' if (d.get('forcing') or {}).get('passed') else 'FAIL'}" if "forcing" in d else ""))
    return L


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.shape = "tiny" if args.shape == "qwen3-8b" else args.shape
        args.requests, args.requests_c1, args.prompt_len, args.new, args.block = 4, 2, 16, 12, 4
        args.concurrency, args.in_process = [2, 1], True
    rn = Run("serving", args)
    s = Serving(rn, args)
    if rn.phase("setup", s.setup) is None:
        return rn.finish(table(rn.R))
    cells = rn.R.setdefault("cells", {})
    for c in args.concurrency:
        cell = rn.phase(f"c{c}", lambda c=c: s.cell(c), keep=False)
        if cell is not None:
            cells[f"c{c}"] = cell
    rn.phase("ar_equality", s.ar_equality)
    return rn.finish(table(rn.R))

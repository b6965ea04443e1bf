"""``specpilot bench serve-vs-run``: the served engine against ``specpilot run`` and against served
stock, in one command.

On the same prompts, token budget (``ignore_eos``, as ``specpilot run``) and engine configs, two
phases, each with its own servers (so that at most two servers and one run hold a GPU's memory at a
time: three copies of an 8B target fit an H100) and each server with the KV-cache size
``specpilot run`` allocates for these prompts (so both attend over the same cache):

1. **c1**: ``specpilot serve`` of the found engine (``--engine-config``) and of stock, 1 slot each;
   ``--rounds`` times, alternating which goes first, ``specpilot run --engine specpilot
   --concurrency 1 --no-profile`` (throughput = output tokens / the cell's wall seconds, from its
   records) and the found engine served, then stock served.
2. **high**: the found engine (``--engine-config-high``: the config of the regime serving
   ``--concurrency-high``; default ``--engine-config``) and stock with ``--concurrency-high``
   slots, ``--rounds`` times, alternating which goes first.

Each served side is ``specpilot bench client``'s closed loop (:func:`specpilot.bench.client.drive`).
A machine whose speed drifts slows both sides of a round alike. Reported: served / run throughput
at c1 per round and its median (the bar: within 5 %), high-concurrency over c1 served throughput,
TTFT and ITL p50/p99, and at c1 and at the high concurrency the found engine served against stock
served: geometric mean over requests of stock / specpilot decode seconds (each request's fastest
round, as the study table) with the table's bootstrap interval over requests and rounds
(:func:`specpilot.aggregate.bootstrap_interval`), and the ratio of median throughputs.
``--record-dir DIR``: every server records its requests (``DIR/{server}/records.jsonl`` and
``prompts.jsonl``, :class:`specpilot.server.engine.RecordWriter`) for token forcing.

``--dry-run``: a random tiny deployment, four short prompts, one round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..aggregate import bootstrap_interval, geomean
from ..errors import SpecpilotError
from ..io import read_prompts, write_jsonl
from ..records import read_records
from ..server.engine import EngineFiles, run_args
from ..engine import cli as run_cli
from ..engine.serve import kv_slots_needed
from ._common import Run, add_common
from .client import drive, dry_deployment, free_port, start_server


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "serve-vs-run")
    p.add_argument("--target", help="target checkpoint directory")
    p.add_argument("--drafter", help="drafter checkpoint directory")
    p.add_argument("--drafter-name", default="dflash")
    p.add_argument("--engine-config", help="the found engine's config at c1 (results/{gpu}/{deployment}/{regime}/"
                   "specpilot.json of the regime serving c1)")
    p.add_argument("--engine-config-high", help="the found engine's config at --concurrency-high (its regime's; "
                   "default --engine-config)")
    p.add_argument("--kernels-manifest", help="results/{gpu}/kernels/manifest.json (as the workflow cell)")
    p.add_argument("--kernel-agent", help="results/{gpu}/kernels/{deployment}/{regime}/kernel-agent.json (c1's regime)")
    p.add_argument("--kernel-agent-high", help="the kernel agent of --concurrency-high's regime (default --kernel-agent)")
    p.add_argument("--prompts", help="prompt file (results/prompts/{deployment}/{benchmark}.jsonl)")
    p.add_argument("--limit", type=int, help="the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency-high", type=int, default=4, help="the second served concurrency (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the c1 phase (default 3)")
    p.add_argument("--rounds-high", type=int, help="alternating rounds of the high phase (default --rounds)")
    p.add_argument("--record-dir", help="folder: each server records its requests in DIR/{server}/ (for token forcing)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads of run and the servers (default 1, as the workflow's timed CPU cells; 0: torch's "
                        "default, which on a busy 2-core machine made specpilot run 12x slower: OpenMP oversubscribed)")


def _run_cell(args, prompts: Path, out: Path, threads: int) -> dict:
    """``specpilot run`` of the found engine at c1: output tokens / the cell's wall seconds.
    ``--no-profile``: the server does not time the draft phase apart either (profiling cost
    ``specpilot run`` ~5 % on the CPU, 2026-12-06)."""
    cmd = [sys.executable, "-m", "specpilot", "run", "--engine", "specpilot", "--target", args.target,
           "--drafter", args.drafter, "--drafter-name", args.drafter_name, "--engine-config", args.engine_config,
           "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", str(args.max_new_tokens),
           "--concurrency", "1", "--threads", str(threads), "--no-profile"]
    for flag, v in (("--kernels-manifest", args.kernels_manifest), ("--kernel-agent", args.kernel_agent)):
        if v:
            cmd += [flag, v]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SpecpilotError(f"specpilot run failed: {r.stderr[-1500:]}")
    recs = read_records(out)
    wall = max(x.finish_s for x in recs) - min(x.arrival_s for x in recs)
    return {"output_tok_s": sum(x.new_tokens for x in recs) / wall, "wall_s": wall,
            "tokens": sum(x.new_tokens for x in recs)}


def _servers(args, rows: list[dict], tmp: Path, which: list[tuple[str, str, int, str | None]],
             agent: str | None) -> dict[str, tuple]:
    """Start ``which`` (name, engine, slots, engine config) servers with the kernel agent
    ``agent``, each with ``specpilot run``'s KV-cache size; name -> (process, base url)."""
    longest = max(len(r["prompt_ids"]) for r in rows)
    out = {}
    try:
        for name, engine, slots, config in which:
            files = EngineFiles(deployment="bench", target=args.target, drafter=args.drafter,
                                drafter_name=args.drafter_name, engine_config=config,
                                kernels_manifest=args.kernels_manifest, kernel_agent=agent)
            spec = run_cli.engine_specs(run_args(files, engine, "cpu", args.threads, "off"))[0]
            max_seq = kv_slots_needed(longest, args.max_new_tokens, spec.verify_width, slots > 1)
            argv = ["--target", args.target, "--drafter", args.drafter, "--drafter-name", args.drafter_name,
                    "--engine", engine, "--max-concurrency", str(slots), "--max-seq", str(max_seq),
                    "--threads", str(args.threads), "--model-name", "bench"]
            if engine == "specpilot":
                argv += ["--engine-config", config]
            for flag, v in (("--kernels-manifest", args.kernels_manifest), ("--kernel-agent", agent)):
                if v:
                    argv += [flag, v]
            if args.record_dir:
                argv += ["--record", str(Path(args.record_dir) / name)]
            port = free_port()
            out[name] = (start_server(argv, port, tmp / f"server-{name}.log"), f"http://127.0.0.1:{port}/v1")
    except BaseException:
        _stop(out)
        raise
    return out


def _stop(servers: dict) -> None:
    for proc, _ in servers.values():
        proc.terminate()
        proc.wait(timeout=60)
    servers.clear()


def _phase(bench: Run, args, rows: list[dict], prompts: Path, servers: dict, tmp: Path, key: str,
           order: list[str], slots: int, n_rounds: int) -> None:
    """``n_rounds`` rounds of ``order`` (``run`` = ``specpilot run`` at c1, else a server's name),
    rotated each round so that each side goes first in turn; every measurement kept under ``key``."""
    rounds = bench.R.setdefault(key, [])
    for k in range(n_rounds):
        got = {}
        for what in order[k % len(order):] + order[:k % len(order)]:
            if what == "run":
                got["run"] = _run_cell(args, prompts, tmp / f"run-{k}.jsonl", args.threads)
            else:
                got[what] = drive(servers[what][1], "bench", rows, slots, "completions", args.max_new_tokens, True)
        if "run" in got:
            got["served_over_run_c1"] = got["c1"]["output_tok_s"] / got["run"]["output_tok_s"]
        rounds.append(got)
        bench.save()


def _over_stock(rounds: list[dict], found: str, stock: str) -> tuple[float, float, float]:
    """Stock / found decode seconds per request (each side's fastest round), geomean and its
    bootstrap interval over requests and rounds."""
    times: dict[str, tuple[list, list]] = {}
    for r in rounds:
        for side, key in ((0, stock), (1, found)):
            for q in r[key]["per_request"]:
                times.setdefault(q["request_id"], ([], []))[side].append(max(q["decode_s"], 1e-9))
    pairs = [v for v in times.values() if v[0] and v[1]]
    lo, hi = bootstrap_interval([pairs])
    return geomean(min(a) / min(e) for a, e in pairs), lo, hi


def summary(rounds: list[dict], high: str, rounds_high: list[dict] | None = None) -> dict:
    """Medians over rounds, and the served found engine against served stock per request, at c1
    (``rounds``) and at the high concurrency (``rounds_high``)."""
    med = {"served_over_run_c1": statistics.median(r["served_over_run_c1"] for r in rounds)}
    for key in ("run", "c1", "stock-c1"):
        med[f"{key}_tok_s"] = statistics.median(r[key]["output_tok_s"] for r in rounds)
    keys = ["c1"]
    s, med["specpilot_over_stock_served_lo"], med["specpilot_over_stock_served_hi"] = _over_stock(rounds, "c1", "stock-c1")
    med["specpilot_over_stock_served"] = s
    if rounds_high:
        for key in (high, f"stock-{high}"):
            med[f"{key}_tok_s"] = statistics.median(r[key]["output_tok_s"] for r in rounds_high)
        med[f"{high}_over_c1"] = med[f"{high}_tok_s"] / med["c1_tok_s"]
        v, lo, hi = _over_stock(rounds_high, high, f"stock-{high}")
        med[f"specpilot_over_stock_served_{high}"], med[f"specpilot_over_stock_served_{high}_lo"], \
            med[f"specpilot_over_stock_served_{high}_hi"] = v, lo, hi
        med[f"throughput_specpilot_over_stock_{high}"] = med[f"{high}_tok_s"] / med[f"stock-{high}_tok_s"]
        keys.append(high)
    med["throughput_specpilot_over_stock_c1"] = med["c1_tok_s"] / med["stock-c1_tok_s"]
    for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
        for c in keys:
            med[f"{c}_{key}"] = statistics.median(r[c][key] or 0.0 for r in (rounds if c == "c1" else rounds_high))
    return med


def run(args: argparse.Namespace) -> int:
    """The two phases (module docstring), then the JSON and the table."""
    bench = Run("serve-vs-run", args)
    tmp_dir = tempfile.TemporaryDirectory(prefix="specpilot-svr-")
    tmp = Path(tmp_dir.name)
    servers: dict = {}
    high = f"c{args.concurrency_high}"
    try:
        if args.dry_run:
            dep, rows = dry_deployment(tmp / "dep")
            (tmp / "engine.json").write_text('{"block_size": 3}')
            args.target, args.drafter, args.engine_config = str(dep / "target"), str(dep / "drafter-dflash"), \
                str(tmp / "engine.json")
            args.max_new_tokens, args.rounds, args.rounds_high, args.threads = 8, 1, 1, 1
        else:
            if not (args.target and args.drafter and args.engine_config and args.prompts):
                raise SpecpilotError("give --target, --drafter, --engine-config and --prompts")
            rows = read_prompts(args.prompts, args.limit)
        config_high = args.engine_config_high or args.engine_config
        prompts = tmp / "prompts.jsonl"
        write_jsonl(prompts, rows)
        bench.R.update(max_new_tokens=args.max_new_tokens, requests=len(rows), threads=args.threads,
                       engine_config=args.engine_config, engine_config_high=config_high)
        agent_high = args.kernel_agent_high or args.kernel_agent
        for key, which, order, slots, agent, n in (
                ("rounds", [("c1", "specpilot", 1, args.engine_config), ("stock-c1", "stock", 1, None)],
                 ["run", "c1", "stock-c1"], 1, args.kernel_agent, args.rounds),
                ("rounds_high", [(high, "specpilot", args.concurrency_high, config_high),
                                 (f"stock-{high}", "stock", args.concurrency_high, None)],
                 [high, f"stock-{high}"], args.concurrency_high, agent_high, args.rounds_high or args.rounds)):
            servers = bench.phase(f"servers_{key}", lambda which=which, agent=agent:
                                  _servers(args, rows, tmp, which, agent), keep=False) or {}
            if servers:
                bench.phase(f"{key}_run", lambda key=key, order=order, slots=slots, n=n:
                            _phase(bench, args, rows, prompts, servers, tmp, key, order, slots, n), keep=False)
            _stop(servers)
        s = bench.phase("summary", lambda: summary(bench.R["rounds"], high, bench.R.get("rounds_high"))) \
            if bench.R.get("rounds") else None
    finally:
        _stop(servers)
        tmp_dir.cleanup()
    lines = []
    if s:
        lines = [f"served/run c1 throughput: median {s['served_over_run_c1']:.3f} over {len(bench.R['rounds'])} round(s) "
                 f"(run {s['run_tok_s']:.1f} tok/s, served {s['c1_tok_s']:.1f})",
                 f"specpilot served / stock served c1 (decode, geomean over requests): "
                 f"{s['specpilot_over_stock_served']:.3f} [{s['specpilot_over_stock_served_lo']:.3f}, "
                 f"{s['specpilot_over_stock_served_hi']:.3f}]; throughput {s['throughput_specpilot_over_stock_c1']:.3f}",
                 f"c1 TTFT p50/p99 {s['c1_ttft_ms_p50']:.1f}/{s['c1_ttft_ms_p99']:.1f} ms, ITL p50/p99 "
                 f"{s['c1_itl_ms_p50']:.1f}/{s['c1_itl_ms_p99']:.1f} ms"]
        if f"{high}_over_c1" in s:
            lines += [f"specpilot served / stock served {high} (decode, geomean over requests): "
                      f"{s[f'specpilot_over_stock_served_{high}']:.3f} [{s[f'specpilot_over_stock_served_{high}_lo']:.3f}, "
                      f"{s[f'specpilot_over_stock_served_{high}_hi']:.3f}]; throughput "
                      f"{s[f'throughput_specpilot_over_stock_{high}']:.3f}",
                      f"served {high}/c1 throughput: {s[f'{high}_over_c1']:.2f} ({s[f'{high}_tok_s']:.1f} tok/s)",
                      f"{high} TTFT p50/p99 {s[f'{high}_ttft_ms_p50']:.1f}/{s[f'{high}_ttft_ms_p99']:.1f} ms, ITL p50/p99 "
                      f"{s[f'{high}_itl_ms_p50']:.1f}/{s[f'{high}_itl_ms_p99']:.1f} ms"]
    return bench.finish(lines)

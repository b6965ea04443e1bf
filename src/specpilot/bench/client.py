"""``specpilot bench client``: drive any OpenAI-compatible endpoint at given concurrencies.

A closed-loop client (as SGLang's ``bench_serving --max-concurrency c``): c workers each send the
next prompt of the file as soon as their last request finished, streamed through the ``openai``
package (``AsyncOpenAI``), greedy (temperature 0), ``ignore_eos`` (each request decodes its whole
``--max-tokens``, as the study and ``bench_serving``'s fixed output lengths; ``--stop-at-eos``
turns it off). Per concurrency: output throughput (completion tokens / wall seconds from the first
request's start to the last one's end), request throughput, TTFT (first text chunk), ITL (the gap
between successive text chunks of a request, pooled over requests: per chunk, as ``bench_serving``
reports it, so a verify step that commits several tokens in one chunk is one gap) p50/p99, end to
end latency, tokens per request. The prompts are a prompt file of ``specpilot prompts``:
``--api completions`` sends each row's ``prompt_ids`` (the exact tokens ``specpilot run`` decodes),
``--api chat`` its first user turn through the server's chat template.

``--dry-run`` starts ``specpilot serve`` on a random tiny deployment (byte-level tokenizer) and
drives it with a few short prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from openai import AsyncOpenAI

from ..deployment_random import write_random_deployment
from ..errors import SpecpilotError
from ..io import comma_list, read_prompts
from ..prompts import load_tokenizer
from ._common import Run, add_common

ITL_NOTE = "per text chunk (bench_serving's ITL): a verify step committing several tokens is one chunk"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "client")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint (default the local server)")
    p.add_argument("--model", help="model name (default: the endpoint's first /v1/models entry)")
    p.add_argument("--prompts", help="prompt file from 'specpilot prompts' (required but for --dry-run)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="completions: each row's prompt_ids (default); chat: its first user turn")
    p.add_argument("--concurrency", type=comma_list, default=["1", "4"], help="closed-loop concurrencies (default 1,4)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--limit", type=int, help="the first N prompts")
    p.add_argument("--stop-at-eos", action="store_true", help="let requests stop at EOS (default: ignore_eos)")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _request(client: AsyncOpenAI, model: str, row: dict, api: str, max_tokens: int, ignore_eos: bool) -> dict:
    """One streamed request: its start, chunk arrival times, end and completion tokens."""
    t0 = time.perf_counter()
    kw = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": ignore_eos})
    if api == "chat":
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": row["turns"][0]}], **kw)
    else:
        stream = await client.completions.create(prompt=row["prompt_ids"], **kw)
    chunks, tokens = [], 0
    async for ch in stream:
        if ch.choices:
            c = ch.choices[0]
            text = c.delta.content if api == "chat" else c.text
            if text:
                chunks.append(time.perf_counter())
        if getattr(ch, "usage", None):
            tokens = ch.usage.completion_tokens
    t1 = time.perf_counter()
    return {"request_id": row["request_id"], "start": t0, "end": t1, "ttft_s": (chunks[0] if chunks else t1) - t0,
            "itl_s": list(np.diff(chunks)) if len(chunks) > 1 else [], "e2e_s": t1 - t0, "tokens": tokens,
            "decode_s": t1 - (chunks[0] if chunks else t1)}


async def _closed_loop(base_url: str, model: str, rows: list[dict], concurrency: int, api: str, max_tokens: int,
                       ignore_eos: bool) -> list[dict]:
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600)
    todo = list(rows)
    done: list[dict] = []

    async def worker():
        while todo:
            row = todo.pop(0)
            done.append(await _request(client, model, row, api, max_tokens, ignore_eos))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return done


def drive(base_url: str, model: str, rows: list[dict], concurrency: int, api: str = "completions",
          max_tokens: int = 128, ignore_eos: bool = True) -> dict:
    """Serve ``rows`` through the endpoint with ``concurrency`` closed-loop workers.

    Returns:
        ``{"concurrency", "requests", "wall_s", "output_tok_s", "request_s", "ttft_ms_p50/p99",
        "itl_ms_p50/p99", "e2e_ms_p50", "tokens_per_request", "per_request": [...]}`` (seconds
        and milliseconds of the host clock; ITL per text chunk).
    Raises:
        SpecpilotError: concurrency < 1 or no rows; the endpoint's errors pass through (openai's).
    """
    if concurrency < 1 or not rows:
        raise SpecpilotError(f"need concurrency >= 1 and prompts, got {concurrency} and {len(rows)} prompt(s)")
    per = asyncio.run(_closed_loop(base_url, model, rows, concurrency, api, max_tokens, ignore_eos))
    wall = max(r["end"] for r in per) - min(r["start"] for r in per)
    tokens = sum(r["tokens"] for r in per)
    itl = [x for r in per for x in r["itl_s"]]
    ms = 1e3
    return {"concurrency": concurrency, "requests": len(per), "wall_s": wall, "output_tok_s": tokens / wall,
            "request_s": len(per) / wall, "ttft_ms_p50": _pct([r["ttft_s"] * ms for r in per], 50),
            "ttft_ms_p99": _pct([r["ttft_s"] * ms for r in per], 99), "itl_ms_p50": _pct([x * ms for x in itl], 50),
            "itl_ms_p99": _pct([x * ms for x in itl], 99), "e2e_ms_p50": _pct([r["e2e_s"] * ms for r in per], 50),
            "tokens_per_request": tokens / len(per),
            "per_request": [{k: v for k, v in r.items() if k != "itl_s"} for r in per]}


def served_model(base_url: str) -> str:
    """The endpoint's first model name (``GET /v1/models``)."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def start_server(argv: list[str], port: int, log: Path, timeout_s: float = 300, cwd: str | Path | None = None,
                 env: dict | None = None) -> subprocess.Popen:
    """Start ``specpilot serve ARGV --port PORT`` (in ``cwd``, with ``env``; default this process's)
    and wait for ``/health``; its output goes to ``log``.

    Raises:
        SpecpilotError: the server exits or is not healthy within ``timeout_s`` (its log's end quoted)."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", *argv, "--port", str(port)],
                            stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SpecpilotError(f"specpilot serve {' '.join(argv)} did not start: {log.read_text()[-1500:]}")


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dry_deployment(folder: Path) -> tuple[Path, list[dict]]:
    """A random tiny deployment (byte-level tokenizer) and four short prompt rows, for dry runs."""
    write_random_deployment(folder, "tiny", seed=0, block_size=4)
    tok = load_tokenizer(folder / "target")
    rows = [{"request_id": f"dry/{i:04d}", "benchmark": "dry", "turns": [t],
             "prompt_ids": tok(t, add_special_tokens=False)["input_ids"]}
            for i, t in enumerate(["Hello there.", "What is 2 + 3?", "Write a haiku.", "Count to five."])]
    return folder, rows


def table(results: list[dict]) -> list[str]:
    """One line per concurrency."""
    lines = ["  c  req  tok/s    req/s  TTFT p50/p99 ms   ITL p50/p99 ms  tok/req"]
    for r in results:
        lines.append(f"{r['concurrency']:>3} {r['requests']:>4} {r['output_tok_s']:>6.1f} {r['request_s']:>8.2f} "
                     f"{r['ttft_ms_p50']:>7.1f}/{r['ttft_ms_p99']:<7.1f} {r['itl_ms_p50'] or 0:>7.1f}/"
                     f"{r['itl_ms_p99'] or 0:<7.1f} {r['tokens_per_request']:>6.1f}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Drive the endpoint (or, dry, a server started here) at each concurrency; write the JSON, print the table."""
    bench = Run("client", args)
    concurrencies = [int(c) for c in args.concurrency]
    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="specpilot-client-")
    try:
        if args.dry_run:
            dep, rows = dry_deployment(Path(tmp.name) / "dep")
            port = free_port()
            proc = start_server(["--target", str(dep / "target"), "--drafter", str(dep / "drafter-dflash"),
                                 "--engine", "stock", "--max-concurrency", str(max(concurrencies)), "--max-seq", "256",
                                 "--threads", "1", "--device", "cpu"], port, Path(tmp.name) / "server.log")
            base_url, max_tokens = f"http://127.0.0.1:{port}/v1", 8
        else:
            if not args.prompts:
                raise SpecpilotError("--prompts is required (a prompt file from 'specpilot prompts')")
            rows, base_url, max_tokens = read_prompts(args.prompts, args.limit), args.base_url, args.max_tokens
        model = args.model or served_model(base_url)
        bench.R.update(base_url=base_url, model=model, api=args.api, max_tokens=max_tokens, itl=ITL_NOTE)
        results = []
        for c in concurrencies:
            r = bench.phase(f"c{c}", lambda c=c: drive(base_url, model, rows, c, args.api, max_tokens,
                                                        not args.stop_at_eos))
            if r is not None:
                results.append(r)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        tmp.cleanup()
    return bench.finish(table(results))

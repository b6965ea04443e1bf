"""``specpilot ceilings``: measure a device's memory bandwidth and matmul rate.

The cost model compares engine step times with these two ceilings (a roofline), so they are
measured on the machine itself rather than taken from a datasheet:

- memory bandwidth [bytes/s]: the best of several copies of a large buffer (bigger than any cache),
  counting bytes read plus bytes written;
- matmul rate [FLOP/s]: the best of several square matmuls (2 n^3 FLOP each) in the device's
  working dtype: float32 on CPU, bfloat16 on CUDA.

It takes a few seconds on CPU. The output (JSON) also names the device, dtype, torch version,
thread count and the time of measurement.

On the CPU both ceilings depend on the threads a step runs with (one core's bandwidth and vector
units against every core's), so they are measured once per thread count: with one thread and with
every thread given (``--threads``), kept under ``per_threads`` (``{"1": {...}, "2": {...}}``, each
with the two ceilings, their medians and the raw timings). The top-level values stay the
measurement with every thread (what readers of older files read). The cost model compares a step
timed with T threads against the ceilings measured with T threads (:func:`for_threads`); a
timed CPU job of the workflow runs with one thread (``rules/common.smk``). A GPU has one
measurement, as before.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import time

from .errors import SpecpilotError
from .io import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True, help="device to measure")
    parser.add_argument("--out", required=True, help="output JSON, e.g. results/{gpu}/ceilings.json")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's default)")
    parser.add_argument("--expect-gpu", default=None,
                        help="fail unless the device's normalized name is this (guards results/{gpu}/)")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the copied buffer in MiB (default 256 on CPU, 2048 on CUDA)")
    parser.add_argument("--matmul-n", type=int, default=None,
                        help="matmul size n (default 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repetitions per measurement (default 5 on CPU, 20 on CUDA)")


def cpu_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timer(device: str):
    """Return (sync, now) for wall-clock timing with the device synchronized before each read."""
    import torch

    if device == "cuda":
        def sync():
            torch.cuda.synchronize()
    else:
        def sync():
            pass
    return sync, time.perf_counter


def measure(device: str, copy_mib: int, matmul_n: int, repeats: int) -> dict:
    """Measure bandwidth and matmul rate on ``device``; returns the numbers and the raw timings."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync, now = _timer(device)
    elem = torch.tensor([], dtype=dtype).element_size()

    # Memory bandwidth: dst.copy_(src) reads and writes every byte once.
    n_elem = copy_mib * 2**20 // elem
    src = torch.ones(n_elem, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in both buffers
    sync()
    copy_s = []
    for _ in range(repeats):
        t0 = now()
        dst.copy_(src)
        sync()
        copy_s.append(now() - t0)
    moved = 2 * n_elem * elem
    del src, dst

    # Matmul rate: 2 n^3 FLOP per square matmul.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(matmul_n, matmul_n, dtype=dtype, device=device, generator=gen)
    b = torch.randn(matmul_n, matmul_n, dtype=dtype, device=device, generator=gen)
    c = a @ b  # warm-up (kernel selection, thread pool start)
    sync()
    mm_s = []
    for _ in range(repeats):
        t0 = now()
        torch.matmul(a, b, out=c)
        sync()
        mm_s.append(now() - t0)
    flop = 2 * matmul_n**3
    del a, b, c

    return {
        "dtype": str(dtype).removeprefix("torch."),
        "memory_bandwidth_bytes_per_s": moved / min(copy_s),
        "memory_bandwidth_median_bytes_per_s": moved / statistics.median(copy_s),
        "matmul_flop_per_s": flop / min(mm_s),
        "matmul_median_flop_per_s": flop / statistics.median(mm_s),
        "method": {
            "copy_bytes_moved": moved,
            "copy_buffer_mib": copy_mib,
            "copy_seconds": copy_s,
            "matmul_n": matmul_n,
            "matmul_flop": flop,
            "matmul_seconds": mm_s,
            "repeats": repeats,
            "note": "ceilings are the best repetition; bandwidth counts read + write bytes",
        },
    }


def cpu_thread_counts(threads: int) -> list[int]:
    """The thread counts the CPU ceilings are measured at: one, and ``threads`` (every thread given)."""
    return sorted({1, max(1, int(threads))})


CEILING_KEYS = ("memory_bandwidth_bytes_per_s", "memory_bandwidth_median_bytes_per_s", "matmul_flop_per_s",
                "matmul_median_flop_per_s")


def for_threads(ceilings: dict, threads: int | None) -> tuple[dict, int | None]:
    """The ceilings a step timed with ``threads`` threads is held to, and the thread count they were
    measured with.

    The ``per_threads`` entry of exactly ``threads`` when the file has one (CPU ceilings from
    :func:`run`); otherwise the top-level measurement and its own ``threads`` (a GPU, a step whose
    thread count is unknown -- ``None``, records written before they carried it -- or a thread
    count that was not measured: no floor is made up for it, and the caller states the mismatch).
    Returns ``(ceilings with the keys of CEILING_KEYS the file has, measured thread count or None)``.
    """
    per = ceilings.get("per_threads") or {}
    if threads is not None and str(int(threads)) in per:
        return {k: per[str(int(threads))][k] for k in CEILING_KEYS if k in per[str(int(threads))]}, int(threads)
    measured = ceilings.get("threads")
    return {k: ceilings[k] for k in CEILING_KEYS if k in ceilings}, (int(measured) if measured is not None else None)


def run(args: argparse.Namespace) -> int:
    import torch

    from .device import detect_gpu

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SpecpilotError("--device cuda given but torch sees no CUDA device")
    gpu = detect_gpu() if args.device == "cuda" else "cpu"
    if args.expect_gpu is not None and args.expect_gpu != gpu:
        raise SpecpilotError(
            f"this machine's device is {gpu!r}, not {args.expect_gpu!r}: its ceilings would be "
            f"filed under the wrong results/{args.expect_gpu}/ folder")
    if args.threads is not None:
        if args.threads < 1:
            raise SpecpilotError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cpu = args.device == "cpu"
    copy_mib = args.copy_mib or (256 if cpu else 2048)
    matmul_n = args.matmul_n or (2048 if cpu else 8192)
    repeats = args.repeats or (5 if cpu else 20)
    if min(copy_mib, matmul_n, repeats) < 1:
        raise SpecpilotError("--copy-mib, --matmul-n and --repeats must be >= 1")

    result = {
        "gpu": gpu,
        "device": args.device,
        "device_name": cpu_name() if cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if not cpu else None,
        "threads": torch.get_num_threads(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if cpu:  # one measurement per thread count, every thread's last (the top-level values)
        every = torch.get_num_threads()
        per = {}
        for n in cpu_thread_counts(every):
            torch.set_num_threads(n)
            per[str(n)] = measure(args.device, copy_mib, matmul_n, repeats)
        torch.set_num_threads(every)
        result.update(per[str(every)])
        result["per_threads"] = per
    else:
        result.update(measure(args.device, copy_mib, matmul_n, repeats))
    write_json(args.out, result)
    for n, m in (result.get("per_threads") or {str(result["threads"]): result}).items():
        print(f"{gpu} ({n} thread(s)): {m['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
              f"{m['matmul_flop_per_s'] / 1e12:.2f} TFLOP/s ({m['dtype']}) -> {args.out}")
    return 0

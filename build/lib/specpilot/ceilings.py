"""``specpilot ceilings``: measure a device's memory bandwidth and matmul rate.

The cost model compares engine step times with these two ceilings (a roofline), so they are
measured on the machine itself rather than taken from a datasheet:

- memory bandwidth [bytes/s]: the best of several copies of a large buffer (bigger than any cache),
  counting bytes read plus bytes written;
- matmul rate [FLOP/s]: the best of several square matmuls (2 n^3 FLOP each) in the device's
  working dtype: float32 on CPU, bfloat16 on CUDA.

It takes a few seconds on CPU. The output (JSON) also names the device, dtype, torch version,
thread count and the time of measurement.
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
    result.update(measure(args.device, copy_mib, matmul_n, repeats))
    write_json(args.out, result)
    print(f"{gpu}: {result['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"{result['matmul_flop_per_s'] / 1e12:.2f} TFLOP/s ({result['dtype']}) -> {args.out}")
    return 0

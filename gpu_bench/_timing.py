"""Timing helpers the GPU benchmark scripts share (bench_engine, bench_verify, bench_targets).

The scripts run as ``python3 gpu_bench/<script>.py`` from the repository root and import this
module as ``_timing`` from their own folder. Nothing here imports torch at import time: a script
may set ``TRITON_INTERPRET`` before torch and Triton load.

- :func:`log`: a progress line stamped with the seconds since the script started (:data:`T0`),
  kept in :data:`LOG`;
- :func:`event_times` / :func:`wall_times`: seconds of each of ``iters`` back-to-back calls (CUDA
  events on the GPU, the host clock on the CPU) and the wall time of the whole loop;
- :func:`capture_graph`: a CUDA graph of a function, warmed up on a side stream first;
- :func:`copy_bandwidth`: device copy bandwidth (bytes read + written / time), the MBU denominator;
- :func:`graph_time_us`: per-call time of a call cycling over weight copies, inside one CUDA graph;
- :func:`rel_err`: relative L2 error;
- :func:`compile_linear`: one call of the Triton linear in a fused variant, so that the compile
  workers fill Triton's on-disk cache before anything is timed (prints what it compiled).
"""

from __future__ import annotations

import time

T0 = time.time()  # the script's start: it imports this module before anything slow
LOG: list[str] = []  # every line :func:`log` printed, for the JSON the script writes


def log(*a) -> None:
    """Print the arguments on one line stamped with the seconds since :data:`T0`; keep it in :data:`LOG`."""
    s = " ".join(str(x) for x in a)
    print(f"[{time.time() - T0:7.1f}s] {s}", flush=True)
    LOG.append(s)


def event_times(fn, iters: int) -> tuple[list[float], float]:
    """Run ``fn`` ``iters`` times back to back on the GPU, each call between two CUDA events.

    Returns (seconds of each call by its events, host seconds from the first record to the
    synchronize after the last). No warm-up: the caller warms up and synchronizes first.
    """
    import torch

    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    t0 = time.perf_counter()
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return [a.elapsed_time(b) / 1e3 for a, b in evs], total


def wall_times(fn, iters: int) -> tuple[list[float], float]:
    """Run ``fn`` ``iters`` times by the host clock (no synchronization: the CPU path).

    Returns (seconds of each call, seconds of the whole loop).
    """
    times = []
    t0 = time.perf_counter()
    for _ in range(iters):
        t1 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t1)
    return times, time.perf_counter() - t0


def capture_graph(fn):
    """A ``torch.cuda.CUDAGraph`` of ``fn``: two warm-up calls on a side stream, then the capture."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def copy_bandwidth(a, median) -> float:
    """Copy bandwidth [B/s]: bytes read + written by ``b.copy_(a)`` (``b`` a buffer like ``a``)
    over ``median(fn)``, the caller's median seconds of a call of ``fn``."""
    import torch

    b = torch.empty_like(a)
    t = median(lambda: b.copy_(a))
    return 2 * a.numel() * a.element_size() / t


def rel_err(a, b) -> float:
    """Relative L2 error ||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compile_linear(K, variant: str, key: str, x, w, out, norm, tag: str = "") -> None:
    """Compile the Triton linear ``K.linear`` (``specpilot.engine.triton_step``) of config ``key`` in
    ``variant`` by one call, and print ``compiled ...`` with the seconds it took or ``FAILED ...``
    (a failed compile does not raise). Variants: ``norm`` (RMSNorm prologue), ``res`` (residual
    add), ``swiglu`` (norm + SwiGLU over the fused gate/up weight ``w``), ``swiglu_pre`` (SwiGLU
    alone), anything else plain. ``w`` holds 2 x ``out``'s columns of rows (the gate/up layout);
    the other variants use its first half. ``tag`` is appended to the key in the message."""
    import torch

    cfg = K.LinearConfig.parse(key)
    n = out.shape[1]
    t = time.time()
    try:
        if variant == "norm":
            K.linear(x, w[:n], out, cfg=cfg, norm=norm)
        elif variant == "res":
            K.linear(x, w[:n], out, cfg=cfg, residual=out)
        elif variant == "swiglu":
            K.linear(x, w, out, cfg=cfg, norm=norm, swiglu=True)
        elif variant == "swiglu_pre":
            K.linear(x, w, out, cfg=cfg, swiglu=True)
        else:
            K.linear(x, w[:n], out, cfg=cfg)
        torch.cuda.synchronize()
        print(f"compiled {variant} {key}{tag} in {time.time() - t:.1f}s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"FAILED {variant} {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def graph_time_us(call, n_copies: int, min_calls: int = 32, reps: int = 15) -> tuple[float, float, float]:
    """(median, min, max) microseconds per call of ``call(i)``, ``i`` cycling over ``n_copies``
    weight copies (enough to exceed the L2 cache), replayed as one CUDA graph of at least
    ``min_calls`` calls, ``reps`` times, each replay between two CUDA events."""
    import math
    import statistics

    import torch

    for i in range(n_copies):
        call(i)
    torch.cuda.synchronize()
    inner = n_copies * max(1, math.ceil(min_calls / n_copies))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(inner):
            call(j % n_copies)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000.0 / inner)
    del g
    return statistics.median(ts), min(ts), max(ts)

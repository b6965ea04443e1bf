"""The one timing helper: every tuner, the kernel sub-agent and the benchmark suite time with it.

- :func:`log`: a progress line stamped with the seconds since :data:`T0`, kept in :data:`LOG`;
- :func:`median_ms`: median device milliseconds of one call (CUDA events, L2 flushed before each);
- :func:`event_times` / :func:`wall_times`: seconds of each of ``iters`` back-to-back calls (CUDA
  events on the GPU, the host clock on the CPU) and the wall time of the whole loop;
- :func:`mean_s`: mean device seconds per call of a back-to-back loop between two CUDA events;
- :func:`capture_graph`: a CUDA graph of a function, warmed up on a side stream first;
- :func:`graph_us`: median device microseconds per call of launches replayed as one CUDA graph;
- :func:`graph_time_us`: per-call time of a call cycling over weight copies, inside one CUDA graph;
- :func:`copy_bandwidth`: device copy bandwidth (bytes read + written / time), the MBU denominator;
- :func:`rel_err`: relative L2 error (inf for a non-finite output);
- :func:`clock` / :class:`PhaseTimer`: the engine's own phase times (decode, draft, verify) for the
  records: one device synchronization per step.

Method: CUDA events around the timed region after a warm-up, medians over repeats, weights rotated
or the L2 flushed so a call reads from device memory as it does inside a full step (the device
tool's METHOD.md; ``triton.testing.do_bench`` times the same way).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

T0 = time.time()  # the process's start, as near as an import gets
LOG: list[str] = []  # every line :func:`log` printed, for the JSON a benchmark writes

_L2_FLUSH: list = []  # a buffer twice the L2 cache, written before each timed call of median_ms


def log(*a) -> None:
    """Print the arguments on one line stamped with the seconds since :data:`T0`; keep it in :data:`LOG`."""
    s = " ".join(str(x) for x in a)
    print(f"[{time.time() - T0:7.1f}s] {s}", flush=True)
    LOG.append(s)


def median_ms(fn: Callable[[], object], iters: int = 5, warmup: int = 2, flush_l2: bool = True) -> float:
    """Median device milliseconds of ``fn()`` over ``iters`` calls (CUDA events), after ``warmup``.

    ``flush_l2``: overwrite the L2 cache before each timed call, so a matmul reads its weight from
    device memory as it does in a step over every layer (a probe on one layer's weight would
    otherwise find it in L2 and favour whichever option is more bound by bandwidth). CUDA only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if flush_l2 and not _L2_FLUSH:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2 = getattr(props, "L2_cache_size", 0) or (64 << 20)
        _L2_FLUSH.append(torch.empty(2 * l2, dtype=torch.uint8, device="cuda"))
    times = []
    for _ in range(iters):
        if flush_l2:
            _L2_FLUSH[0].zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def mean_s(fn: Callable[[], object], iters: int = 50) -> float:
    """Mean device seconds per call of ``fn`` run ``iters`` times back to back between two CUDA
    events, after one warm-up call (launch gaps included: a host-launched sequence)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def event_times(fn: Callable[[], object], iters: int) -> tuple[list[float], float]:
    """Run ``fn`` ``iters`` times back to back on the GPU, each call between two CUDA events.

    Returns (seconds of each call by its events, host seconds from the first record to the
    synchronize after the last). No warm-up: the caller warms up and synchronizes first.
    """
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    t0 = time.perf_counter()
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return [a.elapsed_time(b) / 1e3 for a, b in evs], total


def wall_times(fn: Callable[[], object], iters: int) -> tuple[list[float], float]:
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


def capture_graph(fn: Callable[[], object]):
    """A ``torch.cuda.CUDAGraph`` of ``fn``: two warm-up calls on a side stream, then the capture."""
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


def graph_us(fns: list[Callable[[], object]], iters: int = 10, calls: int = 8) -> float:
    """Median device microseconds per call of the launches ``fns`` (CUDA only): a CUDA graph of
    the ``fns`` in turn, repeated to at least ``calls`` calls, replayed ``iters`` times between CUDA
    events (no host launch cost in the time; a Triton launch from Python costs more than a small
    matmul runs). Warmed (compiled) on a side stream before the capture."""
    passes = max(1, -(-calls // len(fns)))

    def run():
        for _ in range(passes):
            for f in fns:
                f()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (passes * len(fns)))
    del g
    return statistics.median(times)


def graph_time_us(call: Callable[[int], object], n_copies: int, min_calls: int = 32,
                  reps: int = 15) -> tuple[float, float, float]:
    """(median, min, max) microseconds per call of ``call(i)``, ``i`` cycling over ``n_copies``
    weight copies (enough to exceed the L2 cache), replayed as one CUDA graph of at least
    ``min_calls`` calls, ``reps`` times, each replay between two CUDA events."""
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


def copy_bandwidth(a, median: Callable[[Callable[[], object]], float]) -> float:
    """Copy bandwidth [bytes/s]: bytes read + written by ``b.copy_(a)`` (``b`` a buffer like ``a``)
    over ``median(fn)``, the caller's median seconds of a call of ``fn``."""
    b = torch.empty_like(a)
    t = median(lambda: b.copy_(a))
    return 2 * a.numel() * a.element_size() / t


def rel_err(a, b) -> float:
    """Relative L2 error ||a - b|| / ||b|| in fp32 (tensors of one shape); inf when ``a`` holds a
    NaN or an infinity (an output that was not written, or overflowed, never passes a check)."""
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def clock(device: torch.device) -> float:
    """Seconds from a monotonic clock, after synchronizing ``device`` (CUDA) so time is real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class PhaseTimer:
    """Clock readings of a step's phase boundaries with one synchronization per step.

    ``mark()`` at each boundary, ``finish()`` at the step's end: returns the clock reading
    (:func:`clock` seconds) of every mark and of the end. On CUDA the marks are CUDA events, so
    the host never waits between phases (a synchronization per mark would leave the device idle
    while the host launches the next phase); the readings are placed back from the end by the
    events' elapsed times, i.e. a phase's duration is the device time from its mark to the
    next. On the CPU the marks read the clock directly. Disabled: no marks, ``finish`` returns
    0.0 for each mark asked and the end's reading.
    """

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled = device, enabled
        self.cuda = enabled and device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        """A phase boundary (a CUDA event on the current stream, or a clock reading)."""
        if not self.enabled:
            self.marks.append(None)
        elif self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def finish(self) -> list[float]:
        """Readings [s] of the marks, then of the end (synchronizes the device once)."""
        if not self.enabled:
            return [0.0] * len(self.marks) + [clock(self.device)]
        if not self.cuda:
            return self.marks + [time.perf_counter()]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        now = clock(self.device)
        evs = self.marks + [end]
        out = [now]
        for a, b in zip(reversed(evs[:-1]), reversed(evs[1:])):
            out.append(out[-1] - a.elapsed_time(b) / 1e3)
        return out[::-1]

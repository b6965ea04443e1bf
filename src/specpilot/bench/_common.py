"""What every benchmark of the suite shares: options, device, timing by CUDA events or the host
clock (both through :mod:`specpilot.tuning.timing`), phases that record their errors, the atomic
JSON result and the table printed last.

A benchmark builds one :class:`Run` from its parsed arguments, runs its phases through
:meth:`Run.phase` (an exception is recorded in the result's ``errors`` and the next phase runs;
the exit status is then 1), and ends with :meth:`Run.finish`, which writes the result and prints
the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..device import detect_gpu
from ..errors import SpecpilotError
from ..io import write_json
from ..tuning import timing


def add_common(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every benchmark takes: ``--out``, ``--dry-run``, ``--seed``."""
    parser.add_argument("--out", help=f"result JSON (default results/{{gpu}}/bench/{name}.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, Triton under its interpreter: checks the benchmark in seconds, "
                             "measures nothing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")


def interpret_triton() -> None:
    """Run Triton kernels under its CPU interpreter in this process (``TRITON_INTERPRET=1`` before
    Triton is imported), with interpreted tensors given ``__index__`` (triton 3.6 with numpy >= 2.3
    calls ``int()`` on one-element arrays; the same patch as ``tests/triton_interp.py``)."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # no Triton: the benchmark's Triton phases record the import error
        return
    if not hasattr(interp, "_patch_lang_tensor") or getattr(interp, "_specpilot_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._specpilot_patched = True


def environment(device: torch.device) -> dict:
    """Versions (Python, torch, Triton, transformers) and, on CUDA, the GPU's name, SMs and memory."""
    env = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


class Run:
    """One run of a benchmark: its device, its result dict ``R`` and where the result goes.

    ``R`` holds ``benchmark``, ``date``, ``command``, ``dry_run``, ``device``, ``env``, ``errors``
    (one ``{"phase", "error"}`` per failed phase), ``log`` (every :func:`timing.log` line) and what
    the phases return, under their names. On CUDA (unless ``--dry-run``) the device is the GPU and
    the dtype bf16; else the CPU and fp32 (Triton's interpreter has no bf16 constants).
    """

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.dry = bool(args.dry_run)
        if self.dry:
            interpret_triton()
            torch.set_num_threads(1)
        torch.set_grad_enabled(False)
        self.device = torch.device("cuda" if torch.cuda.is_available() and not self.dry else "cpu")
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.gpu = detect_gpu() if self.cuda else "cpu"
        self.out = Path(args.out) if args.out else Path("results") / self.gpu / "bench" / f"{name}.json"
        self.t0 = time.time()
        self.R: dict = {"benchmark": name, "date": time.strftime("%Y-%m-%d"),
                        "command": "specpilot bench " + " ".join(getattr(args, "argv", [name])),
                        "dry_run": self.dry, "device": self.gpu, "env": environment(self.device),
                        "errors": [], "log": timing.LOG}

    # -- phases and the result ---------------------------------------------------------------
    def save(self) -> None:
        """Write the result as it stands (atomically: a killed run leaves the last complete one)."""
        self.R["wall_s"] = round(time.time() - self.t0, 2)
        write_json(self.out, json.loads(json.dumps(self.R, default=str)))

    def phase(self, key: str, fn: Callable[[], object], keep: bool = True):
        """Run ``fn()``, keep its return value as ``R[key]`` (unless not ``keep``) and save; an
        exception is logged with its traceback, recorded in ``R["errors"]`` and returns None (the
        next phase still runs)."""
        t = time.time()
        timing.log(f"== {key}")
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - a failed phase is reported in the result, not fatal
            timing.log(f"ERROR in {key}: {type(e).__name__}: {e}")
            traceback.print_exc()
            self.R["errors"].append({"phase": key, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            value = None
        else:
            if value is not None and keep:
                self.R[key] = value
        self.R.setdefault("phase_s", {})[key] = round(time.time() - t, 2)
        self.save()
        return value

    def finish(self, table: list[str]) -> int:
        """Write the result, print ``table`` (and the errors) last; 1 if a phase failed, else 0."""
        self.R["table"] = table
        self.save()
        lines = [f"{self.name} ({'dry run: times mean nothing' if self.dry else self.gpu}), result {self.out}", *table]
        if self.R["errors"]:
            lines.append("errors: " + "; ".join(f"{e['phase']}: {e['error'][:160]}" for e in self.R["errors"]))
        print("\n" + "\n".join(lines), flush=True)
        return 1 if self.R["errors"] else 0

    # -- timing ------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_s(self, fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
        """Median seconds per call of ``fn`` after ``warmup`` calls: CUDA events around each call
        on the GPU (:func:`timing.event_times`), the host clock on the CPU (:func:`timing.wall_times`).
        A dry run times one call, without warm-up."""
        if self.dry:
            iters, warmup = 1, 0
        for _ in range(warmup):
            fn()
        self.sync()
        times, _ = timing.event_times(fn, iters) if self.cuda else timing.wall_times(fn, iters)
        return statistics.median(times)

    def graph_s(self, fn: Callable[[], object], iters: int = 10) -> float:
        """Median seconds of one replay of a CUDA graph of ``fn`` (:func:`timing.capture_graph`);
        on the CPU, of a plain call."""
        if not self.cuda:
            return self.median_s(fn, iters, 1)
        g = timing.capture_graph(fn)
        t = self.median_s(g.replay, iters, 2)
        del g
        return t

    def copy_bandwidth(self, nbytes: int = 2 << 30) -> float:
        """Device copy bandwidth [bytes/s] (read + write) of a buffer of ``nbytes`` (16 MiB on the
        CPU): the MBU denominator (:func:`timing.copy_bandwidth`)."""
        n = (nbytes if self.cuda else 16 << 20) // 2
        a = torch.empty(n, dtype=torch.bfloat16, device=self.device).normal_()
        bw = timing.copy_bandwidth(a, lambda fn: self.median_s(fn, 10, 3))
        del a
        timing.log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
        return bw

    def need_cuda(self, what: str) -> None:
        """Raise SpecpilotError naming ``what`` when the run is not on a CUDA device."""
        if not self.cuda:
            raise SpecpilotError(f"{what} needs a CUDA device (this run is on the CPU)")


def kernel_profile(fn: Callable[[], object], n: int = 5, top: int | None = 20) -> dict:
    """Device time per kernel name of one call of ``fn`` (CUDA; torch.profiler over ``n`` calls
    after 2 warm-up calls), largest first, the ``top`` largest (None: every kernel):
    ``{"kernels": {name: {"ms", "launches"}}, "kernel_sum_ms"}``. Once the profiler has run in a process every later call is slower
    (CUPTI stays attached): profile after the timings."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        if getattr(ev, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
        kernels[ev.key[:80]] = {"ms": t / n / 1e3, "launches": ev.count / n}
    kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[:top])
    return {"kernels": kernels, "kernel_sum_ms": sum(v["ms"] for v in kernels.values())}


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` token ids drawn uniformly below ``vocab`` by a CPU generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def fmt(x, spec: str = "{:.3f}") -> str:
    """``spec`` applied to a number, "-" for anything else (a phase that did not run)."""
    return spec.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"

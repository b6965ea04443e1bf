"""One device per GPU job on a multi-GPU host: a pool of per-device lock files and a job wrapper.

Snakemake counts a ``gpu`` resource but does not choose a device (snakemake issue #281), so every
local job would see all GPUs and PyTorch would use device 0. The workflow runs every GPU job
through this wrapper::

    python -m specpilot.devices run --gpu h100 -- python -m specpilot run ...

which takes one device of the run's pool for the job's lifetime: the first free device whose
lock file it can ``flock`` exclusively (waiting while all are taken), exports it as
``CUDA_VISIBLE_DEVICES`` (its UUID: CUDA's own enumeration order may differ from ``nvidia-smi``'s),
``SPECPILOT_DEVICE_INDEX`` / ``_UUID`` / ``_NAME`` for the job, writes which device and when into
the job's log, and runs the command. The lock is an open file description shared by the wrapper
and the command; the kernel drops it when both have exited, so the device is freed on success,
failure and kill (SIGKILL included). Every GPU job holds its device exclusively: a timed cell
never shares a GPU with another job, and other jobs run on the other devices meanwhile.

The pool: the host's devices from ``nvidia-smi`` whose normalized name is the job's ``{gpu}``
(:func:`normalize_gpu_name`; a host with H100s and A100s gives ``h100`` jobs only
H100s), restricted to ``CUDA_VISIBLE_DEVICES`` when the run was started with it (or SLURM set it).
The workflow records the pool's UUIDs when it plans the run (``SPECPILOT_DEVICE_POOL``); a device
of it that is gone when a job starts stops that job with one error naming it. Lock files live in
``SPECPILOT_DEVICE_DIR`` (default ``<tmp>/specpilot-devices``: per host, so two runs on one server
share the pool, and never on a network filesystem).

Without CUDA the pool and the wrapper are tested with fake devices: ``SPECPILOT_FAKE_DEVICES`` is a
comma-separated list of device names (``"NVIDIA H100 80GB HBM3,NVIDIA H100 80GB HBM3"``), standing in
for ``nvidia-smi``; fake device ``i`` has UUID ``FAKE-i``. On CPU runs the workflow does not call
the wrapper at all.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import SpecpilotError
from .io import read_json, read_jsonl, write_json

FAKE_ENV = "SPECPILOT_FAKE_DEVICES"
DIR_ENV = "SPECPILOT_DEVICE_DIR"
POOL_ENV = "SPECPILOT_DEVICE_POOL"
INDEX_ENV, UUID_ENV, NAME_ENV = "SPECPILOT_DEVICE_INDEX", "SPECPILOT_DEVICE_UUID", "SPECPILOT_DEVICE_NAME"


# (pattern on the lowercased device name, normalized name); first match wins, so more specific
# names come before the names they contain.
_KNOWN: list[tuple[str, str]] = [
    (r"\bgh200\b", "gh200"),
    (r"\bgb200\b", "gb200"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b", "h100"),
    (r"\bh800\b", "h800"),
    (r"\bh20\b", "h20"),
    (r"\bb200\b", "b200"),
    (r"\bb300\b", "b300"),
    (r"\ba100\b", "a100"),
    (r"\ba800\b", "a800"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\brtx pro 6000\b", "rtx_pro_6000"),
    (r"\brtx 6000 ada\b", "rtx_6000_ada"),
]


def normalize_gpu_name(name: str) -> str:
    """Map a CUDA device name to the ``{gpu}`` wildcard value.

    Known families map to short names (``"NVIDIA H100 80GB HBM3"`` -> ``h100``,
    ``"NVIDIA RTX PRO 6000 Blackwell Server Edition"`` -> ``rtx_pro_6000``). Anything else becomes
    the name lowercased, without a leading ``NVIDIA``, with every run of other characters turned
    into one underscore (``"NVIDIA GeForce RTX 4090"`` -> ``geforce_rtx_4090``).
    """
    low = " ".join(name.lower().split())
    for pattern, short in _KNOWN:
        if re.search(pattern, low):
            return short
    low = re.sub(r"^nvidia\b", "", low)
    slug = re.sub(r"[^a-z0-9]+", "_", low).strip("_")
    return slug or "unknown_gpu"


@dataclass(frozen=True)
class Device:
    """One GPU of the host: ``nvidia-smi``'s index (PCI order), UUID and name."""

    index: int
    uuid: str
    name: str


def _nvidia_smi() -> list[Device]:
    """The host's GPUs as ``nvidia-smi`` lists them (all of them, whatever CUDA_VISIBLE_DEVICES says).

    Raises:
        SpecpilotError: ``nvidia-smi`` fails (a lost GPU makes it fail: its message is named).
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    r = subprocess.run([exe, "--query-gpu=index,uuid,name", "--format=csv,noheader"], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        raise SpecpilotError(f"nvidia-smi failed (exit {r.returncode}): {why[0] if why else 'no message'}")
    out = []
    for line in r.stdout.strip().splitlines():
        index, uuid, name = (x.strip() for x in line.split(",", 2))
        out.append(Device(int(index), uuid, name))
    return out


def host_devices() -> list[Device]:
    """The GPUs this process may use: ``nvidia-smi``'s list (or ``SPECPILOT_FAKE_DEVICES``),
    restricted to ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when that is set, in its order."""
    fake = os.environ.get(FAKE_ENV)
    if fake is not None:
        found = [Device(i, f"FAKE-{i}", n.strip()) for i, n in enumerate(fake.split(",")) if n.strip()]
    else:
        found = _nvidia_smi()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    out = []
    for item in (x.strip() for x in visible.split(",") if x.strip()):
        match = [d for d in found if item == str(d.index) or item == d.uuid or (item.startswith("GPU-")
                                                                                   and d.uuid.startswith(item))]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        out.append(match[0])
    return out


def pool(gpu: str, devices: list[Device] | None = None) -> list[Device]:
    """The devices of ``{gpu}`` (normalized name) among ``devices`` (default :func:`host_devices`)."""
    devices = host_devices() if devices is None else devices
    return [d for d in devices if normalize_gpu_name(d.name) == gpu]


def lock_dir() -> Path:
    """Folder of the per-device lock files: ``$SPECPILOT_DEVICE_DIR``, else ``<tmp>/specpilot-devices``."""
    return Path(os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / "specpilot-devices")


def _lock_path(folder: Path, d: Device) -> Path:
    return folder / f"{socket.gethostname()}-{d.uuid}.lock"


def try_lock(folder: Path, d: Device) -> int | None:
    """An fd holding device ``d``'s exclusive lock, or None when another job holds it.

    Raises:
        SpecpilotError: the lock folder or file cannot be used (named, with the variable to set).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(_lock_path(folder, d), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise SpecpilotError(f"cannot use the device lock folder {folder} ({e.strerror}); set {DIR_ENV} "
                             f"to a writable local folder") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise SpecpilotError(f"cannot lock {_lock_path(folder, d)} ({e.strerror}); set {DIR_ENV} to a "
                             f"folder on a local filesystem") from None
    return fd


def acquire(devices: list[Device], folder: Path, poll_s: float = 0.5, timeout_s: float | None = None,
            on_wait=None) -> tuple[Device, int]:
    """The first free device of ``devices`` and the fd of its lock, waiting while all are taken.

    Args:
        poll_s: seconds between attempts while every device is taken.
        timeout_s: give up after this many seconds (None: wait as long as it takes).
        on_wait: called once, with no argument, when the first attempt finds every device taken.
    Raises:
        SpecpilotError: ``devices`` is empty, or ``timeout_s`` passed.
    """
    if not devices:
        raise SpecpilotError("no device to take")
    start = time.monotonic()
    waited = False
    while True:
        for d in devices:
            fd = try_lock(folder, d)
            if fd is not None:
                return d, fd
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise SpecpilotError(f"no device of {len(devices)} came free within {timeout_s:.0f} s")
        time.sleep(poll_s)


def check_pool(gpu: str, devices: list[Device], expected: str | None) -> None:
    """Raise when a device of the run's pool (``expected``: comma-separated UUIDs recorded when the
    run was planned) is no longer among ``devices``, or when there is no ``gpu`` device at all."""
    have = {d.uuid for d in devices}
    gone = [u for u in (expected or "").split(",") if u and u not in have]
    if gone:
        raise SpecpilotError(f"device(s) {', '.join(gone)} of this run's {gpu} pool are gone (the host now lists "
                             f"{', '.join(f'{d.index}: {d.uuid}' for d in devices) or 'none'}); check nvidia-smi, "
                             f"then rerun the same command")
    if not devices:
        raise SpecpilotError(f"a {gpu} job, but this host has no visible {gpu} device (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="milliseconds")


def run_on_device(gpu: str, cmd: list[str], poll_s: float = 0.5) -> int:
    """Run ``cmd`` on one free ``gpu`` device of the pool (see the module docstring); its exit status.

    Raises:
        SpecpilotError: no command, no such device, a device of the run's pool gone, or the lock
            folder unusable.
    """
    if not cmd:
        raise SpecpilotError("no command to run (python -m specpilot.devices run --gpu GPU -- CMD ...)")
    devices = pool(gpu)
    check_pool(gpu, devices, os.environ.get(POOL_ENV))
    log = sys.stderr
    d, fd = acquire(devices, lock_dir(), poll_s,
                    on_wait=lambda: print(f"specpilot: all {len(devices)} {gpu} device(s) busy; waiting", file=log))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": d.uuid, INDEX_ENV: str(d.index), UUID_ENV: d.uuid, NAME_ENV: d.name}
    start = time.monotonic()
    print(f"specpilot: device {d.index} ({d.uuid}, {d.name}) taken at {_now()} by pid {os.getpid()} "
          f"on {socket.gethostname()}", file=log, flush=True)
    try:
        proc = subprocess.Popen(cmd, env=env, pass_fds=(fd,))  # the command holds the lock too
    except OSError as e:
        raise SpecpilotError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
    # SIGTERM/SIGHUP (Snakemake stopping the job) go on to the command; a terminal's SIGINT reaches
    # it directly (one process group), so the wrapper only waits for it to finish
    forwarded = {s: signal.signal(s, lambda sig, _f: proc.send_signal(sig)) for s in (signal.SIGTERM, signal.SIGHUP)}
    forwarded[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rc = proc.wait()
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)
        os.close(fd)
    print(f"specpilot: device {d.index} ({d.uuid}) released at {_now()} after {time.monotonic() - start:.1f} s "
          f"(exit {rc})", file=log, flush=True)
    return rc if rc >= 0 else 128 - rc


def device_identity() -> dict:
    """Which physical device this process computes on, for its records.

    Returns:
        ``{"device_index": int | None, "device_uuid": str | None, "device_name": str}``: from the
        wrapper's variables (``SPECPILOT_DEVICE_INDEX`` / ``_UUID`` / ``_NAME``) when the job runs
        through it; else CUDA device 0 as torch sees it (when torch is imported and CUDA is
        available; its ``nvidia-smi`` index is then unknown: None); else the CPU
        (``device_name`` ``"cpu"``).
    """
    if os.environ.get(UUID_ENV):
        index = os.environ.get(INDEX_ENV)
        return {"device_index": int(index) if index and index.isdigit() else None,
                "device_uuid": os.environ[UUID_ENV], "device_name": os.environ.get(NAME_ENV, "")}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        uuid = getattr(props, "uuid", None)
        return {"device_index": None, "device_uuid": f"GPU-{uuid}" if uuid is not None else None,
                "device_name": props.name}
    return {"device_index": None, "device_uuid": None, "device_name": "cpu"}


# ---- per-device speed: copy bandwidth, and the table's warning when one comparison mixes speeds ----

def measure_bandwidth(mib: int = 1024, iters: int = 10) -> float:
    """Copy bandwidth [bytes/s] of CUDA device 0 (the wrapper's device): a ``mib`` MiB bf16 buffer
    copied, median of ``iters`` calls (:func:`specpilot.tuning.timing.copy_bandwidth`, ``median_ms``)."""
    import torch

    from .tuning.timing import copy_bandwidth, median_ms

    a = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    return copy_bandwidth(a, lambda fn: median_ms(fn, iters=iters) / 1e3)


def measure_pool(gpu: str, out: str | Path, poll_s: float = 0.5) -> dict:
    """Copy bandwidth of every ``gpu`` device of the pool, each measured in a child process that
    holds that device's lock (so it waits for a job running there); written to ``out`` as
    ``{"gpu", "devices": [{"index", "uuid", "name", "copy_bandwidth"}]}`` [bytes/s], atomically.

    Raises:
        SpecpilotError: no ``gpu`` device, a device of the run's pool gone, or a measurement failed.
    """
    devices = pool(gpu)
    check_pool(gpu, devices, os.environ.get(POOL_ENV))
    rows = []
    for d in devices:
        _, fd = acquire([d], lock_dir(), poll_s)
        try:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": d.uuid}
            r = subprocess.run([sys.executable, "-c", "from specpilot.devices import measure_bandwidth as m; "
                                "print(m())"], env=env, capture_output=True, text=True, pass_fds=(fd,))
        finally:
            os.close(fd)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["no message"])[-1]
            raise SpecpilotError(f"measuring device {d.index} ({d.uuid}) failed: {why}")
        rows.append({**asdict(d), "copy_bandwidth": float(r.stdout.strip().splitlines()[-1])})
        print(f"device {d.index} ({d.uuid}, {d.name}): copy bandwidth {rows[-1]['copy_bandwidth'] / 1e9:.0f} GB/s")
    doc = {"gpu": gpu, "host": socket.gethostname(), "devices": rows}
    write_json(out, doc)
    return doc


def speed_warnings(records: list[dict], speeds: dict[str, float], tolerance: float = 0.03) -> list[str]:
    """Warnings for comparisons whose cells ran on devices of different speed.

    Args:
        records: raw record dicts with ``device_uuid`` (records without it are left out: CPU cells,
            older records), ``deployment``, ``benchmark``, ``concurrency``.
        speeds: device UUID -> copy bandwidth [bytes/s] (``results/{gpu}/devices.json``).
        tolerance: relative difference of copy bandwidth above which two devices differ in speed.
    Returns:
        One line per comparison mixing devices of different (or unknown) speed: a cell (its engines
        are compared with each other), a deployment's cells of one concurrency (its geomean row),
        every cell of one concurrency (the ``all`` row).
    """
    cells: dict[tuple, set[str]] = {}
    for r in records:
        if r.get("device_uuid"):
            cells.setdefault((r["deployment"], r["benchmark"], int(r["concurrency"])), set()).add(r["device_uuid"])
    groups: dict[str, dict[tuple, set[str]]] = {}
    for cell, uuids in cells.items():
        dep, bench, conc = cell
        groups.setdefault(f"cell {dep}/{bench}/c{conc}", {})[cell] = uuids
        groups.setdefault(f"{dep} at concurrency {conc} (its geomean row)", {})[cell] = uuids
        groups.setdefault(f"all deployments at concurrency {conc}", {})[cell] = uuids
    out = []
    for what, members in groups.items():
        used = sorted(set().union(*members.values()))
        if len(used) < 2:
            continue
        known = [speeds[u] for u in used if u in speeds]
        if len(known) == len(used) and max(known) <= min(known) * (1 + tolerance):
            continue
        desc = ", ".join(f"{u} ({speeds[u] / 1e9:.0f} GB/s)" if u in speeds else f"{u} (speed unknown)" for u in used)
        out.append(f"{what} ran on devices of different speed: {desc}; its speedups compare devices, not only "
                   f"engines (rerun those cells with one device, e.g. --resources gpu=1)")
    return out


def table_warnings(record_paths: list[str], devices_json: str | None) -> list[str]:
    """:func:`speed_warnings` for the table's records files and ``results/{gpu}/devices.json``
    (None: no speeds known, so any two devices in one comparison are named)."""
    speeds = {}
    if devices_json:
        speeds = {d["uuid"]: d["copy_bandwidth"] for d in read_json(devices_json)["devices"]}
    records = [r for p in record_paths for r in read_jsonl(p)]
    return speed_warnings(records, speeds)


# ---- command line ----

def main(argv: list[str] | None = None) -> int:
    """``python -m specpilot.devices {run,list,bandwidth}`` (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m specpilot.devices", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="run the command after -- on one free device of the pool")
    run.add_argument("--gpu", required=True, help="the {gpu} wildcard: devices of this normalized name")
    lst = sub.add_parser("list", help="print the pool (JSON)")
    lst.add_argument("--gpu", default=None)
    bw = sub.add_parser("bandwidth", help="copy bandwidth of every device of the pool")
    bw.add_argument("--gpu", required=True)
    bw.add_argument("--out", required=True, help="results/{gpu}/devices.json")
    args = parser.parse_args(argv)
    try:
        if args.what == "run":
            return run_on_device(args.gpu, cmd)
        if args.what == "list":
            print(json.dumps([asdict(d) for d in (pool(args.gpu) if args.gpu else host_devices())]))
            return 0
        measure_pool(args.gpu, args.out)
        return 0
    except SpecpilotError as e:
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``specpilot kernels``: per-GPU kernel build and tuning output under ``results/{gpu}/kernels/``.

This step writes ``manifest.json``. On CPU it records that no GPU kernels apply. On a GPU it
records the device and, until the 12-bit / kernel-tuning work adds entries, that no tuned configs
exist yet. That work calls :func:`register_kernel_results` to add its own entry to the manifest.

Manifest fields: ``gpu``, ``device_name``, ``applies`` (bool), ``note``, ``torch``, ``cuda``,
``timestamp``, ``kernels`` (name -> payload dict, one per registered kernel result).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import os
from pathlib import Path
from typing import Any

from .errors import SpecpilotError
from .io import read_json, write_json

MANIFEST = "manifest.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", required=True, help="the {gpu} wildcard: cpu, h100, h200, ...")
    parser.add_argument("--out-dir", required=True, help="output folder, e.g. results/{gpu}/kernels")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def _locked(out_dir: Path):
    """Hold an exclusive lock on ``{out_dir}/.manifest.lock`` (concurrent registrations)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".manifest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def base_manifest(gpu: str) -> dict[str, Any]:
    """The manifest for ``gpu`` before any kernel results are registered.

    Raises:
        SpecpilotError: ``gpu`` is not ``cpu`` but this machine has no CUDA device, or a different one.
    """
    import torch

    manifest: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__, "timestamp": _now()}
    if gpu == "cpu":
        manifest.update(device_name="cpu", cuda=None, applies=False,
                        note="no GPU kernels apply on cpu; the engines use plain torch ops")
    else:
        from .device import detect_gpu

        if not torch.cuda.is_available():
            raise SpecpilotError(f"--gpu {gpu} given but torch sees no CUDA device on this machine")
        found = detect_gpu()
        if found != gpu:
            raise SpecpilotError(f"this machine's GPU is {found!r}, not {gpu!r}")
        manifest.update(device_name=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                        applies=True, note="no tuned kernel configs yet")
    manifest["kernels"] = {}
    return manifest


def register_kernel_results(out_dir: str | os.PathLike, name: str, payload: dict[str, Any]) -> Path:
    """Add (or replace) the entry ``name`` in ``{out_dir}/manifest.json``; returns the manifest path.

    For the kernel build / tuning steps: ``payload`` is any JSON-serializable dict (tuned configs,
    build flags, timings, paths of files written beside the manifest). The write is atomic and
    serialized by a lock file, so several steps may register at once. A missing manifest is an
    error: ``specpilot kernels`` writes it first.
    """
    out_dir = Path(out_dir)
    if not name or "/" in name:
        raise SpecpilotError(f"kernel result name must be non-empty without '/': {name!r}")
    if not isinstance(payload, dict):
        raise SpecpilotError(f"kernel result payload for {name!r} must be a dict, got {type(payload).__name__}")
    path = out_dir / MANIFEST
    with _locked(out_dir):
        manifest = read_json(path)
        manifest.setdefault("kernels", {})[name] = {**payload, "registered": _now()}
        if manifest.get("applies"):
            manifest["note"] = f"{len(manifest['kernels'])} kernel result(s) registered"
        write_json(path, manifest)
    return path


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    manifest = base_manifest(args.gpu)
    with _locked(out_dir):
        write_json(out_dir / MANIFEST, manifest)
    print(f"{args.gpu}: {manifest['note']} -> {out_dir / MANIFEST}")
    return 0

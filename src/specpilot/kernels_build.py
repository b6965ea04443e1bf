"""``specpilot kernels``: the per-GPU kernel manifest under ``results/{gpu}/kernels/``, and the
function that puts the per-GPU kernel outputs to use in an engine process.

``manifest.json`` records the device and which tuned kernel tables shipped with the package
(``specpilot/kernels/tuned/<kind>_<gpu>.json``) apply to it. On CPU it records that no GPU kernels
apply. The kernel sub-agent (:mod:`specpilot.agent.kernel_agent`) writes its own file beside it
per deployment; :func:`use_kernel_outputs` reads both.

Manifest fields: ``gpu``, ``device_name``, ``applies`` (bool), ``note``, ``torch``, ``cuda``,
``timestamp``, ``kernels`` (kind -> {``table``: packaged file name, ``entries``: tuned shapes}).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from .errors import SpecpilotError
from .io import read_json, write_json

MANIFEST = "manifest.json"
TUNED_KINDS = ("w12",)  # tables the engine installs (kernels/tuned/<kind>_<gpu>.json)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", required=True, help="the {gpu} wildcard: cpu, h100, h200, ...")
    parser.add_argument("--out-dir", required=True, help="output folder, e.g. results/{gpu}/kernels")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def packaged_tables(gpu: str) -> dict[str, dict]:
    """Tuned tables shipped for ``gpu``: kind -> {table: file name, entries: number of tuned shapes}."""
    out = {}
    for kind in TUNED_KINDS:
        f = files("specpilot") / "kernels" / "tuned" / f"{kind}_{gpu}.json"
        if f.is_file():
            out[kind] = {"table": f.name, "entries": len(json.loads(f.read_text()).get("configs", {}))}
    return out


def base_manifest(gpu: str) -> dict[str, Any]:
    """The manifest for ``gpu``: the device, and the packaged tuned tables that apply to it.

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
        tables = packaged_tables(gpu)
        manifest.update(device_name=torch.cuda.get_device_name(0), cuda=torch.version.cuda, applies=True,
                        note=f"packaged tuned tables: {', '.join(tables) or 'none'} (else heuristic configs)")
        manifest["kernels"] = tables
        return manifest
    manifest["kernels"] = {}
    return manifest


def use_kernel_outputs(manifest_path: str | None, agent_path: str | None) -> dict[str, Any]:
    """Install the per-GPU kernel outputs in this process; returns what ``engine_config["kernels"]`` records.

    ``manifest_path``: ``results/{gpu}/kernels/manifest.json``; ``agent_path``: the kernel
    sub-agent's ``kernel-agent.json`` of the deployment (either may be None: nothing applies). On a
    GPU the packaged w12 table for that GPU, overridden by the sub-agent's winners, becomes the w12
    kernels' tuned table (:func:`specpilot.kernels.w12_triton.set_tuned`).

    Returns:
        ``{"applies": False, "reason": str}``, or ``{"applies": True, "gpu", "w12_tuned": number of
        tuned shapes installed, "w12_from_agent": how many came from the sub-agent, "agent": its
        reason when it did not apply}``.

    Raises:
        SpecpilotError: a file is missing or not JSON, or the two files name different GPUs.
    """
    if manifest_path is None:
        return {"applies": False, "reason": "no kernel manifest given"}
    m = read_json(manifest_path)
    agent = read_json(agent_path) if agent_path else {"applies": False, "configs": {},
                                                      "reason": "no kernel sub-agent output given"}
    if agent_path and agent.get("gpu") != m.get("gpu"):
        raise SpecpilotError(f"{agent_path} is for gpu {agent.get('gpu')!r}, {manifest_path} for {m.get('gpu')!r}")
    if not m.get("applies"):
        return {"applies": False, "reason": m.get("note", "")}
    table: dict[str, dict] = {}
    w12 = m.get("kernels", {}).get("w12")
    if w12:
        table.update(json.loads((files("specpilot") / "kernels" / "tuned" / w12["table"]).read_text())["configs"])
    table.update(agent.get("configs") or {})
    out = {"applies": True, "gpu": m["gpu"], "w12_tuned": len(table), "w12_from_agent": len(agent.get("configs") or {})}
    if not agent.get("applies"):
        out["agent"] = agent.get("reason", "")
    if table:
        try:
            from .kernels import w12_triton
        except ImportError as e:
            return {**out, "w12_tuned": 0, "reason": f"Triton kernels unavailable: {e}"}
        w12_triton.set_tuned(table)
    return out


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    manifest = base_manifest(args.gpu)
    write_json(out_dir / MANIFEST, manifest)
    print(f"{args.gpu}: {manifest['note']} -> {out_dir / MANIFEST}")
    return 0

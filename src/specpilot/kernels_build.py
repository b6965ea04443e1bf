"""``specpilot kernels``: the per-GPU kernel manifest under ``results/{gpu}/kernels/``, and the
functions that put the per-GPU kernel outputs to use in an engine process.

``manifest.json`` records the device and which tuned kernel tables shipped with the package
(``specpilot/kernels/tuned/<kind>_<gpu>.json``) apply to it. On CPU it records that no GPU kernels
apply. The kernel sub-agent (:mod:`specpilot.agent.kernel_agent`) writes its own file beside it
per deployment (``kernel-agent.json``: tuned w12 configs, and ``engine_configs``, the entries of
the bf16 Triton step's matmul tables it found faster on this GPU); :func:`use_kernel_outputs`
reads both and installs the w12 table, :func:`engine_tables` merges the engine entries with
``DEFAULT_CONFIGS`` (and an explicit ``--kernel-configs`` file on top) for a target's backend to
install (:meth:`specpilot.engine.backend.Backend.install_tables`), as ``specpilot run``,
``specpilot force`` and the round steps do.

Manifest fields: ``gpu``, ``device_name``, ``applies`` (bool), ``note``, ``torch``, ``cuda``,
``timestamp``, ``kernels`` (kind -> {``table``: packaged file name, ``entries``: tuned shapes}).
The sub-agent's ``w12_choice`` (which matmul roles the fast path holds in 12 bits and at which
row counts they run the 12-bit loader, :mod:`specpilot.fastpath.w12`) is validated here;
:func:`w12_choice_for` hands it (or every role, when the sub-agent did not tune one) to the
backend decision of a target loaded with ``weight_format: w12`` and ``w12_fast``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from .device import detect_gpu
from .engine.config import EngineConfig
from .errors import SpecpilotError
from .fastpath.cpu_linear import set_matmul
from .fastpath.tables import DEFAULT_CONFIGS, LINEAR_ROLES, LinearConfig
from .fastpath.w12 import choice_json, every_role, parse_choice
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
    manifest: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__, "timestamp": _now()}
    if gpu == "cpu":
        manifest.update(device_name="cpu", cuda=None, applies=False,
                        note="no GPU kernels apply on cpu; the engines use plain torch ops")
    else:
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


def check_engine_configs(configs: Any, where: str = "kernel-agent.json") -> dict[str, dict[str, str]]:
    """Validate the ``engine_configs`` of a kernel-agent.json: ``{role: {max_rows: config key}}``.

    Roles must be the engine's matmul roles (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``),
    ``max_rows`` integers >= 1 (JSON strings of them), keys strings that
    :meth:`specpilot.fastpath.tables.LinearConfig.parse` accepts (Triton configs only: the
    sub-agent never writes ``"cublas"``). Returns a normalized copy (``max_rows`` as ``str(int)``).

    Raises:
        SpecpilotError: naming ``where`` and the bad role, row count or key.
    """
    if configs is None:
        return {}
    if not isinstance(configs, dict):
        raise SpecpilotError(f"{where}: engine_configs must be an object {{role: {{max_rows: key}}}}, "
                             f"got {type(configs).__name__}")
    out: dict[str, dict[str, str]] = {}
    for role, table in configs.items():
        if role not in LINEAR_ROLES:
            raise SpecpilotError(f"{where}: engine_configs names unknown matmul role {role!r}; "
                                 f"roles: {', '.join(LINEAR_ROLES)}")
        if not isinstance(table, dict):
            raise SpecpilotError(f"{where}: engine_configs[{role!r}] must be an object {{max_rows: key}}, "
                                 f"got {table!r}")
        entries = {}
        for rows, key in table.items():
            try:
                n = int(rows)
            except (TypeError, ValueError):
                n = 0
            if n < 1 or str(rows).strip() != str(n):
                raise SpecpilotError(f"{where}: engine_configs[{role!r}] has row count {rows!r}; "
                                     "row counts must be integers >= 1")
            if not isinstance(key, str):
                raise SpecpilotError(f"{where}: engine_configs[{role!r}][{rows!r}] = {key!r} is not a config key")
            try:
                LinearConfig.parse(key)
            except ValueError as e:
                raise SpecpilotError(f"{where}: engine_configs[{role!r}][{rows!r}] = {key!r}: {e}") from None
            entries[str(n)] = key
        if entries:
            out[role] = entries
    return out


def agent_engine_configs(agent_path: str | None) -> dict[str, dict[str, str]]:
    """The validated ``engine_configs`` of a kernel-agent.json (``{}`` for None, or a file without
    them, e.g. one written on CPU). Raises SpecpilotError for a missing, corrupt or malformed file."""
    if not agent_path:
        return {}
    agent = read_json(agent_path)
    if not isinstance(agent, dict):
        raise SpecpilotError(f"{agent_path} must hold a JSON object")
    return check_engine_configs(agent.get("engine_configs"), str(agent_path))


def engine_tables(engine_configs: dict | None, explicit: dict | None = None) -> dict:
    """The configs to install in a target's Triton step (:meth:`~specpilot.engine.backend.Backend.install_tables`).

    ``engine_configs``: the sub-agent's entries ``{role: {max_rows: key}}``; each role named gets
    its whole table, ``DEFAULT_CONFIGS[role]`` with those entries replaced (``set_configs`` replaces
    a role's table as a whole). ``explicit``: a ``--kernel-configs`` file's content ``{role: key or
    table}`` (or ``attn_rows``), on top: a role it names takes its value as given. Returns ``{}``
    when neither names anything (nothing to install).
    """
    out: dict = {role: {**DEFAULT_CONFIGS[role], **{str(k): v for k, v in entries.items()}}
                 for role, entries in (engine_configs or {}).items() if entries}
    out.update(explicit or {})
    return out


def use_kernel_outputs(manifest_path: str | None, agent_path: str | None) -> dict[str, Any]:
    """Install the per-GPU kernel outputs in this process; returns what ``engine_config["kernels"]`` records.

    ``manifest_path``: ``results/{gpu}/kernels/manifest.json``; ``agent_path``: the kernel
    sub-agent's ``kernel-agent.json`` of the deployment (either may be None: nothing applies). On a
    GPU the packaged w12 table for that GPU, overridden by the sub-agent's winners, becomes the w12
    kernels' tuned table (:func:`specpilot.kernels.w12_triton.set_tuned`). The sub-agent's
    ``engine_configs`` are validated (:func:`check_engine_configs`) and returned, not installed:
    they go into a target's step (:func:`engine_tables`, :meth:`~specpilot.engine.backend.Backend.install_tables`).

    Returns:
        ``{"applies": False, "reason": str}`` (on the CPU with ``"cpu": {"verify_path", "draft_path",
        "context_path", "matmul"}``, the step paths and the matmul kernel the sub-agent chose, when its output has them;
        the kernel is installed for the fused CPU steps, :func:`specpilot.fastpath.cpu_linear.set_matmul`), or ``{"applies": True, "gpu", "w12_tuned": number of
        tuned shapes installed, "w12_from_agent": how many came from the sub-agent,
        "engine_configs": the sub-agent's engine matmul entries {role: {max_rows: key}} (those that
        differ from DEFAULT_CONFIGS; may be empty), "engine_from_agent": their number, "agent": its
        reason when it did not apply}``.

    Raises:
        SpecpilotError: a file is missing or not JSON, the two files name different GPUs, or the
            sub-agent's engine_configs are malformed (named).
    """
    if manifest_path is None:
        return {"applies": False, "reason": "no kernel manifest given"}
    m = read_json(manifest_path)
    agent = read_json(agent_path) if agent_path else {"applies": False, "configs": {},
                                                      "reason": "no kernel sub-agent output given"}
    if agent_path and agent.get("gpu") != m.get("gpu"):
        raise SpecpilotError(f"{agent_path} is for gpu {agent.get('gpu')!r}, {manifest_path} for {m.get('gpu')!r}")
    engine = check_engine_configs(agent.get("engine_configs"), str(agent_path))
    drafter_engine = check_engine_configs(agent.get("drafter_engine_configs"), f"{agent_path} (drafter_engine_configs)")
    w12_choice = agent_w12_choice(agent, str(agent_path))
    cpu = agent.get("cpu")
    if not m.get("applies"):
        out = {"applies": False, "reason": m.get("note", "")}
        if cpu:  # the CPU step paths the sub-agent chose (agent.kernel_cpu; the rounds' directions read them)
            out["cpu"] = {k: cpu.get(k, d) for k, d in (("verify_path", "plain"), ("draft_path", "plain"),
                                                          ("context_path", "plain"), ("matmul", "aten"))}
            set_matmul(out["cpu"]["matmul"])  # the fused CPU steps' matmul kernel, process-wide
        return out
    table: dict[str, dict] = {}
    w12 = m.get("kernels", {}).get("w12")
    if w12:
        table.update(json.loads((files("specpilot") / "kernels" / "tuned" / w12["table"]).read_text())["configs"])
    table.update(agent.get("configs") or {})
    out = {"applies": True, "gpu": m["gpu"], "w12_tuned": len(table), "w12_from_agent": len(agent.get("configs") or {}),
           "engine_configs": engine, "engine_from_agent": sum(len(v) for v in engine.values()),
           "drafter_engine_configs": drafter_engine,
           "w12_choice": w12_choice}
    if not agent.get("applies"):
        out["agent"] = agent.get("reason", "")
    if table:
        try:
            from .kernels import w12_triton
        except ImportError as e:
            return {**out, "w12_tuned": 0, "reason": f"Triton kernels unavailable: {e}"}
        w12_triton.set_tuned(table)
    return out


def agent_w12_choice(agent: dict, where: str) -> dict:
    """The validated ``w12_choice`` of a kernel-agent.json's content (``{}`` when absent), in its
    JSON form normalized (:func:`specpilot.fastpath.w12.parse_choice`, then ``choice_json``).

    Raises:
        SpecpilotError: a malformed choice, naming ``where``."""
    if not agent.get("w12_choice"):
        return {}
    return choice_json(parse_choice(agent["w12_choice"], f"{where}: w12_choice"))


def w12_choice_for(kernel_outputs: dict, config: EngineConfig) -> dict[str, tuple] | None:
    """The w12 roles of a target of engine ``config`` (``weight_format: w12`` with ``w12_fast``,
    the default): the kernel sub-agent's ``kernel_outputs["w12_choice"]`` (from
    :func:`use_kernel_outputs`) parsed, else every role at every row count (the 12-bit loader
    gives the bf16 bits, so the choice is only about speed); None for another weight format or
    ``w12_fast: false`` (the eager 12-bit linear layers, decoded exactly). The backend installs it
    (:func:`~specpilot.engine.backend.choose_backend`)."""
    if config.weight_format != "w12" or not config.w12_fast:
        return None
    choice = kernel_outputs.get("w12_choice")
    return parse_choice(choice, "w12_choice") if choice else every_role()


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    manifest = base_manifest(args.gpu)
    write_json(out_dir / MANIFEST, manifest)
    print(f"{args.gpu}: {manifest['note']} -> {out_dir / MANIFEST}")
    return 0

"""The engine ``specpilot serve`` serves: one deployment's engine loaded as ``specpilot run`` loads it.

:func:`deployment_files` finds a deployment's files in a finished workflow run by name (the one
function that knows the workflow's layout); :class:`ServedEngine` loads them through the same
functions as ``specpilot run`` (:func:`specpilot.engine.cli.engine_specs`: the engine config and
block; :func:`specpilot.kernels_build.use_kernel_outputs`: the kernel manifest and the kernel
sub-agent's choice; :func:`specpilot.engine.cli.load_deployments`: target, drafter, dtype, weight
format, backend, matmul tables) and serves it with an
:class:`~specpilot.engine.online.OnlineScheduler` of ``slots`` slots built as a closed-loop cell
builds its scheduler (:func:`specpilot.engine.serve.continuous_engine`). :class:`RecordWriter`
writes the served requests as records of the workflow's schema plus the prompt file token
forcing reads (``--record DIR``).
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import yaml

from ..engine import cli as run_cli
from ..engine.online import OnlineScheduler
from ..engine.serve import ServeOptions, continuous_engine, to_record
from ..device import detect_gpu
from ..errors import SpecpilotError
from ..io import read_json, read_jsonl, write_jsonl
from ..kernels_build import use_kernel_outputs
from ..prompts import load_tokenizer
from ..records import Record, read_records, write_records
from ..regimes import SINGLE, regime_of, resolve

DEFAULT_MAX_SEQ = 4096  # KV-cache slots per request when --max-seq is not given (capped at the target's positions)


@dataclass
class EngineFiles:
    """What loads one deployment's engine (the flags ``specpilot run`` gets in a workflow cell)."""

    deployment: str
    target: str
    drafter: str | None = None
    drafter_name: str = "dflash"
    target_name: str | None = None
    engine_config: str | None = None
    kernels_manifest: str | None = None
    kernel_agent: str | None = None
    block_size: str = "auto"
    weight_format: str | None = None
    dtype: str = "auto"
    regime: str | None = None  # the serving regime whose engine config this is (by name)


def run_regimes(results: str | Path, config: str | Path = "config/config.yaml") -> tuple[dict[str, dict], str]:
    """The serving regimes of a finished run (:mod:`specpilot.regimes`): name -> ``{tune, cells}``
    in memory order, and where they were read (said at start-up).

    What the run left in ``results`` decides: the table's ``regime`` column gives each regime's
    cell concurrencies, the regimes' ``{results}/*/{regime}/specpilot.json`` (``tuned_concurrency``)
    their tunes (else the config's, else the smallest cell). Without a table with that column (a
    run from before regimes, or one not finished to its table), the run's config file ``config``
    (:func:`specpilot.regimes.resolve`).

    Raises:
        SpecpilotError: neither gives regimes, or they break :func:`specpilot.regimes.resolve`'s rules.
    """
    results = Path(results)
    cfg = yaml.safe_load(Path(config).read_text()) if Path(config).is_file() else None
    table = results / "table.csv"
    cells: dict[str, set[int]] = {}
    if table.is_file():
        t = pd.read_csv(table)
        if "regime" in t.columns:
            for r, c in zip(t["regime"], t["concurrency"]):
                if isinstance(r, str) and pd.notna(c):
                    cells.setdefault(r, set()).add(int(c))
    if not cells:
        if cfg is None:
            raise SpecpilotError(f"{table} has no regime column and {config} is not a file: the run's serving "
                                 f"regimes are unknown (give --config, the run's workflow config)")
        return resolve(cfg), f"config {config} ({table} has no regime column)"
    known = {}
    if cfg is not None:
        try:
            known = resolve(cfg)
        except SpecpilotError:
            known = {}
    given = {}
    for name, cs in cells.items():
        tune = None
        for f in sorted(results.glob(f"*/{name}/specpilot.json")):
            tune = read_json(f).get("tuned_concurrency")
            if tune:
                break
        given[name] = {"tune": int(tune or known.get(name, {}).get("tune") or min(cs)), "cells": sorted(cs)}
    order = sorted(given, key=lambda n: given[n]["tune"])
    return resolve({"regimes": {n: given[n] for n in order}}), f"{table} (regime column) and the regimes' specpilot.json"


def serving_regime(regimes: dict[str, dict], concurrency: int) -> tuple[str, str | None]:
    """The regime whose engine serves ``concurrency`` slots: the one whose cells include it
    (:func:`specpilot.regimes.regime_of`); else the one whose tune is nearest (the smaller on a
    tie), with a note saying so (None when the concurrency is a cell)."""
    by_cell = regime_of(regimes)
    if concurrency in by_cell:
        return by_cell[concurrency], None
    name = min(regimes, key=lambda n: (abs(regimes[n]["tune"] - concurrency), regimes[n]["tune"]))
    cells = "; ".join(f"{n}: {', '.join(map(str, r['cells']))}" for n, r in regimes.items())
    return name, (f"--max-concurrency {concurrency} is no cell concurrency of the run ({cells}): serving regime "
                  f"{name!r}, tuned at c{regimes[name]['tune']}, the nearest tune")


def deployment_files(name: str, results: str | Path, config: str | Path = "config/config.yaml",
                     regime: str = SINGLE) -> EngineFiles:
    """A deployment's files in a finished workflow run, by name and serving regime (unchecked: the
    caller puts explicit paths on top, then :func:`check_files`): ``config`` (the run's config)
    gives its target, drafter, block and weight format; the checkpoints are under
    ``resources/deployments/`` of the run's folder (the parent of ``results/``), the tiny
    deployments sharing one build (``tiny``, ``tiny-hybrid``, ``tiny-muse``); the engine config is
    the regime's ``{results}/{name}/{regime}/specpilot.json`` (the regime's last round's), the
    kernels ``{results}/kernels/manifest.json`` and ``{results}/kernels/{name}/{regime}/kernel-agent.json``
    (the layout of ``rules/common.smk``: ``engine_config_path``, ``kernel_agent_path``).

    Raises:
        SpecpilotError: the config lacks the deployment.
    """
    results = Path(results)
    cfg = yaml.safe_load(Path(config).read_text()) if Path(config).is_file() else None
    deps = (cfg or {}).get("deployments") or {}
    if name not in deps:
        raise SpecpilotError(f"deployment {name!r} is not in {config} (deployments: {', '.join(deps) or 'none'})")
    d = deps[name]
    kind = d.get("tiny_kind", "dense")
    folder = ("tiny" if kind == "dense" else f"tiny-{kind}") if d["target"] == "tiny" else name
    base = run_root(results) / "resources" / "deployments" / folder
    return EngineFiles(deployment=name, target=str(base / "target"), drafter=str(base / f"drafter-{d['drafter']}"),
                       drafter_name=d["drafter"], target_name=d["target"],
                       engine_config=str(results / name / regime / "specpilot.json"),
                       kernels_manifest=str(results / "kernels" / "manifest.json"),
                       kernel_agent=str(results / "kernels" / name / regime / "kernel-agent.json"),
                       block_size=str(d.get("block_size", "auto")),
                       weight_format="w12" if d.get("weight_format") == "w12" else None,
                       dtype="fp32" if d.get("weight_format") == "fp32" else "bf16", regime=regime)


def run_root(results: str | Path) -> Path:
    """The run's folder: the parent of ``results/`` in ``results/{gpu}``."""
    return Path(results).resolve().parent.parent


def check_files(files: EngineFiles, engine: str, where: str) -> None:
    """Every file ``engine`` loads exists (the engine config only for ``specpilot``).

    Raises:
        SpecpilotError: the first missing one, named (``where``: the run's folder, for the hint)."""
    needed = ["target", "drafter", "kernels_manifest", "kernel_agent"] + (["engine_config"] if engine == "specpilot"
                                                                           else [])
    for what in needed:
        path = getattr(files, what)
        if path and not Path(path).exists():
            raise SpecpilotError(f"deployment {files.deployment!r}: {path} not found (is the workflow run in {where} "
                                 f"finished? give --{what.replace('_', '-')} to use another file)")


def best_deployment(results: str | Path, regime: str | None = None, concurrency: int | None = None) -> str:
    """The deployment of a finished run with the highest ``specpilot_speedup`` over AR in its
    table (``{results}/table.csv``): the per-deployment ``geomean`` rows of ``regime`` (the
    table's ``regime`` column; all rows of a table without one) at ``concurrency`` when the
    table has rows there, else at the regime's smallest concurrency.

    Raises:
        SpecpilotError: the table is missing or has no such value (named)."""
    path = Path(results) / "table.csv"
    if not path.is_file():
        raise SpecpilotError(f"{path} not found: --deployment best needs a finished workflow run's table")
    t = pd.read_csv(path)
    t = t[(t["benchmark"] == "geomean") & (t["deployment"] != "all") & t["specpilot_speedup"].notna()]
    if regime is not None and "regime" in t.columns:
        t = t[t["regime"] == regime]
    if len(t):
        at = t[t["concurrency"] == concurrency]
        t = at if len(at) else t[t["concurrency"] == t["concurrency"].min()]
    if not len(t):
        where = f" of regime {regime!r}" if regime is not None else ""
        raise SpecpilotError(f"{path} has no deployment{where} with a specpilot speedup (forcing failed or not run)")
    return str(t.loc[t["specpilot_speedup"].idxmax(), "deployment"])


def run_args(files: EngineFiles, engine: str, device: str, threads: int, graphs: str) -> argparse.Namespace:
    """The ``specpilot run`` arguments that load ``files`` with ``engine`` (its parser's defaults
    for the rest), so that the server loads exactly what a workflow cell loads."""
    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    argv = ["--engine", engine, "--target", files.target, "--prompts", "-", "--out", "-",
            "--deployment", files.deployment, "--drafter-name", files.drafter_name, "--block-size", files.block_size,
            "--device", device, "--dtype", files.dtype, "--threads", str(threads), "--graphs", graphs,
            "--gpu", "cpu" if device == "cpu" else detect_gpu()]
    for flag, value in (("--drafter", files.drafter), ("--target-name", files.target_name),
                        ("--engine-config", files.engine_config if engine == "specpilot" else None),
                        ("--kernels-manifest", files.kernels_manifest), ("--kernel-agent", files.kernel_agent),
                        ("--weight-format", files.weight_format)):
        if value:
            argv += [flag, value]
    return p.parse_args(argv)


class ServedEngine:
    """One deployment's engine and its online scheduler (module docstring).

    Args:
        files: what to load; engine: ``specpilot`` (needs ``files.engine_config``), ``stock`` or ``ar``.
        slots: requests decoded together (the concurrency the engine serves, ``--max-concurrency``).
        max_seq: KV-cache slots per request (the context: prompt + new tokens + verify width);
            None = :data:`DEFAULT_MAX_SEQ` capped at the target's ``max_position_embeddings``.
        max_queue: requests that may wait for a slot; device, threads, graphs: as ``specpilot run``.
    Raises:
        SpecpilotError: as ``specpilot run`` for the engine config, kernels and checkpoints; bad
            ``slots`` or ``max_seq``.
    """

    def __init__(self, files: EngineFiles, engine: str = "specpilot", slots: int = 1, max_seq: int | None = None,
                 max_queue: int = 64, device: str = "auto", threads: int = 0, graphs: str = "auto",
                 prefill_chunk: int | None = None):
        if engine == "specpilot" and not files.engine_config:
            raise SpecpilotError("engine specpilot needs an engine config (--engine-config, or --deployment with "
                                 "--results)")
        if slots < 1:
            raise SpecpilotError(f"--max-concurrency must be >= 1, got {slots}")
        self.args = args = run_args(files, engine, device, threads, graphs)
        if threads:
            torch.set_num_threads(threads)
        self.files, self.engine = files, engine
        self.spec = run_cli.engine_specs(args)[0]
        self.kernel_outputs = use_kernel_outputs(args.kernels_manifest, args.kernel_agent)
        self.dep = run_cli.load_deployments(args, [self.spec], self.kernel_outputs)[self.spec.config.weight_format]
        limit = int(self.dep.target.config.max_position_embeddings)
        if max_seq is not None and not 1 <= max_seq <= limit:
            raise SpecpilotError(f"--max-seq must be in 1..{limit} (the target's max_position_embeddings), got {max_seq}")
        self.max_seq = max_seq or min(DEFAULT_MAX_SEQ, limit)
        self.slots = slots
        proposer, runner = continuous_engine(self.spec, self.dep, slots, self.max_seq)
        self.scheduler = OnlineScheduler(runner, proposer, accept=self.spec.accept, eos_id=self.dep.eos_id,
                                         max_queue=max_queue, prefill_chunk=prefill_chunk, overlap=self.spec.overlap)
        self.tokenizer = load_tokenizer(files.target)

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward of the served engine (its proposer's width; 1 for AR)."""
        return int(self.scheduler.verify_width)

    def room(self, prompt_len: int) -> int:
        """New tokens the context leaves after a prompt of ``prompt_len`` tokens: a request needs
        prompt + budget - 2 + verify width (+ 1 with several slots) KV-cache slots
        (:func:`specpilot.engine.scheduler.slots_needed`)."""
        return self.max_seq - prompt_len + 2 - self.verify_width - (1 if self.slots > 1 else 0)

    def start(self) -> None:
        """Warm the engine up and start its thread (:meth:`OnlineScheduler.start`)."""
        self.scheduler.start(self.tokenizer("Hello", add_special_tokens=False)["input_ids"][:8] or [1])

    def record(self, request_id: str, prompt_ids: list[int], result, served: dict, ignore_eos: bool) -> Record:
        """A served request as a record of the workflow's schema (as a cell's, at the server's
        concurrency), with its own budget, EOS token and what the server answered (``served``)."""
        meta = {"deployment": self.files.deployment, "target": self.files.target_name or self.files.target,
                "drafter": self.files.drafter_name, "gpu": self.args.gpu}
        row = {"request_id": request_id, "benchmark": "served", "prompt_ids": prompt_ids}
        rec = to_record(self.spec, row, result, self.slots, meta, ServeOptions(), self.dep.backend.path)
        manifest = self.args.kernels_manifest or self.args.kernel_agent
        run_cli.stamp_records([rec], self.dep, self.kernel_outputs if manifest else None)
        rec.max_new_tokens = served.pop("max_new_tokens")
        rec.eos_id = None if ignore_eos else self.dep.eos_id
        rec.served = served
        return rec


class RecordWriter:
    """``--record DIR``: ``DIR/records.jsonl`` (the served requests' records) and
    ``DIR/prompts.jsonl`` (their prompts, the file ``specpilot force --prompts`` reads), both
    rewritten atomically as each request finishes; a server restarted on the same folder
    continues its request ids (``served/000000``, ...)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.records_path, self.prompts_path = self.folder / "records.jsonl", self.folder / "prompts.jsonl"
        self.records = read_records(self.records_path) if self.records_path.is_file() else []
        self.prompts = read_jsonl(self.prompts_path) if self.prompts_path.is_file() else []
        self._lock = threading.Lock()
        self._next = len(self.prompts)

    def new_id(self) -> str:
        """A request id not used in this folder."""
        with self._lock:
            i, self._next = self._next, self._next + 1
        return f"served/{i:06d}"

    def add(self, record: Record, prompt_ids: list[int]) -> None:
        """Add one finished request (and its prompt) and rewrite both files."""
        row = {"request_id": record.request_id, "benchmark": record.benchmark, "prompt_ids": list(prompt_ids)}
        with self._lock:
            self.records.append(record)
            self.prompts.append(row)
            write_jsonl(self.prompts_path, self.prompts)
            write_records(self.records_path, self.records)

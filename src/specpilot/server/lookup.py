"""A deployment's files in a finished workflow run, by name and serving regime (``specpilot serve
--deployment NAME|best --results results/{gpu}``): the one place of the server that knows the
workflow's result layout (``rules/common.smk``: ``engine_config_path``, ``kernel_agent_path``).

:func:`run_regimes` reads the run's serving regimes from what it left in ``results/{gpu}``,
:func:`serving_regime` picks the one serving a concurrency, :func:`best_deployment` the best
deployment in that regime's table rows, :func:`deployment_files` the files (unchecked, so that
explicit paths go on top first) and :func:`check_files` checks them. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from ..errors import SpecpilotError
from ..io import read_json
from ..regimes import SINGLE, regime_of, resolve


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



"""Serving regimes: what a deployment is tuned for (issue 53).

A deployment is tuned per serving regime: a regime is a name, the concurrency its agent rounds
tune at (``tune``) and the cell concurrencies its engine serves (``cells``). Each (deployment,
regime) has its own calibration prompts, kernel sub-agent, rounds, engine config and cells
(``results/{gpu}/{deployment}/{regime}/...``); the study table has a row per deployment x regime x
cell concurrency x benchmark.

Config (checked at planning time, :func:`resolve`): the ``single`` regime is derived from today's
keys, ``{tune: rounds.concurrency, cells: concurrency}``, unless ``regimes.single`` is given; the
other regimes come from config ``regimes`` in their order, e.g.::

    regimes:
      batched: {tune: 16, cells: [16, 20, 24]}

so an old config is one ``single`` regime, and a regime added with ``--configfile`` joins the end
(the regimes before it keep their jobs). The regimes' order is the memory order: a later regime's
round starts from the earlier regimes' validated entries; ``tune`` must rise along it. A cell
concurrency belongs to one regime (the table's ``regime`` column is a function of it).

Torch-free: the workflow imports it while planning.
"""

from __future__ import annotations

import math
import re

from .errors import SpecpilotError

SINGLE = "single"
NAME = re.compile(r"^[a-z][a-z0-9_]*$")
KEYS = ("tune", "cells", "directions", "engine_rows", "max_new_tokens")
# the rounds' calibration requests per regime: at least this many times its tuned concurrency (two
# full waves of the batch), spread over the benchmarks
CALIBRATION_WAVES = 2


def _positive_ints(value, where: str) -> list[int]:
    if not isinstance(value, list) or not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                       for v in value):
        raise SpecpilotError(f"config {where}: {value!r} is not a list of positive integers")
    if len(set(value)) != len(value):
        raise SpecpilotError(f"config {where}: {value!r} lists a concurrency twice")
    return [int(v) for v in value]


def _one(name, spec, where: str) -> dict:
    """One regime's settings checked (``where``: its config key)."""
    if not isinstance(name, str) or not NAME.match(name):
        raise SpecpilotError(f"config regimes: regime name {name!r} must match {NAME.pattern} (e.g. single, batched)")
    if not isinstance(spec, dict):
        raise SpecpilotError(f"config {where}: {spec!r} is not a mapping such as {{tune: 16, cells: [16]}}")
    unknown = [k for k in spec if k not in KEYS]
    if unknown:
        raise SpecpilotError(f"config {where}: unknown key {unknown[0]!r}; valid keys here: {', '.join(KEYS)}")
    for key in ("tune", "cells"):
        if key not in spec:
            raise SpecpilotError(f"config {where}: needs {key} (e.g. {{tune: 16, cells: [16]}})")
    tune = spec["tune"]
    if isinstance(tune, bool) or not isinstance(tune, int) or tune < 1:
        raise SpecpilotError(f"config {where}.tune: {tune!r} is not a positive integer")
    out = {"tune": tune, "cells": _positive_ints(spec["cells"], f"{where}.cells")}
    if spec.get("directions") is not None:
        d = spec["directions"]
        if not isinstance(d, list) or not d or not all(isinstance(x, str) for x in d):
            raise SpecpilotError(f"config {where}.directions: {d!r} is not a non-empty list of direction names")
        out["directions"] = list(d)
    if spec.get("engine_rows") is not None:
        out["engine_rows"] = _positive_ints(spec["engine_rows"], f"{where}.engine_rows")
    if spec.get("max_new_tokens") is not None:
        n = spec["max_new_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise SpecpilotError(f"config {where}.max_new_tokens: {n!r} is not an integer >= 2 (a calibration "
                                 f"request needs a verify step)")
        out["max_new_tokens"] = n
    return out


def resolve(config: dict) -> dict[str, dict]:
    """The regimes of a (schema-checked) config, name -> ``{tune, cells[, directions, engine_rows,
    max_new_tokens]}``
    in memory order: ``single`` (given, or derived from ``concurrency`` and ``rounds.concurrency``)
    first, then config ``regimes`` in their order.

    Raises:
        SpecpilotError: a malformed regime (name, unknown key, missing tune/cells, a value that is
            not a positive integer), ``tune`` not rising along the order, or a cell concurrency in
            two regimes -- one line naming the setting.
    """
    given = config.get("regimes") or {}
    if not isinstance(given, dict):
        raise SpecpilotError(f"config regimes: {given!r} is not a mapping of regime name -> {{tune, cells}}")
    rounds = config.get("rounds") or {}
    out: dict[str, dict] = {}
    if SINGLE in given:
        out[SINGLE] = _one(SINGLE, given[SINGLE], f"regimes.{SINGLE}")
    else:
        out[SINGLE] = {"tune": int(rounds.get("concurrency") or 1),
                       "cells": _positive_ints(list(config.get("concurrency") or [1]), "concurrency")}
    for name, spec in given.items():
        if name != SINGLE:
            out[name] = _one(name, spec, f"regimes.{name}")
    prev, owner = None, {}
    for name, r in out.items():
        if prev is not None and r["tune"] <= out[prev]["tune"]:
            raise SpecpilotError(f"config regimes.{name}.tune: {r['tune']} does not rise after regime {prev!r} "
                                 f"(tune {out[prev]['tune']}); the regimes are tuned in order, smallest "
                                 f"concurrency first")
        for c in r["cells"]:
            if c in owner:
                raise SpecpilotError(f"config regimes.{name}.cells: concurrency {c} is already a cell of regime "
                                     f"{owner[c]!r}; a cell concurrency belongs to one regime")
            owner[c] = name
        prev = name
    return out


def calibration_tokens(regime: dict, rounds: dict) -> int:
    """New tokens per calibration request of a regime's rounds: its own ``max_new_tokens`` (config
    ``regimes.<name>.max_new_tokens``), else ``rounds.max_new_tokens`` (issue 61: the rounds time the
    regime's own workload, decode-dominated at c16 as its cells are, not one count for every regime).

    Args:
        regime: one resolved regime (:func:`resolve`).
        rounds: the config's ``rounds`` mapping, ``max_new_tokens`` filled (rules/config.smk).
    Returns:
        The token count (int >= 2).
    Raises:
        SpecpilotError: neither is set.
    """
    n = regime.get("max_new_tokens") or rounds.get("max_new_tokens")
    if not n:
        raise SpecpilotError("config rounds.max_new_tokens: not set (and the regime has no max_new_tokens)")
    return int(n)


def regime_of(regimes: dict[str, dict]) -> dict[int, str]:
    """Cell concurrency -> the regime whose engine serves it."""
    return {c: name for name, r in regimes.items() for c in r["cells"]}


def calibration_count(regime: dict, per_benchmark: int, benchmarks: int) -> int:
    """Calibration prompts per benchmark of a regime: config ``rounds.calibration_prompts``, raised
    so the regime's rounds serve at least :data:`CALIBRATION_WAVES` x ``tune`` requests in all."""
    need = math.ceil(CALIBRATION_WAVES * regime["tune"] / max(1, benchmarks))
    return max(int(per_benchmark), need) if regime["tune"] > 1 else int(per_benchmark)


def calibration_rungs(regime: dict, per_benchmark: int, cap: int | None, benchmarks: int) -> list[int]:
    """Calibration prompts per benchmark at each rung of a sequential trial
    (:meth:`specpilot.agent.trial.Evaluator.trial`): rung 0 is :func:`calibration_count`, each next
    rung doubles it, the last is config ``rounds.calibration_cap`` (None, or not above rung 0: one
    rung, no sequential trials). E.g. 1 per benchmark with cap 8: ``[1, 2, 4, 8]``."""
    first = calibration_count(regime, per_benchmark, benchmarks)
    rungs = [first]
    while cap is not None and rungs[-1] < cap:
        rungs.append(min(2 * rungs[-1], int(cap)))
    return rungs


def table_option(regimes: dict[str, dict]) -> str:
    """``specpilot table --regimes`` value: ``name=c1+c2,...`` (each regime's cell concurrencies)."""
    return ",".join(f"{n}=" + "+".join(str(c) for c in r["cells"]) for n, r in regimes.items())


def parse_table_option(text: str) -> dict[int, str]:
    """Concurrency -> regime from a :func:`table_option` value.

    Raises:
        SpecpilotError: not ``name=c+c,...`` with integer concurrencies."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        name, _, cells = part.partition("=")
        try:
            for c in cells.split("+"):
                out[int(c)] = name
        except ValueError:
            raise SpecpilotError(f"--regimes {text!r}: expected name=c+c,... (e.g. single=1,batched=16+20)") from None
        if not NAME.match(name):
            raise SpecpilotError(f"--regimes {text!r}: regime name {name!r} must match {NAME.pattern}")
    return out

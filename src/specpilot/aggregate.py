"""``specpilot table``: aggregate records into the study table (``results/{gpu}/table.csv``).

One row per cell (deployment, benchmark, concurrency) plus summary rows. For each candidate engine
(``stock``, ``specpilot``) in a cell:

- per-request speedup = AR ``decode_s`` / engine ``decode_s`` for the same ``request_id`` (the two
  must have the same ``new_tokens``, else the table fails: a greedy lossless engine cannot differ);
  ``{engine}_speedup`` is the geometric mean of the per-request speedups;
- ``{engine}_speedup_arith``: ratio of arithmetic means of time per output token
  (mean AR ``decode_s/new_tokens`` over mean engine ``decode_s/new_tokens``; the z-lab convention);
- ``{engine}_tau``: mean over all verify steps of the cell of tokens committed per step (bonus
  included), i.e. sum of ``committed_per_step`` over total ``verify_steps``;
  ``{engine}_tau_req``: mean over requests of each request's own mean (the z-lab convention);
- ``{engine}_tok_s``: sum of new tokens / sum of decode seconds; ``ar_tok_s`` likewise for AR;
- ``{engine}_throughput`` (and ``ar_throughput``): system throughput of the cell = its output
  tokens / wall seconds (last ``finish_s`` - first ``arrival_s`` of its records; empty for
  records without times, e.g. the static-batch regime), beside the per-request speedups;
- ``{engine}_prefill_share`` (and ``ar_prefill_share``): the share of a request's end-to-end time
  spent in prefill, its own and other requests' (``prefill_s`` + ``prefill_stall_s`` over
  ``prefill_s`` + ``decode_s``; the stalls are part of ``decode_s``), the mean over the cell's
  requests (:func:`prefill_share`): whether the cell measures decode (issue 61: the study's requests
  are decode-dominated); a summary row takes the arithmetic mean over its cells;
- ``{engine}_forcing``: ``pass``/``FAIL``/``not run`` from the cell's ``.forcing.json``
  (:func:`specpilot.forcing.verdict_word`: ``pass`` needs zero violations, coverage 100 % and a
  verdict over exactly the cell's requests and tokens). A cell whose forcing failed leaves that
  engine's speedup and tau empty: a lossy engine's speed is no result.

``timing_spread`` says how far the cell's reported speedups can move with the other timing repeats:
every speedup uses each request's fastest repeat (``decode_s``), and an engine's slowest repeats
(``decode_s_repeats``, from ``specpilot run --timing-repeats``) in their place move a speedup by
the geometric mean over the cell's requests of that engine's ``max/min``; ``timing_spread`` is the
largest such move over the cell's engines, minus one (empty when the cell was timed once). One
request disturbed once moves a figure of n requests by only the n-th root of its spread, and so
marks its cell only if that moves the figure. ``timing_warning`` is true when it exceeds
``max_spread`` (config ``timing.max_spread``, default 0.25): the figure depends on which repeat
was kept, so it is not to be trusted. Such cells are also named in the ``note`` and in a warning on
stderr, and the figures mark them. Values are written at full precision (shortest repr that reads
back as the same float), so they can be recomputed from the records exactly.

Uncertainty: ``{engine}_speedup_lo`` / ``_hi`` bound a 95 % interval of ``{engine}_speedup``
and ``specpilot_over_stock`` (geomean of per-request stock ``decode_s`` / specpilot ``decode_s``)
comes with ``specpilot_over_stock_lo`` / ``_hi``: a seeded percentile bootstrap
(:data:`BOOT_SAMPLES` resamples) over requests and repeats: each resample draws the cell's
requests with replacement and, for each drawn request, resamples each engine's timing repeats
(``decode_s_repeats``; ``decode_s`` when timed once) with replacement and keeps the fastest, then
takes the geometric mean as the point estimate does. A summary row resamples within each of its cells and takes the geometric
mean over the cells, as its point value does. The interval of a cell timed once with few requests
is wide; it says how far timing noise alone can move the number.

``forcing`` combines the engines of the cell (``FAIL`` if any failed, ``pass`` if all that ran
passed, else ``not run``). Summary rows have ``benchmark = geomean``: the geometric mean over the
benchmarks of each (deployment, concurrency), and over every cell of a concurrency with
``deployment = all``. A summary value is empty when any cell it covers is empty.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from .agent.directions import normalize
from .devices import table_warnings
from .errors import SpecpilotError
from .io import atomic_write_text, read_json
from .records import Record, read_records
from .regimes import parse_table_option

BENCHMARK_ORDER = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
CANDIDATES = ["stock", "specpilot"]
SUMMARY = "geomean"
ALL = "all"

COLUMNS = [
    "deployment", "target", "drafter", "benchmark", "concurrency", "n_requests", "ar_tok_s",
    "stock_speedup", "specpilot_speedup", "stock_tau", "specpilot_tau", "forcing", "note",
    "synthetic", "timing_spread", "timing_warning",
]
MAX_SPREAD = 0.25  # default: a speedup moving by more with the other repeats => unreliable (timing_spread)
log = logging.getLogger("specpilot.table")
_PER_ENGINE = ["speedup_lo", "speedup_hi", "speedup_arith", "tau_req", "tok_s", "throughput", "forcing"]
_VALUES = ["speedup", "speedup_lo", "speedup_hi", "speedup_arith", "tau", "tau_req", "tok_s",
           "throughput"]  # per-engine value columns
RATIO = "specpilot_over_stock"
RATIO_COLS = [RATIO, f"{RATIO}_lo", f"{RATIO}_hi"]
BOOT_SAMPLES = 2000  # bootstrap resamples of the speedup intervals
BOOT_SEED = 0

_FORCING_NAME = re.compile(r"^(?P<engine>[A-Za-z0-9_]+)-c(?P<concurrency>\d+)\.forcing\.json$")

Cell = tuple[str, str, int]  # (deployment, benchmark, concurrency)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", nargs="+", required=True,
                        help="records files (results/{gpu}/{deployment}/{benchmark}/{engine}-c{c}.jsonl)")
    parser.add_argument("--forcing", nargs="*", default=[],
                        help="forcing verdicts (.../{engine}-c{c}.forcing.json beside the records)")
    parser.add_argument("--out", required=True, help="output CSV, e.g. results/{gpu}/table.csv")
    parser.add_argument("--specpilot-note", default="specpilot not run",
                        help="note for cells without specpilot records (why it was not run)")
    parser.add_argument("--max-spread", type=float, default=MAX_SPREAD,
                        help="how far a cell's speedups may move with the other timing repeats (timing_spread) "
                             f"before the cell is marked unreliable (default {MAX_SPREAD})")
    parser.add_argument("--devices", help="results/{gpu}/devices.json: warn when a comparison mixes device speeds")
    parser.add_argument("--regimes", help="the serving regimes' cell concurrencies, name=c+c,... (e.g. "
                                          "single=1,batched=16+20): a regime column (specpilot.regimes)")


# ---------------------------------------------------------------------------------------------
# reading


def forcing_key(path: str | Path) -> tuple[Cell, str]:
    """(cell, engine) of a forcing file from its path ``.../{deployment}/{benchmark}/{engine}-c{c}.forcing.json``."""
    p = Path(path)
    m = _FORCING_NAME.match(p.name)
    if not m or len(p.parts) < 3:
        raise SpecpilotError(
            f"forcing file {path} is not named .../{{deployment}}/{{benchmark}}/{{engine}}-c{{concurrency}}.forcing.json")
    return (p.parent.parent.name, p.parent.name, int(m["concurrency"])), m["engine"]


def read_forcing(paths: Iterable[str | Path]) -> dict[tuple[Cell, str], dict]:
    """Forcing verdicts keyed by (cell, engine); each value has ``passed`` and ``violations``."""
    out = {}
    for path in paths:
        key = forcing_key(path)
        doc = read_json(path)
        if not isinstance(doc, dict) or "passed" not in doc:
            raise SpecpilotError(f"{path} has no 'passed' field")
        out[key] = doc
    return out


def group_records(records: Iterable[Record]) -> dict[Cell, dict[str, list[Record]]]:
    """Records grouped by cell, then engine; a request id twice in one cell and engine is an error."""
    cells: dict[Cell, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    seen = set()
    for r in records:
        key = (r.deployment, r.benchmark, int(r.concurrency), r.engine, r.request_id)
        if key in seen:
            raise SpecpilotError(f"request {r.request_id} appears twice for engine {r.engine} in cell "
                                 f"{r.deployment}/{r.benchmark}/c{r.concurrency}")
        seen.add(key)
        cells[(r.deployment, r.benchmark, int(r.concurrency))][r.engine].append(r)
    return cells


# ---------------------------------------------------------------------------------------------
# arithmetic


def geomean(values: Iterable[float]) -> float:
    """Geometric mean; NaN when empty or when any value is NaN or not positive."""
    vals = list(values)
    if not vals or any(not (v > 0) or math.isinf(v) for v in vals):  # NaN fails v > 0
        return math.nan
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def tau_over_steps(records: list[Record]) -> float:
    """Mean committed tokens per verify step over all steps of all records (bonus included)."""
    steps = sum(len(r.committed_per_step) for r in records)
    return sum(sum(r.committed_per_step) for r in records) / steps if steps else math.nan


def tau_per_request(records: list[Record]) -> float:
    """Mean over requests of each request's mean committed tokens per step."""
    taus = [r.tau for r in records if r.committed_per_step]
    return sum(taus) / len(taus) if taus else math.nan


def timing_spread(records: list[Record]) -> float:
    """How far a speedup over ``records`` moves with the other repeats: the largest over their
    engines of the geometric mean over requests of ``max/min`` of a request's repeated decode
    times, minus one (a request timed once counts as 1); NaN when none was repeated.

    A speedup uses each request's fastest repeat on both sides; with one side's slowest repeats
    instead it moves by exactly that geometric mean, so this bounds how far the reported figure
    depends on which repeat was kept."""
    per_engine: dict[str, list[float]] = defaultdict(list)
    repeated = False
    for r in records:
        reps = [t for t in (r.decode_s_repeats or []) if isinstance(t, (int, float))]
        if len(reps) >= 2 and min(reps) > 0:
            repeated = True
            per_engine[r.engine].append(max(reps) / min(reps))
        else:
            per_engine[r.engine].append(1.0)
    if not repeated:
        return math.nan
    return max(geomean(v) for v in per_engine.values()) - 1.0


def prefill_share(records: list[Record]) -> float:
    """Mean over requests of (``prefill_s`` + ``prefill_stall_s``) / (``prefill_s`` + ``decode_s``):
    the share of each request's end-to-end time [s / s] spent in prefill, its own and the stalls of
    other requests' prefill steps inside its decode (continuous batching). NaN without records or
    when every request took no time."""
    shares = [(r.prefill_s + r.prefill_stall_s) / (r.prefill_s + r.decode_s)
              for r in records if r.prefill_s + r.decode_s > 0]
    return sum(shares) / len(shares) if shares else math.nan


def tok_s(records: list[Record]) -> float:
    secs = sum(r.decode_s for r in records)
    return sum(r.new_tokens for r in records) / secs if secs > 0 else math.nan


def throughput(records: list[Record]) -> float:
    """System throughput [tokens/s]: output tokens of all records / wall seconds of the cell
    (latest ``finish_s`` - earliest ``arrival_s``); NaN when a record has no times."""
    if not records or any(r.finish_s is None or r.arrival_s is None for r in records):
        return math.nan
    wall = max(r.finish_s for r in records) - min(r.arrival_s for r in records)
    return sum(r.new_tokens for r in records) / wall if wall > 0 else math.nan


def paired_speedups(ar: list[Record], eng: list[Record], where: str) -> tuple[float, float, int]:
    """(geometric-mean speedup, ratio-of-arithmetic-means speedup, requests left out).

    Requests whose decode time is zero on either side (a single generated token) have no defined
    speedup and are left out of both means.

    Raises:
        SpecpilotError: the two request sets differ, or a request's ``new_tokens`` differ.
    """
    a = {r.request_id: r for r in ar}
    e = {r.request_id: r for r in eng}
    if a.keys() != e.keys():
        only_a = sorted(a.keys() - e.keys())[:5]
        only_e = sorted(e.keys() - a.keys())[:5]
        raise SpecpilotError(f"{where}: request ids differ from AR's (only in ar: {only_a}, "
                             f"only in {eng[0].engine if eng else 'engine'}: {only_e})")
    ratios, tpot_a, tpot_e, left_out = [], [], [], 0
    for rid in sorted(a):
        ra, re_ = a[rid], e[rid]
        if ra.new_tokens != re_.new_tokens:
            raise SpecpilotError(f"{where}: request {rid} has new_tokens {re_.new_tokens} for "
                                 f"{re_.engine} but {ra.new_tokens} for ar; a lossless greedy engine "
                                 f"must produce the same tokens")
        if ra.decode_s <= 0 or re_.decode_s <= 0 or ra.new_tokens <= 0:
            left_out += 1
            continue
        ratios.append(ra.decode_s / re_.decode_s)
        tpot_a.append(ra.decode_s / ra.new_tokens)
        tpot_e.append(re_.decode_s / re_.new_tokens)
    arith = (sum(tpot_a) / sum(tpot_e)) if tpot_e else math.nan
    return geomean(ratios), arith, left_out


def timing_pairs(base: list[Record], eng: list[Record]) -> list[tuple[list[float], list[float]]]:
    """Per request (sorted by id) with a decode time on both sides: (base repeats, engine repeats)
    [seconds], each ``decode_s_repeats`` or ``[decode_s]`` when timed once. Requests with a zero
    time on either side are left out (as in :func:`paired_speedups`)."""
    a = {r.request_id: r for r in base}
    out = []
    for r in sorted(eng, key=lambda r: r.request_id):
        b = a.get(r.request_id)
        if b is None or b.decode_s <= 0 or r.decode_s <= 0:
            continue
        out.append(([t for t in (b.decode_s_repeats or [b.decode_s]) if t > 0] or [b.decode_s],
                    [t for t in (r.decode_s_repeats or [r.decode_s]) if t > 0] or [r.decode_s]))
    return out


def bootstrap_interval(groups: list[list[tuple[list[float], list[float]]]], level: float = 0.95,
                       samples: int = BOOT_SAMPLES, seed: int = BOOT_SEED) -> tuple[float, float]:
    """Percentile-bootstrap interval of a geometric-mean speedup over requests and repeats.

    Args:
        groups: one list per cell of :func:`timing_pairs` (a cell row passes one group, a summary
            row one per cell it covers).
        level: coverage of the two-sided interval (0.95 = the 2.5th and 97.5th percentiles).
    Returns:
        (lo, hi) of geomean over groups of (geomean over a group's resampled requests of
        base time / engine time); (nan, nan) when a group is empty.
    Each resample draws every group's requests with replacement and, per drawn request, resamples
    each side's repeats with replacement and keeps the fastest, as the point estimate keeps each
    request's fastest run; seeded, so the table is reproducible (Efron & Tibshirani, An
    Introduction to the Bootstrap, 1993, ch. 13).
    """
    if not groups or any(not g for g in groups):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    total = np.zeros(samples)
    for g in groups:
        n = len(g)
        width = max(max(len(a), len(e)) for a, e in g)
        la = np.full((n, width), np.nan)
        le = np.full((n, width), np.nan)
        na = np.array([len(a) for a, _ in g])
        ne = np.array([len(e) for _, e in g])
        for i, (a, e) in enumerate(g):
            la[i, :len(a)] = np.log(a)
            le[i, :len(e)] = np.log(e)
        req = rng.integers(0, n, size=(samples, n))
        # each side's repeats resampled with replacement, the fastest kept (as the point estimate)
        ia = (rng.random((samples, n, width)) * na[req][..., None]).astype(int)
        ie = (rng.random((samples, n, width)) * ne[req][..., None]).astype(int)
        ra = np.take_along_axis(la[req], ia, axis=2)
        re_ = np.take_along_axis(le[req], ie, axis=2)
        ka = np.arange(width) < na[req][..., None]  # only as many draws as the request has repeats
        ke = np.arange(width) < ne[req][..., None]
        best_a = np.where(ka, ra, np.inf).min(axis=2)
        best_e = np.where(ke, re_, np.inf).min(axis=2)
        total += (best_a - best_e).mean(axis=1)
    total /= len(groups)
    q = (1 - level) / 2
    lo, hi = np.quantile(total, [q, 1 - q])
    return float(math.exp(lo)), float(math.exp(hi))


# ---------------------------------------------------------------------------------------------
# the table


def _forcing_word(doc: dict | None, records: list[Record] | None = None) -> tuple[str, str]:
    """(word, why) of a cell's verdict: :func:`specpilot.forcing.verdict_word` (coverage included)."""
    from .forcing import verdict_word

    return verdict_word(doc, records)


def combine_forcing(words: Iterable[str]) -> str:
    words = list(words)
    if "FAIL" in words:
        return "FAIL"
    if words and all(w == "pass" for w in words):
        return "pass"
    return "not run"


def mechanisms(record: Record) -> dict:
    """A record's engine config as mechanisms (:func:`specpilot.agent.directions.normalize`: keys at
    their "off" value dropped), without what only says how it ran (kernels used, replay profile)."""
    cfg = {k: v for k, v in (record.engine_config or {}).items() if k not in ("kernels", "replay_profile")}
    return normalize(cfg)


def cell_row(cell: Cell, engines: dict[str, list[Record]], forcing: dict[tuple[Cell, str], dict],
             specpilot_note: str, max_spread: float = MAX_SPREAD) -> dict:
    """One table row for ``cell`` from its records by engine and the forcing verdicts."""
    deployment, benchmark, concurrency = cell
    where = f"cell {deployment}/{benchmark}/c{concurrency}"
    if "ar" not in engines:
        raise SpecpilotError(f"{where}: no AR records; every speedup is relative to AR")
    ar = engines["ar"]
    candidates = CANDIDATES + sorted(e for e in engines if e not in CANDIDATES and e != "ar")
    named = next((engines[e][0] for e in candidates if engines.get(e)), ar[0])
    row: dict = {
        "deployment": deployment, "target": ar[0].target, "drafter": named.drafter,
        "benchmark": benchmark, "concurrency": concurrency, "n_requests": len(ar),
        "ar_tok_s": tok_s(ar), "ar_throughput": throughput(ar), "ar_prefill_share": prefill_share(ar),
        "synthetic": any(r.synthetic for recs in engines.values() for r in recs),
    }
    notes, words = [], []
    for eng in candidates:
        recs = engines.get(eng)
        for suffix in _VALUES:
            row[f"{eng}_{suffix}"] = math.nan
        if not recs:
            row[f"{eng}_forcing"] = "not run"
            notes.append(specpilot_note if eng == "specpilot" else f"{eng} not run")
            continue
        row[f"{eng}_prefill_share"] = prefill_share(recs)
        doc = forcing.get((cell, eng))
        word, why = _forcing_word(doc, recs)
        row[f"{eng}_forcing"] = word
        words.append(word)
        if word == "FAIL":
            notes.append(f"{eng} forcing FAIL ({why}): speedup withheld")
            continue
        geo, arith, left_out = paired_speedups(ar, recs, where)
        pairs = timing_pairs(ar, recs)
        lo, hi = bootstrap_interval([pairs])
        row.setdefault("_pairs", {})[eng] = pairs
        row.update({f"{eng}_speedup": geo, f"{eng}_speedup_lo": lo, f"{eng}_speedup_hi": hi,
                    f"{eng}_speedup_arith": arith,
                    f"{eng}_tau": tau_over_steps(recs), f"{eng}_tau_req": tau_per_request(recs),
                    f"{eng}_tok_s": tok_s(recs), f"{eng}_throughput": throughput(recs)})
        if left_out:
            notes.append(f"{eng}: {left_out} request(s) without decode time left out of speedups")
        if word == "not run":
            notes.append(f"{eng} forcing not run")
    row["forcing"] = combine_forcing(words)
    if engines.get("stock") and engines.get("specpilot") and \
            mechanisms(engines["specpilot"][0]) == mechanisms(engines["stock"][0]):
        notes.append("specpilot runs stock's config (the rounds kept it)")
    reasons = sorted({r.engine_config.get("block_reason") for r in engines.get("stock", [])} - {None})
    notes += [f"stock block: {why}" for why in reasons]  # stock off its drafter's trained block (config block_reason)
    for col in RATIO_COLS:
        row[col] = math.nan
    if all(row.get(f"{e}_speedup") == row.get(f"{e}_speedup") for e in CANDIDATES):  # both have a speedup
        pairs = timing_pairs(engines["stock"], engines["specpilot"])
        row["_pairs"][RATIO] = pairs
        row[RATIO] = paired_speedups(engines["stock"], engines["specpilot"], where)[0]
        row[f"{RATIO}_lo"], row[f"{RATIO}_hi"] = bootstrap_interval([pairs])
    spread = timing_spread([r for recs in engines.values() for r in recs])
    row["timing_spread"] = spread
    row["timing_warning"] = bool(spread > max_spread)  # NaN (timed once) compares False
    if row["timing_warning"]:
        notes.append(f"unstable timing: the speedups move by up to {spread:.0%} with the other repeats "
                     f"(> {max_spread:.0%}); unreliable")
    row["note"] = "; ".join(notes)
    return row


def summary_row(rows: list[dict], deployment: str, concurrency: int, value_cols: list[str],
                specpilot_note: str = "") -> dict:
    """The ``benchmark = geomean`` row over ``rows`` (cells of one concurrency)."""
    def same_or_all(col):
        vals = {r[col] for r in rows}
        return vals.pop() if len(vals) == 1 else ALL

    out = {"deployment": deployment, "target": same_or_all("target"),
           "drafter": same_or_all("drafter"), "benchmark": SUMMARY, "concurrency": concurrency,
           "n_requests": sum(r["n_requests"] for r in rows),
           "synthetic": any(r["synthetic"] for r in rows)}
    spreads = [r["timing_spread"] for r in rows if r.get("timing_spread") == r.get("timing_spread")]
    out["timing_spread"] = max(spreads) if spreads else math.nan
    out["timing_warning"] = any(r.get("timing_warning") for r in rows)
    notes = []
    for col in value_cols:
        vals = [r[col] for r in rows]
        out[col] = geomean(vals)
        empty = sum(1 for v in vals if not (v == v))
        if empty and empty < len(vals) and col.endswith("_speedup"):
            notes.append(f"{col} empty: {empty} of {len(vals)} cells have none")
    for key in [c[: -len("_speedup_lo")] for c in value_cols if c.endswith("_speedup_lo")] + [RATIO]:
        col = f"{key}_speedup" if key != RATIO else RATIO
        groups = [r.get("_pairs", {}).get(key) for r in rows]
        if key == RATIO:
            out[RATIO] = geomean(r[RATIO] for r in rows)
        lo_col, hi_col = (f"{col}_lo", f"{col}_hi")
        out[lo_col], out[hi_col] = (bootstrap_interval(groups) if all(groups) and out[col] == out[col]
                                    else (math.nan, math.nan))
    for col in dict.fromkeys(c for r in rows for c in r if c.endswith("_prefill_share")):  # a share: the mean
        vals = [r[col] for r in rows if r.get(col) == r.get(col)]
        out[col] = sum(vals) / len(vals) if len(vals) == len(rows) else math.nan
    for col in [c for c in rows[0] if c.endswith("_forcing")]:
        out[col] = combine_forcing(r[col] for r in rows)
    out["forcing"] = combine_forcing(r["forcing"] for r in rows)
    if out["timing_warning"]:
        notes.append("unstable timing in " + ", ".join(
            f"{r['deployment']}/{r['benchmark']}" for r in rows if r.get("timing_warning")))
    if out["forcing"] == "FAIL":
        notes.append("forcing FAIL in " + ", ".join(
            f"{r['deployment']}/{r['benchmark']}" for r in rows if r["forcing"] == "FAIL"))
    if specpilot_note and all(r.get("specpilot_forcing") == "not run"
                              and not (r.get("specpilot_speedup") == r.get("specpilot_speedup"))
                              for r in rows) and any(specpilot_note in r["note"] for r in rows):
        notes.append(specpilot_note)
    out["note"] = "; ".join(notes)
    return out


def build_table(records: Iterable[Record], forcing: dict[tuple[Cell, str], dict] | None = None,
                specpilot_note: str = "specpilot not run", max_spread: float = MAX_SPREAD) -> pd.DataFrame:
    """The study table (cells and summary rows) as a DataFrame with :data:`COLUMNS` first.

    ``max_spread``: see ``timing_warning`` in the module docstring; each flagged cell is also
    logged as a warning (logger ``specpilot.table``).
    """
    forcing = forcing or {}
    cells = group_records(records)
    if not cells:
        raise SpecpilotError("no records to aggregate")
    for key in forcing:
        if key[0] not in cells:
            raise SpecpilotError(f"forcing verdict for {key[1]} in cell {'/'.join(map(str, key[0]))} "
                                 f"has no records")
    dep_order: list[str] = []
    for dep, _, _ in cells:
        if dep not in dep_order:
            dep_order.append(dep)

    def bench_key(b):
        return (BENCHMARK_ORDER.index(b), b) if b in BENCHMARK_ORDER else (len(BENCHMARK_ORDER), b)

    rows_by_cell = {cell: cell_row(cell, engines, forcing, specpilot_note, max_spread)
                    for cell, engines in cells.items()}
    for cell, row in rows_by_cell.items():
        if row["timing_warning"]:
            log.warning("cell %s/%s/c%d: its speedups move by up to %.0f%% with the other timing repeats "
                        "(> %.0f%%): unreliable (rerun it on an idle machine)",
                        *cell, 100 * row["timing_spread"], 100 * max_spread)
    candidates = sorted({c[: -len("_forcing")] for r in rows_by_cell.values() for c in r
                         if c.endswith("_forcing")},
                        key=lambda e: (CANDIDATES.index(e) if e in CANDIDATES else len(CANDIDATES), e))
    value_cols = ["ar_tok_s", "ar_throughput"] + [f"{e}_{s}" for e in candidates for s in _VALUES]
    # every row gets every candidate's columns (an engine may be absent from some cells)
    for r in rows_by_cell.values():
        for e in candidates:
            for s in _VALUES:
                r.setdefault(f"{e}_{s}", math.nan)
            r.setdefault(f"{e}_forcing", "not run")
            r.setdefault(f"{e}_prefill_share", math.nan)

    table: list[dict] = []
    concurrencies = sorted({c for _, _, c in cells})
    for dep in dep_order:
        for conc in concurrencies:
            rows = [rows_by_cell[c] for c in sorted(
                (c for c in cells if c[0] == dep and c[2] == conc), key=lambda c: bench_key(c[1]))]
            if not rows:
                continue
            table.extend(rows)
            table.append(summary_row(rows, dep, conc, value_cols, specpilot_note))
    for conc in concurrencies:
        rows = [r for c, r in rows_by_cell.items() if c[2] == conc]
        table.append(summary_row(rows, ALL, conc, value_cols, specpilot_note))

    extra = ["ar_throughput"] + [f"{e}_{s}" for e in candidates for s in _PER_ENGINE] + RATIO_COLS + \
            [f"{e}_{s}" for e in candidates for s in ["speedup", "tau"] if f"{e}_{s}" not in COLUMNS] + \
            [f"{e}_prefill_share" for e in ["ar"] + candidates]
    cols = COLUMNS + [c for c in dict.fromkeys(extra) if c not in COLUMNS]
    return pd.DataFrame(table, columns=cols)


def with_regimes(df: pd.DataFrame, regime_of: dict[int, str]) -> pd.DataFrame:
    """``df`` with a ``regime`` column before ``concurrency``: the serving regime whose engine
    served each row's concurrency (a cell concurrency belongs to one regime; :mod:`specpilot.regimes`).

    Raises:
        SpecpilotError: a row's concurrency is in no regime."""
    missing = sorted({int(c) for c in df["concurrency"]} - set(regime_of))
    if missing:
        raise SpecpilotError(f"--regimes: concurrency {missing} of the records is in no regime ({regime_of})")
    out = df.copy()
    out.insert(out.columns.get_loc("concurrency"), "regime", [regime_of[int(c)] for c in out["concurrency"]])
    return out


def write_table(df: pd.DataFrame, path: str | Path) -> None:
    """Write the table as CSV atomically; empty cells (NaN) are written as empty fields, floats at
    full precision (Python's shortest round-trip repr: read back, a value is the same float)."""
    atomic_write_text(path, df.to_csv(index=False, na_rep=""))


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    records: list[Record] = []
    for path in args.records:
        records.extend(read_records(path))
    df = build_table(records, read_forcing(args.forcing), args.specpilot_note,
                     getattr(args, "max_spread", MAX_SPREAD))
    if getattr(args, "regimes", None):
        df = with_regimes(df, parse_table_option(args.regimes))
    write_table(df, args.out)
    for w in table_warnings(args.records, getattr(args, "devices", None)): log.warning(w)  # noqa: E701 (issue 40)
    n_cells = int((df["benchmark"] != SUMMARY).sum())
    print(f"{n_cells} cells, {len(df) - n_cells} summary rows -> {args.out}")
    return 0

"""``specpilot figures``: the study figures from ``table.csv``.

Writes ``speedup.png`` (speedup over AR per benchmark, stock vs specpilot), ``tau.png``
(acceptance length per benchmark) and ``concurrency.png`` (per-request speedup and
system throughput vs concurrency) into the output
folder. Readable in grayscale: engines differ by gray level and hatching (bars) or line style and
marker (lines). A value the table leaves empty (engine not run, or token forcing failed) is drawn as
absent, labelled ``n/a`` or ``FAIL``, never as zero. A value that moves with the other timing repeats
(table column ``timing_warning``) is marked ``!`` above its bar or point and explained in the notes.
``rounds.png`` in the same folder belongs to the agent rounds.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib
import pandas as pd

matplotlib.use("Agg")  # files only, no display; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from .errors import SpecpilotError

TIMED = {"speedup", "throughput", "tok_s"}  # metrics a loaded machine can disturb (tau is a token count)
ENGINE_STYLE = {
    # engine: (face gray, hatch, line style, marker)
    "stock": ("0.45", "//", "-", "o"),
    "specpilot": ("0.85", "..", "--", "s"),
}
SUMMARY = "geomean"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table", help="results/{gpu}/table.csv")
    parser.add_argument("--rounds", nargs="+", help="integrated.json files of the agent rounds (draws rounds.png)")
    parser.add_argument("--out-dir", required=True, help="output folder, e.g. results/{gpu}/figures")


def _plt():
    plt.rcParams.update({"font.size": 9, "hatch.linewidth": 0.6, "savefig.dpi": 150})
    return plt


def _isnum(v) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def _save(fig, path: Path) -> None:
    """Save via a temporary name in the same folder, then rename (no half-written PNG)."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, bbox_inches="tight")
    tmp.replace(path)


def _absent_label(row, engine: str) -> str:
    return "FAIL" if row.get(f"{engine}_forcing") == "FAIL" else "n/a"


def _warned(row) -> bool:
    """The row's speedups depend on which timing repeat was kept (table column ``timing_warning``)."""
    v = row.get("timing_warning", False)
    return str(v).strip().lower() == "true" if not isinstance(v, bool) else v


LOADED_NOTE = "!: the value moves by more than the tolerance with the other timing repeats (timing_spread): unreliable"


def _notes(df: pd.DataFrame) -> list[str]:
    notes = []
    if any(_warned(r) for _, r in df.iterrows()):
        notes.append(LOADED_NOTE)
    for engine in ENGINE_STYLE:
        col = f"{engine}_speedup"
        if col in df and df[col].isna().all():
            why = sorted({n for n in df["note"].fillna("") if engine in n}) or [f"{engine} not run"]
            notes.append(f"{engine}: no values ({why[0].split(';')[0].strip()})")
    if (df.get("forcing") == "FAIL").any():
        notes.append("FAIL: token forcing failed, speed withheld")
    if df.get("synthetic", pd.Series(dtype=bool)).astype(str).str.lower().eq("true").any():
        notes.append("some cells use a synthetic (replay) drafter")
    shares = pd.to_numeric(df.get("ar_prefill_share", pd.Series(dtype=float)), errors="coerce").dropna()
    if len(shares):  # whether the cells measure decode (issue 61): the table's ar_prefill_share
        notes.append(f"AR's prefill share of a request's time (prefill + stalls): {shares.min():.0%}-{shares.max():.0%}")
    return notes


def _panels(df: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[str, str | None, int]]]:
    """The rows drawn (no ``all`` deployment; per regime its lowest cell concurrency, without a
    ``regime`` column the lowest concurrency) and the panels (deployment, regime or None, concurrency)."""
    d = df[df["deployment"] != "all"]
    if "regime" not in d.columns:
        conc = int(d["concurrency"].min())
        d = d[d["concurrency"] == conc]
        return d, [(dep, None, conc) for dep in dict.fromkeys(d["deployment"])]
    lowest = {r: int(g["concurrency"].min()) for r, g in d.groupby("regime", sort=False)}
    d = d[[int(c) == lowest[r] for r, c in zip(d["regime"], d["concurrency"])]]
    return d, list(dict.fromkeys((dep, r, lowest[r]) for dep, r in zip(d["deployment"], d["regime"])))


def per_benchmark(df: pd.DataFrame, metric: str, ylabel: str, title: str, path: Path,
                  baseline: float | None) -> list[tuple[str, str, str]]:
    """Grouped bars per benchmark (+ geomean), one panel per deployment and serving regime (the
    table's ``regime`` column; without it one regime), each at its regime's lowest cell concurrency.

    Returns the (deployment, benchmark, engine) bars marked ``!`` (loaded machine); only timed
    metrics (:data:`TIMED`) carry the mark: tau does not depend on the clock.
    """
    marked = []
    plt = _plt()
    d, panels = _panels(df)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.6 * len(panels)), squeeze=False)
    width = 0.38
    for ax, (dep, regime, conc) in zip(axes[:, 0], panels):
        rows = d[(d["deployment"] == dep) & (d["concurrency"] == conc)].reset_index(drop=True)
        labels = list(rows["benchmark"])
        top = 0.0
        for k, (engine, (gray, hatch, _, _)) in enumerate(ENGINE_STYLE.items()):
            col = f"{engine}_{metric}"
            labelled = False
            for i, row in rows.iterrows():
                x = i + (k - 0.5) * width
                v = row.get(col, math.nan)
                if _isnum(v):
                    ax.bar(x, v, width, color=gray, hatch=hatch, edgecolor="black", linewidth=0.6,
                           label=None if labelled else engine)
                    labelled = True
                    top = max(top, v)
                    if metric in TIMED and _warned(row):  # tau counts tokens: no clock reads it
                        ax.text(x, v, "!", ha="center", va="bottom", fontsize=9, fontweight="bold")
                        marked.append((dep, row["benchmark"], engine))
                else:
                    ax.text(x, 0.02, _absent_label(row, engine), rotation=90, ha="center",
                            va="bottom", fontsize=7, transform=ax.get_xaxis_transform())
        if baseline is not None:
            ax.axhline(baseline, color="black", linewidth=0.8, linestyle=":")
            ax.text(0.995, baseline, "AR", transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=7)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.6, len(labels) - 0.4)
        ax.set_ylim(0, max(top, baseline or 0, 1.0) * 1.12)
        target, drafter = rows.loc[0, "target"], rows.loc[0, "drafter"]
        where = f"regime {regime}, concurrency {conc}" if regime else f"concurrency {conc}"
        ax.set_title(f"{dep}  (target {target}, drafter {drafter}, {where})", fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("benchmark")
        handles, names = ax.get_legend_handles_labels()
        seen = dict(zip(names, handles))
        for engine, (gray, hatch, _, _) in ENGINE_STYLE.items():
            if engine not in seen:
                seen[engine + " (no values)"] = plt.Rectangle((0, 0), 1, 1, facecolor="white",
                                                              edgecolor="0.6", linestyle="--")
        ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.04, 1.0))
    notes = _notes(d)
    fig.suptitle(title, fontsize=10)
    if notes:
        fig.text(0.01, -0.01, "\n".join(notes), fontsize=7, va="top")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return marked


AR_STYLE = ("0.0", "", ":", "^")  # AR's line in the throughput panel


def speedup_vs_concurrency(df: pd.DataFrame, path: Path) -> None:
    """Two panels against concurrency, one line per deployment and engine: the geometric-mean
    per-request speedup over AR (left) and the system throughput ``*_throughput`` in output
    tokens/s, AR included (right; absent when the table has no throughput columns)."""
    plt = _plt()
    s = df[df["benchmark"] == SUMMARY]
    deployments = [d for d in dict.fromkeys(s["deployment"]) if d != "all"] or ["all"]
    grays = [str(g) for g in ([0.0] if len(deployments) == 1 else
                              [round(0.65 * i / (len(deployments) - 1), 2) for i in range(len(deployments))])]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    drawn = drawn_tp = 0
    for dep, gray in zip(deployments, grays):
        rows = s[s["deployment"] == dep].sort_values("concurrency")
        for engine, (_, _, ls, marker) in [("ar", AR_STYLE), *ENGINE_STYLE.items()]:
            for axis, col in ((ax, f"{engine}_speedup"), (ax2, f"{engine}_throughput")):
                if col not in rows:
                    continue
                pts = [(c, v) for c, v in zip(rows["concurrency"], rows[col]) if _isnum(v)]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                axis.plot(xs, ys, linestyle=ls, marker=marker, color=gray, markerfacecolor="white"
                          if engine == "specpilot" else gray, label=f"{dep} {engine}")
                if axis is ax:
                    drawn += 1
                    for (_, r) in rows.iterrows():
                        if _warned(r) and _isnum(r[col]):
                            ax.annotate("!", (r["concurrency"], r[col]), textcoords="offset points", xytext=(0, 5),
                                        ha="center", fontsize=9, fontweight="bold")
                else:
                    drawn_tp += 1
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    concs = sorted(set(int(c) for c in s["concurrency"]))
    for axis in (ax, ax2):
        axis.set_xticks(concs)
        axis.set_xlabel("concurrency c (requests in flight)")
        axis.set_ylim(bottom=0)
    ax.set_ylabel("per-request speedup over AR (×, geomean over benchmarks)")
    ax.set_title("Per-request speedup over AR vs concurrency", fontsize=10)
    ax2.set_ylabel("system throughput (output tokens/s, geomean over benchmarks)")
    ax2.set_title("Throughput vs concurrency", fontsize=10)
    if drawn_tp:
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    elif drawn:
        ax.legend(fontsize=7, loc="upper left")
    if not drawn_tp:
        ax2.text(0.5, 0.5, "no throughput values\n(records without arrival/finish times)", ha="center",
                 va="center", transform=ax2.transAxes, fontsize=8)
    notes = _notes(s)
    if not drawn:
        notes.insert(0, "no speedup values to draw")
    if notes:
        fig.text(0.01, -0.01, "\n".join(notes), fontsize=7, va="top")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def draw_all(table: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw the three figures from ``table`` into ``out_dir``; returns their paths."""
    try:
        df = pd.read_csv(table, keep_default_na=False, na_values=[""])
    except FileNotFoundError:
        raise SpecpilotError(f"file not found: {table}") from None
    needed = {"deployment", "target", "drafter", "benchmark", "concurrency", "forcing", "note"}
    if missing := needed - set(df.columns):
        raise SpecpilotError(f"{table} lacks column(s) {sorted(missing)}")
    if df.empty:
        raise SpecpilotError(f"{table} has no rows")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "speedup.png", out / "tau.png", out / "concurrency.png"]
    per_benchmark(df, "speedup", "speedup over AR (×, geomean)",
                  "Speedup over autoregressive decoding (per-request geometric mean)", paths[0], 1.0)
    per_benchmark(df, "tau", "τ (tokens / verify step)",
                  "Acceptance length τ: committed tokens per verify step, bonus included", paths[1], 1.0)
    speedup_vs_concurrency(df, paths[2])
    return paths


def rounds_figure(integrated: list[str | Path], path: str | Path) -> Path:
    """Speedup over AR per agent round per deployment (stock = round 0), on calibration prompts.

    ``integrated``: paths ``results/{gpu}/{deployment}/{regime}/rounds/round-{k}/integrated.json``
    (one line per deployment and regime; a path without the regime level: the deployment's).
    """
    series: dict[str, dict[int, float]] = {}
    for f in integrated:
        f = Path(f)
        d = json.loads(f.read_text())
        dep = f"{f.parents[3].name} ({d['regime']})" if d.get("regime") else f.parents[2].name
        pts = series.setdefault(dep, {})
        if int(d["round"]) == 1:  # stock, as measured by round 1's plan, is round 0
            pts[0] = d["stock_speedup_vs_ar"]
        pts[int(d["round"])] = d["speedup_vs_ar"]
    if not series:
        raise SpecpilotError("no agent rounds to draw")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    styles = ["o-", "s--", "^-.", "d:"]
    for i, (dep, pts) in enumerate(sorted(series.items())):
        ks = sorted(pts)
        ax.plot(ks, [pts[k] for k in ks], styles[i % len(styles)], color=str(0.15 + 0.5 * (i % 3) / 2), label=dep)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xlabel("agent round (0 = stock)")
    ax.set_ylabel("speedup over AR (×, geomean)")
    ax.set_title("Speedup over AR after each agent round (calibration prompts)")
    ax.set_xticks(sorted({k for pts in series.values() for k in pts}))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    if args.rounds:
        print(rounds_figure(args.rounds, Path(args.out_dir) / "rounds.png"))
        return 0
    if not args.table:
        raise SpecpilotError("give --table (study figures) or --rounds (agent-rounds figure)")
    for p in draw_all(args.table, args.out_dir):
        print(p)
    return 0

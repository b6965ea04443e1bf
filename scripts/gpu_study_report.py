"""What `scripts/gpu_study.sh` prints after the workflow: the table (or, when the run did not finish,
a partial table of the cells that did), the forcing verdict of every cell, what the rounds of each
(deployment, serving regime) ranked, tried and kept (and what the memory chain carried), and one
line per bar of issues 46 and 53; per (deployment, regime) the rounds' calibration gain over stock
beside the cell's specpilot / stock, and every GPU job's device-held seconds (issue 61). Reads results/$GPU/...; writes $OUTDIR/table.csv (or partial-table.csv). Exit 0 when the
whole table exists, 1 otherwise.

Environment: GPU, CONFIG_FILES (the config files of the run, merged left to right over
config/config.yaml), OUTDIR, WALL (seconds Snakemake ran), RC (its exit status).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pandas as pd
import yaml

from specpilot.agent.final import gain_over_stock
from specpilot.aggregate import build_table, read_forcing, with_regimes, write_table
from specpilot.joblog import gpu_seconds, gpu_seconds_lines, merge_gpu_seconds
from specpilot.records import read_records
from specpilot.regimes import regime_of, resolve

GPU = os.environ["GPU"]
OUT = Path(os.environ.get("OUTDIR", "results/gpu-study"))
RES = Path("results") / GPU
COLS = ["deployment", "benchmark", "regime", "concurrency", "n_requests", "stock_speedup", "specpilot_speedup",
        "specpilot_over_stock", "specpilot_over_stock_lo", "specpilot_over_stock_hi", "stock_tau", "specpilot_tau",
        "ar_prefill_share", "stock_prefill_share", "specpilot_prefill_share", "forcing", "synthetic", "note"]
PREDICTED_WITHIN = 0.05  # issue 61: the rounds' calibration gain over stock within 5 % of the cell's ratio


def merged_config() -> dict:
    cfg = yaml.safe_load(Path("config/config.yaml").read_text())
    for f in os.environ.get("CONFIG_FILES", "config/gpu.yaml").split():
        for k, v in (yaml.safe_load(Path(f).read_text()) or {}).items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k] = {**cfg[k], **{n: ({**cfg[k][n], **s} if isinstance(s, dict) and isinstance(cfg[k].get(n), dict)
                                           else s) for n, s in v.items()}}
            else:
                cfg[k] = v
    return cfg


def cell_concurrencies(cfg: dict) -> list[int]:
    return sorted(regime_of(resolve(cfg)))


def deployments(cfg: dict) -> list[str]:
    return [d for d, v in cfg["deployments"].items() if v.get("available", True)]


def table(cfg: dict) -> tuple[pd.DataFrame | None, bool]:
    """(table, complete): results/$GPU/table.csv, else the cells whose records all exist."""
    path = RES / "table.csv"
    if path.is_file():
        shutil.copy(path, OUT / "table.csv")
        return pd.read_csv(path), True
    records, forcing = [], []
    for d in deployments(cfg):
        for b in cfg["benchmarks"]:
            for c in cell_concurrencies(cfg):
                files = [RES / d / b / f"{e}-c{c}.jsonl" for e in cfg["engines"]]
                if all(f.is_file() for f in files):
                    for f in files:
                        records += read_records(f)
                    forcing += [str(p) for p in (RES / d / b).glob(f"*-c{c}.forcing.json")]
    if not records:
        return None, False
    df = build_table(records, read_forcing(forcing), "specpilot not run")
    df = with_regimes(df, regime_of(resolve(cfg)))
    write_table(df, OUT / "partial-table.csv")
    return df, False


def show_table(df: pd.DataFrame, complete: bool, cfg: dict) -> None:
    print(("TABLE" if complete else "PARTIAL TABLE (the run did not finish; cells with every engine's records)")
          + f" results/{GPU}:")
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 70):
        print(df[[c for c in COLS if c in df.columns]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"note: every cell's request generates {cfg['max_new_tokens']} new tokens (the study: 2048, "
          f"{cfg['max_new_tokens'] / 2048:.2f}x); *_prefill_share: the mean share of a request's end-to-end "
          "time in prefill and other requests' prefill stalls (issue 61: AR's <= 0.10 at c1, <= 0.25 at c16)")


def show_predictions(df: pd.DataFrame | None, cfg: dict) -> None:
    """Per (deployment, regime): the kept config's calibration gain over stock (its last round) beside
    the cell's specpilot / stock (the regime's geomean row), and whether they agree within 5 %."""
    print("\nROUNDS vs CELLS (per deployment and regime: the kept config's calibration gain over stock, "
          "the cell's specpilot/stock):")
    rows = df[(df["benchmark"] == "geomean") & (df["deployment"] != "all")] if df is not None else None
    for d in deployments(cfg):
        for r in resolve(cfg):
            rounds = sorted((RES / d / r / "rounds").glob("round-*/integrated.json"),
                            key=lambda p: int(p.parent.name.split("-")[1]))
            gain = gain_over_stock(json.loads(rounds[-1].read_text())) if rounds else None
            cell = rows[(rows["deployment"] == d) & (rows["regime"] == r)] if rows is not None and "regime" in rows \
                else None
            ratio = float(cell["specpilot_over_stock"].iloc[0]) if cell is not None and len(cell) else float("nan")
            agree = (f"{abs(gain / ratio - 1):.1%} apart (within {PREDICTED_WITHIN:.0%}: "
                     f"{'yes' if abs(gain / ratio - 1) <= PREDICTED_WITHIN else 'NO'})"
                     if gain is not None and ratio == ratio else "not comparable yet")
            print(f"  {d} {r}: calibration gain over stock {'-' if gain is None else f'{gain:.3f}'} "
                  f"({rounds[-1].parent.name if rounds else 'no round integrated'}); cell specpilot/stock "
                  f"{'-' if ratio != ratio else f'{ratio:.3f}'}; {agree}")


def show_gpu_seconds() -> None:
    """Every GPU job's device-held seconds (specpilot.joblog.gpu_seconds), this call's and the earlier
    calls' (logs/gpu-seconds.tsv travels in the resume archive), also when the time guard stopped the run."""
    rows = merge_gpu_seconds(Path("logs") / "gpu-seconds.tsv", gpu_seconds("logs"))
    shutil.copy(Path("logs") / "gpu-seconds.tsv", OUT / "gpu-seconds.tsv")
    print("\nGPU SECONDS (per job, every call so far; logs/gpu-seconds.tsv):")
    for line in gpu_seconds_lines(rows):
        print(f"  {line}")


def show_forcing() -> None:
    print("\nFORCING (per cell and engine: verdict, tokens checked, violations, near ties):")
    for f in sorted(RES.glob("*/*/*.forcing.json")):
        v = json.loads(f.read_text())
        print(f"  {f.relative_to(RES)}: {'pass' if v.get('passed') else 'FAIL'}, {v.get('tokens_checked')} tokens, "
              f"{v.get('violations')} violations, {v.get('near_ties')} near ties"
              + ("" if v.get("passed") else f"; first: {json.dumps((v.get('violation_list') or [None])[0])[:200]}"))


def show_rounds(cfg: dict) -> None:
    print("\nROUNDS (per deployment and regime: directions ranked by the cost model, memory carried, agents, kept):")
    for d in deployments(cfg):
        for plan in [p for r in resolve(cfg) for p in sorted((RES / d / r / "rounds").glob("round-*/plan.json"))]:
            p = json.loads(plan.read_text())
            rd = plan.parent
            ranked = ", ".join(f"{x['direction']} ({x['cost_term']} {1e3 * x['gap_s_per_token']:.3f} ms/token)"
                               for x in p.get("ranked_directions", []))
            print(f"  {d} {p.get('regime')} (tuned at c{p.get('concurrency')}) {rd.name}: ranked terms {', '.join(p['ranked_terms'])}; directions ranked {ranked or '-'}; "
                  f"chosen {p['directions'] or 'none'}")
            for t in p.get("memory_tried", []):
                print(f"    memory tried: {t['direction']} {json.dumps(t['params'])} from {t['from']}: passed "
                      f"{t['passed']}, gain {t['gain']}{' (' + t['note'] + ')' if t.get('note') else ''}")
            for t in p.get("memory_transferred", []):
                print(f"    memory transferred: {t['direction']} {json.dumps(t['params'])} gain {t['gain']:.3f}")
            for a in sorted(rd.glob("agent-*.json")):
                ag = json.loads(a.read_text())
                trials = "; ".join(f"{json.dumps(t.get('params'))} " + (
                    f"refused ({t['gate']['refused']})" if t["gate"].get("refused") else
                    "rejected by forcing" if not t["gate"]["passed"] else
                    f"gain {t['gain']:.3f} [{t['gain_lo']:.3f}, {t['gain_hi']:.3f}]") for t in ag["trials"])
                print(f"    agent {ag['direction']}: {trials or 'no trial'}; best "
                      f"{json.dumps(ag['best']['params']) if ag.get('best') else 'none'}")
            integ = rd / "integrated.json"
            if integ.is_file():
                i = json.loads(integ.read_text())
                print(f"    kept: {json.dumps(i['config'])} ({i['decision']}); gain over the base {i['gain_vs_base']}")


def bars(df: pd.DataFrame | None, complete: bool, cfg: dict) -> None:
    print("\nBARS (issues 46, 53 and 61):")
    wall, rc = int(os.environ.get("WALL", "0")), os.environ.get("RC", "?")
    print(f"  snakemake exit {rc}, {wall} s (<= 540 s: {'yes' if wall <= 540 else 'NO'}); whole table: "
          f"{'yes' if complete else 'NO'}")
    if df is None:
        return
    cells = df[df["benchmark"] != "geomean"]
    for d in deployments(cfg):
        rows = cells[cells["deployment"] == d]
        have = sorted(int(c) for c in rows["concurrency"])
        forcing = list(rows["forcing"])
        ok = []
        for _, r in rows.iterrows():
            ratio = r.get("specpilot_over_stock")
            note = str(r.get("note") or "")
            ok.append(bool(ratio == ratio and ratio >= 1.0) or "stock's config" in note)
        print(f"  {d}: concurrencies {have}; forcing {forcing}; specpilot >= stock or stock's config kept: {ok}")
        for r in resolve(cfg):
            plan1 = RES / d / r / "rounds" / "round-1" / "plan.json"
            if plan1.is_file():
                p = json.loads(plan1.read_text())
                print(f"    {r} round-1 plan: memory tried {[t['from'] for t in p.get('memory_tried', [])]}, "
                      f"transferred {[t['direction'] for t in p.get('memory_transferred', [])]}")
    regime_bars(df, cells)
    workload_bars(cells, cfg)


def workload_bars(cells: pd.DataFrame, cfg: dict) -> None:
    """Issue 61's bars per cell: the tokens each request generated (read from the cell's records: >= 512),
    AR's prefill share (<= 0.10 at c1, <= 0.25 at c16 and above: the cell measures decode), forcing, and
    specpilot / stock against the issue's bars (a bar is MET only when the tokens were measured as named)."""
    want = {("qwen3-8b", 1): 1.10, ("qwen3-8b", 16): 1.20, ("qwen3.8-27b", 16): 1.10, ("muse-glimmer-30b", 16): 1.10}
    need = int(cfg["max_new_tokens"])
    for _, r in cells.iterrows():
        d, b, c = r["deployment"], r["benchmark"], int(r["concurrency"])
        recs = [x for e in cfg["engines"] if (RES / d / b / f"{e}-c{c}.jsonl").is_file()
                for x in read_records(RES / d / b / f"{e}-c{c}.jsonl")]
        tokens = min((x.new_tokens for x in recs), default=0)
        ok_tokens = tokens >= max(need, 512) if GPU != "cpu" else tokens >= need
        share, limit = float(r.get("ar_prefill_share", float("nan"))), (0.10 if c == 1 else 0.25)
        ratio, lo = float(r.get("specpilot_over_stock", float("nan"))), float(r.get("specpilot_over_stock_lo", float("nan")))
        bar = want.get((d, c))
        print(f"  issue 61: {d} {r.get('regime')} c{c} {b}: {tokens} new tokens per request "
              f"({'as named' if ok_tokens else 'FEWER than named'}); AR prefill share {share:.3f} (<= {limit}: "
              f"{'MET' if ok_tokens and share <= limit else 'MISSED'}); forcing {r['forcing']}; specpilot/stock "
              f"{ratio:.3f} (low end {lo:.3f}, >= 0.98: {'yes' if lo >= 0.98 else 'NO'})"
              + (f"; bar >= {bar}: {'MET' if ok_tokens and ratio >= bar else 'MISSED'}" if bar else ""))


def regime_bars(df: pd.DataFrame, cells: pd.DataFrame) -> None:
    """Issue 53's bars: specpilot/stock per deployment and regime (geomean rows), and the cells whose
    interval lies below 0.98 with a config other than stock's."""
    summary = df[(df["benchmark"] == "geomean") & (df["deployment"] != "all")]
    want = {("qwen3-8b", "single"): 1.10, ("qwen3-8b", "batched"): 1.25, ("qwen3.8-27b", "batched"): 1.10,
            ("muse-glimmer-30b", "batched"): 1.10}
    for _, r in summary.iterrows():
        bar = want.get((r["deployment"], r.get("regime")))
        ratio, lo, hi = (float(r.get(k, float("nan"))) for k in
                         ("specpilot_over_stock", "specpilot_over_stock_lo", "specpilot_over_stock_hi"))
        print(f"  issue 53: {r['deployment']} {r.get('regime')} c{r['concurrency']}: specpilot/stock {ratio:.3f} "
              f"[{lo:.3f}, {hi:.3f}]" + (f"; bar >= {bar}: {'MET' if ratio >= bar else 'MISSED'}" if bar else ""))
    lo = pd.to_numeric(cells.get("specpilot_over_stock_lo"), errors="coerce")
    low = cells[(lo < 0.98) & ~cells["note"].fillna("").astype(str).str.contains("stock's config")]
    print("  issue 53: cells whose interval lies below 0.98 with a config other than stock's: "
          f"{[(r['deployment'], r.get('regime'), r['concurrency'], r['benchmark']) for _, r in low.iterrows()] or 'none'}")


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = merged_config()
    df, complete = table(cfg)
    if df is None:
        print(f"no engine cell finished under results/{GPU}")
    else:
        show_table(df, complete, cfg)
    show_forcing()
    show_rounds(cfg)
    show_predictions(df, cfg)
    bars(df, complete, cfg)
    show_gpu_seconds()
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())

"""The study table from hand-made records: means, forcing verdicts, summary rows, the CLI."""

import json
import math

import pandas as pd
import pytest

from specpilot.aggregate import build_table, forcing_key, geomean, read_forcing, run
from specpilot.errors import SpecpilotError
from specpilot.records import Record, write_records


def rec(engine, i, decode_s, new_tokens=10, steps=None, benchmark="gsm8k", deployment="tiny",
        concurrency=1, **kw):
    """One record; AR commits one token per step, others as given by ``steps``."""
    if steps is None:
        steps = [1] * (new_tokens - 1) if engine == "ar" else [3] * 3
    return Record(
        request_id=f"{benchmark}/{i:04d}", benchmark=benchmark, deployment=deployment,
        target="tiny", drafter="none" if engine == "ar" else "dflash", gpu="cpu", engine=engine,
        concurrency=concurrency, prompt_tokens=5, new_tokens=new_tokens, prefill_s=0.01,
        decode_s=decode_s, verify_steps=len(steps), committed_per_step=steps,
        output_ids=list(range(new_tokens)), **kw)


def cell_records(benchmark="gsm8k", deployment="tiny", concurrency=1, stock_times=(1.0, 4.0),
                 ar_times=(4.0, 4.0), new_tokens=(10, 10)):
    out = []
    for i, (a, s, n) in enumerate(zip(ar_times, stock_times, new_tokens)):
        out.append(rec("ar", i, a, n, benchmark=benchmark, deployment=deployment, concurrency=concurrency))
        out.append(rec("stock", i, s, n, benchmark=benchmark, deployment=deployment, concurrency=concurrency))
    return out


def cells(df):
    return df[(df.benchmark != "geomean") & (df.deployment != "all")]


def test_geomean_differs_from_arithmetic():
    # per-request speedups 4 and 1 -> geomean 2; arithmetic: mean AR TPOT 0.4 / mean stock TPOT 0.25
    df = build_table(cell_records())
    row = cells(df).iloc[0]
    assert row.stock_speedup == pytest.approx(2.0)
    assert row.stock_speedup_arith == pytest.approx(0.4 / 0.25)
    assert row.stock_speedup != pytest.approx(row.stock_speedup_arith)
    assert row.n_requests == 2
    assert row.ar_tok_s == pytest.approx(20 / 8.0)


def test_tau_over_steps_and_per_request():
    recs = [rec("ar", 0, 2.0, 7), rec("ar", 1, 2.0, 7),
            rec("stock", 0, 1.0, 7, steps=[4, 2]),          # request tau 3
            rec("stock", 1, 1.0, 7, steps=[1, 1, 1, 1, 1, 1])]  # request tau 1
    row = cells(build_table(recs)).iloc[0]
    assert row.stock_tau == pytest.approx(12 / 8)       # all steps pooled
    assert row.stock_tau_req == pytest.approx((3 + 1) / 2)


def test_mismatched_new_tokens_is_an_error():
    recs = [rec("ar", 0, 2.0, 10), rec("stock", 0, 1.0, 11)]
    with pytest.raises(SpecpilotError, match="new_tokens"):
        build_table(recs)


def test_mismatched_request_sets_is_an_error():
    recs = [rec("ar", 0, 2.0), rec("ar", 1, 2.0), rec("stock", 0, 1.0)]
    with pytest.raises(SpecpilotError, match="request ids differ"):
        build_table(recs)


def test_missing_ar_is_an_error():
    with pytest.raises(SpecpilotError, match="no AR records"):
        build_table([rec("stock", 0, 1.0)])


def test_forcing_fail_blanks_the_speedup():
    key = (("tiny", "gsm8k", 1), "stock")
    df = build_table(cell_records(), {key: {"passed": False, "violations": 3}})
    row = cells(df).iloc[0]
    assert row.forcing == "FAIL" and row.stock_forcing == "FAIL"
    assert math.isnan(row.stock_speedup) and math.isnan(row.stock_speedup_arith)
    assert math.isnan(row.stock_tau)
    assert "FAIL" in row.note
    summary = df[(df.deployment == "tiny") & (df.benchmark == "geomean")].iloc[0]
    assert summary.forcing == "FAIL" and math.isnan(summary.stock_speedup)


def test_forcing_fail_with_different_tokens_is_not_an_error():
    # a lossy engine may produce other tokens: the verdict is FAIL, not a crash
    recs = [rec("ar", 0, 2.0, 10), rec("stock", 0, 1.0, 12)]
    df = build_table(recs, {(("tiny", "gsm8k", 1), "stock"): {"passed": False, "violations": 1}})
    assert cells(df).iloc[0].forcing == "FAIL"


PASSED = {"passed": True, "violations": 0, "coverage": 1.0, "tokens_checked": 20, "tokens_generated": 20,
          "requests": 2}  # a verdict of specpilot.forcing over the two 10-token stock records


def test_forcing_pass_and_not_run():
    df = build_table(cell_records(), {(("tiny", "gsm8k", 1), "stock"): PASSED})
    assert cells(df).iloc[0].forcing == "pass"
    # "passed" alone is not enough: a verdict without full coverage, or over other records, fails
    for doc in ({"passed": True, "violations": 0}, {**PASSED, "coverage": 0.5, "tokens_checked": 10},
                {**PASSED, "tokens_generated": 30, "tokens_checked": 30}):
        row = cells(build_table(cell_records(), {(("tiny", "gsm8k", 1), "stock"): doc})).iloc[0]
        assert row.forcing == "FAIL" and math.isnan(row.stock_speedup)
    df = build_table(cell_records())
    row = cells(df).iloc[0]
    assert row.forcing == "not run" and row.stock_speedup == pytest.approx(2.0)


def test_specpilot_absent_is_empty_with_note():
    df = build_table(cell_records(), specpilot_note="specpilot not run: rounds missing")
    for _, row in df.iterrows():
        assert math.isnan(row.specpilot_speedup) and math.isnan(row.specpilot_tau)
        assert row.specpilot_forcing == "not run"
        assert "specpilot not run: rounds missing" in row.note


def test_summary_rows():
    recs = (cell_records("gsm8k", stock_times=(1.0, 1.0)) +              # speedup 4
            cell_records("mbpp", stock_times=(4.0, 4.0)) +               # speedup 1
            cell_records("gsm8k", deployment="other", stock_times=(2.0, 2.0)) +  # speedup 2
            cell_records("gsm8k", concurrency=16, stock_times=(0.5, 0.5)))       # speedup 8
    df = build_table(recs)
    assert list(df.columns[:14]) == [
        "deployment", "target", "drafter", "benchmark", "concurrency", "n_requests", "ar_tok_s",
        "stock_speedup", "specpilot_speedup", "stock_tau", "specpilot_tau", "forcing", "note",
        "synthetic"]
    s = df[df.benchmark == "geomean"].set_index(["deployment", "concurrency"])
    assert s.loc[("tiny", 1), "stock_speedup"] == pytest.approx(2.0)    # geomean(4, 1)
    assert s.loc[("tiny", 1), "n_requests"] == 4
    assert s.loc[("other", 1), "stock_speedup"] == pytest.approx(2.0)
    assert s.loc[("tiny", 16), "stock_speedup"] == pytest.approx(8.0)
    assert s.loc[("all", 1), "stock_speedup"] == pytest.approx((4 * 1 * 2) ** (1 / 3))
    assert s.loc[("all", 16), "stock_speedup"] == pytest.approx(8.0)
    assert s.loc[("all", 1), "target"] == "tiny"
    # cells come in benchmark order, each deployment's summary after its cells, "all" last
    assert list(df.benchmark[:3]) == ["gsm8k", "mbpp", "geomean"]
    assert list(df.deployment[-2:]) == ["all", "all"]


def test_geomean_helper():
    assert geomean([2, 8]) == pytest.approx(4)
    assert math.isnan(geomean([]))
    assert math.isnan(geomean([1.0, float("nan")]))
    assert math.isnan(geomean([1.0, 0.0]))


def test_forcing_key_from_path():
    assert forcing_key("results/cpu/tiny/mt-bench/specpilot-c16.forcing.json") == \
        (("tiny", "mt-bench", 16), "specpilot")
    with pytest.raises(SpecpilotError):
        forcing_key("results/cpu/tiny/mt-bench/stock.json")


def test_cli_writes_empty_fields_for_missing_values(tmp_path):
    d = tmp_path / "results" / "cpu" / "tiny" / "gsm8k"
    d.mkdir(parents=True)
    recs = cell_records()
    write_records(d / "ar-c1.jsonl", [r for r in recs if r.engine == "ar"])
    write_records(d / "stock-c1.jsonl", [r for r in recs if r.engine == "stock"])
    (d / "stock-c1.forcing.json").write_text(json.dumps({"passed": False, "violations": 2}))
    out = tmp_path / "table.csv"

    class Args:
        records = [str(d / "ar-c1.jsonl"), str(d / "stock-c1.jsonl")]
        forcing = [str(d / "stock-c1.forcing.json")]
        specpilot_note = "specpilot not run"

    Args.out = str(out)
    assert run(Args) == 0
    text = out.read_text().splitlines()
    header = text[0].split(",")
    first = dict(zip(header, text[1].split(",")))
    assert first["stock_speedup"] == "" and first["forcing"] == "FAIL"
    df = pd.read_csv(out)
    assert set(df.benchmark) == {"gsm8k", "geomean"}
    assert read_forcing([d / "stock-c1.forcing.json"])[(("tiny", "gsm8k", 1), "stock")]["violations"] == 2


def test_figures_from_table_with_missing_and_failed_values(tmp_path):
    from specpilot.aggregate import write_table
    from specpilot.figures import draw_all

    recs = cell_records("gsm8k") + cell_records("mbpp") + cell_records("gsm8k", concurrency=16)
    df = build_table(recs, {(("tiny", "mbpp", 1), "stock"): {"passed": False, "violations": 1}},
                     specpilot_note="specpilot not run: rounds missing")
    write_table(df, tmp_path / "table.csv")
    paths = draw_all(tmp_path / "table.csv", tmp_path / "figures")
    assert [p.name for p in paths] == ["speedup.png", "tau.png", "concurrency.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _noisy_cell(n, speed, spread, benchmark="gsm8k", with_specpilot=None):
    """n requests, AR 4 s; stock 4/speed s; repeats of each side spread by +-spread (relative)."""
    out = []
    for i in range(n):
        jitter = [1 - spread, 1 + spread]
        out.append(rec("ar", i, 4.0 * jitter[0], benchmark=benchmark,
                       decode_s_repeats=[4.0 * j for j in jitter]))
        out.append(rec("stock", i, 4.0 / speed * jitter[0], benchmark=benchmark,
                       decode_s_repeats=[4.0 / speed * j for j in jitter[::-1]]))
        if with_specpilot:
            t = 4.0 / with_specpilot
            out.append(rec("specpilot", i, t * jitter[0], benchmark=benchmark,
                           decode_s_repeats=[t * j for j in jitter]))
    return out


def test_speedup_interval_brackets_the_speedup_and_narrows_with_less_noise():
    wide = cells(build_table(_noisy_cell(6, 2.0, 0.3))).iloc[0]
    tight = cells(build_table(_noisy_cell(6, 2.0, 0.02))).iloc[0]
    for row in (wide, tight):
        assert row.stock_speedup_lo <= row.stock_speedup <= row.stock_speedup_hi
    # repeats differ by +-30 %: the interval spans it; +-2 %: within a few percent of 2
    assert wide.stock_speedup_hi / wide.stock_speedup_lo > 1.5
    assert tight.stock_speedup_hi / tight.stock_speedup_lo < 1.1
    assert tight.stock_speedup_lo > 1.9 and tight.stock_speedup_hi < 2.1
    # seeded: the same records give the same interval
    again = cells(build_table(_noisy_cell(6, 2.0, 0.3))).iloc[0]
    assert (again.stock_speedup_lo, again.stock_speedup_hi) == (wide.stock_speedup_lo, wide.stock_speedup_hi)


def test_specpilot_over_stock_ratio_and_summary_interval():
    recs = _noisy_cell(4, 2.0, 0.02, with_specpilot=3.0) + _noisy_cell(4, 2.0, 0.02, "math500", with_specpilot=2.0)
    df = build_table(recs)
    c = cells(df).set_index("benchmark")
    assert c.loc["gsm8k", "specpilot_over_stock"] == pytest.approx(1.5)
    assert c.loc["math500", "specpilot_over_stock"] == pytest.approx(1.0)
    assert c.loc["gsm8k", "specpilot_over_stock_lo"] > 1.3       # clearly above 1
    assert c.loc["math500", "specpilot_over_stock_lo"] < 1.0 < c.loc["math500", "specpilot_over_stock_hi"]
    s = df[(df.benchmark == "geomean") & (df.deployment == "tiny")].iloc[0]
    assert s.specpilot_over_stock == pytest.approx(math.sqrt(1.5))
    assert s.specpilot_over_stock_lo < s.specpilot_over_stock < s.specpilot_over_stock_hi

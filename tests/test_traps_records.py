"""Records, table and file traps (issue 12): records validated on read, full-precision table
values, the loaded-machine warning from repeated timings, files readable by others."""

from __future__ import annotations

import json
import math
import os
import stat

import pandas as pd
import pytest

from specpilot.aggregate import build_table, run as table_run, write_table
from specpilot.errors import SpecpilotError
from specpilot.io import write_json, write_jsonl
from specpilot.records import Record, read_records, write_records


def rec(engine, i, decode_s, new_tokens=10, steps=None, repeats=None, benchmark="gsm8k"):
    if steps is None:
        steps = [1] * (new_tokens - 1) if engine == "ar" else [3] * 3
    extra = {} if repeats is None else {"decode_s_repeats": repeats}
    return Record(request_id=f"{benchmark}/{i:04d}", benchmark=benchmark, deployment="tiny", target="tiny",
                  drafter="none" if engine == "ar" else "dflash", gpu="cpu", engine=engine, concurrency=1,
                  prompt_tokens=5, new_tokens=new_tokens, prefill_s=0.01, decode_s=decode_s,
                  verify_steps=len(steps), committed_per_step=steps, output_ids=list(range(new_tokens)),
                  **extra)


def _write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("change,match", [
    ({"committed_per_step": [3, 3, 3, 3, 3, 3], "verify_steps": 6}, r"committed_per_step sums to 18, but new_tokens - 1 = 9"),
    ({"verify_steps": 4}, r"verify_steps is 4 but committed_per_step has 3 entries"),
    ({"new_tokens": 11}, r"new_tokens is 11 but output_ids holds 10"),
    ({"committed_per_step": [3, -3, 9]}, r"committed_per_step must be a list of non-negative integers"),
    ({"decode_s": -1.0}, r"decode_s must be a finite number"),
])
def test_inconsistent_record_is_refused_naming_file_line_request(tmp_path, change, match):
    good = [rec("stock", i, 1.0).to_dict() for i in range(3)]
    bad = {**good[1], **change}
    path = tmp_path / "stock-c1.jsonl"
    _write_lines(path, [good[0], bad, good[2]])
    with pytest.raises(SpecpilotError, match=match) as info:
        read_records(path)
    assert f"{path}:2: request 'gsm8k/0001' (stock)" in str(info.value)


def test_doubled_steps_do_not_reach_the_table(tmp_path):
    """The issue's case: a doubled committed_per_step list raised a table tau; now the table job fails."""
    ar = tmp_path / "ar-c1.jsonl"
    stock = tmp_path / "stock-c1.jsonl"
    write_records(ar, [rec("ar", 0, 2.0)])
    doubled = rec("stock", 0, 1.0).to_dict()
    doubled["committed_per_step"] = doubled["committed_per_step"] * 2
    doubled["verify_steps"] = len(doubled["committed_per_step"])
    _write_lines(stock, [doubled])

    class Args:
        records = [str(ar), str(stock)]
        forcing = []
        specpilot_note = "x"
        out = str(tmp_path / "table.csv")
        max_spread = 0.25

    with pytest.raises(SpecpilotError, match="sums to 18"):
        table_run(Args)
    assert not (tmp_path / "table.csv").exists()


def test_table_values_at_full_precision(tmp_path):
    recs = [rec("ar", 0, 1.0 / 3.0), rec("stock", 0, 0.123456789012345),
            rec("ar", 1, 2.0 / 7.0), rec("stock", 1, 0.1 + 1e-12)]
    df = build_table(recs)
    write_table(df, tmp_path / "t.csv")
    back = pd.read_csv(tmp_path / "t.csv", keep_default_na=False, na_values=[""])
    cell = back[back.benchmark == "gsm8k"].iloc[0]
    # an independent recomputation from the records matches exactly, not to 6 digits
    expect = math.exp((math.log((1 / 3) / 0.123456789012345) + math.log((2 / 7) / (0.1 + 1e-12))) / 2)
    assert cell.stock_speedup == pytest.approx(expect, rel=1e-15, abs=0)
    assert cell.ar_tok_s == 20 / (1 / 3 + 2 / 7)


def test_loaded_machine_warning_from_repeated_timings(tmp_path, caplog):
    calm = [rec("ar", 0, 1.0, repeats=[1.0, 1.05]), rec("stock", 0, 0.5, repeats=[0.52, 0.5])]
    loaded = [rec("ar", 0, 1.0, benchmark="mbpp", repeats=[1.0, 30.0]),
              rec("stock", 0, 0.5, benchmark="mbpp", repeats=[0.5, 0.55])]
    once = [rec("ar", 0, 1.0, benchmark="math500"), rec("stock", 0, 0.5, benchmark="math500")]
    with caplog.at_level("WARNING", logger="specpilot.table"):
        df = build_table(calm + loaded + once, max_spread=0.25)  # noqa: the keyword is new
    by = {b: r for b, r in zip(df.benchmark, df.to_dict("records")) if r["deployment"] == "tiny"}
    assert by["gsm8k"]["timing_spread"] == pytest.approx(0.05) and by["gsm8k"]["timing_warning"] is False
    assert by["mbpp"]["timing_spread"] == pytest.approx(29.0) and by["mbpp"]["timing_warning"] is True
    assert "unstable timing" in by["mbpp"]["note"] and "unstable timing" not in by["gsm8k"]["note"]
    assert math.isnan(by["math500"]["timing_spread"]) and by["math500"]["timing_warning"] is False
    assert by["geomean"]["timing_warning"] is True and "tiny/mbpp" in by["geomean"]["note"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "tiny/mbpp/c1" in warnings[0]
    # the figures mark exactly that cell
    from specpilot.figures import per_benchmark

    write_table(df, tmp_path / "t.csv")
    table = pd.read_csv(tmp_path / "t.csv", keep_default_na=False, na_values=[""])
    marked = per_benchmark(table, "speedup", "x", "t", tmp_path / "s.png", 1.0)
    assert marked == [("tiny", "mbpp", "stock"), ("tiny", "geomean", "stock")]  # and the summary covering it
    assert per_benchmark(table, "tau", "x", "t", tmp_path / "t.png", 1.0) == []  # tau is not timed: no mark


def test_merge_repeats_keeps_fastest_and_checks_tokens():
    from specpilot.records import merge_repeats

    a = [rec("stock", 0, 1.0), rec("stock", 1, 3.0)]
    b = [rec("stock", 0, 2.0), rec("stock", 1, 2.5)]
    merged = merge_repeats([a, b])
    assert [r.decode_s for r in merged] == [1.0, 2.5]
    assert [r.decode_s_repeats for r in merged] == [[1.0, 2.0], [3.0, 2.5]]
    c = [rec("stock", 0, 1.0), rec("stock", 1, 1.0)]
    c[1].output_ids = list(range(1, 11))
    with pytest.raises(SpecpilotError, match="gsm8k/0001.*not deterministic"):
        merge_repeats([a, c])
    assert merge_repeats([a]) == a


def test_atomic_files_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        write_jsonl(tmp_path / "b.jsonl", [{"x": 1}])
        os.umask(0o077)  # a private umask is respected too
        write_json(tmp_path / "c.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.jsonl").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "c.json").stat().st_mode) == 0o600


def _cell(benchmark, stock_repeats):
    """Four requests: AR steady, stock's repeats as given per request (the fastest is decode_s)."""
    recs = []
    for i, reps in enumerate(stock_repeats):
        recs += [rec("ar", i, 1.0, benchmark=benchmark, repeats=[1.0, 1.02]),
                 rec("stock", i, min(reps), benchmark=benchmark, repeats=reps)]
    return recs


def test_mark_follows_the_figure_not_one_repeat():
    """Issue 56: the mark says the reported speedup depends on which repeat was kept. A planted
    unstable request (stock 3x slower once) moves a 4-request geomean by 3 ** (1/4) - 1 = 32 %:
    marked; stable repeats are not; one request 40 % slower once moves it by 9 %: not marked
    (the old per-request spread, 40 % > 25 %, marked it)."""
    stable = _cell("gsm8k", [[0.5, 0.51], [0.5, 0.52], [0.4, 0.41], [0.6, 0.6]])
    planted = _cell("mbpp", [[0.5, 1.5], [0.5, 0.52], [0.4, 0.41], [0.6, 0.6]])
    one_slow = _cell("math500", [[0.5, 0.7], [0.5, 0.51], [0.4, 0.41], [0.6, 0.6]])
    df = build_table(stable + planted + one_slow, max_spread=0.25)
    by = {b: r for b, r in zip(df.benchmark, df.to_dict("records")) if r["deployment"] == "tiny"}
    gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    assert by["mbpp"]["timing_spread"] == pytest.approx(gm([3.0, 0.52 / 0.5, 0.41 / 0.4, 1.0]) - 1)
    assert by["mbpp"]["timing_warning"] is True and "unstable timing" in by["mbpp"]["note"]
    assert by["gsm8k"]["timing_warning"] is False and by["gsm8k"]["timing_spread"] < 0.03
    assert by["math500"]["timing_spread"] == pytest.approx(gm([1.4, 1.02, 0.41 / 0.4, 1.0]) - 1)
    assert by["math500"]["timing_warning"] is False
    # the figure really moves by timing_spread: stock's slowest repeats in place of its fastest
    slow = [rec(r.engine, int(r.request_id[-4:]), max(r.decode_s_repeats), benchmark="mbpp")
            if r.engine == "stock" else r for r in planted]
    moved = build_table(slow).set_index("benchmark").loc["mbpp", "stock_speedup"]
    assert by["mbpp"]["stock_speedup"] / moved == pytest.approx(1 + by["mbpp"]["timing_spread"])

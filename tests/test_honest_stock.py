"""Stock at its drafter's own block (issue 45): ``auto`` in the CLIs, the rounds and the configs; a
stock block other than the drafter's trained one only with a reason, which the table's note shows.

On the quick deployment (drafters trained at block 8; DSpark gamma 7), a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from specpilot.aggregate import build_table
from specpilot.cli import main
from specpilot.records import read_records

ROOT = Path(__file__).resolve().parents[1]


def _run(quick_deployment, tmp_path, kind, *extra):
    rows = [{"request_id": "gsm8k/0", "benchmark": "gsm8k", "prompt_ids": list(range(5, 40))}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = [tmp_path / f"{e}-{kind}.jsonl" for e in ("ar", "stock")]
    rc = main(["run", "--engine", "ar,stock", "--target", str(quick_deployment / "target"), "--drafter",
               str(quick_deployment / f"drafter-{kind}"), "--drafter-name", kind, "--prompts", str(prompts),
               "--out", ",".join(map(str, outs)), "--max-new-tokens", "12", "--device", "cpu", *extra])
    return rc, outs


def test_stock_runs_at_its_drafters_block_by_default(quick_deployment, tmp_path):
    for kind, trained in (("dflash", 8), ("dspark", 7)):
        rc, (_, stock) = _run(quick_deployment, tmp_path, kind)
        assert rc == 0
        assert {r.engine_config["block_size"] for r in read_records(stock)} == {trained}
        assert all("block_reason" not in r.engine_config for r in read_records(stock))


def test_another_stock_block_needs_a_reason_that_the_table_shows(quick_deployment, tmp_path, capsys):
    rc, (_, stock) = _run(quick_deployment, tmp_path, "dflash", "--block-size", "6")
    err = capsys.readouterr().err
    assert rc == 2 and "stock block 6 is not the block its drafter was trained for (8" in err
    assert "block_reason" in err and not stock.exists()
    rc, (ar, stock) = _run(quick_deployment, tmp_path, "dflash", "--block-size", "6", "--block-reason",
                           "the study's block")
    assert rc == 0
    recs = read_records(stock)
    assert recs[0].engine_config["block_size"] == 6
    assert recs[0].engine_config["block_reason"] == "the study's block (stock block 6; the drafter was trained at 8)"
    table = build_table(read_records(ar) + recs, {})
    row = table[table.benchmark == "gsm8k"].iloc[0]
    assert "stock block: the study's block (stock block 6; the drafter was trained at 8)" in row.note
    rc, _ = _run(quick_deployment, tmp_path, "dflash", "--block-size", "8", "--block-reason", "x")
    assert rc == 2 and "--block-reason given, but stock runs at its drafter's trained block 8" in \
        capsys.readouterr().err


def test_the_rounds_resolve_auto(quick_deployment, quick_prompts, tmp_path, capsys):
    rows = [p for p in quick_prompts if p["benchmark"] == "gsm8k"][:1]
    prompts = tmp_path / "cal.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["round", "references", "--target", str(quick_deployment / "target"), "--drafter",
               str(quick_deployment / "drafter-dspark"), "--drafter-name", "dspark", "--prompts", str(prompts),
               "--max-new-tokens", "8", "--repeats", "1", "--block-size", "auto", "--out", str(tmp_path / "ar.jsonl"),
               "--out-stock", str(tmp_path / "stock.jsonl")])
    assert rc == 0 and "(block 7)" in capsys.readouterr().out
    assert {r.engine_config["block_size"] for r in read_records(tmp_path / "stock.jsonl")} == {7}


def test_the_shipped_configs_run_stock_at_the_drafters_block():
    for name in ("config.yaml", "tiny-all.yaml"):
        deps = yaml.safe_load((ROOT / "config" / name).read_text())["deployments"]
        for dep, d in deps.items():
            assert d["block_size"] == "auto" or d.get("block_reason") or d.get("available") is False, (name, dep)

"""The typed engine config (issues 33 and 34): parsed once, strictly; one error naming the key, the
value and what is allowed; nothing run and no record written for a bad config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specpilot.engine.config import FIELDS, EngineConfig, EngineSpec, tree_width_of
from specpilot.errors import SpecpilotError


@pytest.mark.parametrize("raw, key, words", [
    ({"block_sise": 8}, "block_sise", "did you mean 'block_size'"),       # a misspelt key
    ({"tree_branch": "4"}, "tree_branch", "'4' (a string)"),              # a string for an integer
    ({"block_size": 8.5}, "block_size", "8.5 (a number)"),                # a float for an integer: not silently 8
    ({"second_level": True}, "second_level", "True (a boolean)"),         # a boolean for a number: not 1
    ({"tree_depth": -1}, "tree_depth", "an integer >= 0"),                # out of range
    ({"confidence_threshold": 1.5}, "confidence_threshold", "[0, 1)"),
    ({"verify_budget": "wide"}, "verify_budget", "'off', 'load_aware'"),
    ({"overlap": "yes"}, "overlap", "true or false"),
    ({"weight_format": "int4"}, "weight_format", "'w12'"),
    ({"accept": "lenient"}, "accept", "greedy"),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(raw, key, words):
    with pytest.raises(SpecpilotError) as e:
        EngineConfig.parse(raw, "specpilot.json")
    msg = str(e.value)
    assert msg.startswith("specpilot.json: ") and key in msg and words in msg, msg
    assert "\n" not in msg  # one line


@pytest.mark.parametrize("raw", [[{"block_size": 8}], "block_size: 8", 8])
def test_a_config_that_is_not_an_object_is_refused(raw):
    with pytest.raises(SpecpilotError, match="must be a JSON object"):
        EngineConfig.parse(raw, "cfg.json")


def test_good_values_are_kept_typed_and_recorded_as_given():
    cfg = EngineConfig.parse({"tree_branch": 2, "tree_depth": 3, "overlap": True, "block_size": "auto"})
    assert (cfg.tree_branch, cfg.tree_depth, cfg.overlap, cfg.block_size) == (2, 3, True, "auto")
    assert cfg.second_level == FIELDS["second_level"][0] == 0 and not cfg.is_set("second_level")
    assert cfg.to_dict() == {"tree_branch": 2, "tree_depth": 3, "overlap": True, "block_size": "auto"}
    assert EngineConfig.parse({"kernels": {"applies": True}}, record=True).to_dict() == {}  # a record's CLI field
    with pytest.raises(SpecpilotError, match="kernels"):
        EngineConfig.parse({"kernels": {}})  # not an engine setting
    spec = EngineSpec("specpilot", 6, {"tree_branch": 2})
    assert spec.record_config() == {"block_size": 6, "tree_branch": 2}
    assert spec.verify_width == 6 + 1 + 2 * 1
    assert EngineSpec("ar").record_config() == {"block_size": 1}
    with pytest.raises(SpecpilotError, match="tree_nodes"):
        cfg.replace(tree_nodes=-3)


def test_tree_width_of_a_record_config():
    assert tree_width_of({"block_size": 8}) == 0  # a chain
    assert tree_width_of({"block_size": 8, "tree_branch": 2, "tree_depth": 2}) == 8 + 1 + 4
    assert tree_width_of({"tree_nodes": 31}) == 32
    assert tree_width_of({"tree_branch": "2", "block_size": 8}) > 64  # malformed: checked eagerly


def test_cli_refuses_a_bad_config_before_any_work(tmp_path):
    """`specpilot run` with a bad engine config: exit 2, one line naming the file, key and value,
    and no records file (the target is never loaded: its path does not even exist)."""
    bad = tmp_path / "specpilot.json"
    bad.write_text(json.dumps({"engine_config": {"block_size": 8, "tree_brnch": 2}}))
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"request_id": "gsm8k/0", "benchmark": "gsm8k", "prompt_ids": [1, 2]}) + "\n")
    r = subprocess.run([sys.executable, "-m", "specpilot", "run", "--engine", "specpilot", "--target",
                        str(tmp_path / "no-target"), "--drafter", str(tmp_path / "no-drafter"), "--prompts",
                        str(prompts), "--out", str(out), "--engine-config", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tree_brnch" in lines[0] and "tree_branch" in lines[0] and str(bad) in lines[0]
    assert not out.exists()
    bad.write_text(json.dumps([8]))
    r = subprocess.run([sys.executable, "-m", "specpilot", "run", "--engine", "specpilot", "--target", "t",
                        "--drafter", "d", "--prompts", str(prompts), "--out", str(out), "--engine-config", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "JSON object" in r.stderr


@pytest.mark.parametrize("raw, key, needs", [
    ({"tree_depth": 3}, "tree_depth", "tree_branch > 0"),
    ({"tree_branch": 0, "tree_depth": 2}, "tree_depth", "tree_branch > 0"),
    ({"tree_profile": "dflash"}, "tree_profile", "tree_nodes > 0"),
])
def test_a_key_without_effect_in_its_context_is_refused(raw, key, needs):
    """A config that says more than it does (issue 45): the key and what it needs are named."""
    with pytest.raises(SpecpilotError) as e:
        EngineConfig.parse(raw, "specpilot.json")
    assert str(e.value).startswith(f"specpilot.json: {key} = ") and needs in str(e.value)
    assert EngineConfig.parse(raw, record=True).to_dict() == raw  # records are read as the engine wrote them


@pytest.mark.parametrize("content", ["null", '{"engine_config": null}'])
def test_cli_refuses_a_null_engine_config(tmp_path, content, capsys):
    """JSON null is not silently "no mechanisms" (issue 45): one line naming the file, nothing run."""
    from specpilot.cli import main

    cfg = tmp_path / "specpilot.json"
    cfg.write_text(content)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"request_id": "gsm8k/0", "benchmark": "gsm8k", "prompt_ids": [1, 2]}) + "\n")
    rc = main(["run", "--engine", "specpilot", "--target", "t", "--drafter", "d", "--block-size", "8",
               "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--engine-config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{cfg}: the engine config is JSON null" in err and not (tmp_path / "o.jsonl").exists()

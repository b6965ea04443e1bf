"""Benchmark loading, prompt formats, subsets, prompt files and training pairs (local data)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from specpilot import prompts as bm
from specpilot.cli import main as cli_main
from specpilot.errors import SpecpilotError
from specpilot.io import read_jsonl
from specpilot.tiny.tokenizer import build_tokenizer

DATA = Path(os.environ.get("SPECPILOT_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks")
pytestmark = pytest.mark.skipif(not (DATA / "MANIFEST.json").is_file(), reason=f"benchmark data not found at {DATA}")

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    texts = [bm.load_rows("humaneval", DATA)[i]["prompt"] for i in range(40)]
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(texts, 600, out)
    return out


def _jsonl(rel):
    with open(DATA / rel, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("name,count,reserved", [("gsm8k", 1319, 0), ("humaneval", 164, 8), ("math500", 500, 8),
                                                ("mbpp", 500, 0), ("mt-bench", 80, 8)])
def test_row_counts(name, count, reserved):
    assert len(bm.load_rows(name, DATA)) == count
    # benchmarks without a train split keep a fixed calibration reserve out of evaluation
    assert len(bm.select(name, "all", data_dir=DATA)) == count - reserved


def test_mbpp_is_test_split_in_file_order():
    rows = bm.load_rows("mbpp", DATA)
    assert [r["task_id"] for r in rows] == list(range(11, 511))
    first = bm.select("mbpp", "all", data_dir=DATA)
    by_id = {r["request_id"]: r for r in first}
    assert by_id["mbpp/0000"]["turns"] == [rows[0]["text"]]  # mbpp/0000 is task 11


def test_prompt_formats_exact():
    def first(name):
        return {r["request_id"]: r["turns"] for r in bm.select(name, "all", data_dir=DATA)}

    gq = _jsonl("gsm8k/test.jsonl")[0]["question"]
    assert gq.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first("gsm8k")["gsm8k/0000"] == [gq + "\nPlease reason step by step, and put your final answer within \\boxed{}."]
    mp = _jsonl("math500/test.jsonl")[0]["problem"]
    assert first("math500")["math500/0000"] == [mp + BOXED]
    hp = _jsonl("humaneval/test.jsonl")[0]["prompt"]
    assert first("humaneval")["humaneval/0000"] == [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n" + hp + "\n```"
    ]
    assert first("mbpp")["mbpp/0000"] == [
        "Write a python function to remove first and last occurrence of a given character from the string."
    ]
    assert first("mt-bench")["mt-bench/0000"] == [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
        "and must-see attractions.",
        "Rewrite your previous response. Start every sentence with the letter A.",
    ]


def test_request_ids_point_at_their_rows():
    rows = bm.load_rows("gsm8k", DATA)
    sel = bm.select("gsm8k", 50, seed=3, data_dir=DATA)
    for r in sel:
        assert re.fullmatch(r"gsm8k/\d{4}", r["request_id"]) and r["benchmark"] == "gsm8k"
        assert r["turns"] == [rows[int(r["request_id"][-4:])]["question"] + BOXED]


def test_subsets_deterministic_and_pinned():
    ids = lambda **kw: [r["request_id"] for r in bm.select("gsm8k", data_dir=DATA, **kw)]  # noqa: E731
    # pinned: changing the permutation silently changes every subset of the study
    assert ids(n=5) == ["gsm8k/1101", "gsm8k/0120", "gsm8k/0474", "gsm8k/0991", "gsm8k/0192"]
    assert ids(n=3, role="calibration") == ["gsm8k/train-1333", "gsm8k/train-2527", "gsm8k/train-6689"]
    assert ids(n=40) == ids(n=40)
    assert ids(n=40)[:10] == ids(n=10)
    assert ids(n=40, seed=1) != ids(n=40)
    assert ids(n=0) == ids(n="all") and sorted(ids(n=0)) == [f"gsm8k/{i:04d}" for i in range(1319)]
    assert ids(n=3, role="calibration", seed=5) != ids(n=3, role="calibration")
    assert ids(n=8, role="calibration")[:3] == ids(n=3, role="calibration")


@pytest.mark.parametrize("name", bm.BENCHMARKS)
def test_calibration_disjoint_from_every_eval_prompt(name):
    """n_prompts: all (the study config) leaves room for calibration on every benchmark, and no
    calibration prompt is an evaluation prompt, by id or by text, for any seed."""
    for seed in (0, 1):
        ev = bm.select(name, "all", seed=seed, data_dir=DATA, n_eval="all")
        cal = bm.select(name, 8, role="calibration", seed=seed, data_dir=DATA, n_eval="all")
        assert len(cal) == 8 and len({r["request_id"] for r in cal}) == 8
        assert not {r["request_id"] for r in ev} & {r["request_id"] for r in cal}
        assert not {t for r in ev for t in r["turns"]} & {t for r in cal for t in r["turns"]}
        # the calibration rows do not depend on how many eval prompts there are
        assert cal == bm.select(name, 8, role="calibration", seed=seed, data_dir=DATA, n_eval=4)
    source = {"gsm8k": r"gsm8k/train-\d{4}", "mbpp": r"mbpp/task-\d{4}"}.get(name, rf"{name}/\d{{4}}")
    assert all(re.fullmatch(source, r["request_id"]) for r in cal)
    if name == "mbpp":
        assert all(int(r["request_id"][-4:]) not in bm.MBPP_TEST_TASK_IDS for r in cal)
    with pytest.raises(SpecpilotError, match="calibration_prompts"):
        bm.select(name, len(bm.calibration_pool(name, DATA)) + 1, role="calibration", data_dir=DATA)
    with pytest.raises(SpecpilotError, match="calibration"):
        bm.select(name, "all", role="calibration", data_dir=DATA)


def test_calibration_cli_with_all_eval_prompts(tok_dir, tmp_path):
    """`specpilot prompts --role calibration --n-eval all` (what the workflow runs for the study
    config) writes its prompts; it refused before the calibration rows had a source of their own."""
    out = tmp_path / "cal.jsonl"
    rc = cli_main(["prompts", "--tokenizer", str(tok_dir), "--benchmark", "gsm8k", "--role", "calibration",
                   "--n-prompts", "2", "--n-eval", "all", "--data-dir", str(DATA), "--out", str(out)])
    assert rc == 0 and [r["request_id"] for r in read_jsonl(out)] == ["gsm8k/train-1333", "gsm8k/train-2527"]


@pytest.mark.parametrize("kwargs,match", [
    ({"benchmark": "gsm9k", "n": 1}, "gsm9k.*gsm8k, humaneval, math500, mbpp, mt-bench"),
    ({"benchmark": "mt-bench", "n": 81}, "n=81"),
    ({"benchmark": "mt-bench", "n": -1}, "-1"),
    ({"benchmark": "mt-bench", "n": "lots"}, "lots"),
    ({"benchmark": "mt-bench", "n": 1, "role": "train"}, "train"),
])
def test_select_bad_input(kwargs, match):
    with pytest.raises(SpecpilotError, match=match):
        bm.select(data_dir=DATA, **kwargs)


def test_bad_data_dir(tmp_path):
    with pytest.raises(SpecpilotError, match="nowhere"):
        bm.load_rows("gsm8k", tmp_path / "nowhere")
    with pytest.raises(SpecpilotError, match=r"gsm8k.*test\.jsonl"):
        bm.load_rows("gsm8k", tmp_path)


def test_training_pairs_exclude_test_rows():
    pairs = bm.training_pairs(DATA)
    mbpp = _jsonl("mbpp/mbpp.jsonl")
    test_mbpp = [r for r in mbpp if 11 <= r["task_id"] <= 510]
    users = {u for u, _ in pairs}
    answers = {a for _, a in pairs}
    assert not users & {r["text"] for r in test_mbpp}
    assert not answers & {r["code"].replace("\r\n", "\n") for r in test_mbpp}
    assert not users & {r["question"] + BOXED for r in _jsonl("gsm8k/test.jsonl")}
    assert not users & {r["question"] for r in _jsonl("gsm8k/test.jsonl")}
    # calibration prompts are never training text either
    assert not users & {t for b in ("gsm8k", "mbpp") for r in bm.calibration_pool(b, DATA) for t in r["turns"]}
    # 7473 gsm8k train + 474 mbpp non-test tasks - 3 whose text repeats a test task (602, 704, 872)
    # - 64 + 64 reserved for calibration
    assert len(pairs) == 7473 + 474 - 3 - 2 * bm.TRAIN_RESERVE
    train0 = _jsonl("gsm8k/train.jsonl")[0]
    assert pairs[0] == (train0["question"] + BOXED, train0["answer"])
    task1 = next(r for r in mbpp if r["task_id"] == 1)
    assert (task1["text"], task1["code"].replace("\r\n", "\n")) in pairs
    assert all("\r\n" not in a for _, a in pairs)


def test_missing_source_is_one_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECPILOT_DATA_DIR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    # as a user without the data folder beside the repository: no local data anywhere
    script = ("import sys, specpilot.prompts.sources as p; from pathlib import Path; "
              f"p.repo_data_dir = lambda repo=None: Path({str(tmp_path / 'none')!r}); "
              "from specpilot.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run(
        [sys.executable, "-c", script, "prompts", "--tokenizer", str(tmp_path), "--benchmark", "math500",
         "--n-prompts", "2", "--out", str(tmp_path / "p.jsonl")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "'math500'" in lines[0] and "no local data dir" in lines[0] and "SPECPILOT_DATA_DIR" in lines[0]
    assert not (tmp_path / "p.jsonl").exists()


def test_hub_rows_mapped_to_local_layout(monkeypatch, tmp_path):
    """Hub copies differ from the local files: mbpp comes split-wise, mt-bench names turns 'prompt'."""
    calls = []

    class FakeDS(list):
        def to_list(self):
            return list(self)

    def load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        if repo == "HuggingFaceH4/mt_bench_prompts":
            return FakeDS([{"prompt": ["a", "b"], "prompt_id": 7, "category": "x", "reference": []}])
        return FakeDS([{"task_id": {"prompt": 1, "test": 11, "validation": 511, "train": 601}[split] + k,
                        "text": f"{split}{k}", "code": "c"} for k in (1, 0)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("SPECPILOT_DATA_DIR", raising=False)
    monkeypatch.setattr(bm.sources, "repo_data_dir", lambda repo=None: tmp_path / "none")
    assert bm.select("mt-bench", 1) == [{"request_id": "mt-bench/0000", "benchmark": "mt-bench", "turns": ["a", "b"]}]
    assert [r["task_id"] for r in bm.load_rows("mbpp")] == [11, 12]
    assert ("google-research-datasets/mbpp", "full", "train") in calls


def test_cli_writes_prompt_file(tok_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "sub" / "humaneval.jsonl"
    rc = cli_main(["prompts", "--tokenizer", str(tok_dir), "--benchmark", "humaneval", "--n-prompts", "3",
                   "--data-dir", str(DATA), "--out", str(out)])
    assert rc == 0
    rows = read_jsonl(out)
    sel = bm.select("humaneval", 3, data_dir=DATA)
    assert [r["request_id"] for r in rows] == [r["request_id"] for r in sel]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for row, s in zip(rows, sel):
        assert set(row) == {"request_id", "benchmark", "prompt_text", "prompt_ids", "turns", "chat_template_kwargs"}
        assert row["chat_template_kwargs"] == {"enable_thinking": False}
        assert row["benchmark"] == "humaneval" and row["turns"] == s["turns"]
        assert row["prompt_text"] == CHAT.format(s["turns"][0])
        tail = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        assert tail[0] == 1 and row["prompt_ids"][0] == 1 and row["prompt_ids"][-len(tail):] == tail
        assert row["prompt_ids"] == tok(row["prompt_text"], add_special_tokens=False)["input_ids"]
        assert tok.decode(row["prompt_ids"]) == row["prompt_text"]
    assert [p.name for p in out.parent.iterdir()] == ["humaneval.jsonl"]  # no temp files left


def test_cli_bad_benchmark_is_one_line(tok_dir, tmp_path, capsys):
    rc = cli_main(["prompts", "--tokenizer", str(tok_dir), "--benchmark", "gsm9k", "--n-prompts", "3",
                   "--data-dir", str(DATA), "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "'gsm9k'" in err and all(name in err for name in bm.BENCHMARKS)


def test_max_prompt_tokens(tok_dir, tmp_path):
    rows = bm.write_prompt_file("mt-bench", tok_dir, tmp_path / "a.jsonl", 5, data_dir=DATA)
    longest = max(rows, key=lambda r: len(r["prompt_ids"]))
    n = len(longest["prompt_ids"])
    bm.write_prompt_file("mt-bench", tok_dir, tmp_path / "b.jsonl", 5, data_dir=DATA, max_prompt_tokens=n)
    with pytest.raises(SpecpilotError, match=f"{longest['request_id']} has {n} tokens"):
        bm.write_prompt_file("mt-bench", tok_dir, tmp_path / "c.jsonl", 5, data_dir=DATA, max_prompt_tokens=n - 1)
    assert not (tmp_path / "c.jsonl").exists()
    with pytest.raises(SpecpilotError, match="max_prompt_tokens"):
        bm.write_prompt_file("mt-bench", tok_dir, tmp_path / "d.jsonl", 5, data_dir=DATA, max_prompt_tokens=0)


def test_format_prompt_multi_turn(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert bm.format_prompt(tok, msgs) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(SpecpilotError, match="content"):
        bm.format_prompt(tok, [{"role": "user"}])


def test_data_dir_resolution_order(tmp_path, monkeypatch):
    """config data_dir, else $SPECPILOT_DATA_DIR, else shared/data/benchmarks beside the repo, else the Hub."""
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.delenv("SPECPILOT_DATA_DIR", raising=False)
    assert bm.resolve_data_dir(None, repo) is None  # nothing beside the repo: the Hub
    beside = tmp_path / "shared" / "data" / "benchmarks"
    beside.mkdir(parents=True)
    assert bm.resolve_data_dir(None, repo) is None  # a folder without MANIFEST.json is not the data
    (beside / "MANIFEST.json").write_text("{}")
    assert bm.resolve_data_dir(None, repo) == beside.resolve()
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(DATA))
    assert bm.resolve_data_dir(None, repo) == DATA
    assert bm.resolve_data_dir(tmp_path, repo) == tmp_path
    with pytest.raises(SpecpilotError, match="nowhere.*data_dir"):
        bm.resolve_data_dir(tmp_path / "nowhere", repo)
    monkeypatch.setenv("SPECPILOT_DATA_DIR", str(tmp_path / "gone"))
    with pytest.raises(SpecpilotError, match="gone.*SPECPILOT_DATA_DIR"):
        bm.resolve_data_dir(None, repo)
    # the data's identity, not its location: a copy elsewhere has the same checksum
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "MANIFEST.json").write_bytes((DATA / "MANIFEST.json").read_bytes())
    assert bm.data_checksum(copy) == bm.data_checksum(DATA) != bm.data_checksum(beside)
    assert bm.data_checksum(None) == "hub"


def test_missing_tokenizer_file_error_shown_whole(tmp_path):
    """A tokenizer folder without tokenizer.json: the whole reason, not its first line only."""
    import shutil

    src = tmp_path / "src"
    build_tokenizer(["some text to learn from"] * 4, 300, src)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    for f in broken.iterdir():
        if f.name not in ("tokenizer_config.json",):
            f.unlink()
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(broken))
        pytest.skip("this transformers version loads a tokenizer without its files")
    except Exception as e:  # what transformers says, in full
        original = [line.strip() for line in str(e).splitlines() if line.strip()]
    with pytest.raises(SpecpilotError) as info:
        bm.load_tokenizer(broken)
    msg = str(info.value)
    assert "\n" not in msg and all(line in msg for line in original), (original, msg)


def test_distillation_prompts_cover_every_kind_and_never_an_eval_or_calibration_prompt():
    import random

    got = bm.distillation_prompts(400, random.Random(0), DATA)
    assert len(got) == 400
    kinds = {k: sum(1 for kind, _ in got if kind == k) for k in bm.DISTILL_MIX}
    assert kinds == {k: round(share * 400) for k, share in bm.DISTILL_MIX.items()}  # 120, 60, 80, 70, 70
    held = {t for b in bm.BENCHMARKS for r in bm.select(b, "all", data_dir=DATA) for t in r["turns"]}
    held |= {t for b in bm.BENCHMARKS for r in bm.calibration_pool(b, DATA) for t in r["turns"]}
    texts = [t for _, t in got]
    assert not held & set(texts)
    assert len(set(texts)) == len(texts)
    stubs = [t for k, t in got if k == "code_completion"]
    assert all(t.startswith(bm.HUMANEVAL_PREFIX) and '"""' in t and t.endswith(bm.HUMANEVAL_SUFFIX) for t in stubs)
    # a DISTILL_LONG share carries solved MBPP functions before the stub (HumanEval-length prompts)
    long_code = [t for t in stubs if t.count("\ndef ") + t.startswith(bm.HUMANEVAL_PREFIX + "def ") >= 3]
    assert 0.3 < len(long_code) / len(stubs) < 0.7 and max(map(len, long_code)) > 3 * max(map(len, set(stubs) - set(long_code)))
    chats = [t for k, t in got if k == "chat"]
    assert 0.3 < sum("\n\n" in t for t in chats) / len(chats) < 0.7
    assert all(t.endswith(bm.BOXED_SUFFIX) for k, t in got if k in ("word_maths", "competition_maths"))
    assert bm.distillation_prompts(400, random.Random(0), DATA) == got  # deterministic for a seed
    assert bm.distillation_prompts(400, random.Random(1), DATA) != got

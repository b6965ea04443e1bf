"""README's serving command against the finished embedded-default run (issue 59).

The command is read from README.md (the line starting ``specpilot serve``) and run as written, in
the repository root, against the repository's own ``results/cpu`` -- the run CI makes before the
tests (.ci/run: ``snakemake --cores all`` first), not a fixture of its layout; only ``--port`` is
swapped for a free port (a fixed port may be taken on a shared machine). The server is asked with
the ``openai`` client: a completion of a gsm8k request's prompt ids and a streamed chat of its
first user turn each return exactly the text of the run's AR record of that request
(``results/cpu/<deployment>/gsm8k/ar-c1.jsonl``), token count included; the start-up lines name
the serving regime and the engine config file of the per-regime layout. At 77bc289 the server
stopped at start-up (the engine config looked up at the old path).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from openai import OpenAI

from specpilot.bench.client import free_port, start_server
from specpilot.errors import SpecpilotError
from specpilot.prompts import load_tokenizer
from specpilot.records import read_records
from specpilot.server.lookup import run_regimes, serving_regime

REPO = Path(__file__).resolve().parents[1]
BENCH = "gsm8k"


def readme_serve_argv() -> list[str]:
    """The arguments of README.md's ``specpilot serve`` line (a trailing ``&`` dropped)."""
    lines = [ln.strip() for ln in (REPO / "README.md").read_text().splitlines() if ln.strip().startswith("specpilot serve ")]
    assert lines, "README.md has no line starting 'specpilot serve'"
    argv = shlex.split(lines[0].rstrip("&").strip())
    assert argv[:2] == ["specpilot", "serve"]
    return argv[2:]


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"README's serving command has no {name}: {argv}"
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """README's server, started in the repository root on the finished run's results."""
    argv = readme_serve_argv()
    results = REPO / _flag(argv, "--results")
    if not (results / "table.csv").is_file():
        pytest.skip(f"no finished workflow run in {results} (run `snakemake --cores all` first; CI always has one)")
    _flag(argv, "--port")
    k = argv.index("--port")
    argv = argv[:k] + argv[k + 2:]  # start_server adds a free port
    log = tmp_path_factory.mktemp("readme-serve") / "server.log"
    try:
        proc = start_server(argv, port := free_port(), log, timeout_s=120, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    except SpecpilotError as e:
        pytest.fail(f"README's serving command did not start: {e}")
    base = f"http://127.0.0.1:{port}"
    yield {"argv": argv, "results": results, "log": log,
           "client": OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)}
    proc.terminate()
    proc.wait(timeout=30)


def test_readme_serving_command_serves_the_run_as_ar(readme_server):
    """The served deployment's completion (prompt ids) and streamed chat (the prompt's text) of a
    gsm8k request equal the run's AR record of it; the start-up names regime and config file."""
    client, results = readme_server["client"], readme_server["results"]
    model = client.models.list().data[0].id
    startup = readme_server["log"].read_text()
    regime, note = serving_regime(run_regimes(results)[0], int(_flag(readme_server["argv"], "--max-concurrency")))
    assert regime == "single"  # the embedded default: one regime, tuned at c1 (README's c4: the nearest tune)
    config = Path(_flag(readme_server["argv"], "--results")) / model / regime / "specpilot.json"
    assert (REPO / config).is_file()
    assert f"regime '{regime}', engine config {config};" in startup, startup
    assert note is None or note in startup, startup
    ar = read_records(results / model / BENCH / "ar-c1.jsonl")
    prompts = {json.loads(x)["request_id"]: json.loads(x)
               for x in (REPO / "results" / "prompts" / model / f"{BENCH}.jsonl").read_text().splitlines()}
    tok = load_tokenizer(REPO / "resources" / "deployments" / "tiny" / "target")
    rec = ar[0]
    row = prompts[rec.request_id]
    want = tok.decode(rec.output_ids, skip_special_tokens=True)
    done = client.completions.create(model=model, prompt=row["prompt_ids"], max_tokens=rec.new_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == rec.new_tokens and done.usage.prompt_tokens == rec.prompt_tokens
    assert done.choices[0].text == want
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["turns"][0]}],
                                            max_tokens=rec.new_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed, not one piece
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens == rec.prompt_tokens  # the chat template gave the prompt file's ids

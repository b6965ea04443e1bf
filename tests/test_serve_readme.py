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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from specpilot.bench.client import free_port
from specpilot.prompts import load_tokenizer
from specpilot.records import read_records

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
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    log_path = tmp_path_factory.mktemp("readme-serve") / "server.log"
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "specpilot", "serve", *argv], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"README's serving command did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.3)
    yield {"argv": argv, "results": results, "log": log_path,
           "client": OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120)}
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def test_readme_serving_command_serves_the_run_as_ar(readme_server):
    """The served deployment's completion (prompt ids) and streamed chat (the prompt's text) of a
    gsm8k request equal the run's AR record of it; the start-up names regime and config file."""
    client, results = readme_server["client"], readme_server["results"]
    model = client.models.list().data[0].id
    startup = readme_server["log"].read_text()
    config = results / model / "single" / "specpilot.json"  # the embedded default: one regime, single
    assert config.is_file()
    assert f"regime 'single', engine config {Path(_flag(readme_server['argv'], '--results')) / model / 'single'}" \
           f"/specpilot.json" in startup, startup
    assert "serving regime 'single', tuned at c1, the nearest tune" in startup, startup  # c4 is no cell of the run
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

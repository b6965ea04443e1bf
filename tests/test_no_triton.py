"""Without Triton installed the Triton tests are skipped, never collection errors (issue 45): the
whole suite is collected in a process where Triton cannot be found (tests/notriton/sitecustomize.py
hides it from every import finder, as if it were not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_suite_collects_without_triton():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "notriton"), str(REPO / "src")]))
    hidden = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('triton'))"],
                            capture_output=True, text=True, env=env)
    assert hidden.stdout.strip() == "None", hidden.stdout + hidden.stderr  # Triton is really hidden
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", str(REPO / "tests")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0 and "error" not in r.stdout.splitlines()[-1].lower(), r.stdout[-3000:] + r.stderr[-2000:]

"""Shared fixtures: the local benchmark data, a seconds-long quick deployment, the full tiny one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("SPECPILOT_DATA_DIR") or REPO.parent / "shared" / "data" / "benchmarks")
TINY = Path(os.environ.get("SPECPILOT_TINY_DIR") or REPO / "resources" / "deployments" / "tiny")
# a quick deployment built before (read only), e.g. by a run of .test/config/config.yaml
QUICK_DIR = os.environ.get("SPECPILOT_QUICK_DIR")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA / "MANIFEST.json").is_file():
        pytest.skip(f"benchmark data not found at {DATA}")
    return DATA


@pytest.fixture(scope="session")
def quick_deployment(tmp_path_factory, data_dir) -> Path:
    """A deployment built with the QUICK recipe (a few seconds; not a useful model), or the one at
    $SPECPILOT_QUICK_DIR when that names a finished build."""
    from specpilot.tiny.build import QUICK, build_tiny

    if QUICK_DIR and (Path(QUICK_DIR) / "build.json").is_file():
        return Path(QUICK_DIR)
    out = tmp_path_factory.mktemp("quick")
    build_tiny(out, data_dir, seed=0, recipe=QUICK, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def tiny_deployment(data_dir) -> Path:
    """The embedded default deployment: reused when already built (build.json present), else built."""
    from specpilot.tiny.build import build_tiny

    if not (TINY / "build.json").is_file():
        build_tiny(TINY, data_dir, seed=0)  # what the embedded default uses: the three drafters
    return TINY


@pytest.fixture(scope="session")
def quick_prompts(tmp_path_factory, quick_deployment, data_dir) -> list[dict]:
    """Two formatted prompts per benchmark for the quick deployment's tokenizer."""
    from specpilot.prompts import BENCHMARKS, write_prompt_file

    out = tmp_path_factory.mktemp("prompts")
    rows = []
    for b in BENCHMARKS:
        rows += write_prompt_file(b, quick_deployment / "target", out / f"{b}.jsonl", 2, data_dir=data_dir)
    return rows


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker takes its share of the cores for torch's threads:
    N workers each starting one thread per core would wait on each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The test files that take minutes on 2 cores (Triton's CPU interpreter, whole workflow runs),
# longest first: collected first, so that under pytest-xdist (`--dist loadfile`) they start at
# once on the two workers and the short files fill in around them, instead of a long file starting
# last and running alone at the end.
LONG_FILES = ["test_forcing_family.py", "test_family_fast.py", "test_workflow_rerun.py", "test_gpu_path.py",
              "test_rounds_workflow.py", "test_memory_workflow.py", "test_regimes_workflow.py", "test_paper_shaped.py", "test_w12_triton.py",
              "test_traps_engine.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order kept otherwise

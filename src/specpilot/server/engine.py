"""The engine ``specpilot serve`` serves: one deployment's engine loaded as ``specpilot run`` loads it.

:mod:`specpilot.server.lookup` finds a deployment's files in a finished workflow run by name and
serving regime; :class:`ServedEngine` loads them through the same
functions as ``specpilot run`` (:func:`specpilot.engine.cli.engine_specs`: the engine config and
block; :func:`specpilot.kernels_build.use_kernel_outputs`: the kernel manifest and the kernel
sub-agent's choice; :func:`specpilot.engine.cli.load_deployments`: target, drafter, dtype, weight
format, backend, matmul tables) and serves it with an
:class:`~specpilot.engine.online.OnlineScheduler` of ``slots`` slots built as a closed-loop cell
builds its scheduler (:func:`specpilot.engine.serve.continuous_engine`). :class:`RecordWriter`
writes the served requests as records of the workflow's schema plus the prompt file token
forcing reads (``--record DIR``).
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import torch

from ..engine import cli as run_cli
from ..engine.online import OnlineScheduler
from ..engine.serve import ServeOptions, continuous_engine, to_record
from ..device import detect_gpu
from ..errors import SpecpilotError
from ..io import read_jsonl, write_jsonl
from ..kernels_build import use_kernel_outputs
from ..prompts import load_tokenizer
from ..records import Record, read_records, write_records
from .lookup import EngineFiles

DEFAULT_MAX_SEQ = 4096  # KV-cache slots per request when --max-seq is not given (capped at the target's positions)


def run_args(files: EngineFiles, engine: str, device: str, threads: int, graphs: str) -> argparse.Namespace:
    """The ``specpilot run`` arguments that load ``files`` with ``engine`` (its parser's defaults
    for the rest), so that the server loads exactly what a workflow cell loads."""
    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    argv = ["--engine", engine, "--target", files.target, "--prompts", "-", "--out", "-",
            "--deployment", files.deployment, "--drafter-name", files.drafter_name, "--block-size", files.block_size,
            "--device", device, "--dtype", files.dtype, "--threads", str(threads), "--graphs", graphs,
            "--gpu", "cpu" if device == "cpu" else detect_gpu()]
    for flag, value in (("--drafter", files.drafter), ("--target-name", files.target_name),
                        ("--engine-config", files.engine_config if engine == "specpilot" else None),
                        ("--kernels-manifest", files.kernels_manifest), ("--kernel-agent", files.kernel_agent),
                        ("--weight-format", files.weight_format)):
        if value:
            argv += [flag, value]
    return p.parse_args(argv)


class ServedEngine:
    """One deployment's engine and its online scheduler (module docstring).

    Args:
        files: what to load; engine: ``specpilot`` (needs ``files.engine_config``), ``stock`` or ``ar``.
        slots: requests decoded together (the concurrency the engine serves, ``--max-concurrency``).
        max_seq: KV-cache slots per request (the context: prompt + new tokens + verify width);
            None = :data:`DEFAULT_MAX_SEQ` capped at the target's ``max_position_embeddings``.
        max_queue: requests that may wait for a slot; device, threads, graphs: as ``specpilot run``.
    Raises:
        SpecpilotError: as ``specpilot run`` for the engine config, kernels and checkpoints; bad
            ``slots`` or ``max_seq``.
    """

    def __init__(self, files: EngineFiles, engine: str = "specpilot", slots: int = 1, max_seq: int | None = None,
                 max_queue: int = 64, device: str = "auto", threads: int = 0, graphs: str = "auto",
                 prefill_chunk: int | None = None):
        if engine == "specpilot" and not files.engine_config:
            raise SpecpilotError("engine specpilot needs an engine config (--engine-config, or --deployment with "
                                 "--results)")
        if slots < 1:
            raise SpecpilotError(f"--max-concurrency must be >= 1, got {slots}")
        self.args = args = run_args(files, engine, device, threads, graphs)
        if threads:
            torch.set_num_threads(threads)
        self.files, self.engine = files, engine
        self.spec = run_cli.engine_specs(args)[0]
        self.kernel_outputs = use_kernel_outputs(args.kernels_manifest, args.kernel_agent)
        self.dep = run_cli.load_deployments(args, [self.spec], self.kernel_outputs)[self.spec.config.weight_format]
        limit = int(self.dep.target.config.max_position_embeddings)
        if max_seq is not None and not 1 <= max_seq <= limit:
            raise SpecpilotError(f"--max-seq must be in 1..{limit} (the target's max_position_embeddings), got {max_seq}")
        self.max_seq = max_seq or min(DEFAULT_MAX_SEQ, limit)
        self.slots = slots
        if self.spec.config.mixed_prefill:
            raise SpecpilotError("mixed_prefill is not served by specpilot serve's online scheduler (it prefills "
                                 "newcomers in steps of their own); drop it from the engine config")
        proposer, runner = continuous_engine(self.spec, self.dep, slots, self.max_seq)
        self.scheduler = OnlineScheduler(runner, proposer, accept=self.spec.accept, eos_id=self.dep.eos_id,
                                         max_queue=max_queue, prefill_chunk=prefill_chunk, overlap=self.spec.overlap)
        self.tokenizer = load_tokenizer(files.target)

    @property
    def verify_width(self) -> int:
        """Tokens per verify forward of the served engine (its proposer's width; 1 for AR)."""
        return int(self.scheduler.verify_width)

    def room(self, prompt_len: int) -> int:
        """New tokens the context leaves after a prompt of ``prompt_len`` tokens: a request needs
        prompt + budget - 2 + verify width (+ 1 with several slots) KV-cache slots
        (:func:`specpilot.engine.scheduler.slots_needed`)."""
        return self.max_seq - prompt_len + 2 - self.verify_width - (1 if self.slots > 1 else 0)

    def start(self) -> None:
        """Warm the engine up and start its thread (:meth:`OnlineScheduler.start`)."""
        self.scheduler.start(self.tokenizer("Hello", add_special_tokens=False)["input_ids"][:8] or [1])

    def record(self, request_id: str, prompt_ids: list[int], result, served: dict, ignore_eos: bool) -> Record:
        """A served request as a record of the workflow's schema (as a cell's, at the server's
        concurrency), with its own budget, EOS token and what the server answered (``served``)."""
        meta = {"deployment": self.files.deployment, "target": self.files.target_name or self.files.target,
                "drafter": self.files.drafter_name, "gpu": self.args.gpu}
        row = {"request_id": request_id, "benchmark": "served", "prompt_ids": prompt_ids}
        rec = to_record(self.spec, row, result, self.slots, meta, ServeOptions(), self.dep.backend.path)
        manifest = self.args.kernels_manifest or self.args.kernel_agent
        run_cli.stamp_records([rec], self.dep, self.kernel_outputs if manifest else None)
        rec.max_new_tokens = served.pop("max_new_tokens")
        rec.eos_id = None if ignore_eos else self.dep.eos_id
        rec.served = served
        return rec


class RecordWriter:
    """``--record DIR``: ``DIR/records.jsonl`` (the served requests' records) and
    ``DIR/prompts.jsonl`` (their prompts, the file ``specpilot force --prompts`` reads), both
    rewritten atomically as each request finishes; a server restarted on the same folder
    continues its request ids (``served/000000``, ...)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.records_path, self.prompts_path = self.folder / "records.jsonl", self.folder / "prompts.jsonl"
        self.records = read_records(self.records_path) if self.records_path.is_file() else []
        self.prompts = read_jsonl(self.prompts_path) if self.prompts_path.is_file() else []
        self._lock = threading.Lock()
        self._next = len(self.prompts)

    def new_id(self) -> str:
        """A request id not used in this folder."""
        with self._lock:
            i, self._next = self._next, self._next + 1
        return f"served/{i:06d}"

    def add(self, record: Record, prompt_ids: list[int]) -> None:
        """Add one finished request (and its prompt) and rewrite both files."""
        row = {"request_id": record.request_id, "benchmark": record.benchmark, "prompt_ids": list(prompt_ids)}
        with self._lock:
            self.records.append(record)
            self.prompts.append(row)
            write_jsonl(self.prompts_path, self.prompts)
            write_records(self.records_path, self.records)

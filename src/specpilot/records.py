"""The per-request record: the one data contract between engines and everything downstream.

Aggregation, token forcing, the cost model and the figures read only these records, so any
aggregate can be recomputed from them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecpilotError
from .io import read_jsonl, write_jsonl


@dataclass
class Record:
    """One request served by one engine; one JSON object per line in a records file.

    Fields (units in brackets):
        request_id: ``"{benchmark}/{index:04d}"``, the same id across engines for the same prompt.
        benchmark: ``gsm8k``, ``humaneval``, ``math500``, ``mbpp`` or ``mt-bench``.
        deployment: deployment name from the config (e.g. ``tiny``).
        target: target checkpoint name or path.
        drafter: drafter name (``dflash``, ``dflash2``, ``dspark``, ``lookup``) or ``none`` for AR.
        gpu: ``cpu`` or the normalized GPU name (``h100``, ``h200``, ...).
        engine: ``ar``, ``stock``, ``lookup`` or ``specpilot``.
        concurrency: number of requests decoded together in one batch.
        prompt_tokens: prompt length [tokens].
        new_tokens: generated tokens [tokens]; equals ``len(output_ids)``. The first one comes from
            prefill, the rest from verify steps, so ``sum(committed_per_step) == new_tokens - 1``.
        prefill_s: prompt prefill time [seconds], device synchronized before each clock read.
        decode_s: decode time after prefill [seconds], device synchronized before each clock read.
        verify_steps: target forward passes after prefill (AR: one per token).
        committed_per_step: tokens committed by each verify step, bonus token included
            (AR: all ones). Its mean is the acceptance length tau.
        output_ids: generated token ids, prompt excluded.
        synthetic: true only for the replay drafter (system benchmarks on random weights).
        engine_config: block size, mechanisms and their parameters.
        draft_s: seconds spent in the drafter during decode (0 for AR); instrumentation for the
            cost model.
        verify_s: seconds spent in target verify/decode forwards during decode.
        prompt_ids: the prompt's token ids, kept only where no prompt file holds them (later turns
            of multi-turn chaining); None otherwise.
        arrival_s, first_token_s, finish_s: when the request was issued, got its first token and
            its last token [seconds from the cell's start] under continuous batching
            (:mod:`specpilot.engine.scheduler`); None from the static-batch regime.
        prefill_stall_s: seconds of the decode spent in other requests' prefill steps
            (continuous batching; part of ``decode_s``).
    """

    request_id: str
    benchmark: str
    deployment: str
    target: str
    drafter: str
    gpu: str
    engine: str
    concurrency: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    verify_steps: int
    committed_per_step: list[int]
    output_ids: list[int]
    synthetic: bool = False
    engine_config: dict[str, Any] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prompt_ids: list[int] | None = None
    arrival_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    prefill_stall_s: float = 0.0

    @property
    def tau(self) -> float:
        """Acceptance length: mean tokens committed per verify step, bonus included."""
        steps = self.committed_per_step
        return sum(steps) / len(steps) if steps else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name for f in dataclasses.fields(Record)}
_REQUIRED = {f.name for f in dataclasses.fields(Record)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def record_from_dict(d: dict[str, Any], where: str = "record") -> Record:
    """Build a Record from a dict, ignoring unknown keys (fields may be added freely).

    Raises:
        SpecpilotError: a required field is missing (the field and ``where`` are named).
    """
    missing = _REQUIRED - d.keys()
    if missing:
        raise SpecpilotError(f"{where} lacks field(s) {sorted(missing)}")
    return Record(**{k: v for k, v in d.items() if k in _FIELDS})


def read_records(path: str | os.PathLike) -> list[Record]:
    """Read a records file (JSON lines) into Records; errors name the file and line."""
    return [record_from_dict(d, f"{path}:{i + 1}") for i, d in enumerate(read_jsonl(path))]


def write_records(path: str | os.PathLike, records: list[Record]) -> None:
    """Write records atomically, one JSON object per line, in the given order."""
    write_jsonl(path, (r.to_dict() for r in records))

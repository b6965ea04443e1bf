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
        chat_template_kwargs: the chat-template settings the prompt was rendered with (e.g.
            ``{"enable_thinking": false}``), recorded for multi-turn chaining, where every turn is
            rendered with them; None when not known.
        decode_s_repeats: ``decode_s`` of every timing repeat of the cell [seconds] (the record's
            own timings are the fastest run's); None when the cell was timed once. Their spread is
            the table's loaded-machine check.
        arrival_s, first_token_s, finish_s: when the request was issued, got its first token and
            its last token [seconds from the cell's start] under continuous batching
            (:mod:`specpilot.engine.scheduler`); None from the static-batch regime.
        prefill_stall_s: seconds of the decode spent in other requests' prefill steps
            (continuous batching; part of ``decode_s``).
        mixed_steps: decode steps of the request that also carried a newcomer's prompt chunk (engine
            config ``mixed_prefill``, :mod:`specpilot.engine.mixed`); None without it.
        device_index, device_uuid, device_name: the physical device that timed the request
            (:func:`specpilot.devices.device_identity`: index and UUID on a GPU host, ``cpu``
            otherwise); None in records written before they existed.
        threads: torch's CPU threads in the process that timed the request (``torch.get_num_threads()``;
            the host side of a GPU step too); the cost model holds CPU steps to ceilings measured with
            as many threads (:func:`specpilot.ceilings.for_threads`). None in records written before
            it existed.
        max_new_tokens, eos_id: a served request's own token budget and the token that ended it
            (``specpilot serve``, where each request has its own; token forcing's re-execution
            serves it with them); None in a workflow cell (the cell's budget, EOS ignored).
        served: what ``specpilot serve`` answered: ``finish_reason`` (``length``, ``eos``,
            ``stop``, ``cancelled``), ``endpoint``, ``completion_tokens`` (tokens returned to the
            client) and, for a stop string, ``stop`` = ``{"string", "tokens"}``: the response
            text was cut where the string begins, inside the step whose commit completed it, and
            ``tokens`` counts the output tokens up to and including the one that completed it;
            ``output_ids`` keeps every token the engine committed (that whole step), which token
            forcing checks. None outside serving.
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
    chat_template_kwargs: dict[str, Any] | None = None
    decode_s_repeats: list[float] | None = None
    arrival_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    prefill_stall_s: float = 0.0
    mixed_steps: int | None = None
    device_index: int | None = None
    device_uuid: str | None = None
    device_name: str | None = None
    threads: int | None = None
    max_new_tokens: int | None = None
    eos_id: int | None = None
    served: dict[str, Any] | None = None

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_record(r: Record, where: str = "record") -> Record:
    """Check a record's counts agree with each other (DESIGN.md: readers validate a record).

    Checks: ``committed_per_step`` a list of non-negative ints and ``output_ids`` a list of ints;
    ``new_tokens == len(output_ids)`` (at least 1: the first token comes from prefill);
    ``sum(committed_per_step) == new_tokens - 1`` (the rest come from verify steps);
    ``verify_steps == len(committed_per_step)``; ``decode_s``/``prefill_s`` finite and >= 0.

    Raises:
        SpecpilotError: the first check that fails, naming ``where``, the request and the values.
    """
    who = f"{where}: request {r.request_id!r} ({r.engine})"
    steps = r.committed_per_step
    if not isinstance(steps, list) or not all(_is_int(c) and c >= 0 for c in steps):
        raise SpecpilotError(f"{who}: committed_per_step must be a list of non-negative integers")
    if not isinstance(r.output_ids, list) or not all(_is_int(t) for t in r.output_ids):
        raise SpecpilotError(f"{who}: output_ids must be a list of integers")
    if not _is_int(r.new_tokens) or r.new_tokens != len(r.output_ids) or r.new_tokens < 1:
        raise SpecpilotError(f"{who}: new_tokens is {r.new_tokens!r} but output_ids holds {len(r.output_ids)} "
                             f"tokens (at least 1)")
    if sum(steps) != r.new_tokens - 1:
        raise SpecpilotError(f"{who}: committed_per_step sums to {sum(steps)}, but new_tokens - 1 = "
                             f"{r.new_tokens - 1} (the first token comes from prefill, the rest from verify steps)")
    if r.verify_steps != len(steps):
        raise SpecpilotError(f"{who}: verify_steps is {r.verify_steps!r} but committed_per_step has "
                             f"{len(steps)} entries")
    for name in ("prefill_s", "decode_s"):
        v = getattr(r, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < float("inf")):
            raise SpecpilotError(f"{who}: {name} must be a finite number of seconds >= 0, got {v!r}")
    return r


def record_from_dict(d: dict[str, Any], where: str = "record") -> Record:
    """Build a Record from a dict, ignoring unknown keys (fields may be added freely), and
    validate it (:func:`validate_record`).

    Raises:
        SpecpilotError: a required field is missing, or the record's counts disagree (the field,
            ``where`` and the request are named).
    """
    missing = _REQUIRED - d.keys()
    if missing:
        raise SpecpilotError(f"{where} lacks field(s) {sorted(missing)}")
    return validate_record(Record(**{k: v for k, v in d.items() if k in _FIELDS}), where)


def read_records(path: str | os.PathLike) -> list[Record]:
    """Read a records file (JSON lines) into validated Records; errors name the file and line."""
    return [record_from_dict(d, f"{path}:{i + 1}") for i, d in enumerate(read_jsonl(path))]


def merge_repeats(runs: list[list[Record]]) -> list[Record]:
    """One record per request from several timing runs of the same cell.

    Each request keeps the record of its fastest run (smallest ``decode_s``; the usual estimator
    of the unloaded time) with ``decode_s_repeats`` = its ``decode_s`` in every run, in run order.
    A single run is returned as it is.

    Raises:
        SpecpilotError: the runs differ in their requests or in any output token (a deterministic
            greedy engine gives the same tokens every time).
    """
    if not runs:
        raise SpecpilotError("no timing runs to merge")
    if len(runs) == 1:
        return list(runs[0])
    first = runs[0]
    out = []
    for i, rec in enumerate(first):
        same = []
        for k, run in enumerate(runs):
            if len(run) != len(first) or run[i].request_id != rec.request_id:
                raise SpecpilotError(f"timing run {k + 1} served other requests than run 1")
            if run[i].output_ids != rec.output_ids:
                raise SpecpilotError(f"request {rec.request_id!r}: timing run {k + 1} produced other tokens than "
                                     f"run 1; the engine is not deterministic")
            same.append(run[i])
        best = min(same, key=lambda r: r.decode_s)
        out.append(dataclasses.replace(best, decode_s_repeats=[r.decode_s for r in same]))
    return out


def write_records(path: str | os.PathLike, records: list[Record]) -> None:
    """Write records atomically, one JSON object per line, in the given order."""
    write_jsonl(path, (r.to_dict() for r in records))

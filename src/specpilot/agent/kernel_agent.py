"""Kernel sub-agent: tune the launch configs of the engine's kernels for the GPU it runs on.

Two sections, written to ``results/{gpu}/kernels/{deployment}/kernel-agent.json``:

- ``configs`` (the 12-bit format's fused decode+matmul, :mod:`specpilot.kernels.w12_triton`): for
  each linear shape of the deployment's target and each decode/verify row count M, it times the
  default config, ranks shapes by achieved weight bandwidth / measured copy bandwidth (lowest
  first), and for the ``top`` furthest shapes tries every candidate config of
  :func:`specpilot.kernels.w12_triton.candidate_configs`. A config counts only after its output
  matched the bf16 reference (decoded weights, torch matmul) within bf16 accumulation tolerance.
  Winners form the table of :func:`specpilot.kernels.w12_triton.set_tuned` (``"M_BUCKET,N,K" ->
  config``).
- ``engine_configs`` (the bf16 Triton step's matmul tables, ``DEFAULT_CONFIGS`` of
  :mod:`specpilot.fastpath.tables`): for the target's five matmul roles at its real (fused) shapes
  and the row buckets of up to 64 rows (16, 32, 64), the default config and the candidates of
  :func:`specpilot.tuning.matmul.candidate_linear_configs`, each checked before it is timed:
  every output row bit-equal to the same row computed alone by the current decode config (the
  engine's batch invariance; so the decode config itself changes only for a bit-equal one), and
  close to an fp32 reference (:func:`specpilot.tuning.matmul.tune_engine_configs`). Only the
  entries that differ from ``DEFAULT_CONFIGS`` are written (``{role: {max_rows: key}}``, possibly
  empty); their checks and times are ``engine_summary`` / ``engine_trials``.

The engine cells, token forcing and the round steps read the file
(:func:`specpilot.kernels_build.use_kernel_outputs`, ``--kernel-agent``) and install both; the
manifest written by ``specpilot kernels`` is left untouched so finished steps stay finished. On
CPU (or without CUDA / Triton) it records that no GPU kernel applies, with both tables empty; on the
CPU its section ``cpu`` chooses the step paths instead (:mod:`specpilot.agent.kernel_cpu`: the fused
CPU steps of the target and the drafter, checked and timed against the plain forward).
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch

from ..fastpath.tables import DEFAULT_TUNE_ROWS, LINEAR_ROLES
from ..io import read_json, write_json
from ..models.config import TargetConfig, read_config
from ..models.dflash import DrafterConfig
from ..tuning.timing import mean_s
from ..tuning.w12 import tune_w12_choice
from ..w12 import pack
from .kernel_cpu import choose_paths



def _nothing(gpu: str, reason: str) -> dict:
    return {"gpu": gpu, "applies": False, "configs": {}, "engine_configs": {}, "reason": reason}


def tune(target_dir: str, gpu: str, ceilings_path: str, out: str | Path, rows: tuple[int, ...] = (1, 16),
         top: int = 3, max_configs: int = 16, manifest: dict | None = None, w12: bool = True,
         engine: bool = True, engine_rows: tuple[int, ...] | None = None, engine_roles: tuple[str, ...] | None = None,
         max_engine_configs: int = 16, engine_min_gain: float = 0.02, w12_fast: bool = True,
         w12_widths: tuple[int, ...] = (16,), manifest_path: str | None = None, cpu: dict | None = None,
         drafter_dir: str | None = None) -> dict:
    """Run the sub-agent; writes ``out`` (kernel-agent.json) and returns its content.

    ``target_dir``: the target checkpoint (only its config.json is read: the kernels are tuned on
    random weights of its shapes); ``ceilings_path``: ceilings.json (``memory_bandwidth_bytes_per_s``).
    ``rows``, ``top``, ``max_configs``: the w12 section (row counts timed, shapes tuned, candidates
    each). ``engine_rows`` / ``engine_roles`` / ``max_engine_configs`` / ``engine_min_gain``: the
    engine section (default :data:`~specpilot.fastpath.tables.DEFAULT_TUNE_ROWS` and the five
    roles, 16 candidates per bucket, 2 % gain to replace a default; see
    :func:`specpilot.tuning.matmul.tune_engine_configs`). ``w12`` / ``engine``: run that section.

    Fields: ``gpu``, ``applies`` (bool), ``reason`` (when it does not apply), ``configs`` (tuned w12
    table ``"M_BUCKET,N,K" -> config``; empty when nothing applies), ``ranked`` (w12 shapes by
    achieved fraction of the copy bandwidth), ``trials``; ``engine_configs`` (``{role: {max_rows:
    LinearConfig key}}``, only the entries that differ from the engine's DEFAULT_CONFIGS; ``{}`` when
    nothing applies), ``engine_summary`` and ``engine_trials`` (per bucket and per candidate: checks,
    device microseconds per call), ``engine_reason`` when the engine section did not run or failed
    (its tables then stay the defaults: an error there never fails the job, it is recorded). With
    ``drafter_dir`` (a DFlash-family drafter checkpoint; only its config.json is read) the engine
    section tunes the draft step's tables too, the same rows (issue 62: at c16 the draft runs 16 x
    block rows): ``drafter_engine_configs`` (its q/k/v, o, gate/up and down roles on the drafter's
    layer shapes; ``lm_head`` the target's entries, the same weight), ``drafter_engine_summary``,
    or ``drafter_engine_reason``.
    ``w12_choice`` (section ``w12_fast``, any target family): per matmul role and row count of
    ``w12_widths`` (rows per verify matmul; default 16, one request at block 16), whether the
    engine's fast path runs it with the 12-bit loader of the bf16 kernels (the same bits, so only
    speed decides), with ``w12_choice_summary``, ``w12_choice_checks``, ``w12_choice_trials``
    (:func:`specpilot.tuning.w12.tune_w12_choice`), or ``w12_choice_reason``.

    On the CPU, with ``cpu`` (``{"drafter": drafter dir or None, "prompts": calibration rows,
    "block": stock block, "tolerance": forcing tolerance}``), the section ``cpu``: the step paths the
    target and the drafter run there, each checked and timed against the plain forward
    (:func:`specpilot.agent.kernel_cpu.choose_paths`).

    Raises:
        SpecpilotError: the target's config.json or ceilings.json is missing or malformed (on a GPU).
    """
    if gpu == "cpu" or not torch.cuda.is_available():
        res = _nothing(gpu, "no GPU kernels apply on cpu" if gpu == "cpu" else "CUDA not available on this node")
        if gpu == "cpu" and cpu is not None:  # the CPU step paths (agent.kernel_cpu)
            res["cpu"] = choose_paths(target_dir, cpu.get("drafter"), cpu["prompts"], cpu["block"], cpu["tolerance"])
        write_json(out, res)
        return res
    try:
        from ..kernels import w12_triton as kern
    except ImportError as e:
        res = _nothing(gpu, f"Triton kernels unavailable: {e}")
        write_json(out, res)
        return res
    cfg = TargetConfig.from_hf_dict(read_config(target_dir))
    bw = read_json(ceilings_path)["memory_bandwidth_bytes_per_s"]
    table, trials, measured = (_tune_w12(kern, cfg, bw, rows, top, max_configs) if w12 else ({}, [], []))
    res = {"gpu": gpu, "applies": True, "kernel": "w12 fused decode+matmul", "ranked": measured,
           "configs": table, "trials": trials, "engine_configs": {}}
    if not engine:
        res["engine_reason"] = "engine section not run"
    else:  # dense targets and the families (the family step's role weights: tuning.matmul.family_role_shapes)
        from ..tuning.matmul import tune_engine_configs  # the Triton step: an optional dependency

        _section(res, "engine_configs", "engine_reason", "engine tuning", lambda: tune_engine_configs(
            cfg, "cuda", tuple(engine_rows or DEFAULT_TUNE_ROWS), tuple(engine_roles) if engine_roles else LINEAR_ROLES,
            max_configs=max_engine_configs, min_gain=engine_min_gain, bandwidth=bw))
        if drafter_dir:
            _section(res, "drafter_engine_configs", "drafter_engine_reason", "drafter engine tuning", lambda: _drafter(
                drafter_dir, cfg, res, tuple(engine_rows or DEFAULT_TUNE_ROWS), engine_roles, max_engine_configs,
                engine_min_gain, bw))
    res["w12_choice"] = {}
    if not w12_fast:
        res["w12_choice_reason"] = "w12 fast-path section not run"
    else:
        _section(res, "w12_choice", "w12_choice_reason", "w12 choice tuning",
                 lambda: tune_w12_choice(cfg, tuple(w12_widths)))
    write_json(out, res)
    return res


def _drafter(drafter_dir: str, cfg: TargetConfig, res: dict, rows: tuple[int, ...], roles, max_configs: int,
             min_gain: float, bw: float) -> dict:
    """The draft step's tables (see :func:`tune`; :func:`specpilot.tuning.matmul.tune_drafter_configs`)."""
    from ..tuning.matmul import tune_drafter_configs

    dcfg = DrafterConfig.from_hf_dict(read_config(drafter_dir))
    return tune_drafter_configs(dcfg, cfg.vocab_size, res.get("engine_configs", {}), rows, roles, device="cuda",
                                max_configs=max_configs, min_gain=min_gain, bandwidth=bw)


def _section(res: dict, table: str, reason: str, what: str, run) -> None:
    """Run one tuning section (``run() -> fields``) into ``res``. An error never fails the job: it is
    logged, ``res[table]`` stays ``{}`` (the engine keeps its defaults) and ``res[reason]`` says why."""
    try:
        res.update(run())
    except Exception as e:  # noqa: BLE001 - see above
        traceback.print_exc()
        res[table] = {}
        res[reason] = f"{what} failed: {type(e).__name__}: {str(e)[:300]}"


def _tune_w12(kern, cfg, bw: float, rows: tuple[int, ...], top: int, max_configs: int) -> tuple[dict, list, list]:
    """The w12 section of :func:`tune`: (tuned table, trials, shapes ranked by bandwidth fraction)."""
    h, i, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    shapes = sorted({(qd, h), (kvd, h), (h, qd), (i, h), (h, i)})
    dev = torch.device("cuda")
    measured = []
    packed = {}
    for n, k in shapes:
        if k % 8:
            continue
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        p = pack(w.cpu())
        esc = kern.prepare_escapes(p.escape_idx.to(dev), p.escape_val.to(dev), n, k)
        packed[(n, k)] = (w, p.mant.to(dev), p.codes.to(dev), p.base, esc)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            mant, codes, base = packed[(n, k)][1:4]
            t = mean_s(lambda: kern.matmul(x, mant, codes, base, esc))
            measured.append({"m": m, "n": n, "k": k, "seconds": t, "bw_fraction": n * k * 1.5 / t / bw})
    measured.sort(key=lambda r: r["bw_fraction"])
    table, trials = {}, []
    for r in measured[:top]:
        m, n, k = r["m"], r["n"], r["k"]
        w, mant, codes, base, esc = packed[(n, k)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ w.float().T)
        tol = 2e-2 * ref.abs().max().item() + 1e-3
        best = None
        for c in kern.candidate_configs(m, n, k)[:max_configs]:
            try:
                y = kern.matmul(x, mant, codes, base, esc, config=c)
            except Exception as e:  # a config that does not compile/launch is simply not a candidate
                trials.append({"m": m, "n": n, "k": k, "config": dataclasses.asdict(c), "error": type(e).__name__})
                continue
            err = (y.float() - ref).abs().max().item()
            ok = err <= tol
            t = mean_s(lambda: kern.matmul(x, mant, codes, base, esc, config=c)) if ok else None
            trials.append({"m": m, "n": n, "k": k, "config": dataclasses.asdict(c), "max_err": err,
                           "correct": ok, "seconds": t})
            if ok and (best is None or t < best[1]):
                best = (c, t)
        if best is not None:
            table[f"{kern.m_bucket(m)},{n},{k}"] = dataclasses.asdict(best[0])
            r["tuned_seconds"] = best[1]
    return table, trials, measured

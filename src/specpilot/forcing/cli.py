"""``specpilot force``: token forcing of one cell's candidate engines, one verdict file each.

The target is loaded once; several candidates (``--candidate stock,specpilot``) are checked in
order, each against the ``--reference`` files and the candidates before it. The verdict's fields
are listed in docs/forcing.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..deployment import Deployment
from ..device import pick_device, pick_dtype
from ..engine.config import EngineConfig
from ..errors import SpecpilotError
from ..io import comma_list, one_out_each, read_json, read_prompts, write_json
from ..fastpath.cpu_linear import set_matmul
from ..kernels_build import agent_engine_configs, agent_w12_choice, engine_tables, w12_choice_for
from ..models.loading import load_drafter, load_target
from ..records import Record, read_records
from ..w12 import apply_w12
from .reexecute import REEXECUTION_TOKENS, Reexecution, serve_reexecution
from .teacher import CHUNK, DEFAULT_TOLERANCE, TF_PATHS, tolerance_for
from .verdict import check_engine_config, force


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``specpilot force``."""
    p.add_argument("--candidate", required=True, type=comma_list,
                   help="records file of the engine under test; several comma-separated (one --out each) are "
                        "checked in one job, each against the --reference files and the candidates before it "
                        "(stock,specpilot: stock against ar, specpilot against ar and stock)")
    p.add_argument("--reference", action="append", default=[],
                   help="reference records (repeatable): request ids and token counts must match")
    p.add_argument("--target", required=True, help="target checkpoint dir: checks every token")
    p.add_argument("--prompts", required=True, help="the cell's prompt file")
    p.add_argument("--drafter", help="drafter checkpoint dir (to re-execute a drafter engine's first steps)")
    p.add_argument("--engine-config", help="JSON file of the engine config the cell was run with (specpilot: "
                   "results/{gpu}/{deployment}/specpilot.json): every record's engine_config must hold it; with "
                   "several candidates it applies to the specpilot one")
    p.add_argument("--max-new-tokens", type=int,
                   help="the cell's token budget (default: the largest new_tokens of the references)")
    p.add_argument("--replay-tokens", type=int, default=REEXECUTION_TOKENS,
                   help="leading new tokens per request whose verify steps are re-executed (0: none)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="near-tie tolerance: top-1 logit margin (config forcing.tolerance for the dtype; "
                        "default the config default for the compute dtype: fp32 0.001, bf16 0.1)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="output positions whose logits are reduced at once in the teacher-forced check")
    p.add_argument("--teacher-forced-path", choices=TF_PATHS, default="auto",
                   help="kernels of the teacher-forced pass: auto (the engine's Triton step where the candidate's "
                        "engine ran it: a dense bf16 CUDA target, chain verify; else the eager forward), eager, triton "
                        "(an engine run with --graphs off or --kernels torch needs eager: its records do not say so)")
    p.add_argument("--kernel-configs", help="JSON file {role: config key}: the matmul configs the engine ran with "
                   "('specpilot run --kernel-configs'), for the Triton teacher-forced pass")
    p.add_argument("--kernel-agent", help="the kernel sub-agent's kernel-agent.json the engine cell ran with (on the "
                   "CPU its matmul kernel for the re-execution of fused steps): its "
                   "engine matmul tables (engine_configs) for the Triton teacher-forced pass and the re-execution "
                   "(--kernel-configs on top, as in 'specpilot run')")
    p.add_argument("--out", required=True, type=comma_list,
                   help="verdict JSON to write; comma-separated, one per --candidate")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    p.add_argument("--report-only", action="store_true", help="exit 0 even when violations are found")


def forcing_kernel_configs(agent_path: str | None, configs_path: str | None) -> dict | None:
    """The matmul configs of the Triton teacher-forced pass: those the engine cell installed
    (``specpilot run``): the kernel sub-agent's ``engine_configs`` of ``agent_path`` merged with
    DEFAULT_CONFIGS, then the ``--kernel-configs`` file ``configs_path`` on top
    (:func:`specpilot.kernels_build.engine_tables`). None when neither names a config.

    Raises:
        SpecpilotError: a missing or corrupt file, malformed engine_configs (named).
    """
    tables = engine_tables(agent_engine_configs(agent_path), dict(read_json(configs_path)) if configs_path else None)
    return tables or None


class _Targets:
    """The forcing job's deployment: the target in its stored weights for the teacher-forced pass
    (reloaded after a w12 re-execution converted it), converted to w12 for re-executing a w12
    engine config, each with its backend, the kernel tables and w12 roles the engine cell
    installed (as ``specpilot run`` installs them), and the drafter for re-execution."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, kernel_configs: dict | None,
                 strict: bool, w12_choice: dict, drafter=None):
        self.path, self.dtype, self.device, self.drafter = path, dtype, device, drafter
        self.kernel_configs, self.strict, self.w12_choice = kernel_configs, strict, w12_choice
        self.dep: Deployment | None = None
        self.w12 = False

    def _tables(self, dep: Deployment, strict: bool) -> Deployment:
        if self.kernel_configs is not None and self.device.type == "cuda":
            dep.backend.install_tables(self.kernel_configs, strict=strict)
        return dep

    def reference(self) -> Deployment:
        """The deployment in the target's stored weights."""
        if self.w12 or self.dep is None:
            target = load_target(self.path, self.dtype, self.device)
            self.dep, self.w12 = self._tables(Deployment.of(target, self.drafter), self.strict), False
        return self.dep

    def for_config(self, config: EngineConfig) -> Deployment:
        """The deployment for the spot re-execution in ``config``'s weight format (after
        :meth:`reference`). Raises SpecpilotError for w12 on weights other than bf16."""
        if config.weight_format != "w12":
            return self.dep
        if not self.w12:  # after the teacher-forced pass, which uses the reference weights
            if self.dtype != torch.bfloat16:
                raise SpecpilotError("weight_format w12 needs bf16 weights (--dtype bf16)")
            target = self.dep.target
            choice = w12_choice_for({"w12_choice": self.w12_choice}, config) if self.device.type == "cuda" else None
            if not choice:
                apply_w12(target)  # the eager 12-bit layers (w12_fast off, or the CPU)
            self.dep, self.w12 = self._tables(Deployment.of(target, self.drafter, w12_choice=choice), False), True
        return self.dep


def _load_drafter(args, candidates: list[tuple[str, list[Record], str]], dtype: torch.dtype,
                  device: torch.device):
    """The drafter for re-executing a drafter engine's first steps (None when not needed)."""
    if args.replay_tokens <= 0:
        return None
    needs_drafter = any(r.engine in ("stock", "specpilot") for _, recs, _ in candidates for r in recs)
    if needs_drafter and not args.drafter:
        raise SpecpilotError("re-executing a drafter engine's first steps needs --drafter "
                             "(or --replay-tokens 0 to skip the spot re-execution)")
    return load_drafter(args.drafter, dtype=dtype, device=device) if args.drafter else None


def _reexecution(args, candidate: list[Record], targets: _Targets) -> Reexecution | None:
    """The spot re-execution of a candidate over the loaded deployment (None with --replay-tokens 0)."""
    if args.replay_tokens <= 0:
        return None
    r0 = candidate[0] if candidate else None
    meta = {"deployment": r0.deployment, "target": r0.target, "drafter": r0.drafter, "gpu": r0.gpu} if r0 else {}
    return Reexecution(serve_reexecution(targets.for_config, meta), args.replay_tokens, args.max_new_tokens)


def _print_summary(name: str, verdict: dict) -> None:
    """One line per verdict on stdout, then its first five violations."""
    mx = verdict["max_near_tie_margin"]
    print(f"token forcing {Path(name).name}: {'pass' if verdict['passed'] else 'FAIL'} "
          f"({verdict['tokens_checked']}/{verdict['tokens_generated']} tokens checked, "
          f"{verdict['violations']} violations {verdict['violations_by_check'] or ''}, "
          f"{verdict['near_ties']} near-ties (largest margin {mx if mx is not None else '-'}, "
          f"tolerance {verdict['tolerance']:g}), replay {verdict['replay']['reproduced']}/"
          f"{verdict['replay']['requests']} reproduced; teacher-forced path {verdict['teacher_forced_path']}; "
          f"{verdict['seconds']['teacher_forced']:.2f} s + {verdict['seconds']['replay']:.2f} s)")
    for v in verdict["violation_list"][:5]:
        print(f"  {v['check']} {v['request_id']}: {v.get('detail', '')}")


def run(args: argparse.Namespace) -> int:
    """Run ``specpilot force``: write one verdict per candidate; returns 0 when every candidate
    passed (or with ``--report-only``), else 1.

    Raises:
        SpecpilotError: a bad ``--chunk``, unreadable records or prompts, a drafter engine without
            ``--drafter`` (and re-execution on), bad kernel files, and as :func:`force`.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk < 1:
        raise SpecpilotError(f"--chunk must be >= 1, got {args.chunk}")
    candidates = [(str(c), read_records(c), out) for c, out in one_out_each(args.out, args.candidate, "candidate(s)")]
    references = {str(p): read_records(p) for p in args.reference}
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    prompts = {p["request_id"]: p["prompt_ids"] for p in read_prompts(args.prompts)}
    drafter = _load_drafter(args, candidates, dtype, device)
    tol = args.tolerance if args.tolerance is not None else \
        tolerance_for(DEFAULT_TOLERANCE, "bf16" if dtype == torch.bfloat16 else "fp32")
    kernel_configs = forcing_kernel_configs(args.kernel_agent, args.kernel_configs)
    w12_choice = agent_w12_choice(read_json(args.kernel_agent), args.kernel_agent) if args.kernel_agent else {}
    cpu = read_json(args.kernel_agent).get("cpu") if args.kernel_agent else None
    if cpu:  # the re-execution runs fused CPU steps with the matmul kernel the cell ran (the teacher: plain)
        set_matmul(cpu.get("matmul", "aten"))
    targets = _Targets(args.target, dtype, device, kernel_configs, bool(args.kernel_configs), w12_choice, drafter)
    failed = False
    for name, candidate, out in candidates:
        backend = targets.reference().backend
        verdict = force(candidate, references, prompts, backend, tol, _reexecution(args, candidate, targets),
                        args.chunk, candidate_name=name, teacher_forced_path=args.teacher_forced_path,
                        kernel_configs=kernel_configs)
        engine_config = args.engine_config if len(candidates) == 1 or (
            candidate and candidate[0].engine == "specpilot") else None
        if engine_config:
            check_engine_config(verdict, candidate, engine_config)
        write_json(out, verdict)
        _print_summary(name, verdict)
        failed |= not verdict["passed"]
        references[name] = candidate  # a later candidate is checked against this one too
    return 0 if not failed or args.report_only else 1

"""The one decision of the execution path: how a target (and its drafter) run on their device.

:func:`choose_backend` looks at a loaded target once and returns a :class:`Backend`: eager (no CUDA
graphs), the eager forward captured in CUDA graphs (``torch-graphs``), the Triton dense step
(``triton-dense``) or the Triton family step of hybrid Gated DeltaNet / sliding-window targets
(``triton-family``), with or without 12-bit (w12) matmul roles. The object holds the compiled step,
its CUDA graphs, its matmul tables and the reason for the choice; the runner, token forcing, the
kernels rule, the w12 installer and the kernel sub-agent all receive it. Nothing is stored on the
model: whoever loads a deployment keeps its backend (:class:`specpilot.deployment.Deployment`).

The rules (unchanged from the engine's history, now in one place):

- CUDA graphs: on for a CUDA device unless ``graphs`` is False; True on the CPU is an error.
- Kernels ``auto``: Triton on CUDA with bf16 weights when Triton imports, else the eager forward
  (``torch``). ``triton`` asked where Triton is missing is an error.
- Dense targets: the Triton dense step when :func:`~specpilot.fastpath.support.dense_support`
  allows it; else the eager forward in CUDA graphs (``triton`` asked explicitly: an error).
- Hybrid / sliding-window targets: the Triton family step when the kernels are not ``torch``, the
  weights not fp32, and :func:`~specpilot.fastpath.support.family_support` allows it; else eager.
- w12 roles (``w12_choice``: which matmul roles are held in 12 bits and at which row counts they
  run the 12-bit loader, :mod:`specpilot.fastpath.w12`; the kernel sub-agent's choice, or every
  role): the target is converted in place first (:func:`~specpilot.fastpath.w12.prepare`, any
  path), then the Triton dense or family step runs those roles with the bf16 kernel's 12-bit
  loader, bit-identical to bf16; the eager forward decodes them exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import SpecpilotError
from ..fastpath.cpu_linear import matmul
from ..fastpath.cpu_target import FusedTarget
from ..fastpath.graphs import StepGraphs
from ..fastpath.support import dense_support, family_support, target_support, triton_available
from ..fastpath.tables import KERNELS
from ..fastpath.w12 import choice_json, parse_choice, prepare
from .config import EngineConfig

PATHS = ("eager", "torch-graphs", "triton-dense", "triton-family")


def use_graphs(graphs: bool | None, device: torch.device) -> bool:
    """``None`` (auto) -> CUDA graphs on CUDA devices, eager elsewhere; True needs CUDA.

    Raises SpecpilotError for True on a device that is not CUDA."""
    if graphs is None:
        return device.type == "cuda"
    if graphs and device.type != "cuda":
        raise SpecpilotError("CUDA graphs need a CUDA device (use graphs off on the CPU)")
    return bool(graphs)


def resolve_kernels(kernels: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``triton`` on CUDA with bf16 weights when Triton imports, else ``torch``.

    Raises SpecpilotError for an unknown name, or ``triton`` without Triton installed."""
    kernels = kernels or "auto"
    if kernels not in KERNELS:
        raise SpecpilotError(f"unknown kernels {kernels!r}; use {', '.join(KERNELS)}")
    if kernels == "auto":
        ok = device.type == "cuda" and dtype == torch.bfloat16 and triton_available()
        return "triton" if ok else "torch"
    if kernels == "triton" and not triton_available():
        raise SpecpilotError("kernels 'triton' requested but triton is not installed")
    return kernels


@dataclass
class Backend:
    """How one target runs (see the module docstring). Built by :func:`choose_backend`.

    Attributes:
        model: the target it decides for.
        path: one of :data:`PATHS`; reason: why (a sentence for logs and records).
        graphs: whether steps run under CUDA graphs (the drafter's steps follow it).
        kernels: the kernels asked for (``auto``/``triton``/``torch``), resolved again for the drafter.
        step_graphs: the target's captured steps (:class:`~specpilot.fastpath.graphs.StepGraphs`),
            None on the eager path.
        tables: matmul tables installed in the Triton step (:meth:`install_tables`).
        drafter_tables: matmul tables of the Triton draft step (:meth:`install_drafter_tables`).
        w12: the w12 choice the target was prepared with (JSON form, ``{role: "w12" | {max_rows:
            "w12" | "bf16"}}``), or None; w12_stats: what the preparation converted and freed.
    """

    model: nn.Module
    path: str
    reason: str
    graphs: bool = False
    kernels: str = "auto"
    step_graphs: object | None = None
    tables: dict = field(default_factory=dict)
    drafter_tables: dict = field(default_factory=dict)
    w12: dict | None = None
    w12_stats: dict | None = None
    _drafters: dict = field(default_factory=dict, repr=False)
    _fused: object | None = field(default=None, repr=False)

    @property
    def fast(self):
        """The Triton step (:class:`~specpilot.fastpath.dense.FastTarget` or its family subclass), or None."""
        return None if self.step_graphs is None else self.step_graphs.fast

    @property
    def triton(self) -> bool:
        """True on a Triton path (dense or family)."""
        return self.path.startswith("triton")

    @property
    def tree_fast(self) -> bool:
        """Token trees verify in the Triton step (under CUDA graphs on a GPU): the dense and the
        family paths, up to 256 nodes and depth 64 (larger trees are refused, never handed to
        the eager forward); the eager paths verify trees eagerly like every other step."""
        return self.triton

    @property
    def can_prefill_rows(self) -> bool:
        """Prompts prefill row by row through the Triton step (batch-invariant; every refill too)."""
        return self.fast is not None

    def install_tables(self, tables: dict, strict: bool = False) -> bool:
        """Install matmul ``tables`` (``{role: key or {max_rows: key}}``, ``attn_rows``) in the Triton
        step; returns whether it did. ``strict`` (an explicit ``--kernel-configs``): install or raise;
        otherwise (the kernel sub-agent's tables, tuned for this deployment's target: the dense
        step's or the family step's role weights) a target that runs no Triton step is left alone.

        Raises:
            SpecpilotError: ``strict`` and no Triton step; a malformed table (named)."""
        if not tables:
            return False
        if self.path not in ("triton-dense", "triton-family") and not (strict and self.triton):
            if strict:
                raise SpecpilotError(f"matmul tables need the Triton step, but this target runs {self.path}: "
                                     f"{self.reason}")
            return False
        if self.fast.set_configs(tables):
            self.step_graphs.cache.entries.clear()  # other kernels: recapture
        self.tables = dict(tables)
        return True

    def install_drafter_tables(self, tables: dict) -> bool:
        """Install matmul ``tables`` (``{role: {max_rows: key}}``, the kernel sub-agent's draft-step
        tables through :func:`~specpilot.kernels_build.engine_tables`) in every Triton draft step of
        this deployment, those built later included (:meth:`drafter_graphs`; their graphs recaptured).
        Returns whether it may run here (the target on a Triton path under CUDA graphs: the draft
        step follows it; a drafter the Triton draft step cannot run keeps its eager network).
        Raises SpecpilotError for a malformed table (when a draft step takes it)."""
        if not tables or not self.graphs or not self.triton:
            return False
        self.drafter_tables = dict(tables)
        for _, g in self._drafters.values():
            if g.fast is not None and g.fast.set_configs(tables):
                g.cache.entries.clear()
        return True

    def fused_step(self):
        """The fused CPU step of this target (:class:`~specpilot.fastpath.cpu_target.FusedTarget`,
        engine config ``verify_path: fused``), built on first use and kept.

        Raises:
            SpecpilotError: the target does not run eagerly on the CPU, or the step cannot run it
                (the reason named)."""
        if self.path != "eager" or self.model.lm_head.weight.device.type != "cpu":
            raise SpecpilotError(f"verify_path fused is the CPU step; this target runs {self.path} on "
                                 f"{self.model.lm_head.weight.device.type}: {self.reason}")
        if self._fused is None or self._fused.kernel != matmul():  # the installed matmul kernel (cpu_linear)
            self._fused = FusedTarget(self.model)
        return self._fused

    def drafter_graphs(self, drafter, embed: nn.Embedding, lm_head: nn.Module):
        """The captured steps of a DFlash-family ``drafter`` reading this target's ``embed`` and
        ``lm_head`` (:class:`~specpilot.fastpath.drafter.DrafterGraphs`, built once per triple and
        kept here), or None without CUDA graphs. Raises SpecpilotError for a drafter off CUDA."""
        if not self.graphs:
            return None
        key = (id(drafter), id(embed), id(lm_head))
        if key not in self._drafters:
            w = drafter.fc.weight
            if w.device.type != "cuda":
                raise SpecpilotError("CUDA graphs need the drafter on a CUDA device")
            kernels = resolve_kernels(self.kernels, w.device, w.dtype)
            from ..fastpath.drafter import DrafterGraphs  # the fast path imports Triton (optional dependency)

            g = DrafterGraphs(drafter, embed, lm_head, kernels)
            if self.w12 and g.fast is not None:  # the draft step's roles in 12 bits too (the same drafts)
                g.fast.use_w12(parse_choice(self.w12))
            if self.drafter_tables and g.fast is not None:  # the sub-agent's draft-step tables
                g.fast.set_configs(self.drafter_tables)
            self._drafters[key] = (drafter, g)
        return self._drafters[key][1]

    def matmul_choices(self) -> dict[str, str]:
        """What the checked-cuBLAS selection of the Triton steps chose so far: ``"role:M:NxK"`` ->
        ``"cublas"`` or a Triton config key; the drafter step's entries prefixed ``"drafter "``."""
        out = {}
        if self.fast is not None:
            out.update({k: v["chosen"] for k, v in self.fast.selection.items()})
        for _, g in self._drafters.values():
            if g.fast is not None:
                out.update({f"drafter {k}": v["chosen"] for k, v in g.fast.selection.items()})
        return out

    def teacher_forced_path(self, engine_configs: list[dict], asked: str = "auto") -> str:
        """Which kernels token forcing's teacher-forced pass runs for a cell: ``"triton"`` (the
        engine's step, margins exactly 0 for an honest engine) or ``"eager"``.

        ``auto``: ``triton`` exactly when the engine ran its prefix and verify steps through a Triton
        step: this backend's path is ``triton-dense`` or ``triton-family`` (chains and trees: every
        tree node's logits are a decode's of its path), no record's engine config converts the
        weights other than to w12 in the fast path (``weight_format: w12`` with ``w12_fast``: the
        12-bit loader of the same kernels, bit-identical to this bf16 step), and no record names
        another execution path (its ``engine_config["path"]``, e.g. an engine run with graphs
        off). ``triton`` asked needs a Triton step for the target (on the CPU: ``TRITON_INTERPRET=1``).

        Raises:
            SpecpilotError: an unknown ``asked``; ``triton`` where the step cannot run.
        """
        if asked not in ("auto", "eager", "triton"):
            raise SpecpilotError(f"unknown teacher-forced path {asked!r}; use auto, eager, triton")
        if asked == "eager":
            return "eager"
        if asked == "triton":
            why = target_support(self.model)
            if why is not None or not triton_available():
                raise SpecpilotError("the teacher-forced pass through the Triton step needs Triton and a target the "
                                     "step runs: plain linear layers and a power-of-two head_dim "
                                     f"({why or 'no Triton'})")
            if self.model.lm_head.weight.device.type != "cuda" and not interpreting():
                raise SpecpilotError("the Triton teacher-forced pass needs a CUDA target (or TRITON_INTERPRET=1)")
            return "triton"
        if not self.triton:
            return "eager"
        for cfg in engine_configs:
            fmt = cfg.get("weight_format") or "bf16"
            w12_fast = fmt == "w12" and EngineConfig.parse(cfg, "a record's engine_config", record=True).w12_fast
            if (fmt != "bf16" and not w12_fast) or cfg.get("path", self.path) != self.path:
                return "eager"
        return "triton"


def _dense(model, kernels: str, asked: str) -> Backend:
    """The backend of a dense target under CUDA graphs with resolved ``kernels``."""
    why = dense_support(model)
    if kernels != "triton" or why is not None:
        if kernels == "triton" and asked == "triton":
            raise SpecpilotError(f"kernels 'triton' cannot run this target: {why}")
        return Backend(model, "torch-graphs", f"eager forward in CUDA graphs ({why or 'kernels torch'})", True, asked,
                       StepGraphs(model))
    from ..fastpath.dense import FastTarget  # Triton: an optional dependency

    return Backend(model, "triton-dense", "Triton dense step", True, asked, StepGraphs(model, FastTarget(model)))


def _with_w12(b: Backend, choice: dict | None, stats: dict | None) -> Backend:
    """Record the w12 choice the target was prepared with and install it in the Triton step."""
    if not choice:
        return b
    b.w12, b.w12_stats = choice_json(choice), stats
    if b.fast is not None:
        b.fast.use_w12(choice)
        b.reason += f" with w12 roles {sorted(choice)} (the 12-bit loader of the same kernels)"
    else:
        b.reason += f"; w12 roles {sorted(choice)} decoded for the eager forward"
    return b


def choose_backend(model, graphs: bool | None = None, kernels: str | None = "auto",
                   w12_choice: dict | None = None) -> Backend:
    """The execution path of a loaded target ``model`` on its device (module docstring).

    Args:
        model: a :class:`~specpilot.models.target.Transformer` (weights on their device).
        graphs: CUDA graphs (None = auto: on for CUDA); kernels: ``auto``, ``triton`` or ``torch``.
        w12_choice: ``{role: tiers}`` (:func:`specpilot.fastpath.w12.parse_choice`): the target is
            converted first (:func:`~specpilot.fastpath.w12.prepare`, bf16 weights only), then
            the Triton step runs those roles with the 12-bit loader (bit-identical to bf16).
    Returns:
        a :class:`Backend`.
    Raises:
        SpecpilotError: graphs on without CUDA, unknown kernels, ``triton`` asked where Triton or
            the target's shape cannot run it, a w12 choice on weights other than bf16.
    """
    w = model.lm_head.weight
    device, dtype = w.device, w.dtype
    asked = kernels or "auto"
    stats = None
    if w12_choice:
        if dtype != torch.bfloat16:
            raise SpecpilotError(f"w12 roles need bf16 weights, the target holds {dtype}")
        stats = prepare(model, w12_choice)  # lossless, in place: every path below reads the converted roles
    if not use_graphs(graphs, device):
        resolve_kernels(asked, device, dtype)  # an unknown name is refused on every path
        return _with_w12(Backend(model, "eager", "no CUDA graphs" + (" (graphs off)" if graphs is False
                                                                      else f" on {device.type}"), False, asked),
                         w12_choice, stats)
    resolved = resolve_kernels(asked, device, dtype)
    if model.config.is_dense:
        return _with_w12(_dense(model, resolved, asked), w12_choice, stats)
    why = family_support(model) or ("fp32 weights" if dtype == torch.float32 else None) \
        or ("kernels torch" if resolved != "triton" else None)
    if why:
        return _with_w12(Backend(model, "eager", f"hybrid / sliding-window target off the family step: {why}", True,
                                 asked), w12_choice, stats)
    from ..fastpath.family import FastFamilyTarget  # Triton: an optional dependency

    return _with_w12(Backend(model, "triton-family", "Triton family step", True, asked,
                             StepGraphs(model, FastFamilyTarget(model))), w12_choice, stats)


def interpreting() -> bool:
    """True when Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``: tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


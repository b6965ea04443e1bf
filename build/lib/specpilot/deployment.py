"""A deployment = target + drafter (+ weight format), loaded from checkpoint directories, with the
execution backend chosen for it once (:func:`specpilot.engine.backend.choose_backend`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine.backend import Backend, choose_backend
from .errors import SpecpilotError
from .models.dflash import DFlashDrafter
from .models.loading import load_drafter, load_target
from .models.qwen3 import Transformer
from .w12 import apply_w12

WEIGHT_FORMATS = ("native", "bf16", "fp32", "w12")


@dataclass
class Deployment:
    """A loaded target, its drafter network (or None), the target's EOS id and its backend."""

    target: Transformer
    drafter: DFlashDrafter | None
    eos_id: int | None
    backend: Backend

    @classmethod
    def of(cls, target: Transformer, drafter: DFlashDrafter | None = None, eos_id: int | None = None,
           graphs: bool | None = None, kernels: str | None = "auto", w12_choice: dict | None = None) -> "Deployment":
        """A deployment of models already loaded, its backend chosen now (see :func:`choose_backend`)."""
        return cls(target, drafter, eos_id, choose_backend(target, graphs, kernels, w12_choice))


def _eos_id(target_dir: str | Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        p = Path(target_dir) / name
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None


def load_deployment(target_dir: str | Path, drafter_dir: str | Path | None, device: torch.device,
                    dtype: torch.dtype, weight_format: str = "native", graphs: bool | None = None,
                    kernels: str | None = "auto", w12_choice: dict | None = None) -> Deployment:
    """Load the target (and drafter) onto ``device`` in ``dtype``, apply the weight format and
    choose the backend.

    ``weight_format`` ``w12`` swaps the target's linear layers for the lossless 12-bit format (needs
    bf16); with a ``w12_choice`` (``{role: W12Role}``) the chosen roles run the 12-bit kernel inside
    the Triton step instead (:func:`~specpilot.engine.backend.choose_backend`).

    Raises:
        SpecpilotError: mismatched target/drafter shapes, an unknown weight format, w12 without bf16.
    """
    target = load_target(target_dir, dtype=dtype, device=device)
    drafter = load_drafter(drafter_dir, dtype=dtype, device=device) if drafter_dir else None
    if drafter is not None:
        tc, dc = target.config, drafter.config
        if dc.hidden_size != tc.hidden_size or dc.vocab_size != tc.vocab_size:
            raise SpecpilotError(
                f"drafter {drafter_dir} (hidden {dc.hidden_size}, vocab {dc.vocab_size}) does not fit target "
                f"{target_dir} (hidden {tc.hidden_size}, vocab {tc.vocab_size})")
        if max(dc.target_layer_ids) >= tc.num_hidden_layers:
            raise SpecpilotError(f"drafter reads target layer {max(dc.target_layer_ids)} but the target has "
                                 f"{tc.num_hidden_layers} layers")
    if weight_format not in WEIGHT_FORMATS:
        raise SpecpilotError(f"unknown weight_format {weight_format!r}; use bf16 or w12")
    if weight_format == "w12":
        if dtype != torch.bfloat16:
            raise SpecpilotError("weight_format w12 needs bf16 weights (--dtype bf16)")
        apply_w12(target)
    return Deployment.of(target, drafter, _eos_id(target_dir), graphs, kernels,
                         w12_choice if weight_format == "w12" else None)

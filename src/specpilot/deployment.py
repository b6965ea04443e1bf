"""A deployment = target + drafter (+ weight format), loaded from checkpoint directories."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecpilotError
from .models.dflash import DFlashDrafter
from .models.loading import load_drafter, load_target
from .models.qwen3 import Transformer


@dataclass
class Deployment:
    target: Transformer
    drafter: DFlashDrafter | None
    eos_id: int | None


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
                    dtype: torch.dtype, config: dict | None = None) -> Deployment:
    """Load the target (and drafter) onto ``device`` in ``dtype``; apply the weight format.

    ``config["weight_format"] == "w12"`` swaps the target's linear layers for the lossless
    12-bit format (needs bf16). Raises SpecpilotError on mismatched target/drafter shapes.
    """
    config = config or {}
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
    fmt = config.get("weight_format", "native")
    if fmt == "w12":
        if dtype != torch.bfloat16:
            raise SpecpilotError("weight_format w12 needs bf16 weights (--dtype bf16)")
        from .w12 import apply_w12

        apply_w12(target)
    elif fmt not in ("native", "bf16", "fp32"):
        raise SpecpilotError(f"unknown weight_format {fmt!r}; use bf16 or w12")
    return Deployment(target, drafter, _eos_id(target_dir))

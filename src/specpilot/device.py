"""Which device this process runs on: the ``{gpu}`` wildcard value of the workflow, and the torch
device and dtype a command's ``--device`` / ``--dtype`` options name.

``cpu`` without CUDA; otherwise the normalized name of CUDA device 0 (``h100``, ``h200``,
``rtx_pro_6000``, ...). Results of different devices live under different ``results/{gpu}/``
folders, so the name must be stable across driver versions and board variants (``H100 80GB HBM3``,
``H100 PCIe`` and ``H100 NVL`` are all ``h100``).
"""

from __future__ import annotations

import re

import torch

from .errors import SpecpilotError

# (pattern on the lowercased device name, normalized name); first match wins, so more specific
# names come before the names they contain.
_KNOWN: list[tuple[str, str]] = [
    (r"\bgh200\b", "gh200"),
    (r"\bgb200\b", "gb200"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b", "h100"),
    (r"\bh800\b", "h800"),
    (r"\bh20\b", "h20"),
    (r"\bb200\b", "b200"),
    (r"\bb300\b", "b300"),
    (r"\ba100\b", "a100"),
    (r"\ba800\b", "a800"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\brtx pro 6000\b", "rtx_pro_6000"),
    (r"\brtx 6000 ada\b", "rtx_6000_ada"),
]


def normalize_gpu_name(name: str) -> str:
    """Map a CUDA device name to the ``{gpu}`` wildcard value.

    Known families map to short names (``"NVIDIA H100 80GB HBM3"`` -> ``h100``,
    ``"NVIDIA RTX PRO 6000 Blackwell Server Edition"`` -> ``rtx_pro_6000``). Anything else becomes
    the name lowercased, without a leading ``NVIDIA``, with every run of other characters turned
    into one underscore (``"NVIDIA GeForce RTX 4090"`` -> ``geforce_rtx_4090``).
    """
    low = " ".join(name.lower().split())
    for pattern, short in _KNOWN:
        if re.search(pattern, low):
            return short
    low = re.sub(r"^nvidia\b", "", low)
    slug = re.sub(r"[^a-z0-9]+", "_", low).strip("_")
    return slug or "unknown_gpu"


def detect_gpu() -> str:
    """``"cpu"`` when CUDA is unavailable, else the normalized name of CUDA device 0."""
    if not torch.cuda.is_available():
        return "cpu"
    return normalize_gpu_name(torch.cuda.get_device_name(0))


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; errors on an unavailable explicit choice."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecpilotError(f"device {name!r} requested but CUDA is not available")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise SpecpilotError(f"unknown device {name!r}; use auto, cpu or cuda")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> fp32 on CPU, bf16 on CUDA."""
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise SpecpilotError(f"unknown dtype {name!r}; use auto, fp32 or bf16")
    return table[name]

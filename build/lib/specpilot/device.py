"""Which device this process runs on: the ``{gpu}`` wildcard value of the workflow, and the torch
device and dtype a command's ``--device`` / ``--dtype`` options name.

``cpu`` without CUDA; otherwise the normalized name of CUDA device 0 (``h100``, ``h200``,
``rtx_pro_6000``, ...). Results of different devices live under different ``results/{gpu}/``
folders, so the name must be stable across driver versions and board variants (``H100 80GB HBM3``,
``H100 PCIe`` and ``H100 NVL`` are all ``h100``).
"""

from __future__ import annotations


import torch

from .devices import normalize_gpu_name  # noqa: F401  (torch-free home; re-exported)
from .errors import SpecpilotError

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

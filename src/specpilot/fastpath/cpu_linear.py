"""The matmul kernel of the fused CPU steps: aten's (``F.linear``: MKL's sgemm on x86) or oneDNN's with
the weight prepacked once (``torch.ops.mkldnn``, the kernel inductor's CPU backend runs).

For the small row counts of a verify or draft block (8-20 rows) on a CPU with AVX-512, oneDNN's
prepacked kernel is about twice as fast as MKL's sgemm for the tiny target's shapes (192 x 1152,
192 x 2048: 2026-12-05, AMD EPYC, 1 thread), with bit-equal or ~1e-6-relative outputs; for one row
it is slower (a fixed ~20 us), so one-row calls stay on aten. Which kernel the fused steps use is
the kernel sub-agent's choice per deployment (:mod:`specpilot.agent.kernel_cpu`: both checked
against the plain forward and timed), installed process-wide by
:func:`specpilot.kernels_build.use_kernel_outputs` (:func:`set_matmul`), as the GPU's tuned tables are.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..errors import SpecpilotError

MATMULS = ("aten", "onednn")
PACK_ROWS = 16  # the row count oneDNN's packed layout is chosen for (verify and draft blocks)
_CHOICE = {"matmul": "aten"}


def onednn_problem() -> str | None:
    """None when oneDNN's prepacked linear runs here (a tiny product checked against ``F.linear``), else why not."""
    try:
        w, x = torch.randn(8, 16), torch.randn(2, 3, 16)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), None,
                                               "none", [], "")
    except Exception as e:  # noqa: BLE001 - a build without oneDNN, another CPU: any failure means no
        return f"oneDNN linear unavailable: {type(e).__name__}: {str(e)[:120]}"
    if not torch.allclose(y, F.linear(x, w), atol=1e-5):
        return "oneDNN linear disagrees with F.linear"
    return None


def set_matmul(name: str) -> None:
    """Install the matmul kernel fused CPU steps built from now on use (``aten`` or ``onednn``).

    Raises SpecpilotError for another name, or ``onednn`` where it cannot run."""
    if name not in MATMULS:
        raise SpecpilotError(f"unknown CPU matmul kernel {name!r}; use {', '.join(MATMULS)}")
    if name == "onednn" and (why := onednn_problem()):
        raise SpecpilotError(f"CPU matmul onednn: {why}")
    _CHOICE["matmul"] = name


def matmul() -> str:
    """The installed matmul kernel (:func:`set_matmul`; default ``aten``)."""
    return _CHOICE["matmul"]


class Linear:
    """``x @ weight.T`` (no bias) with the chosen kernel; ``weight`` [N, K] is read as it is (aten)
    or packed once (oneDNN, at construction). Inputs [..., K] -> [..., N]; one-row inputs run aten."""

    def __init__(self, weight: torch.Tensor, kernel: str | None = None):
        self.weight = weight
        self.kernel = kernel or matmul()
        self.packed = None
        if self.kernel == "onednn":
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.numel() == x.shape[-1]:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")

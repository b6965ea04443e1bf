"""``W12Linear``: a bias-free linear layer whose bf16 weight is held in the lossless 12-bit format.

* CPU (and any non-CUDA device): decode the weight to bf16 with :func:`specpilot.w12.format.unpack`
  (bit-identical to the original) and call ``F.linear``: the output is bit-identical to the
  ``nn.Linear`` it replaced. This is the reference path CI tests.
* CUDA with Triton: the fused decode+matmul kernels of :mod:`specpilot.kernels.w12_triton` for
  ``M <= FUSED_MAX_M`` rows of flattened input (decode steps M = 1..32, verify steps up to 256;
  fp32 accumulation, within bf16 accumulation tolerance of cuBLAS, not bit-identical to it), and
  for larger M the decode kernel followed by ``F.linear``. Without Triton CUDA also uses the
  reference decode + ``F.linear``.

Checkpoint names follow the converter (``specpilot convert-w12``): the weight ``<module>.weight``
becomes ``<module>.weight.w12_mant``, ``.w12_codes``, ``.w12_esc_idx``, ``.w12_esc_val`` and
``.w12_base`` (int32 [1]).

Format after Turbo-Lossless (cenconq25/Turbo-Lossless) and NyoomFloat12
(openreview.net/forum?id=yYFj1E1mSZ); see :mod:`specpilot.w12.format`.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..errors import SpecpilotError
from .format import GROUP, W12Tensor, _check_w12, escape_csr, nbytes, pack, unpack

FUSED_MAX_M = 256
SUFFIXES = ("w12_mant", "w12_codes", "w12_esc_idx", "w12_esc_val", "w12_base")
DEFAULT_SKIP = ("lm_head", "embed")

_KERNELS: Any = None
_KERNELS_TRIED = False


def load_kernels():
    """The :mod:`specpilot.kernels.w12_triton` module, or None when Triton is missing (cached)."""
    global _KERNELS, _KERNELS_TRIED
    if _KERNELS_TRIED:
        return _KERNELS
    _KERNELS_TRIED = True
    try:
        _KERNELS = importlib.import_module("specpilot.kernels.w12_triton")
    except ImportError:
        _KERNELS = None
        warnings.warn("w12: Triton kernels unavailable; CUDA falls back to decode + F.linear", stacklevel=2)
    return _KERNELS


class W12Linear(nn.Module):
    """``y = x @ W.T`` with W (bf16 ``[out_features, in_features]``) stored in the 12-bit format.

    Buffers (moved by ``.to``): ``w12_mant`` uint8 [N, K], ``w12_codes`` uint8 [N, K/2],
    ``w12_esc_idx`` int64 [E], ``w12_esc_val`` bf16 [E], ``w12_base`` int32 [1], and the
    non-persistent row-sorted escape lists the fused kernels read.

    Forward: ``x`` bf16 ``[..., in_features]`` -> bf16 ``[..., out_features]``.
    """

    def __init__(self, packed: W12Tensor):
        super().__init__()
        n, k = packed.shape
        self.in_features = k
        self.out_features = n
        self.base = int(packed.base)
        self.register_buffer("w12_mant", packed.mant)
        self.register_buffer("w12_codes", packed.codes)
        self.register_buffer("w12_esc_idx", packed.escape_idx)
        self.register_buffer("w12_esc_val", packed.escape_val)
        self.register_buffer("w12_base", torch.tensor([self.base], dtype=torch.int32, device=packed.mant.device))
        rowptr, row, col, val = escape_csr(packed)
        self.register_buffer("_esc_rowptr", rowptr, persistent=False)
        self.register_buffer("_esc_row", row, persistent=False)
        self.register_buffer("_esc_col", col, persistent=False)
        self.register_buffer("_esc_val", val, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "W12Linear":
        """Pack an existing bias-free bf16 ``nn.Linear`` (on its current device).

        Raises:
            SpecpilotError: not an ``nn.Linear``, has a bias, weight not bf16, or in_features not a
                multiple of 8.
        """
        if not isinstance(linear, nn.Linear):
            raise SpecpilotError(f"w12: from_linear needs an nn.Linear, got {type(linear).__name__}")
        if linear.bias is not None:
            raise SpecpilotError(f"w12: only bias-free linears are supported; this one "
                                 f"({linear.out_features}x{linear.in_features}) has a bias")
        return cls(pack(linear.weight.detach()))

    def packed(self) -> W12Tensor:
        """The weight as a :class:`W12Tensor` (views of the buffers, no copy)."""
        return W12Tensor(self.w12_mant, self.w12_codes, self.base, self.w12_esc_idx, self.w12_esc_val,
                         (self.out_features, self.in_features))

    def weight_bf16(self) -> torch.Tensor:
        """The exact bf16 weight ``[out_features, in_features]`` (decoded on the buffers' device)."""
        if self.w12_mant.is_cuda:
            kern = load_kernels()
            if kern is not None:
                return kern.decode(self.w12_mant, self.w12_codes, self.base, self.w12_esc_idx, self.w12_esc_val)
        return unpack(self.packed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise SpecpilotError(f"w12: input has {x.shape[-1]} features, layer expects {self.in_features}")
        if x.is_cuda and self.w12_mant.is_cuda:
            kern = load_kernels()
            if kern is not None:
                if x.dtype != torch.bfloat16:
                    raise SpecpilotError(f"w12: CUDA input must be bfloat16, got {x.dtype}")
                lead = x.shape[:-1]
                x2 = x.reshape(-1, self.in_features)
                x2 = x2.contiguous()
                if x2.data_ptr() % 16:  # the kernels read x as 16-byte vectors
                    x2 = x2.clone()
                if x2.shape[0] <= FUSED_MAX_M:
                    esc = kern.EscapeCSR(self._esc_rowptr, self._esc_row, self._esc_col, self._esc_val)
                    y = kern.matmul(x2, self.w12_mant, self.w12_codes, self.base, esc)
                else:
                    y = F.linear(x2, self.weight_bf16())
                return y.reshape(*lead, self.out_features)
        return F.linear(x, unpack(self.packed()))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, base={self.base}, "
                f"escapes={self.w12_esc_idx.numel()}")


def _eligible(name: str, mod: nn.Module, include: Callable[[str], bool], skip: tuple[str, ...]) -> str | None:
    """None when ``mod`` can be swapped, else the reason it is skipped."""
    parts = name.split(".")
    if any(tok in part for part in parts for tok in skip):
        return "skipped by name"
    if not include(name):
        return "excluded by include()"
    if mod.bias is not None:
        return "has a bias"
    if mod.weight.dtype != torch.bfloat16:
        return f"weight dtype {mod.weight.dtype}"
    if mod.in_features % GROUP:
        return f"in_features {mod.in_features} not a multiple of {GROUP}"
    return None


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _stats(mods: list[W12Linear], skipped: dict[str, str]) -> dict[str, Any]:
    params = sum(m.in_features * m.out_features for m in mods)
    escapes = sum(m.w12_esc_idx.numel() for m in mods)
    return {
        "tensors": len(mods),
        "params": params,
        "escape_rate": escapes / params if params else 0.0,
        "bytes_bf16": 2 * params,
        "bytes_w12": sum(nbytes(m.packed()) for m in mods),
        "skipped": skipped,
    }


def apply_w12(model: nn.Module, include: Callable[[str], bool] = lambda name: True,
              skip: tuple[str, ...] = DEFAULT_SKIP) -> dict[str, Any]:
    """Swap every eligible ``nn.Linear`` of ``model`` for a :class:`W12Linear`, in place.

    Eligible: a bias-free ``nn.Linear`` with a bf16 weight and in_features a multiple of 8, whose
    dotted module name has no part containing a ``skip`` token (default: ``lm_head``, ``embed``)
    and for which ``include(name)`` is true. HF Qwen3 / Llama names work as they are
    (``model.layers.{i}.self_attn.q_proj``, ..., ``mlp.down_proj``). The packed weight stays on the
    linear's device. Outputs are unchanged bit for bit on CPU.

    Returns:
        ``{"tensors", "params", "escape_rate", "bytes_bf16", "bytes_w12", "skipped"}``; ``skipped``
        maps each ``nn.Linear`` left alone to the reason.
    """
    targets, skipped = [], {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not isinstance(mod, W12Linear):
            why = _eligible(name, mod, include, skip)
            if why is None:
                targets.append((name, mod))
            else:
                skipped[name] = why
    new_mods = []
    for name, mod in targets:
        new = W12Linear.from_linear(mod)
        _set_child(model, name, new)
        new_mods.append(new)
    return _stats(new_mods, skipped)


def w12_tensors(prefix: str, packed: W12Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one packed weight named ``prefix`` (e.g. ``...q_proj.weight``)."""
    return {
        f"{prefix}.w12_mant": packed.mant,
        f"{prefix}.w12_codes": packed.codes,
        f"{prefix}.w12_esc_idx": packed.escape_idx,
        f"{prefix}.w12_esc_val": packed.escape_val,
        f"{prefix}.w12_base": torch.tensor([int(packed.base)], dtype=torch.int32),
    }


def w12_from_tensors(prefix: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int] | None = None) -> W12Tensor:
    """Rebuild a :class:`W12Tensor` from checkpoint tensors named ``<prefix>.w12_*``.

    Raises:
        SpecpilotError: a part is missing or the parts disagree.
    """
    missing = [s for s in SUFFIXES if f"{prefix}.{s}" not in tensors]
    if missing:
        raise SpecpilotError(f"w12 checkpoint: {prefix} lacks {', '.join(missing)}")
    mant = tensors[f"{prefix}.w12_mant"]
    n, k = shape or tuple(mant.shape)
    t = W12Tensor(mant, tensors[f"{prefix}.w12_codes"], int(tensors[f"{prefix}.w12_base"].reshape(-1)[0]),
                  tensors[f"{prefix}.w12_esc_idx"].to(torch.int64), tensors[f"{prefix}.w12_esc_val"], (n, k))
    _check_w12(t)
    return t


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` to a temp file in the same folder, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_w12_state(model: nn.Module, path: str | os.PathLike) -> dict[str, Any]:
    """Write ``model``'s state as one safetensors file with w12 weights (atomic).

    Each :class:`W12Linear` ``m`` is written as ``m.weight.w12_*`` (the converter's names); every
    other parameter and persistent buffer under its ``state_dict`` name (tied tensors are copied).

    Returns:
        the :func:`apply_w12`-style stats of the w12 modules written.
    """
    tensors: dict[str, torch.Tensor] = {}
    mods, w12_names = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, W12Linear):
            prefix = f"{name}.weight" if name else "weight"
            tensors.update(w12_tensors(prefix, mod.packed()))
            mods.append(mod)
            w12_names.update(f"{name}.{s}" if name else s for s in SUFFIXES)
    for key, val in model.state_dict().items():
        if key not in w12_names:
            tensors[key] = val
    save_safetensors_atomic(tensors, path, metadata={"format": "pt", "weight_format": "w12", "w12_version": "1"})
    return _stats(mods, {})


def load_w12_state(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> dict[str, Any]:
    """Load a w12 checkpoint (from :func:`save_w12_state` or ``specpilot convert-w12``) into ``model``.

    Each ``<module>.weight.w12_*`` group replaces ``<module>`` (an ``nn.Linear`` or a
    ``W12Linear``) by a :class:`W12Linear` on that module's device; the other tensors are loaded
    with ``load_state_dict``.

    Raises:
        SpecpilotError: the file is missing, a w12 group names no module or a module of another
            shape, or (``strict``) keys are missing or unexpected.
    """
    if not Path(path).is_file():
        raise SpecpilotError(f"w12 checkpoint not found: {path}")
    tensors = load_file(str(path))
    prefixes = sorted(k[: -len(".w12_mant")] for k in tensors if k.endswith(".w12_mant"))
    mods = []
    for prefix in prefixes:
        mod_name = prefix[: -len(".weight")] if prefix.endswith(".weight") else prefix
        try:
            old = model.get_submodule(mod_name)
        except AttributeError:
            raise SpecpilotError(f"w12 checkpoint {path}: no module {mod_name!r} in the model") from None
        if not isinstance(old, (nn.Linear, W12Linear)):
            raise SpecpilotError(f"w12 checkpoint {path}: {mod_name!r} is a {type(old).__name__}, not a linear")
        t = w12_from_tensors(prefix, tensors)
        if t.shape != (old.out_features, old.in_features):
            raise SpecpilotError(f"w12 checkpoint {path}: {mod_name} has shape {t.shape}, the model "
                                 f"expects {(old.out_features, old.in_features)}")
        if isinstance(old, nn.Linear) and old.bias is not None:
            raise SpecpilotError(f"w12 checkpoint {path}: {mod_name} has a bias; w12 linears are bias-free")
        dev = old.weight.device if isinstance(old, nn.Linear) else old.w12_mant.device
        new = W12Linear(t.to(dev))
        _set_child(model, mod_name, new)
        mods.append(new)
        for s in SUFFIXES:
            tensors.pop(f"{prefix}.{s}")
    result = model.load_state_dict(tensors, strict=False)
    w12_keys = {k for k in result.missing_keys if k.rsplit(".", 1)[-1] in SUFFIXES}
    missing = [k for k in result.missing_keys if k not in w12_keys]
    if strict and (missing or result.unexpected_keys):
        raise SpecpilotError(f"w12 checkpoint {path}: missing keys {missing[:5]}, unexpected keys "
                             f"{result.unexpected_keys[:5]}")
    return _stats(mods, {})

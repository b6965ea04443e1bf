"""``specpilot convert-w12``: a bf16 checkpoint folder -> a lossless 12-bit (w12) checkpoint folder.

Reads ``config.json`` and every ``*.safetensors`` of ``--src``. Every 2-D floating ``*.weight``
whose name has no part containing ``embed`` or ``lm_head`` (unless ``--include-lm-head``) and whose
column count is a multiple of 8 is packed (:func:`specpilot.w12.format.pack`) into
``<name>.w12_mant``, ``.w12_codes``, ``.w12_esc_idx``, ``.w12_esc_val`` and ``.w12_base``
(int32 [1]); fp32 weights are cast to bf16 first (reported); fp16 weights are refused (a cast would
change values). All other tensors are copied unchanged. Writes, in ``--dst``:

* ``model.w12.safetensors`` (atomic: temp file + ``os.replace``), metadata
  ``{"format": "pt", "weight_format": "w12", "w12_version": "1"}``;
* ``config.json``, ``generation_config.json`` and the tokenizer files, copied;
* ``w12.json``: ``escape_rate``, ``bytes_bf16``, ``bytes_w12``, ``tensors`` (count),
  ``params``, ``cast_from_fp32`` (names), ``verified`` and ``per_tensor`` (shape, base, escapes).

Each packed tensor is decoded again and compared bit for bit (``--no-verify`` skips this).
Format after Turbo-Lossless (cenconq25/Turbo-Lossless) and NyoomFloat12
(openreview.net/forum?id=yYFj1E1mSZ).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import SpecpilotError
from ..io import read_json, write_json
from .format import GROUP, escape_rate, nbytes, pack, unpack
from .linear import save_safetensors_atomic, w12_tensors

OUT_NAME = "model.w12.safetensors"
COPY_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
              "chat_template.jinja", "chat_template.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--src", required=True, help="checkpoint folder: config.json + *.safetensors")
    parser.add_argument("--dst", required=True, help="output folder for the w12 checkpoint")
    parser.add_argument("--include-lm-head", action="store_true", help="also pack lm_head.weight")
    parser.add_argument("--no-verify", action="store_true", help="skip the bit-exact decode check")


def is_linear_weight(name: str, t: torch.Tensor, include_lm_head: bool = False) -> bool:
    """Whether the converter packs tensor ``name``: 2-D float ``*.weight``, K % 8 == 0, not embed/lm_head."""
    if not name.endswith(".weight") or t.dim() != 2 or not t.is_floating_point():
        return False
    parts = name.split(".")
    if any("embed" in p for p in parts):
        return False
    if not include_lm_head and any("lm_head" in p for p in parts):
        return False
    return t.shape[1] % GROUP == 0


def _copy_atomic(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def convert(src: str | os.PathLike, dst: str | os.PathLike, include_lm_head: bool = False,
            verify: bool = True, log=print) -> dict[str, Any]:
    """Convert checkpoint folder ``src`` into a w12 checkpoint folder ``dst``; returns the w12.json dict.

    Raises:
        SpecpilotError: ``src`` lacks config.json or safetensors files, a tensor name repeats across
            shards, a packable weight is fp16, or a verification fails.
    """
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise SpecpilotError(f"convert-w12: no config.json in {src}")
    read_json(src / "config.json")  # must be valid JSON
    files = sorted(p for p in src.glob("*.safetensors") if p.name != OUT_NAME)
    if not files:
        raise SpecpilotError(f"convert-w12: no *.safetensors in {src}")
    dst.mkdir(parents=True, exist_ok=True)
    if dst.resolve() == src.resolve():
        raise SpecpilotError(f"convert-w12: --dst must differ from --src ({src})")

    out: dict[str, torch.Tensor] = {}
    per_tensor: dict[str, dict] = {}
    cast: list[str] = []
    params = escapes = bytes_w12 = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in out or f"{name}.w12_mant" in out:
                    raise SpecpilotError(f"convert-w12: tensor {name} appears twice (second time in {f.name})")
                t = sf.get_tensor(name)
                if not is_linear_weight(name, t, include_lm_head):
                    out[name] = t
                    continue
                if t.dtype == torch.float16:
                    raise SpecpilotError(f"convert-w12: {name} is float16; w12 packs bf16 (an fp16 -> bf16 "
                                         "cast would change values)")
                if t.dtype != torch.bfloat16:
                    cast.append(name)
                    t = t.to(torch.bfloat16)
                packed = pack(t)
                if verify and not torch.equal(unpack(packed).view(torch.int16), t.view(torch.int16)):
                    raise SpecpilotError(f"convert-w12: {name} does not decode bit-exactly")
                out.update(w12_tensors(name, packed))
                per_tensor[name] = {"shape": list(packed.shape), "base": packed.base,
                                    "escapes": int(packed.escape_idx.numel()),
                                    "escape_rate": escape_rate(packed)}
                params += packed.numel
                escapes += int(packed.escape_idx.numel())
                bytes_w12 += nbytes(packed)
    if cast:
        log(f"convert-w12: cast {len(cast)} fp32 weights to bf16 before packing (e.g. {cast[0]})")
    save_safetensors_atomic(out, dst / OUT_NAME, metadata={"format": "pt", "weight_format": "w12",
                                                           "w12_version": "1"})
    for name in COPY_NAMES:
        if (src / name).is_file():
            _copy_atomic(src / name, dst / name)
    summary = {
        "escape_rate": escapes / params if params else 0.0,
        "bytes_bf16": 2 * params,
        "bytes_w12": bytes_w12,
        "tensors": len(per_tensor),
        "params": params,
        "escapes": escapes,
        "cast_from_fp32": cast,
        "verified": bool(verify),
        "source": str(src),
        "per_tensor": per_tensor,
    }
    write_json(dst / "w12.json", summary)
    ratio = bytes_w12 / (2 * params) if params else 0.0
    log(f"convert-w12: {len(per_tensor)} tensors, {params} weights, escape rate {summary['escape_rate']:.6%}, "
        f"{2 * params} bytes bf16 -> {bytes_w12} bytes w12 ({ratio:.4f}x)")
    return summary


def run(args: argparse.Namespace) -> int:
    convert(args.src, args.dst, include_lm_head=args.include_lm_head, verify=not args.no_verify)
    return 0

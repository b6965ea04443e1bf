"""``specpilot random-checkpoint``: random-weight checkpoints of realistic shapes, no downloads.

Writes a Hugging Face layout checkpoint (config.json + safetensors, sharded with an index when
large) of a named shape, loadable by :func:`specpilot.models.loading.load_target` and by
transformers like a real one, plus a random DFlash drafter of the matching shape. Weights are
N(0, 0.02) (norms 1), drawn per tensor from a generator seeded by (seed, tensor name), so the
same seed gives the same tensors in any model that uses the HF names (ours or transformers').

Random weights give meaningless text: use them for system benchmarks (speed, memory) only, with
the replay drafter (:mod:`specpilot.drafters.replay`) standing in for acceptance.

Shapes (``--shape``):

- ``qwen3-8b``: Qwen3-8B (hidden 4096, intermediate 12288, 36 layers, 32 q / 8 kv heads of 128,
  vocab 151936, rope_theta 1e6, untied), 8.2 B parameters, 16.4 GB in bf16; drafter: 5 DFlash
  layers of the same width (target layers 1, 9, 17, 25, 33), block 16.
- ``qwen3-27b-dense``: a 27B-class dense Qwen3 shape (hidden 5120, intermediate 17408, 64
  layers, 40 q / 8 kv heads of 128, vocab 151936), 22.7 B parameters (45.4 GB in bf16: the
  dense layout of that width and depth); drafter: 5 layers.
- ``qwen3.8-27b``: the Qwen3.8-27B / Qwen3.5-27B hybrid (``qwen3_5_text``: hidden 5120,
  intermediate 17408, 64 layers = [3 Gated DeltaNet, 1 gated full attention] x 16; attention 24 q /
  4 kv heads of 256, partial RoPE 0.25, rope_theta 1e7; GDN 16 key / 48 value heads of 128, conv 4;
  vocab 248320, untied), about 26.9 B parameters; drafter: 5 DFlash layers (32 q / 8 kv heads of 128).
- ``muse-glimmer-30b``: Muse-Glimmer-30B's text model (``muse_glimmer_text``: hidden 6656,
  intermediate 19968, 52 layers = [3 sliding (window 2048, RoPE), 1 global NoPE] x 13; 32 q / 2 kv
  heads of 128; vocab 202048; softcap 20, output multiplier 0.196, qk_scale_factor 3.87,
  rope_theta 5e5, untied), about 27.8 B parameters (29.6 B with the 1.8 B vision encoder it omits); drafter: 5 DFlash layers (32 q / 8 kv of 128).
- ``tiny``: 6 layers of width 128 and vocab 1024 (tests, CPU).
- ``tiny-hybrid`` / ``tiny-muse``: the two families at width 128 (tests, CPU).

Sources for the two study shapes: ``shared/notes/mechanisms.md`` section A (config fixtures,
NeMo AutoModel coverage pages) and transformers 5.17's ``Qwen3_5TextConfig`` /
``MuseGlimmerTextConfig`` conventions.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import zlib
from pathlib import Path

import torch
from torch import nn

from safetensors.torch import save_file

from ..io import atomic_write_text
from .config import TargetConfig
from .dflash import DFlashDrafter, DrafterConfig, build_target_layer_ids
from .qwen3 import Transformer
from .shapes import DRAFTER_KEYS, SHAPES, shape_spec

STD = 0.02
# which family's norm convention random_tensor fills (None: plain w = 1; "qwen3_5": every norm but the
# GDN output norm stores 1 + w; "muse": every layer norm stores 1 + w, the final norm plain w)
ZERO_CENTRED: contextvars.ContextVar = contextvars.ContextVar("zero_centred", default=None)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16}


def target_config(shape: str) -> TargetConfig:
    """The :class:`TargetConfig` of a named shape (Qwen3 layout, untied embeddings)."""
    d = {k: v for k, v in shape_spec(shape).items() if k not in DRAFTER_KEYS}
    d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}
    return TargetConfig(**d, tie_word_embeddings=False)


def drafter_config(shape: str, block_size: int = 16) -> DrafterConfig:
    """A DFlash drafter config matching the target shape (same width, ``draft_layers`` layers)."""
    s = shape_spec(shape)
    t = target_config(shape)
    n = s["draft_layers"]
    heads, kv_heads, head_dim = s.get("draft_heads", (t.num_attention_heads, t.num_key_value_heads, t.head_dim))
    return DrafterConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=n,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, vocab_size=t.vocab_size,
                         target_layer_ids=build_target_layer_ids(t.num_hidden_layers, n),
                         mask_token_id=s["mask_token_id"], block_size=block_size, rms_norm_eps=t.rms_norm_eps,
                         rope_theta=t.rope_theta, num_target_layers=t.num_hidden_layers)


def hf_config(cfg: TargetConfig) -> dict:
    """config.json of a random target (``TargetConfig.to_hf_dict`` plus the rope_parameters form)."""
    d = cfg.to_hf_dict()
    d.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": cfg.rope_theta})
    d["bos_token_id"], d["eos_token_id"] = None, None
    return d



def random_tensor(name: str, shape, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The tensor ``name`` of a random checkpoint, seeded by (seed, name): N(0, 0.02) for matrices;
    for vectors the value that makes them neutral or typical: norms 1 (0 where the family stores
    ``1 + w``, see :data:`ZERO_CENTRED`), GDN ``dt_bias`` 1 and ``A_log`` log(U(1, 16))."""
    if name.endswith("A_log"):
        g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log().to(dtype=dtype, device=device)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype, device=device)
    if len(shape) == 1 or "norm" in name:
        fill = 0.0 if ZERO_CENTRED.get() and not name.endswith("linear_attn.norm.weight") else 1.0
        if ZERO_CENTRED.get() == "muse" and name == "model.norm.weight":
            fill = 1.0
        return torch.full(shape, fill, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * STD).to(dtype)


@torch.no_grad()
def fill_random_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Overwrite every parameter of ``module`` (HF names) with its :func:`random_tensor`, in place."""
    seen = set()
    for name, p in module.named_parameters():
        if p.data_ptr() in seen:  # tied weights: filled once
            continue
        seen.add(p.data_ptr())
        p.copy_(random_tensor(name, tuple(p.shape), seed, p.dtype, p.device))
    return module


@contextlib.contextmanager
def _norm_convention(cfg: TargetConfig):
    tok = ZERO_CENTRED.set({"qwen3_5": "qwen3_5", "muse_glimmer": "muse"}.get(cfg.family) if cfg.norm_offset else None)
    try:
        yield
    finally:
        ZERO_CENTRED.reset(tok)


def materialize_target(cfg: TargetConfig, device="cpu", dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0) -> Transformer:
    """A random target of config ``cfg`` built directly on ``device`` (no checkpoint files): the
    tensors of :func:`random_tensor` drawn there (seconds for a 27B shape on a GPU)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    with _norm_convention(cfg):
        return fill_random_(model, seed).eval()


def materialize_drafter(cfg: DrafterConfig, device="cpu", dtype: torch.dtype = torch.bfloat16,
                        seed: int = 1) -> DFlashDrafter:
    """A random DFlash drafter of config ``cfg`` built directly on ``device`` (``seed`` = its own)."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = model.to(dtype).to_empty(device=device)
    return fill_random_(model, seed).eval()


def build_target(shape: str, device="cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Transformer:
    """A random target of a named shape built directly on ``device``, as loading would give."""
    return materialize_target(target_config(shape), device, dtype, seed)


def build_drafter(shape: str, device="cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                  block_size: int = 16) -> DFlashDrafter:
    """A random DFlash drafter of the shape's drafter config, built directly on ``device``."""
    return materialize_drafter(drafter_config(shape, block_size), device, dtype, seed + 1)


def _write(module_factory, config: dict, out: Path, seed: int, dtype: torch.dtype, shard_bytes: int) -> list[str]:
    """Write config.json and the random tensors of ``module_factory()`` (a meta-device module) in shards."""
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        meta = module_factory()
    names = [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
    esize = torch.empty(0, dtype=dtype).element_size()
    shards, cur, size = [], [], 0
    for n, shp in names:
        nbytes = esize * int(torch.Size(shp).numel())
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((n, shp))
        size += nbytes
    if cur:
        shards.append(cur)
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {n: random_tensor(n, shp, seed, dtype, "cpu") for n, shp in shard}
        total += sum(t.numel() * t.element_size() for t in state.values())
        tmp = out / f".{fname}.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / fname)
        files.append(fname)
        weight_map.update({n: fname for n, _ in shard})
        del state
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return files


def write_random_checkpoint(shape: str, out: str | Path, drafter_out: str | Path | None = None,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            shard_bytes: int = 4 * 2 ** 30, lazy: bool = False,
                            drafter_block: int = 16) -> tuple[Path, Path]:
    """Write the random target of ``shape`` to ``out`` and its random DFlash drafter to ``drafter_out``
    (default ``{out}-drafter``), whose config.json gives ``drafter_block`` as the block it drafts
    (its "trained" block: what ``--block-size auto`` reads). Returns both directories.

    ``lazy``: write each config.json alone, marked ``specpilot_random.lazy``: the loader then
    draws the weights from the seed on the device it loads to (:func:`materialize_target`), so a
    27B / 30B shape costs kilobytes of disk and seconds, and every job that loads it gets the same
    tensors (same seed, device kind and torch version)."""
    out = Path(out)
    dout = Path(drafter_out) if drafter_out else out.with_name(out.name + "-drafter")
    tcfg = target_config(shape)
    dname = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]
    config = hf_config(tcfg)
    config["torch_dtype"] = dname
    config["specpilot_random"] = {"shape": shape, "seed": seed, "std": STD, **({"lazy": True} if lazy else {})}
    dcfg = drafter_config(shape, drafter_block)
    dconf = dcfg.to_hf_dict()
    dconf["torch_dtype"] = dname
    dconf["specpilot_random"] = {"shape": shape, "seed": seed + 1, "std": STD, **({"lazy": True} if lazy else {})}
    if lazy:
        for folder, conf in ((out, config), (dout, dconf)):
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / "config.json", json.dumps(conf, indent=2) + "\n")
        return out, dout
    with _norm_convention(tcfg):
        _write(lambda: Transformer(tcfg), config, out, seed, dtype, shard_bytes)
    _write(lambda: DFlashDrafter(dcfg), dconf, dout, seed + 1, dtype, shard_bytes)
    return out, dout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="target checkpoint directory to write")
    p.add_argument("--drafter-out", help="drafter checkpoint directory (default: OUT-drafter)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors shard [GiB]")
    p.add_argument("--drafter-block", type=int, default=16,
                   help="the drafter's block size in its config.json (DFlash counting; default 16)")
    p.add_argument("--lazy", action="store_true", help="write config.json only: the loader draws the weights from "
                   "the seed on its device (kilobytes on disk; for GPU boxes without room for 50 GB checkpoints)")


def run(args) -> int:
    t, d = write_random_checkpoint(args.shape, args.out, args.drafter_out, DTYPES[args.dtype], args.seed,
                                   int(args.shard_gb * 2 ** 30), args.lazy, args.drafter_block)
    print(json.dumps({"target": str(t), "drafter": str(d), "shape": args.shape, "dtype": args.dtype,
                      "seed": args.seed, "lazy": args.lazy}))
    return 0

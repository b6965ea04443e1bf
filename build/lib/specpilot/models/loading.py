"""Load and save checkpoints in the Hugging Face layout (config.json + *.safetensors).

Real checkpoints and the locally built tiny deployment go through the same code path.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import SpecpilotError
from ..io import atomic_write_text
from .config import TargetConfig, read_config
from .dflash import DFlashDrafter, DrafterConfig
from .dflash2 import CODEBOOKS, DFlash2Drafter
from .dspark import DSparkDrafter, dspark_config, dspark_hf_dict
from .random_checkpoint import materialize_drafter, materialize_target
from .target import Transformer

# checkpoint ``architectures`` -> the drafter network class (DFlash / DFlash2: z-lab; DSpark: DeepSpec)
DRAFTER_NETWORKS = {"DFlashDraftModel": DFlashDrafter, "DFlash2DraftModel": DFlash2Drafter,
                    "Qwen3DSparkModel": DSparkDrafter}


def network_class(arch: str):
    """The drafter network class of a checkpoint architecture. Raises SpecpilotError for others."""
    if arch not in DRAFTER_NETWORKS:
        raise SpecpilotError(f"unsupported drafter architecture {arch!r}; supported: {', '.join(DRAFTER_NETWORKS)}")
    return DRAFTER_NETWORKS[arch]

# vision-language checkpoints keep the text model under this prefix (Qwen3_5ForConditionalGeneration,
# MuseGlimmerForConditionalGeneration); everything else under ``model.`` there is the vision tower
VL_TEXT_PREFIX = "model.language_model."
DROPPED_PREFIXES = ("mtp.",)  # Qwen3.5 multi-token-prediction head: not part of the target


def text_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors under our names (``model.*``, ``lm_head.*``).

    Drops MTP weights (``mtp.*``); for a vision-language layout (``model.language_model.*``)
    renames the text model to ``model.*`` and drops the vision tower, adapter and projector.
    """
    state = {k: v for k, v in state.items() if not k.startswith(DROPPED_PREFIXES)}
    if not any(k.startswith(VL_TEXT_PREFIX) for k in state):
        return state
    out = {}
    for k, v in state.items():
        if k.startswith(VL_TEXT_PREFIX):
            out["model." + k[len(VL_TEXT_PREFIX):]] = v
        elif not k.startswith("model."):
            out[k] = v
    return out


def load_state(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (every ``*.safetensors`` file, sharded or not).

    Raises:
        SpecpilotError: no safetensors file, or a corrupt one (named).
    """
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise SpecpilotError(f"no *.safetensors weights in {checkpoint_dir}")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise SpecpilotError(f"corrupt weights file {f}: {e}") from None
    return state


def _load_into(module: torch.nn.Module, state: dict, where: str, ignore_missing: tuple[str, ...] = ()) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in state and not k.endswith(ignore_missing)]
    unexpected = [k for k in state if k not in own]
    if missing:
        raise SpecpilotError(f"{where}: checkpoint lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise SpecpilotError(f"{where}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise SpecpilotError(f"{where}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=False)


def cpu_matmul_layout(module: torch.nn.Module) -> torch.nn.Module:
    """Store every CPU ``nn.Linear`` weight [out, in] transposed in memory (a [in, out] contiguous
    tensor viewed back as [out, in]); returns ``module`` (changed in place).

    ``F.linear(x, W)`` computes ``x @ W.T``: with ``W.T`` contiguous the CPU BLAS runs a plain
    row-major product instead of repacking the weight on every call, which halves the time of the
    small products a decode or verify step is made of (measured on 2 cores, the tiny target: a
    [8, 192] x [192, 576] product 36 -> 16 us; gpt-fast stores weights for its hot path the same
    way). Values are unchanged; results agree to float rounding (another BLAS kernel). A weight
    shared with an embedding (tied LM head) gets its own copy, the embedding keeps the row layout
    its lookups read. CUDA weights are left as they are (the GPU path has its own kernels).
    """
    for mod in module.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.device.type == "cpu" and mod.weight.dim() == 2:
            w = mod.weight
            mod.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
    return module


def _lazy_seed(config: dict) -> int | None:
    """The seed of a lazy random checkpoint's config.json (``specpilot random-checkpoint --lazy``),
    else None."""
    rnd = config.get("specpilot_random")
    return int(rnd.get("seed", 0)) if isinstance(rnd, dict) and rnd.get("lazy") else None


def load_target(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    """Load a target checkpoint directory into our :class:`Transformer` (built by layer type).

    Layouts: text-only causal LMs (Qwen3, Llama, ``Qwen3_5ForCausalLM``, ``MuseGlimmerForCausalLM``)
    and the text model of vision-language checkpoints (``Qwen3_5ForConditionalGeneration``,
    ``MuseGlimmerForConditionalGeneration``: ``model.language_model.*``; vision and MTP weights dropped).

    Args:
        checkpoint_dir: folder with config.json and *.safetensors.
        dtype: parameter dtype (fp32 on CPU, bf16 on CUDA by convention). GDN state stays fp32.
    CPU weights are stored for fast small products (:func:`cpu_matmul_layout`).

    Raises:
        SpecpilotError: missing/corrupt checkpoint, unsupported layer type, tensor mismatch.
    """
    raw = read_config(checkpoint_dir)
    cfg = TargetConfig.from_hf_dict(raw, f"{checkpoint_dir}/config.json")
    lazy = _lazy_seed(raw)
    if lazy is not None:  # a lazy random checkpoint: the weights are drawn from the seed on the device
        return cpu_matmul_layout(materialize_target(cfg, device, dtype, lazy))
    state = text_state(load_state(checkpoint_dir))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_into(model, {k: v.to(dtype) for k, v in state.items()}, str(checkpoint_dir),
               ignore_missing=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    return cpu_matmul_layout(model).eval()


def drafter_config(d: dict, where: str = "drafter config.json") -> DrafterConfig:
    """Parse a drafter config.json by its architecture (DFlash / DFlash2 / DSpark layouts).

    Raises:
        SpecpilotError: unsupported architecture (named) or missing keys.
    """
    arch = (d.get("architectures") or [""])[0]
    if arch not in DRAFTER_NETWORKS:
        raise SpecpilotError(f"{where}: unsupported drafter architecture {arch!r}; "
                             f"supported: {', '.join(DRAFTER_NETWORKS)}")
    if arch == "Qwen3DSparkModel":
        return dspark_config(d, where)
    return DrafterConfig.from_hf_dict(d, where)


def drafter_hf_dict(cfg: DrafterConfig) -> dict:
    """config.json of a drafter in its public layout (DSpark: DeepSpec; else z-lab)."""
    if cfg.architecture == "Qwen3DSparkModel":
        return dspark_hf_dict(cfg)
    return cfg.to_hf_dict()


def _drafter_state(state: dict) -> dict:
    """Checkpoint names -> module names: DFlash2 stores its codebooks without ``.weight``."""
    out = {}
    for k, v in state.items():
        if any(k == f"candidate_selector.{c}" for c in CODEBOOKS):
            k = k + ".weight"
        out[k] = v
    return out


def load_drafter(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> DFlashDrafter:
    """Load a drafter checkpoint, dispatching on ``architectures``: ``DFlashDraftModel`` (z-lab),
    ``DFlash2DraftModel`` (z-lab), ``Qwen3DSparkModel`` (DeepSpec); see :data:`DRAFTER_NETWORKS`.

    Raises:
        SpecpilotError: missing/corrupt checkpoint, unsupported architecture or config, tensor mismatch.
    """
    d = read_config(checkpoint_dir)
    cfg = drafter_config(d, f"{checkpoint_dir}/config.json")
    lazy = _lazy_seed(d)
    if lazy is not None:
        if cfg.architecture != "DFlashDraftModel":
            raise SpecpilotError(f"{checkpoint_dir}: lazy random drafters are DFlash networks, not {cfg.architecture}")
        return cpu_matmul_layout(materialize_drafter(cfg, device, dtype, lazy))
    with torch.device("meta"):
        model = network_class(cfg.architecture)(cfg)
    model = model.to_empty(device=device).to(dtype)
    state = _drafter_state(load_state(checkpoint_dir))
    _load_into(model, {k: v.to(dtype) for k, v in state.items()}, str(checkpoint_dir))
    return cpu_matmul_layout(model).eval()


def save_drafter(module: torch.nn.Module, out_dir: str | Path) -> None:
    """Save a drafter network in its public layout (config.json + model.safetensors)."""
    state = {}
    for k, v in module.state_dict().items():
        for c in CODEBOOKS:
            if k == f"candidate_selector.{c}.weight":
                k = k[: -len(".weight")]
        state[k] = v
    save_checkpoint(module, drafter_hf_dict(module.config), out_dir, state=state)


def save_checkpoint(module: torch.nn.Module, config: dict, out_dir: str | Path, state: dict | None = None) -> None:
    """Write config.json and model.safetensors (shared tensors stored once) atomically per file.

    ``state`` overrides the tensors (default ``module.state_dict()``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in (state or module.state_dict()).items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".model.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / "model.safetensors")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")

"""Target model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecpilotError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")


@dataclass
class TargetConfig:
    """Shape of a dense decoder-only target (Qwen3 or Llama layout).

    ``qk_norm`` is True for Qwen3 (RMSNorm on each query/key head before RoPE), False for Llama.
    ``layer_types`` lists each layer's kind; only ``full_attention`` exists today, the field is
    there so hybrid targets (Gated DeltaNet, sliding window) can add kinds without a new config.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    qk_norm: bool = True
    architecture: str = "Qwen3ForCausalLM"
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecpilotError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> "TargetConfig":
        """Build from a transformers config dict (Qwen3 or Llama).

        Raises:
            SpecpilotError: unsupported architecture or a missing key (named).
        """
        arch = (d.get("architectures") or [""])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecpilotError(
                f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            rope = d.get("rope_parameters") or {}
            theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
            heads = d["num_attention_heads"]
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=d.get("max_position_embeddings", 4096),
                qk_norm=arch == "Qwen3ForCausalLM",
                architecture=arch,
                layer_types=list(d.get("layer_types") or []),
            )
        except KeyError as e:
            raise SpecpilotError(f"{where}: missing key {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict:
        """The transformers ``config.json`` content for this shape (loadable by AutoModelForCausalLM)."""
        model_type = "qwen3" if self.architecture == "Qwen3ForCausalLM" else "llama"
        return {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": self.layer_types,
            "torch_dtype": "float32",
        }


def read_config(checkpoint_dir: str | Path) -> dict:
    """Read ``config.json`` of a checkpoint directory.

    Raises:
        SpecpilotError: the directory or its config.json is missing or not valid JSON.
    """
    path = Path(checkpoint_dir) / "config.json"
    if not Path(checkpoint_dir).is_dir():
        raise SpecpilotError(f"checkpoint directory not found: {checkpoint_dir}")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecpilotError(f"no config.json in checkpoint directory {checkpoint_dir}") from None
    except json.JSONDecodeError as e:
        raise SpecpilotError(f"{path} is not valid JSON: {e}") from None

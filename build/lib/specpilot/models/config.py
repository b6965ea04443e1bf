"""Target model configuration read from a Hugging Face ``config.json``.

One :class:`TargetConfig` describes every target family the engine builds, layer by layer:

- ``qwen3`` / ``llama``: dense full attention (Qwen3 adds a weighted q/k RMSNorm);
- ``qwen3_5`` (Qwen3.5 / 3.6 / 3.8, transformers ``qwen3_5_text``): Gated DeltaNet layers
  (``linear_attention``) and gated full-attention layers with partial RoPE, all RMSNorms stored as
  ``(1 + w)``;
- ``muse_glimmer`` (transformers ``muse_glimmer_text``): sliding-window RoPE layers and global NoPE
  layers, scale-less q/k norm times ``qk_scale_factor``, a sigmoid output gate, sandwich norms, a
  weightless norm on the embeddings and a softcapped LM head with an output multiplier.

The family is read from ``model_type`` (a vision-language config's ``text_config`` is used); the
layers come from ``layer_types``. An unknown layer type is one :class:`SpecpilotError` naming it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import SpecpilotError

LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")

# model_type -> family; a config whose model_type is not listed is read as a plain dense decoder
# (Llama conventions) and must then consist of full-attention layers only.
FAMILIES = {
    "qwen3": "qwen3", "llama": "llama", "qwen2": "llama", "mistral": "llama",
    "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5",
    "muse_glimmer_text": "muse_glimmer", "muse_glimmer": "muse_glimmer",
}
# model_type written for each family (text-only layouts)
TEXT_MODEL_TYPE = {"qwen3": "qwen3", "llama": "llama", "qwen3_5": "qwen3_5_text", "muse_glimmer": "muse_glimmer_text"}
TEXT_ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                     "muse_glimmer": "MuseGlimmerForCausalLM"}


@dataclass
class DecoderShape:
    """The decoder shape a target and its drafter both declare (transformers config names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


@dataclass
class TargetConfig(DecoderShape):
    """Shape and per-layer structure of a decoder-only target.

    Dense fields (all families): the :class:`DecoderShape` fields, rms_norm_eps ...
    max_position_embeddings, ``qk_norm`` (weighted per-head q/k RMSNorm before RoPE: Qwen3,
    Qwen3.5). ``layer_types`` lists each layer's kind
    (:data:`LAYER_TYPES`); empty means all ``full_attention``.

    Family fields (defaults = dense Qwen3):
        family: ``qwen3`` | ``llama`` | ``qwen3_5`` | ``muse_glimmer``.
        norm_offset: layer RMSNorms (and q/k norms) scale by ``1 + w`` (Qwen3.5, Muse-Glimmer).
        final_norm_offset: the final norm scales by ``1 + w`` (Qwen3.5) rather than ``w``.
        partial_rotary_factor: fraction of head_dim rotated by RoPE (Qwen3.5: 0.25).
        attn_gate: attention output gate: ``none``, ``interleaved`` (Qwen3.5: q_proj emits
            [query | gate] per head, out *= sigmoid(gate)), ``proj`` (Muse-Glimmer ``gate_proj``).
        qk_scaleless: q/k RMSNorm without weight (Muse-Glimmer), query then times qk_scale_factor.
        sandwich_norm: post-attention and post-FFN norms (eps ``post_norm_eps``) before the residual.
        embed_norm: a weightless RMSNorm on the token embeddings.
        final_logit_softcapping / output_multiplier: logits = T tanh(mult * x / T) (T None: mult * x).
        sliding_window: W, a sliding query sees W keys including itself.
        layer_rope: per layer, whether it applies RoPE (False = NoPE).
        linear_*: Gated DeltaNet shape (key/value heads and dims, causal conv kernel).
    """

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    qk_norm: bool = True
    architecture: str = "Qwen3ForCausalLM"
    layer_types: list[str] = field(default_factory=list)
    family: str = ""
    norm_offset: bool = False
    final_norm_offset: bool = False
    partial_rotary_factor: float = 1.0
    attn_gate: str = "none"
    qk_scaleless: bool = False
    qk_scale_factor: float = 1.0
    sandwich_norm: bool = False
    post_norm_eps: float = 1e-6
    embed_norm: bool = False
    final_logit_softcapping: float | None = None
    output_multiplier: float = 1.0
    sliding_window: int | None = None
    layer_rope: list[bool] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    def __post_init__(self) -> None:
        if not self.family:
            self.family = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}.get(self.architecture, "llama")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise SpecpilotError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers="
                                 f"{self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise SpecpilotError(f"unsupported layer type {t!r} (layer {i}); supported: {', '.join(LAYER_TYPES)}")
        if not self.layer_rope:
            self.layer_rope = [True] * self.num_hidden_layers
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecpilotError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise SpecpilotError("sliding_attention layers need a positive sliding_window")
        if "linear_attention" in self.layer_types:
            if min(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                   self.linear_value_head_dim) <= 0:
                raise SpecpilotError("linear_attention layers need linear_num_key_heads, linear_num_value_heads, "
                                     "linear_key_head_dim and linear_value_head_dim")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise SpecpilotError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                                     f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.attn_gate not in ("none", "interleaved", "proj"):
            raise SpecpilotError(f"unknown attn_gate {self.attn_gate!r}")

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims RoPE rotates (even)."""
        d = int(self.head_dim * self.partial_rotary_factor)
        return d - d % 2

    @property
    def is_dense(self) -> bool:
        """True for the plain full-attention layout the fused GPU step (fastpath/dense.py) handles."""
        return (self.family in ("qwen3", "llama") and set(self.layer_types) <= {"full_attention"}
                and not self.embed_norm and self.final_logit_softcapping is None and self.output_multiplier == 1.0)

    @property
    def is_recurrent(self) -> bool:
        """True when some layer keeps a recurrent state (Gated DeltaNet)."""
        return "linear_attention" in self.layer_types

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> "TargetConfig":
        """Build from a transformers config dict (any supported family; VL configs via ``text_config``).

        Raises:
            SpecpilotError: an unsupported architecture / model type, a missing key or an unsupported
                layer type (named).
        """
        arch = (d.get("architectures") or [""])[0]
        top = d
        if isinstance(d.get("text_config"), dict):  # vision-language checkpoint: the text model
            d = {**d["text_config"]}
            d.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
        model_type = d.get("model_type") or top.get("model_type") or ""
        family = FAMILIES.get(model_type)
        if family is None:
            family = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
                      "MistralForCausalLM": "llama"}.get(arch)
        if family is None:
            raise SpecpilotError(
                f"{where}: unsupported architecture {arch or '(none)'!r} (model_type {model_type or '(none)'!r}); "
                f"supported model types: {', '.join(sorted(FAMILIES))}")
        try:
            rope = d.get("rope_parameters") or {}
            theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
            heads = d["num_attention_heads"]
            n = d["num_hidden_layers"]
            kw = dict(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=d.get("max_position_embeddings", 4096), qk_norm=family in ("qwen3", "qwen3_5"),
                architecture=arch, layer_types=list(d.get("layer_types") or []), family=family,
            )
            if family == "qwen3_5":
                if not kw["layer_types"]:
                    every = d.get("full_attention_interval", 4)
                    kw["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                         for i in range(n)]
                kw.update(norm_offset=True, final_norm_offset=True, attn_gate="interleaved",
                          partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                               d.get("partial_rotary_factor", 0.25))),
                          linear_num_key_heads=d["linear_num_key_heads"],
                          linear_num_value_heads=d["linear_num_value_heads"],
                          linear_key_head_dim=d["linear_key_head_dim"],
                          linear_value_head_dim=d["linear_value_head_dim"],
                          linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4))
            elif family == "muse_glimmer":
                if not kw["layer_types"]:
                    kw["layer_types"] = ["full_attention" if (n - 1 - i) % 4 == 0 else "sliding_attention"
                                         for i in range(n)]
                lrt = d.get("layer_rope_theta")
                if lrt is None:
                    lrt = [0 if (n - 1 - i) % 4 == 0 else 1 for i in range(n)]
                kw.update(norm_offset=True, final_norm_offset=False, attn_gate="proj", qk_norm=False,
                          qk_scaleless=True, qk_scale_factor=float(d.get("qk_scale_factor", 3.87)),
                          sandwich_norm=True, post_norm_eps=float(d.get("post_norm_eps", 1e-8)), embed_norm=True,
                          final_logit_softcapping=d.get("final_logit_softcapping", 20.0),
                          output_multiplier=float(d.get("output_multiplier", 0.19611613513818404)),
                          sliding_window=d.get("sliding_window", 2048), layer_rope=[bool(t) for t in lrt])
            else:
                if d.get("final_logit_softcapping"):
                    kw["final_logit_softcapping"] = float(d["final_logit_softcapping"])
                if kw["layer_types"] and "sliding_attention" in kw["layer_types"]:
                    kw["sliding_window"] = d.get("sliding_window")
            return cls(**kw)
        except KeyError as e:
            raise SpecpilotError(f"{where}: missing key {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict:
        """The transformers ``config.json`` content for this shape, in the family's text-only layout.

        qwen3 / llama / qwen3_5 load with ``AutoModelForCausalLM``; muse_glimmer is written as
        ``MuseGlimmerForCausalLM`` (vLLM's text-model name; transformers loads it as
        ``MuseGlimmerTextModel`` plus our softcapped head).
        """
        d = {
            "architectures": [TEXT_ARCHITECTURE[self.family]],
            "model_type": TEXT_MODEL_TYPE[self.family],
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
        if self.family == "qwen3_5":
            d.pop("rope_theta")
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.partial_rotary_factor}
            d.update(linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
                     linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
                     linear_conv_kernel_dim=self.linear_conv_kernel_dim)
        elif self.family == "muse_glimmer":
            d.pop("rope_theta"), d.pop("hidden_act")
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
            d.update(hidden_activation="silu", sliding_window=self.sliding_window,
                     final_logit_softcapping=self.final_logit_softcapping, output_multiplier=self.output_multiplier,
                     qk_scale_factor=self.qk_scale_factor, post_norm_eps=self.post_norm_eps,
                     layer_rope_theta=[self.rope_theta if r else 0 for r in self.layer_rope])
        return d

    def summary(self) -> dict:
        """All fields as a plain dict (for build records)."""
        return asdict(self)


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

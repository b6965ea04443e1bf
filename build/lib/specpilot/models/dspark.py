"""The DSpark drafter network: a DFlash backbone that samples from the anchor, with a Markov head
and a confidence head (its proposer is :class:`specpilot.drafters.dspark.DSparkProposer`).

Sources (facts re-implemented; no code copied): DeepSpec (deepseek-ai/DeepSpec,
``deepspec/modeling/dspark/*``) and the DSpark paper (arXiv 2607.05147); vLLM/speculators
``sample_from_anchor``; sglang-jax PR #1619. DeepSpec's code is not available offline here, so
where the notes leave a detail open our reading is stated below.

Network:
- backbone = DFlash layers over [context ; block] (fc + hidden_norm context injection, non-causal
  inside the block unless ``layer_types``/``is_causal`` say otherwise), with the checkpoint's
  own ``embed_tokens`` and ``lm_head`` (shipped; identical to the target's);
- **sample from anchor**: the block input is [anchor, mask x (gamma-1)] and *every* slot j is a
  prediction (slot j predicts the token anchor+j+1), so gamma drafts per step and verify width
  gamma + 1 (DFlash counting would say block gamma + 1);
- vanilla **Markov head** (rank r): logits_j = lm_head(h_j) + W2 W1[x_{j-1}], with x_{-1} = the
  anchor and x_{j-1} the previous drafted token, left to right (``markov_w1`` [V, r],
  ``markov_w2`` [V, r]); the ``gated``/``rnn`` variants are refused (SpecpilotError);
- **confidence head**: c_j = sigmoid(proj([h_j ; W1[x_{j-1}]])) (``confidence_head_with_markov``;
  else proj(h_j)), read as the probability that draft j survives verification given drafts
  < j did; survival of the first j drafts = prod c_1..c_j. Our reading: h_j is the backbone's
  normed output state (the one fed to the LM head).

Checkpoint: ``architectures: ["Qwen3DSparkModel"]``; top-level (or ``dspark_config``/
``dflash_config``) ``block_size`` (= gamma), ``target_layer_ids``, ``mask_token_id``,
``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov``; tensors as DFlash plus ``embed_tokens.weight``,
``lm_head.weight``, ``markov_head.markov_w{1,2}.weight``, ``confidence_head.proj.{weight,bias}``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SpecpilotError
from .dflash import DFlashDrafter, DrafterConfig

DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
               "num_anchors")


def dspark_config(d: dict, where: str = "drafter config.json") -> DrafterConfig:
    """A :class:`DrafterConfig` from a DeepSpec ``Qwen3DSparkModel`` config (keys at top level or in
    ``dspark_config``); DSpark fields go to ``extra``. Raises SpecpilotError on missing keys."""
    sub = dict(d.get("dspark_config") or {})
    flat = {**d, "dflash_config": {**(d.get("dflash_config") or {}), **sub}}
    for k in ("target_layer_ids", "mask_token_id", "block_size", *DSPARK_KEYS):
        if k in d and k not in flat["dflash_config"]:
            flat["dflash_config"][k] = d[k]
    cfg = DrafterConfig.from_hf_dict(flat, where)
    cfg.architecture = "Qwen3DSparkModel"
    x = cfg.extra
    x.setdefault("markov_rank", 256)
    x.setdefault("markov_head_type", "vanilla")
    x.setdefault("enable_confidence_head", True)
    x.setdefault("confidence_head_with_markov", True)
    if x["markov_head_type"] != "vanilla":
        raise SpecpilotError(f"{where}: markov_head_type {x['markov_head_type']!r} is not supported (only vanilla)")
    cfg.extra["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    return cfg


def dspark_hf_dict(cfg: DrafterConfig) -> dict:
    """config.json in the DeepSpec layout (DSpark fields at top level)."""
    d = cfg.to_hf_dict()
    d["architectures"] = ["Qwen3DSparkModel"]
    sub = d.pop("dflash_config")
    for k in ("target_layer_ids", "mask_token_id", "block_size", *DSPARK_KEYS):
        if k in sub:
            d[k] = sub[k]
    d["tie_word_embeddings"] = False
    return d


class MarkovHead(nn.Module):
    """Vanilla Markov head: bias over the vocabulary from the previous token, rank r."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)  # weight [V, r]

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias [..., V], the previous token's embedding W1[prev] [..., r]) for prev int64 [...]."""
        e = self.markov_w1(prev)
        return self.markov_w2(e), e


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden + (rank if with_markov else 0), 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Confidence logit [...] (apply sigmoid for the probability)."""
        x = torch.cat([h, e.to(h.dtype)], -1) if self.with_markov else h
        return self.proj(x)[..., 0]


class DSparkDrafter(DFlashDrafter):
    """The DSpark network (see the module docstring). ``config.block_size`` is gamma (drafts/step)."""

    kind = "dspark"

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        x = cfg.extra
        r = int(x["markov_rank"])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.markov_head = MarkovHead(cfg.vocab_size, r)
        self.confidence_head = ConfidenceHead(cfg.hidden_size, r, bool(x["confidence_head_with_markov"])) \
            if x["enable_confidence_head"] else None

    def embed_block(self, block, embed):
        return self.embed_tokens(block) * self.config.input_embedding_scale

    def heads(self, hidden: torch.Tensor, prev: torch.Tensor):
        """Markov-corrected logits [..., V] and confidence logits [...] (or None) of states
        hidden [..., hidden] given previous tokens prev int64 [...] (teacher forcing, training)."""
        bias, e = self.markov_head(prev)
        logits = self.logits(hidden, self.lm_head) + bias.to(hidden.dtype)
        conf = self.confidence_head(hidden, e) if self.confidence_head is not None else None
        return logits, conf

    def draft_full(self, anchor: torch.Tensor, start: torch.Tensor, gamma: int):
        """gamma drafts after ``anchor`` [B] (at position ``start`` [B]) in one backbone forward.

        Returns tokens int64 [B, gamma], Markov-corrected logits [B, gamma, V] and confidences
        float32 [B, gamma] in (0, 1) (ones without a confidence head).
        """
        B = anchor.shape[0]
        block = torch.full((B, gamma), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        hidden = self.block_hidden(block, start, None)
        base = self.logits(hidden, self.lm_head)
        prev, toks, logits, confs = anchor, [], [], []
        for j in range(gamma):
            bias, e = self.markov_head(prev)
            lj = base[:, j] + bias.to(base.dtype)
            if self.confidence_head is not None:
                confs.append(torch.sigmoid(self.confidence_head(hidden[:, j], e).float()))
            prev = lj.argmax(-1)
            toks.append(prev)
            logits.append(lj)
        conf = torch.stack(confs, 1) if confs else torch.ones(B, gamma, device=anchor.device)
        return torch.stack(toks, 1), torch.stack(logits, 1), conf

    def draft(self, anchor, start, embed, lm_head, block_size):
        """Engine interface: ``block_size`` = verify width (gamma + 1); the target's embed/lm_head
        are ignored (DSpark ships its own). Returns tokens [B, gamma] and logits [B, gamma, V]."""
        toks, logits, _ = self.draft_full(anchor, start, block_size - 1)
        return toks, logits

"""The tiny build's recipe (sizes and step counts), torch-free: the workflow reads it when it plans
(each drafter job's parameter is a hash of the recipe fields that drafter is trained from)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass

from ..errors import SpecpilotError

DRAFTERS = ("dflash", "dflash2", "dspark")


@dataclass
class TinyRecipe:
    """Sizes and step counts; ``FULL`` is the embedded default, ``QUICK`` is for tests (seconds)."""

    vocab: int = 2048
    hidden: int = 192
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 576
    # Step counts and lengths sized for a first run in minutes on 2 cores (issue 39): against the
    # earlier 360 target steps at 768 tokens, 540 / 360 drafter steps and 512 distillation prompts,
    # this recipe trains in about 0.6x the time, and its drafters still read stock tau 6.27 / 7.58 /
    # 6.68 (DFlash / DFlash2 / DSpark) on gsm8k and >= 4.6 on every benchmark at their trained block
    # (4 prompts each, 128 new tokens, 2026-12-04); the target's held-out gsm8k loss is 3.67 (3.22).
    target_steps: int = 240
    batch: int = 5
    seq_len: int = 512  # training window; distillation prompts keep their last 2 x seq_len tokens
    draft_layers: int = 2
    draft_intermediate: int = 512
    draft_block: int = 12
    distill_prompts: int = 384
    distill_tokens: int = 128
    drafter_steps: int = 240
    dflash_steps: int = 360  # DFlash learns slowest (one shared block pass, no selector): 1.5x the others' steps
    drafter_batch: int = 16
    anchors: int = 12
    selector_rank: int = 32
    selector_top_k: int = 8
    markov_rank: int = 64
    # the target's training precision: fp32, bf16 (CPU autocast) or auto (bf16 where the CPU has native
    # bf16). fp32 by default: on a 2-core EPYC bf16 trained the target in 292 s against 383 s with the
    # same held-out loss (3.217 / 3.221), but the drafters distilled from that target read a stock tau
    # geomean of 4.90 against 5.44 on the embedded default (one build each, 2026-12-02). The drafters
    # always train in fp32 (autocast did not make them faster).
    train_precision: str = "fp32"


FULL = TinyRecipe()
QUICK = TinyRecipe(vocab=512, hidden=64, layers=5, heads=2, kv_heads=1, intermediate=128, target_steps=150,
                   batch=8, seq_len=128, draft_intermediate=128, draft_block=8, distill_prompts=16,
                   distill_tokens=48, drafter_steps=20, dflash_steps=20, drafter_batch=8, anchors=4, selector_rank=8,
                   selector_top_k=4, markov_rank=8)


# recipe fields each drafter reads (drafter_config, build_drafter_stage); the rest belong to the
# target and the teacher outputs, shared by every drafter
_DRAFTER_FIELDS = {
    "dflash": ("dflash_steps",),
    "dflash2": ("drafter_steps", "selector_rank", "selector_top_k"),
    "dspark": ("drafter_steps", "markov_rank"),
}
_SHARED_DRAFTER_FIELDS = ("draft_layers", "draft_intermediate", "draft_block", "drafter_batch", "anchors")


def recipe_of(quick: bool) -> TinyRecipe:
    """The recipe a build uses: ``QUICK`` for ``--quick``, else ``FULL``."""
    return QUICK if quick else FULL


def drafter_recipe_hash(kind: str, recipe: TinyRecipe) -> str:
    """12 hex digits of the recipe fields drafter ``kind`` is trained from (its own step count and
    head sizes, the drafter sizes all kinds share). The workflow passes it as the drafter job's
    parameter: a change to one drafter's recipe reruns that drafter's job only.

    Raises SpecpilotError for an unknown kind."""
    if kind not in _DRAFTER_FIELDS:
        raise SpecpilotError(f"unknown tiny drafter {kind!r}; choose from {', '.join(DRAFTERS)}")
    fields = dataclasses.asdict(recipe)
    own = {k: fields[k] for k in _DRAFTER_FIELDS[kind] + _SHARED_DRAFTER_FIELDS}
    return hashlib.sha256(json.dumps(own, sort_keys=True).encode()).hexdigest()[:12]


def target_recipe_hash(recipe: TinyRecipe) -> str:
    """12 hex digits of the recipe fields the target and the teacher outputs depend on (every field
    no drafter owns alone)."""
    own = set(itertools.chain(*_DRAFTER_FIELDS.values())) | set(_SHARED_DRAFTER_FIELDS)
    fields = {k: v for k, v in dataclasses.asdict(recipe).items() if k not in own}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]



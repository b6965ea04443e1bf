"""Part 2 of token forcing: the structure of each record's own evidence.

A record is consistent when ``len(output_ids) == new_tokens``, ``sum(committed_per_step) ==
new_tokens - 1`` (the first token comes from prefill), ``verify_steps == len(committed_per_step)``,
every committed count lies in 1..the verify width of its ``engine_config`` (:func:`verify_width`),
``prompt_tokens`` equals the prompt's length and every token id lies inside the vocabulary.
"""

from __future__ import annotations

from ..errors import SpecpilotError
from ..records import Record


def verify_width(engine: str, engine_config: dict, drafter: str | None = None) -> int:
    """Most tokens one verify step of this engine config can commit (anchor/bonus included).

    AR: 1. A block drafter: ``block_size`` for a chain in DFlash counting (anchor + drafts), and no
    more for a tree either (a tree commits one root-to-leaf path, at most ``block_size`` tokens).
    DSpark counts ``block_size`` = gamma drafts sampled from the anchor (:mod:`specpilot.drafters`),
    so a step commits at most gamma + 1.

    Args:
        engine: ``ar``, ``stock`` or ``specpilot``; engine_config: the record's engine config;
        drafter: the record's drafter name (``dspark`` counts one more).
    Returns:
        the width, in tokens (>= 1).
    Raises:
        SpecpilotError: ``block_size`` is missing or not a positive integer (for a drafter engine).
    """
    if engine == "ar":
        return 1
    block = engine_config.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise SpecpilotError(f"engine_config block_size must be a positive integer, got {block!r}")
    return block + 1 if drafter == "dspark" else block


def structure_problems(r: Record, prompt_len: int | None, vocab: int) -> list[dict]:
    """Inconsistencies of a record's own evidence (the checks in this module's docstring).

    Args:
        r: one record; prompt_len: its prompt's length in tokens (None: not checked);
        vocab: the target's vocabulary size.
    Returns:
        one ``{"field", "detail"}`` dict per problem (empty when consistent); an ``engine_config``
        without a valid ``block_size`` is one problem (field ``engine_config``), not an error.
    """
    out = []

    def bad(field_, detail):
        out.append({"field": field_, "detail": detail})

    if len(r.output_ids) != r.new_tokens:
        bad("new_tokens", f"new_tokens {r.new_tokens} but {len(r.output_ids)} output ids")
    steps = r.committed_per_step
    if r.verify_steps != len(steps):
        bad("verify_steps", f"verify_steps {r.verify_steps} but {len(steps)} committed_per_step entries")
    if r.new_tokens >= 1 and sum(steps) != r.new_tokens - 1:
        bad("committed_per_step", f"sum(committed_per_step) {sum(steps)} != new_tokens - 1 = {r.new_tokens - 1}")
    if r.new_tokens < 1:
        bad("new_tokens", f"new_tokens {r.new_tokens}: every request generates at least one token")
    try:
        width = verify_width(r.engine, r.engine_config or {}, r.drafter)
        off = [(i, c) for i, c in enumerate(steps) if not (isinstance(c, int) and 1 <= c <= width)]
        if off:
            bad("committed_per_step", f"{len(off)} step(s) commit outside 1..{width} (verify width), "
                                      f"first: step {off[0][0]} commits {off[0][1]}")
    except SpecpilotError as e:
        bad("engine_config", str(e))
    if prompt_len is not None and r.prompt_tokens != prompt_len:
        bad("prompt_tokens", f"prompt_tokens {r.prompt_tokens} but the prompt has {prompt_len} tokens")
    outside = [t for t in r.output_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if outside:
        bad("output_ids", f"{len(outside)} token id(s) outside the vocabulary 0..{vocab - 1}, first {outside[0]!r}")
    return out

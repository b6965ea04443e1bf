"""Byte-level BPE tokenizer for the tiny deployment, trained with the ``tokenizers`` library.

Special tokens take ids 0..3 in the order of :data:`SPECIAL_TOKENS`; ``<|MASK|>`` is the DFlash mask
token (the drafter's placeholder for not-yet-drafted positions). The chat template is Qwen's
ChatML layout without a system prompt or thinking block.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SpecpilotError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_BYTE_ALPHABET = 256


def build_tokenizer(texts: list[str], vocab_size: int, out_dir: str | os.PathLike) -> "PreTrainedTokenizerFast":
    """Train a byte-level BPE on ``texts`` and save it as a transformers tokenizer.

    GPT-2 style byte-level pre-tokenization (every byte is a base token, so any text round-trips),
    the four :data:`SPECIAL_TOKENS` at ids 0..3, eos ``<|im_end|>``, pad ``<|endoftext|>``, mask
    ``<|MASK|>``, no BOS, and :data:`CHAT_TEMPLATE`. Training is deterministic for the same
    ``texts`` and ``vocab_size``; ~5 MB of text trains in seconds.

    Args:
        texts: training texts (non-empty list of str).
        vocab_size: total vocabulary size including the 256 byte tokens and 4 special tokens
            (>= 260). The result may be smaller if the texts allow fewer merges.
        out_dir: folder written with ``save_pretrained``; ``AutoTokenizer.from_pretrained(out_dir)``
            loads it.

    Returns:
        The trained ``transformers.PreTrainedTokenizerFast``.

    Raises:
        SpecpilotError: ``texts`` empty or not all strings, or ``vocab_size`` too small.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise SpecpilotError("tokenizer training texts must be a non-empty list of strings")
    minimum = _BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise SpecpilotError(f"vocab_size must be an integer >= {minimum} (256 bytes + 4 special tokens), got {vocab_size!r}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, mask_token=MASK_TOKEN,
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast

"""Prompt lookup decoding (Saxena 2023, "prompt-lookup-decoding"; vLLM/SGLang ``ngram``): the
model-free floor every trained drafter must beat."""

from __future__ import annotations

import torch

from ..errors import SpecpilotError
from .base import Proposer
from .proposal import Proposal, chain


class LookupProposer(Proposer):
    """Finds the most recent earlier occurrence of the last ``n`` tokens (n from ``max_ngram``
    down to 1) in the prompt + output and proposes the tokens that followed it; pads with the
    last token when fewer are available.

    Block counting: ``block_size`` = verify width (anchor + block_size - 1 drafts), as DFlash.
    """

    kind = "lookup"
    capture: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, block_size: int = 8):
        if max_ngram < 1:
            raise SpecpilotError(f"max_ngram must be >= 1, got {max_ngram}")
        if block_size < 2:
            raise SpecpilotError(f"block size must be >= 2, got {block_size}")
        self.max_ngram, self.block_size = max_ngram, block_size

    @property
    def verify_width(self) -> int:
        return self.block_size

    def start(self, runner, prompts, features, first) -> None:
        self.device = first.device
        self.history = [list(p) + [t] for p, t in zip(prompts, first.tolist())]

    def reset_slot(self, b: int, prompt_ids: list[int], first_token: int, reference=None) -> None:
        """Continuous batching: slot b now serves a new request; its history is that prompt + its
        first token."""
        self.history[b] = list(prompt_ids) + [int(first_token)]

    def _lookup(self, seq: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i : i + n] == tail:
                    out = seq[i + n : i + n + k]
                    return out + [seq[-1]] * (k - len(out))
        return [seq[-1]] * k

    def propose(self, last, start) -> Proposal:
        k = self.block_size - 1
        drafts = torch.tensor([self._lookup(h, k) for h in self.history], dtype=torch.long, device=self.device)
        return chain(last, drafts)

    def observe(self, features, start, counts, committed) -> None:
        """Extend each row's history by its committed tokens."""
        for h, toks in zip(self.history, committed):
            h.extend(toks)

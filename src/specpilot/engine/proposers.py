"""Draft proposers: the DFlash block drafter and model-free prompt lookup (n-gram)."""

from __future__ import annotations

import torch

from ..models.dflash import DFlashDrafter
from .runner import TargetRunner, use_graphs


class DFlashProposer:
    """Drafts a block with a DFlash drafter conditioned on the target's hidden states.

    The drafter's context cache grows by the target features of every committed position
    (prompt at prefill, anchor + accepted drafts after each verify step), as in z-lab/dflash.
    """

    def __init__(self, drafter: DFlashDrafter, graphs: bool | None = None, kernels: str | None = None):
        self.drafter = drafter
        self.use_graphs, self.kernels = graphs, kernels
        self.graphs = None

    def start(self, runner: TargetRunner, prompts, features, first) -> None:
        self.embed = runner.model.model.embed_tokens
        self.lm_head = runner.model.lm_head
        self.drafter.setup_cache(len(prompts), runner.max_seq)
        if use_graphs(self.use_graphs, first.device):
            from .graphs import drafter_graphs

            self.graphs = drafter_graphs(self.drafter, self.embed, self.lm_head, self.kernels)
        with torch.inference_mode():
            self.drafter.add_context(features, torch.zeros(len(prompts), dtype=torch.long, device=first.device))

    @torch.inference_mode()
    def propose(self, last, start, k):
        if self.graphs is not None:
            return self.graphs.draft(last, start, k + 1)
        tokens, _ = self.drafter.draft(last, start, self.embed, self.lm_head, k + 1)
        return tokens

    @torch.inference_mode()
    def propose_logits(self, last, start, k):
        """Draft tokens [B, k] and the drafter's logits [B, k, vocab] (for tree building)."""
        return self.drafter.draft(last, start, self.embed, self.lm_head, k + 1)

    @torch.inference_mode()
    def observe(self, features, start, counts, committed) -> None:
        if self.graphs is not None:
            self.graphs.add_context(features, start)
            return
        self.drafter.add_context(features, start)


class LookupProposer:
    """Prompt lookup decoding (Saxena 2023, "prompt-lookup-decoding"; vLLM/SGLang ``ngram``).

    Finds the most recent earlier occurrence of the last ``n`` tokens (n from ``max_ngram`` down
    to 1) in the prompt + output and proposes the tokens that followed it; pads with the last
    token when fewer are available. The floor any trained drafter must beat.
    """

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, runner, prompts, features, first) -> None:
        self.device = first.device
        self.history = [list(p) + [t] for p, t in zip(prompts, first.tolist())]

    def _lookup(self, seq: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i : i + n] == tail:
                    out = seq[i + n : i + n + k]
                    return out + [seq[-1]] * (k - len(out))
        return [seq[-1]] * k

    def propose(self, last, start, k):
        return torch.tensor([self._lookup(h, k) for h in self.history], dtype=torch.long, device=self.device)

    def observe(self, features, start, counts, committed) -> None:
        for h, toks in zip(self.history, committed):
            h.extend(toks)

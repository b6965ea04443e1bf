"""Training loops for the tiny deployment: the target LM and the DFlash drafter (CPU, seeded).

Target: next-token prediction on packed chat-formatted documents. Drafter: distillation on the
target's own greedy continuations (the drafter must predict what the target would decode),
DFlash-style: random anchor positions per sequence, a block of mask tokens after each anchor,
cross-entropy with a position-decayed weight exp(-(j - 1) / gamma) (DFlash community recipes and
DeepSpec use gamma = 4..7).
"""

from __future__ import annotations

import math
import random
import time

import torch
from torch.nn import functional as F

from ..engine.generate import generate_ar
from ..engine.runner import TargetRunner
from ..models.dflash import DFlashDrafter
from ..models.qwen3 import Transformer


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _optimizer(params, lr):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def train_target(model: Transformer, stream: torch.Tensor, steps: int, batch: int, seq_len: int,
                 lr: float = 2e-3, seed: int = 0, log=print) -> list[float]:
    """Next-token training on random windows of a packed token stream (int64 [N]).

    Returns the per-step training losses [nats/token].
    """
    g = torch.Generator().manual_seed(seed)
    opt = _optimizer(model.parameters(), lr)
    model.train()
    losses, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr, max(1, steps // 20))
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
        logits, _ = model.forward_causal(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    return losses


@torch.inference_mode()
def heldout_loss(model: Transformer, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss [nats/token] over consecutive windows of a held-out stream."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    x = stream[: n * seq_len + 1]
    inp = x[:-1].view(n, seq_len)
    tgt = x[1:].view(n, seq_len)
    logits, _ = model.forward_causal(inp)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)).item()


def greedy_continuations(model: Transformer, prompts: list[list[int]], new_tokens: int,
                         batch: int = 64, log=print) -> list[list[int]]:
    """The target's greedy continuations (EOS ignored) of each prompt: the drafter's training data."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        max_seq = max(len(p) for p in chunk) + new_tokens + 1
        rows = generate_ar(TargetRunner(model, len(chunk), max_seq), chunk, new_tokens)
        out += [r.output_ids for r in rows]
        log(f"greedy continuations {len(out)}/{len(prompts)}")
    return out


def train_drafter(drafter: DFlashDrafter, target: Transformer, sequences: list[tuple[int, list[int]]],
                  steps: int, batch: int, block_size: int, anchors: int, lr: float = 2e-3,
                  gamma: float = 4.0, seed: int = 0, log=print) -> list[float]:
    """Distil the target's greedy decoding into the drafter.

    Args:
        sequences: (prompt_len, prompt + greedy continuation ids); anchors are drawn from the
            continuation, where every next token is the target's own argmax.
        block_size: training block (anchor + block_size - 1 predicted slots).
        anchors: blocks per sequence per step.
    Returns:
        per-step losses [nats/token, decay-weighted].
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ids = tuple(drafter.config.target_layer_ids)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = _optimizer(params, lr)
    T = max(len(s) for _, s in sequences)
    drafter.setup_cache(1, T)  # RoPE tables
    embed, head = target.model.embed_tokens, target.lm_head
    weights = torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)
    weights = weights / weights.sum()
    drafter.train()
    losses, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr, max(1, steps // 20))
        chosen = rng.sample(sequences, batch)
        L = max(len(s) for _, s in chosen)  # right-pad: padding sits after every anchor, never visible
        toks = torch.tensor([s + [0] * (L - len(s)) for _, s in chosen])
        anc = torch.tensor([sorted(rng.sample(range(p, len(s) - block_size + 1), anchors)) for p, s in chosen])
        with torch.no_grad():
            _, feats = target.forward_causal(toks, capture=ids)
        logits = drafter.train_logits(feats, toks, anc, embed, head, block_size)
        labels = toks.gather(1, (anc[:, :, None] + torch.arange(1, block_size)).view(batch, -1)).view(
            batch, anchors, block_size - 1)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(batch, anchors, block_size - 1) * weights).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"drafter step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    drafter.eval()
    return losses

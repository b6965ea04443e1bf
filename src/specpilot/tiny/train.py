"""Training loops for the tiny deployment: the target LM and its drafters (CPU, seeded).

Target: next-token prediction on packed chat-formatted documents. Drafters: distillation on the
target's own greedy continuations (the drafter must predict what the target would decode):
random anchor positions per sequence, a block of mask tokens after each anchor, each with its
published objective (facts in shared/notes/drafters.md):

- ``dflash``: block cross-entropy with a position-decayed weight exp(-(j - 1) / gamma) (DFlash
  community recipes and DeepSpec use gamma = 4..7); the anchor slot has no loss;
- ``dflash2``: the DFlash loss + 1.0 x the teacher-forced K-way selector cross-entropy (a gold
  token outside the top-K is injected into the candidates, see
  :func:`specpilot.drafters.dflash2.selector_loss`);
- ``dspark``: sample from the anchor (slot j predicts anchor+j+1), teacher-forced Markov input;
  0.1 x CE + 0.9 x total variation to the target's distribution + 1.0 x BCE of the confidence
  against 1 - TV (TV = half the L1 distance, in [0, 1]), each weighted exp(-k/4) by slot k = 0..
  (DeepSpec's code; the paper writes exp(-(k-1)/gamma)); the confidence BCE only counts slots
  whose teacher-forced draft prefix matched (contiguous-prefix mask, our reading).
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from ..engine.loop import generate_ar
from ..engine.runner import TargetRunner
from ..models.dflash import DFlashDrafter
from ..models.dflash2 import selector_loss
from ..models.qwen3 import Transformer


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


TRAIN_PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str) -> str:
    """The training precision a recipe's ``train_precision`` means on this machine.

    ``fp32``: fp32 throughout. ``bf16``: the forward and backward passes under CPU autocast to
    bfloat16 (``torch.autocast("cpu", torch.bfloat16)``: matmuls in bf16 with fp32 accumulation,
    losses and softmax in fp32; weights, gradients and AdamW state stay fp32). ``auto``: ``bf16``
    where oneDNN reports native bf16 support (AVX512-BF16 / AMX), else ``fp32`` (emulated bf16 is
    slower than fp32). Measured on a 2-core AMD EPYC with AVX512-BF16 (2026-12-02): the tiny
    target's 360 steps took 292 s in bf16 against 383 s in fp32, held-out loss 3.217 against 3.221;
    see :class:`specpilot.tiny.build.TinyRecipe` for why the build keeps fp32 by default. Raises
    ValueError naming an unknown precision."""
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"train precision must be one of {', '.join(TRAIN_PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return "bf16" if native else "fp32"


def _train(module: torch.nn.Module, params: list, steps: int, lr: float, batch_loss, name: str, log,
           precision: str = "fp32") -> list[float]:
    """The loop both trainings share: AdamW (betas 0.9/0.95, weight decay 0.1) on ``params``, linear
    warmup over 5% of the steps then cosine decay to 0.1 x ``lr``, gradient norm clipped at 1,
    ``module`` in train mode while it runs (eval mode after). ``batch_loss()`` draws the next batch
    and returns its loss; it runs under bf16 CPU autocast when ``precision`` (``fp32`` / ``bf16``,
    see :func:`resolve_precision`) is ``bf16``. Returns the per-step losses (fp32)."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    module.train()
    losses, t0 = [], time.time()
    bf16 = resolve_precision(precision) == "bf16"
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr, max(1, steps // 20))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = batch_loss().float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"{name} step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    module.eval()
    return losses


def train_target(model: Transformer, stream: torch.Tensor, steps: int, batch: int, seq_len: int,
                 lr: float = 2e-3, seed: int = 0, log=print, precision: str = "fp32") -> list[float]:
    """Next-token training on random windows of a packed token stream (int64 [N]); ``precision``
    as :func:`resolve_precision` (``auto``, ``fp32``, ``bf16``).

    Returns the per-step training losses [nats/token].
    """
    g = torch.Generator().manual_seed(seed)

    def batch_loss() -> torch.Tensor:
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
        logits, _ = model.forward_causal(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    return _train(model, list(model.parameters()), steps, lr, batch_loss, "target", log, precision)


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


def _dflash_loss(drafter, feats, toks, anc, embed, head, block_size, weights, selector: bool):
    """DFlash block CE (slot j >= 1 predicts anchor + j), plus the DFlash2 selector CE."""
    B, A = anc.shape
    logits, hidden = drafter.train_logits(feats, toks, anc, embed, head, block_size, return_hidden=True)
    idx = (anc[:, :, None] + torch.arange(1, block_size)).view(B, -1)
    labels = toks.gather(1, idx).view(B, A, block_size - 1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    loss = (ce.view(B, A, block_size - 1) * weights).sum(-1).mean()
    if selector:
        prev = toks.gather(1, (anc[:, :, None] + torch.arange(0, block_size - 1)).view(B, -1)).view_as(labels)
        sel = selector_loss(drafter, hidden, logits, prev, labels)
        loss = loss + 1.0 * (sel * weights).sum(-1).mean()
    return loss


def _dspark_loss(drafter, feats, tlogits, toks, anc, gamma):
    """DSpark: 0.1 CE + 0.9 TV + 1.0 confidence BCE, each weighted exp(-k/4) (module docstring)."""
    B, A = anc.shape
    _, hidden = drafter.train_logits(feats, toks, anc, None, drafter.lm_head, gamma, return_hidden=True,
                                     drop_anchor=False)
    offs = torch.arange(gamma)
    pos = (anc[:, :, None] + offs).view(B, -1)  # slot k sits at anchor + k and predicts anchor + k + 1
    prev = toks.gather(1, pos).view(B, A, gamma)
    labels = toks.gather(1, pos + 1).view(B, A, gamma)
    logits, conf = drafter.heads(hidden, prev)
    p_t = torch.softmax(tlogits.gather(1, pos[:, :, None].expand(-1, -1, tlogits.shape[-1])).float(), -1)
    p_t = p_t.view(B, A, gamma, -1)
    q = torch.softmax(logits.float(), -1)
    tv = 0.5 * (q - p_t).abs().sum(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(tv)
    w = torch.exp(-offs.float() / 4.0)
    w = w / w.sum()
    loss = ((0.1 * ce + 0.9 * tv) * w).sum(-1).mean()
    if conf is not None:
        hit = (logits.detach().argmax(-1) == labels).float()
        prefix = torch.cat([torch.ones_like(hit[..., :1]), hit.cumprod(-1)[..., :-1]], -1)
        bce = F.binary_cross_entropy_with_logits(conf.float(), (1 - tv.detach()).clamp(0, 1), reduction="none")
        loss = loss + (bce * prefix * w).sum() / (prefix * w).sum().clamp(min=1e-6)
    return loss


class TeacherCache:
    """The target's features (and, for DSpark, logits) of every distillation sequence, computed once.

    Each drafter step used to run the target over its batch again (the larger part of a step's
    cost on the tiny build); the target is frozen, so one no-grad pass per sequence serves every
    step and every drafter kind that shares the captured layers.

    Attributes:
        feats: per sequence, float32 [L_i, len(layer_ids) * hidden] captured target states.
        logits: per sequence, float32 [L_i - prompt_len_i, vocab] target logits of the
            continuation positions (None unless built with ``logits=True``).
    """

    def __init__(self, target: Transformer, sequences: list[tuple[int, list[int]]], layer_ids: tuple[int, ...],
                 logits: bool = False, batch: int = 32):
        self.layer_ids, self.has_logits = tuple(layer_ids), logits
        self.feats: list[torch.Tensor] = [None] * len(sequences)
        self.logits: list[torch.Tensor | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][1]))
        with torch.no_grad():
            for s in range(0, len(order), batch):
                idx = order[s:s + batch]
                L = max(len(sequences[i][1]) for i in idx)
                toks = torch.tensor([sequences[i][1] + [0] * (L - len(sequences[i][1])) for i in idx])
                lg, feats = target.forward_causal(toks, capture=self.layer_ids)
                for row, i in enumerate(idx):
                    p, seq = sequences[i]
                    self.feats[i] = feats[row, :len(seq)].clone()
                    if logits:
                        self.logits[i] = lg[row, p:len(seq)].clone()

    def save(self, path: str | Path, sequences: list[tuple[int, list[int]]]) -> None:
        """Write the cache and its ``sequences`` to ``path`` (torch.save, atomically: a temporary
        file renamed into place), for drafter jobs that load it (:meth:`load`)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"layer_ids": list(self.layer_ids), "has_logits": self.has_logits, "feats": self.feats,
                    "logits": self.logits if self.has_logits else None, "sequences": sequences}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> tuple["TeacherCache", list[tuple[int, list[int]]]]:
        """(cache, sequences) as :meth:`save` wrote them; the same tensors, bit for bit."""
        doc = torch.load(path, weights_only=True)
        cache = cls.__new__(cls)
        cache.layer_ids, cache.has_logits = tuple(doc["layer_ids"]), doc["has_logits"]
        cache.feats = doc["feats"]
        cache.logits = doc["logits"] if doc["has_logits"] else [None] * len(doc["feats"])
        return cache, [(int(p), list(s)) for p, s in doc["sequences"]]

    def batch(self, chosen: list[int], sequences, L: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded features [B, L, F] (and logits [B, L, vocab], zero outside the
        continuation) of the sequences at indices ``chosen``."""
        F_ = self.feats[chosen[0]].shape[-1]
        feats = torch.zeros(len(chosen), L, F_)
        lg = None
        if self.has_logits:
            lg = torch.zeros(len(chosen), L, self.logits[chosen[0]].shape[-1])
        for row, i in enumerate(chosen):
            p, seq = sequences[i]
            feats[row, :len(seq)] = self.feats[i]
            if lg is not None:
                lg[row, p:len(seq)] = self.logits[i]
        return feats, lg


def train_drafter(drafter: DFlashDrafter, target: Transformer, sequences: list[tuple[int, list[int]]],
                  steps: int, batch: int, block_size: int, anchors: int, lr: float = 2e-3,
                  gamma: float = 4.0, seed: int = 0, log=print, teacher: TeacherCache | None = None
                  ) -> list[float]:
    """Distil the target's greedy decoding into the drafter with its published objective
    (chosen by ``drafter.kind``: dflash, dflash2, dspark; see the module docstring).

    Args:
        sequences: (prompt_len, prompt + greedy continuation ids); anchors are drawn from the
            continuation, where every next token is the target's own argmax.
        block_size: training block in the drafter's counting (DFlash/DFlash2: anchor +
            block_size - 1 predicted slots; DSpark: block_size predicted slots from the anchor).
        anchors: blocks per sequence per step.
        gamma: DFlash position decay exp(-(j - 1) / gamma).
        teacher: the target's features (and logits for DSpark) of ``sequences``, computed once
            (:class:`TeacherCache`); built here when None. Must match ``sequences`` and the
            drafter's ``target_layer_ids``.
    Returns:
        per-step losses [nats/token, decay-weighted].
    """
    kind = getattr(drafter, "kind", "dflash")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ids = tuple(drafter.config.target_layer_ids)
    params = [p for p in drafter.parameters() if p.requires_grad]
    T = max(len(s) for _, s in sequences)
    drafter.setup_cache(1, T)  # RoPE tables
    embed, head = target.model.embed_tokens, target.lm_head
    weights = torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)
    weights = weights / weights.sum()
    span = block_size if kind != "dspark" else block_size + 1  # tokens from the anchor to the last label

    if teacher is None:
        teacher = TeacherCache(target, sequences, ids, logits=kind == "dspark")
    if teacher.layer_ids != ids or (kind == "dspark" and not teacher.has_logits):
        raise ValueError(f"teacher cache captures layers {teacher.layer_ids} (logits {teacher.has_logits}); "
                         f"the {kind} drafter needs {ids}")

    def batch_loss() -> torch.Tensor:
        pick = rng.sample(range(len(sequences)), batch)
        chosen = [sequences[i] for i in pick]
        L = max(len(s) for _, s in chosen)  # right-pad: padding sits after every anchor, never visible
        toks = torch.tensor([s + [0] * (L - len(s)) for _, s in chosen])
        anc = torch.tensor([sorted(rng.sample(range(p, len(s) - span + 1), anchors)) for p, s in chosen])
        feats, tlogits = teacher.batch(pick, sequences, L)
        if kind == "dspark":
            return _dspark_loss(drafter, feats, tlogits, toks, anc, block_size)
        return _dflash_loss(drafter, feats, toks, anc, embed, head, block_size, weights, kind == "dflash2")

    return _train(drafter, params, steps, lr, batch_loss, "drafter", log)

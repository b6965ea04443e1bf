"""``specpilot build-tiny``: the embedded default deployment, built from scratch on CPU.

Steps (seeded, deterministic for a given torch build): a byte-level BPE tokenizer with a chat
template; a tiny Qwen3 target trained on the GSM8K train split and the non-test MBPP tasks; a
DFlash drafter distilled from the target's own greedy continuations. Everything is saved in the
Hugging Face layout (config.json + model.safetensors + tokenizer files) so it loads exactly like a
real checkpoint. ``build.json`` is written last and marks a finished build.
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..prompts import select, training_pairs
from ..errors import SpecpilotError
from ..io import write_json
from ..models.dflash import DFlashDrafter, DrafterConfig, build_target_layer_ids
from ..models.loading import save_checkpoint
from ..models.qwen3 import Transformer
from .targets import TARGET_KINDS, init_family_params, tiny_target_config
from .tokenizer import MASK_TOKEN, build_tokenizer
from .train import greedy_continuations, heldout_loss, train_drafter, train_target


@dataclass
class TinyRecipe:
    """Sizes and step counts; ``FULL`` is the embedded default, ``QUICK`` is for tests (seconds)."""

    vocab: int = 2048
    hidden: int = 192
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 576
    target_steps: int = 360
    batch: int = 16
    seq_len: int = 256
    draft_layers: int = 2
    draft_intermediate: int = 512
    draft_block: int = 12
    distill_prompts: int = 384
    distill_tokens: int = 128
    drafter_steps: int = 260
    drafter_batch: int = 16
    anchors: int = 12


FULL = TinyRecipe()
QUICK = TinyRecipe(vocab=512, hidden=64, layers=5, heads=2, kv_heads=1, intermediate=128, target_steps=150,
                   batch=8, seq_len=128, draft_intermediate=128, draft_block=8, distill_prompts=16,
                   distill_tokens=48, drafter_steps=20, drafter_batch=8, anchors=4)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) for linear and embedding weights; norms stay at one."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)


def _chat(tok, user: str, assistant: str | None = None) -> str:
    msgs = [{"role": "user", "content": user}]
    if assistant is None:
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    msgs.append({"role": "assistant", "content": assistant})
    return tok.apply_chat_template(msgs, tokenize=False)


def _stream(tok, docs: list[str]) -> torch.Tensor:
    ids = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)


def build_tiny(out_dir: str | Path, data_dir: str | Path | None = None, seed: int = 0,
               recipe: TinyRecipe = FULL, log=print, target_kind: str = "dense") -> dict:
    """Build tokenizer, target and DFlash drafter into ``out_dir``; return the build summary.

    Layout: ``{out}/target/`` (checkpoint + tokenizer), ``{out}/drafter-dflash/``, ``{out}/build.json``.
    ``target_kind``: ``dense`` (default), ``hybrid`` or ``muse`` (:mod:`specpilot.tiny.targets`).
    Raises SpecpilotError when the training text cannot be loaded (see :mod:`specpilot.prompts`).
    """
    t_start = time.time()
    out = Path(out_dir)
    (out / "build.json").unlink(missing_ok=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    pairs = training_pairs(data_dir)
    if not pairs:
        raise SpecpilotError("no training text for the tiny deployment")
    if recipe is QUICK:
        pairs = rng.sample(pairs, 400)

    target_dir, drafter_dir = out / "target", out / "drafter-dflash"
    for d in (target_dir, drafter_dir):
        shutil.rmtree(d, ignore_errors=True)
    tok = build_tokenizer([u + "\n" + a for u, a in pairs], recipe.vocab, target_dir)
    docs = [_chat(tok, u, a) for u, a in pairs]
    rng.shuffle(docs)
    stream = _stream(tok, docs)
    log(f"tokenizer: vocab {len(tok)}, training stream {len(stream)} tokens")

    cfg = tiny_target_config(target_kind, recipe, len(tok))
    target = Transformer(cfg)
    init_weights(target)
    init_family_params(target)
    t0 = time.time()
    tlosses = train_target(target, stream, recipe.target_steps, recipe.batch, recipe.seq_len, seed=seed, log=log)
    t_target = time.time() - t0

    test_docs = [_chat(tok, r["turns"][0], row["answer"]) for r, row in
                 zip(select("gsm8k", 200, seed=seed, data_dir=data_dir), _gsm8k_answers(data_dir, seed))]
    held = heldout_loss(target, _stream(tok, test_docs), recipe.seq_len)
    log(f"held-out loss on gsm8k test: {held:.3f} nats/token")
    hf = cfg.to_hf_dict()
    hf.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    save_checkpoint(target, hf, target_dir)
    write_json(target_dir / "generation_config.json",
               {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "do_sample": False})

    t0 = time.time()
    prompts = [tok.encode(_chat(tok, u), add_special_tokens=False) for u, _ in rng.sample(pairs, recipe.distill_prompts)]
    prompts = [p[-(recipe.seq_len * 2):] for p in prompts]
    conts = greedy_continuations(target, prompts, recipe.distill_tokens, log=log)
    t_distill_data = time.time() - t0

    dcfg = DrafterConfig(hidden_size=recipe.hidden, intermediate_size=recipe.draft_intermediate,
                         num_hidden_layers=recipe.draft_layers, num_attention_heads=recipe.heads,
                         num_key_value_heads=recipe.kv_heads, head_dim=recipe.hidden // recipe.heads,
                         vocab_size=len(tok), mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN),
                         target_layer_ids=build_target_layer_ids(recipe.layers, recipe.draft_layers),
                         block_size=recipe.draft_block, rope_theta=10000.0, num_target_layers=recipe.layers)
    drafter = DFlashDrafter(dcfg)
    init_weights(drafter)
    target.requires_grad_(False)
    t0 = time.time()
    seqs = [(len(p), p + c) for p, c in zip(prompts, conts)]
    dlosses = train_drafter(drafter, target, seqs, recipe.drafter_steps, recipe.drafter_batch,
                            recipe.draft_block, recipe.anchors, seed=seed, log=log)
    t_drafter = time.time() - t0
    save_checkpoint(drafter, dcfg.to_hf_dict(), drafter_dir)

    summary = {
        "seed": seed, "recipe": recipe.__dict__, "target_kind": target_kind, "torch": torch.__version__,
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "training_tokens": len(stream), "target_final_loss": sum(tlosses[-20:]) / len(tlosses[-20:]),
        "heldout_loss_gsm8k_test": held, "drafter_final_loss": sum(dlosses[-20:]) / len(dlosses[-20:]),
        "seconds": {"target": t_target, "distill_data": t_distill_data, "drafter": t_drafter,
                    "total": time.time() - t_start},
    }
    write_json(out / "build.json", summary)
    log(f"tiny deployment built in {summary['seconds']['total']:.0f}s -> {out}")
    return summary


def _gsm8k_answers(data_dir, seed):
    from ..prompts import load_rows

    rows = load_rows("gsm8k", data_dir)
    return [rows[int(r["request_id"].split("/")[1])] for r in select("gsm8k", 200, seed=seed, data_dir=data_dir)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="deployment directory, e.g. resources/deployments/tiny")
    p.add_argument("--data-dir", help="local benchmark folder (default: SPECPILOT_DATA_DIR, else "
                   "shared/data/benchmarks beside the repository, else the Hub)")
    p.add_argument("--data-id", help="expected checksum of the data (the workflow passes it): refuse other data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="seconds-long build for tests (not a useful model)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--target-kind", default="dense", choices=TARGET_KINDS,
                   help="tiny target family: dense Qwen3, hybrid Gated DeltaNet, or Muse-Glimmer-style")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..prompts import check_data_id

    data_dir = check_data_id(args.data_dir, args.data_id)
    build_tiny(args.out, data_dir, args.seed, QUICK if args.quick else FULL,
               target_kind=getattr(args, "target_kind", "dense"))
    return 0

"""``specpilot build-tiny``: the embedded default deployment, built from scratch on CPU.

Steps (seeded, deterministic for a given torch build): a byte-level BPE tokenizer with a chat
template; a tiny Qwen3 target trained on the GSM8K train split and the non-test MBPP tasks; one
drafter of each kind (DFlash, DFlash2, DSpark) distilled from the target's own greedy
continuations of prompts of every benchmark's kind (never an evaluation or calibration prompt) with
its published objective (:mod:`specpilot.tiny.train`). The target stage and
each drafter stage are separate functions, so other targets can reuse the drafter stages. Everything is saved in the
Hugging Face layout (config.json + model.safetensors + tokenizer files) so it loads exactly like a
real checkpoint. ``build.json`` is written last and marks a finished build.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from ..prompts import check_data_id, distillation_prompts, load_rows, select, training_pairs
from ..errors import SpecpilotError
from ..io import write_json
from ..models.dflash import DrafterConfig, build_target_layer_ids
from ..models.loading import load_target, network_class, save_checkpoint, save_drafter
from ..models.qwen3 import Transformer
from .recipe import DRAFTERS, FULL, QUICK, TinyRecipe, drafter_recipe_hash
from .targets import TARGET_KINDS, init_family_params, tiny_target_config
from .tokenizer import MASK_TOKEN, build_tokenizer
from .train import TRAIN_PRECISIONS, TeacherCache, greedy_continuations, heldout_loss, resolve_precision, train_drafter, train_target


def _is_quick(recipe: TinyRecipe) -> bool:
    """The QUICK recipe, whatever its training precision (it samples fewer training pairs)."""
    return dataclasses.replace(recipe, train_precision=QUICK.train_precision) == QUICK


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



def drafter_config(kind: str, recipe: TinyRecipe, vocab: int, mask_id: int) -> DrafterConfig:
    """The tiny drafter config of ``kind`` in its public layout (all three share width and depth).

    dflash: full attention, non-causal block (z-lab DFlash); dflash2: + convolutions (kernel 2,
    group 16) and the selector, all layers ``sliding_attention`` with window 2048 and
    ``is_causal`` false as released; dspark: DeepSpec ``Qwen3DSparkModel``, block_size = gamma =
    ``draft_block - 1`` (the same number of predicted slots as DFlash's block), vanilla Markov
    head, confidence head with the Markov embedding.
    """
    cfg = DrafterConfig(hidden_size=recipe.hidden, intermediate_size=recipe.draft_intermediate,
                        num_hidden_layers=recipe.draft_layers, num_attention_heads=recipe.heads,
                        num_key_value_heads=recipe.kv_heads, head_dim=recipe.hidden // recipe.heads,
                        vocab_size=vocab, mask_token_id=mask_id,
                        target_layer_ids=build_target_layer_ids(recipe.layers, recipe.draft_layers),
                        block_size=recipe.draft_block, rope_theta=10000.0, num_target_layers=recipe.layers)
    if kind == "dflash2":
        cfg.architecture = "DFlash2DraftModel"
        cfg.layer_types = ["sliding_attention"] * recipe.draft_layers
        cfg.sliding_window, cfg.is_causal = 2048, False
        cfg.extra = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=recipe.selector_rank,
                         selector_top_k=recipe.selector_top_k)
    elif kind == "dspark":
        cfg.architecture = "Qwen3DSparkModel"
        cfg.block_size = recipe.draft_block - 1
        cfg.extra = dict(markov_rank=recipe.markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                         confidence_head_with_markov=True, num_anchors=recipe.anchors)
    elif kind != "dflash":
        raise SpecpilotError(f"unknown tiny drafter {kind!r}; choose from {', '.join(DRAFTERS)}")
    return cfg


def new_drafter(kind: str, cfg: DrafterConfig, target: Transformer, seed: int) -> nn.Module:
    """A freshly initialized drafter (seeded). DFlash2 starts as DFlash (identity convolutions,
    zero successor codebook; SpecForge DFlash2 docs); DSpark copies the target's embedding and LM
    head (frozen, shipped with the checkpoint as DeepSpec does)."""
    torch.manual_seed(seed)
    net = network_class(cfg.architecture)(cfg)
    init_weights(net)
    with torch.no_grad():
        if kind == "dflash2":
            for layer in net.layers:
                layer.attention_conv.identity_()
                layer.mlp_conv.identity_()
            net.candidate_selector.successor_codebook.weight.zero_()
        if kind == "dspark":
            net.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            net.lm_head.weight.copy_(target.lm_head.weight)
            net.embed_tokens.weight.requires_grad_(False)
            net.lm_head.weight.requires_grad_(False)
    return net


def build_target_stage(out: Path, data_dir, seed: int, recipe: TinyRecipe, log=print,
                       target_kind: str = "dense") -> dict:
    """Tokenizer + target trained from scratch into ``out/target``; returns the state the drafter
    stages need (target, tokenizer, rng, training pairs) and the timings. ``target_kind``:
    ``dense`` (Qwen3), ``hybrid`` (Gated DeltaNet) or ``muse`` (:mod:`specpilot.tiny.targets`)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    pairs = training_pairs(data_dir)
    if not pairs:
        raise SpecpilotError("no training text for the tiny deployment")
    if _is_quick(recipe):
        pairs = rng.sample(pairs, 400)
    target_dir = out / "target"
    shutil.rmtree(target_dir, ignore_errors=True)
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
    tlosses = train_target(target, stream, recipe.target_steps, recipe.batch, recipe.seq_len, seed=seed, log=log,
                           precision=recipe.train_precision)
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
    return {"target": target, "tok": tok, "rng": rng, "pairs": pairs,
            "summary": {"target_params": sum(p.numel() for p in target.parameters()),
                        "training_tokens": len(stream), "target_final_loss": sum(tlosses[-20:]) / len(tlosses[-20:]),
                        "heldout_loss_gsm8k_test": held},
            "seconds": {"target": t_target}}


def reuse_target_stage(out: Path, target_from: Path, data_dir, seed: int, recipe: TinyRecipe, log=print) -> dict:
    """Like :func:`build_target_stage` but copies an already built target (same seed and recipe)
    instead of training it; the rng is advanced exactly as the training stage would, so the
    drafter stages see the same distillation prompts."""
    from transformers import AutoTokenizer

    rng = random.Random(seed)
    pairs = training_pairs(data_dir)
    if _is_quick(recipe):
        pairs = rng.sample(pairs, 400)
    rng.shuffle(list(range(len(pairs))))  # the docs shuffle of the training stage
    target_dir = out / "target"
    if Path(target_from).resolve() != target_dir.resolve():
        shutil.rmtree(target_dir, ignore_errors=True)
        shutil.copytree(target_from, target_dir)
    return {"target": load_target(target_dir), "tok": AutoTokenizer.from_pretrained(target_dir), "rng": rng,
            "pairs": pairs, "summary": {"target_reused_from": str(target_from)}, "seconds": {"target": 0.0}}


def distill_stage(state: dict, recipe: TinyRecipe, log=print, data_dir=None) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + the target's greedy continuation) for the drafters' training.

    The prompts cover every benchmark's kind of text (:func:`specpilot.prompts.distillation_prompts`:
    maths word problems, code tasks, HumanEval-style completions, competition maths, chat), never
    an evaluation or calibration prompt; ``state["distill_mix"]`` records how many of each."""
    tok, rng = state["tok"], state["rng"]
    chosen = distillation_prompts(recipe.distill_prompts, rng, data_dir)
    state["distill_mix"] = {k: sum(1 for kind, _ in chosen if kind == k) for k in dict.fromkeys(k for k, _ in chosen)}
    prompts = [tok.encode(_chat(tok, u), add_special_tokens=False) for _, u in chosen]
    prompts = [p[-(recipe.seq_len * 2):] for p in prompts]
    conts = greedy_continuations(state["target"], prompts, recipe.distill_tokens, log=log)
    return [(len(p), p + c) for p, c in zip(prompts, conts)]


def build_drafter_stage(kind: str, state: dict, seqs, out: Path, recipe: TinyRecipe, seed: int,
                        log=print, teacher: TeacherCache | None = None) -> dict:
    """Distil one drafter of ``kind`` from the target into ``out/drafter-{kind}`` (public layout).
    ``teacher``: the target's features of ``seqs`` computed once for every drafter kind."""
    target, tok = state["target"], state["tok"]
    cfg = drafter_config(kind, recipe, len(tok), tok.convert_tokens_to_ids(MASK_TOKEN))
    drafter = new_drafter(kind, cfg, target, seed)
    target.requires_grad_(False)
    t0 = time.time()
    block = cfg.block_size
    steps = recipe.dflash_steps if kind == "dflash" else recipe.drafter_steps
    losses = train_drafter(drafter, target, seqs, steps, recipe.drafter_batch, block,
                           recipe.anchors, seed=seed, log=lambda m: log(f"[{kind}] {m}"), teacher=teacher)
    dt = time.time() - t0
    d = out / f"drafter-{kind}"
    shutil.rmtree(d, ignore_errors=True)
    save_drafter(drafter, d)
    return {"params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
            "final_loss": sum(losses[-20:]) / len(losses[-20:]), "seconds": dt}


def build_tiny(out_dir: str | Path, data_dir: str | Path | None = None, seed: int = 0,
               recipe: TinyRecipe = FULL, log=print, drafters: tuple[str, ...] = DRAFTERS,
               target_from: str | Path | None = None, target_kind: str = "dense") -> dict:
    """Build tokenizer, target and drafters into ``out_dir``; return the build summary.

    Layout: ``{out}/target/`` (checkpoint + tokenizer), ``{out}/drafter-{kind}/`` per drafter in
    ``drafters`` (dflash, dflash2, dspark; all distilled from the one target), ``{out}/build.json``
    (written last). ``target_from``: reuse a target built earlier with the same seed and recipe.
    ``target_kind``: the tiny target's family (``dense``, ``hybrid``, ``muse``).
    Raises SpecpilotError when the training text cannot be loaded (see :mod:`specpilot.prompts`)
    or for an unknown drafter.
    """
    t_start = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "build.json").unlink(missing_ok=True)
    bad = [k for k in drafters if k not in DRAFTERS]
    if bad:
        raise SpecpilotError(f"unknown tiny drafter {bad[0]!r}; choose from {', '.join(DRAFTERS)}")
    if target_from:
        state = reuse_target_stage(out, Path(target_from), data_dir, seed, recipe, log)
    else:
        state = build_target_stage(out, data_dir, seed, recipe, log, target_kind)
    t0 = time.time()
    seqs = distill_stage(state, recipe, log, data_dir)
    seconds = {**state["seconds"], "distill_data": time.time() - t0}
    t0 = time.time()
    layer_ids = tuple(build_target_layer_ids(recipe.layers, recipe.draft_layers))
    teacher = TeacherCache(state["target"], seqs, layer_ids, logits="dspark" in drafters)
    seconds["teacher_features"] = time.time() - t0
    # the workflow's stage files too (rules/build.smk), so a copy of this build is a finished one there
    write_target_stage(out, seed, recipe, target_kind, state)
    threads = torch.get_num_threads()
    write_teacher_stage(out, teacher, seqs, state["distill_mix"], {k: seconds[k] for k in ("distill_data", "teacher_features")},
                        {"cores": threads, "threads": {k: threads for k in drafters}, "note": "one-process build: not measured"})
    per = {}
    for kind in drafters:
        per[kind] = build_drafter_stage(kind, state, seqs, out, recipe, seed, log, teacher)
        seconds[f"drafter_{kind}"] = per[kind]["seconds"]
        write_drafter_stage(out, kind, per[kind], recipe)
    seconds["total"] = time.time() - t_start
    summary = build_summary(seed, recipe, target_kind, state["summary"], state["distill_mix"], per, seconds)
    write_json(out / "build.json", summary)
    log(f"tiny deployment built in {seconds['total']:.0f}s -> {out}")
    return summary


def stages_dir(out: Path) -> Path:
    """``{out}/stages``: each stage's summary, the teacher outputs and the drafters' thread counts."""
    d = Path(out) / "stages"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_target_stage(out: Path, seed: int, recipe: TinyRecipe, target_kind: str, state: dict) -> dict:
    """``stages/target.json``: what :func:`build_target_stage` returned of the target (summary, seconds)."""
    doc = {"seed": seed, "recipe": dataclasses.asdict(recipe), "target_kind": target_kind,
           "summary": state["summary"], "seconds": state["seconds"], "threads": torch.get_num_threads()}
    write_json(stages_dir(out) / "target.json", doc)
    return doc


def write_teacher_stage(out: Path, teacher: TeacherCache, seqs, distill_mix: dict, seconds: dict,
                        threads: dict) -> None:
    """``stages/teacher.pt`` (the teacher outputs), ``teacher.json`` (mix, seconds) and ``threads.json``."""
    d = stages_dir(out)
    teacher.save(d / "teacher.pt", seqs)
    write_json(d / "teacher.json", {"distill_mix": distill_mix, "seconds": seconds, "sequences": len(seqs),
                                    "logits": teacher.has_logits})
    write_json(d / "threads.json", threads)


def write_drafter_stage(out: Path, kind: str, per: dict, recipe: TinyRecipe) -> dict:
    """``stages/drafter-{kind}.json``: the drafter's summary, threads and recipe hash."""
    doc = {**per, "threads": torch.get_num_threads(), "recipe_hash": drafter_recipe_hash(kind, recipe)}
    write_json(stages_dir(out) / f"drafter-{kind}.json", doc)
    return doc


def build_summary(seed: int, recipe: TinyRecipe, target_kind: str, target_summary: dict, distill_mix: dict,
                  per: dict, seconds: dict) -> dict:
    """The content of ``build.json``: seed, recipe, the target's and each drafter's summary, the
    distillation mix and each stage's seconds (one-process build and workflow stages alike)."""
    summary = {"seed": seed, "recipe": dataclasses.asdict(recipe), "target_kind": target_kind, "torch": torch.__version__,
               "target_train_precision": resolve_precision(recipe.train_precision),
               **target_summary, "distill_mix": distill_mix, "drafters": per, "seconds": seconds}
    if "dflash" in per:  # the fields earlier builds wrote
        summary["drafter_params"] = per["dflash"]["params"]
        summary["drafter_final_loss"] = per["dflash"]["final_loss"]
    return summary


def _gsm8k_answers(data_dir, seed):
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
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated drafter kinds to build")
    p.add_argument("--target-from", help="reuse this already built target (same seed and recipe)")
    p.add_argument("--train-precision", choices=TRAIN_PRECISIONS, default=None,
                   help="training precision of the target (default fp32; bf16 = CPU autocast, about 1.3x faster "
                        "on a CPU with native bf16; auto = bf16 where the CPU has it); the drafters train in fp32")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = check_data_id(args.data_dir, args.data_id)
    recipe = QUICK if args.quick else FULL
    if args.train_precision:
        recipe = dataclasses.replace(recipe, train_precision=args.train_precision)
    build_tiny(args.out, data_dir, args.seed, recipe,
               drafters=tuple(k for k in args.drafters.split(",") if k), target_from=args.target_from,
               target_kind=args.target_kind)
    return 0

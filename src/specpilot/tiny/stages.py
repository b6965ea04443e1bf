"""``specpilot tiny-stage``: the tiny build as separate workflow jobs (issue 56).

The monolithic ``specpilot build-tiny`` trains the target, computes the teacher outputs and trains
every drafter one after another in one process. The workflow runs the same stages as jobs of their
own, so the drafters train side by side:

- ``target``: tokenizer + target into ``{out}/target`` (:func:`specpilot.tiny.build.build_target_stage`),
  its summary into ``{out}/stages/target.json``;
- ``teacher``: the target's greedy continuations of the distillation prompts and its features (and,
  for DSpark, logits) over them, persisted once in ``{out}/stages/teacher.pt`` for every drafter;
  then a few training steps of each drafter at each candidate thread count, timed, and the thread
  counts that finish the drafters soonest side by side (:func:`choose_threads`) into
  ``{out}/stages/threads.json`` (the workflow reads it for each drafter job's ``threads``);
- ``drafter``: one drafter distilled from the persisted teacher into ``{out}/drafter-{kind}``,
  its summary into ``{out}/stages/drafter-{kind}.json``;
- ``assemble``: ``{out}/build.json`` from the stage summaries, the same fields as the one-process
  build (written last: the marker of a finished build).

Every stage seeds itself exactly as the one-process build does (the rng replays the target
stage's draws, :func:`specpilot.tiny.build.reuse_target_stage`), so the stages give the same
models but for the float reduction order of other thread counts.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

import torch

from ..errors import SpecpilotError
from ..io import read_json, write_json
from ..models.dflash import build_target_layer_ids
from ..prompts import check_data_id
from .build import (build_drafter_stage, build_summary, build_target_stage, distill_stage, drafter_config, new_drafter,
                    reuse_target_stage, write_drafter_stage, write_target_stage, write_teacher_stage)
from .recipe import DRAFTERS, TinyRecipe, drafter_recipe_hash, recipe_of, target_recipe_hash
from .tokenizer import MASK_TOKEN
from .train import TeacherCache, train_drafter

STAGES = ("target", "teacher", "drafter", "assemble")


# ---- thread counts -------------------------------------------------------------------------


def makespan(seconds: dict[str, float], threads: dict[str, int], cores: int) -> float:
    """Wall seconds of the drafter jobs run as a scheduler runs them: longest first, each started
    as soon as its ``threads`` cores are free (``seconds[kind]`` = its training time at those threads)."""
    free_at = [0.0] * cores  # when each core is next free
    end = 0.0
    for kind in sorted(seconds, key=lambda k: -seconds[k]):
        free_at.sort()
        t = threads[kind]
        start = free_at[t - 1]  # the t-th core to come free
        for i in range(t):
            free_at[i] = start + seconds[kind]
        end = max(end, start + seconds[kind])
    return end


def choose_threads(step_s: dict[str, dict[int, float]], steps: dict[str, int], cores: int) -> dict[str, int]:
    """Thread count per drafter that ends the drafters' training soonest on ``cores`` cores.

    Args:
        step_s: per kind, measured seconds of one training step at each candidate thread count.
        steps: per kind, the recipe's training steps.
    Returns:
        kind -> threads, minimising :func:`makespan` over every combination of the candidates
        (fewer threads on a tie).
    """
    kinds = sorted(step_s)
    best, best_t = None, None
    for combo in itertools.product(*(sorted(step_s[k]) for k in kinds)):
        threads = dict(zip(kinds, combo))
        t = makespan({k: step_s[k][threads[k]] * steps[k] for k in kinds}, threads, cores)
        if best is None or t < best * (1 - 1e-9) or (t <= best * (1 + 1e-9) and sum(combo) < sum(best_t.values())):
            best, best_t = t, threads
    return best_t


def thread_candidates(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores`` (and ``cores`` itself)."""
    out = [1]
    while out[-1] * 2 <= cores:
        out.append(out[-1] * 2)
    if out[-1] != cores:
        out.append(cores)
    return out


def time_steps(kind: str, state: dict, seqs, teacher: TeacherCache, recipe: TinyRecipe, seed: int,
               threads: int, steps: int = 2) -> float:
    """Seconds of one training step of a fresh ``kind`` drafter at ``threads`` threads (one step of
    warm-up, then the mean of ``steps``)."""
    tok, target = state["tok"], state["target"]
    target.requires_grad_(False)  # frozen, as in the drafter's own job
    cfg = drafter_config(kind, recipe, len(tok), tok.convert_tokens_to_ids(MASK_TOKEN))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        net = new_drafter(kind, cfg, target, seed)
        args = (target, seqs)
        kw = dict(batch=recipe.drafter_batch, block_size=cfg.block_size, anchors=recipe.anchors, seed=seed,
                  log=lambda *_: None, teacher=teacher)
        train_drafter(net, *args, steps=1, **kw)
        t0 = time.perf_counter()
        train_drafter(net, *args, steps=steps, **kw)
        return (time.perf_counter() - t0) / steps
    finally:
        torch.set_num_threads(before)


# ---- the stages ----------------------------------------------------------------------------


def stage_target(out: Path, data_dir, seed: int, recipe: TinyRecipe, target_kind: str) -> dict:
    """Train the tokenizer and target; write ``stages/target.json``; return it."""
    (out / "build.json").unlink(missing_ok=True)
    state = build_target_stage(out, data_dir, seed, recipe, target_kind=target_kind)
    return write_target_stage(out, seed, recipe, target_kind, state)


def _target_state(out: Path, data_dir, seed: int, recipe: TinyRecipe) -> dict:
    return reuse_target_stage(out, out / "target", data_dir, seed, recipe, log=lambda *_: None)


def stage_teacher(out: Path, data_dir, seed: int, recipe: TinyRecipe, drafters: tuple[str, ...],
                  cores: int) -> dict:
    """The teacher outputs (persisted once) and the drafters' thread counts; returns threads.json."""
    state = _target_state(out, data_dir, seed, recipe)
    t0 = time.time()
    seqs = distill_stage(state, recipe, data_dir=data_dir)
    seconds = {"distill_data": time.time() - t0}
    t0 = time.time()
    layer_ids = tuple(build_target_layer_ids(recipe.layers, recipe.draft_layers))
    teacher = TeacherCache(state["target"], seqs, layer_ids, logits="dspark" in drafters)
    seconds["teacher_features"] = time.time() - t0
    cands = thread_candidates(cores)
    step_s = {k: {t: time_steps(k, state, seqs, teacher, recipe, seed, t) for t in cands} for k in drafters}
    steps = {k: recipe.dflash_steps if k == "dflash" else recipe.drafter_steps for k in drafters}
    chosen = choose_threads(step_s, steps, cores) if drafters else {}
    doc = {"cores": cores, "candidates": cands, "step_seconds": {k: {str(t): s for t, s in v.items()}
                                                                 for k, v in step_s.items()},
           "steps": steps, "threads": chosen,
           "makespan_s": makespan({k: step_s[k][chosen[k]] * steps[k] for k in drafters}, chosen, cores)
           if drafters else 0.0}
    write_teacher_stage(out, teacher, seqs, state["distill_mix"], seconds, doc)
    return doc


def stage_drafter(out: Path, data_dir, seed: int, recipe: TinyRecipe, kind: str) -> dict:
    """Distil drafter ``kind`` from the persisted teacher; write ``stages/drafter-{kind}.json``."""
    state = _target_state(out, data_dir, seed, recipe)
    teacher, seqs = TeacherCache.load(out / "stages" / "teacher.pt")
    per = build_drafter_stage(kind, state, seqs, out, recipe, seed, teacher=teacher)
    return write_drafter_stage(out, kind, per, recipe)


def stage_assemble(out: Path, seed: int, recipe: TinyRecipe, drafters: tuple[str, ...]) -> dict:
    """``build.json`` from the stage summaries (the one-process build's fields, plus each stage's
    thread count; ``seconds.total`` is the sum of the stages' seconds, job time: the drafters
    overlap); returns it."""
    stages = out / "stages"
    target = read_json(stages / "target.json")
    teacher_info = read_json(stages / "teacher.json")
    per = {k: read_json(stages / f"drafter-{k}.json") for k in drafters}
    seconds = {**target["seconds"], **teacher_info["seconds"]}
    seconds.update({f"drafter_{k}": v["seconds"] for k, v in per.items()})
    seconds["total"] = sum(seconds.values())
    summary = build_summary(seed, recipe, target["target_kind"], target["summary"], teacher_info["distill_mix"],
                            per, seconds)
    summary["stage_threads"] = {"target": target["threads"], **{k: v["threads"] for k, v in per.items()}}
    write_json(out / "build.json", summary)
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--out", required=True, help="build directory, e.g. resources/deployments/tiny")
    p.add_argument("--data-dir", help="local benchmark folder (as for build-tiny)")
    p.add_argument("--data-id", help="expected checksum of the data (the workflow passes it): refuse other data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="the seconds-long test recipe")
    p.add_argument("--threads", type=int, default=0, help="torch threads of this stage (0: torch's default)")
    p.add_argument("--target-kind", default="dense", help="target family (target stage)")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="drafter kinds of the build (teacher, assemble)")
    p.add_argument("--kind", help="the drafter this job trains (drafter stage)")
    p.add_argument("--recipe-hash", help="the workflow's hash of this stage's recipe: refuse a different recipe")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = recipe_of(args.quick)
    out = Path(args.out)
    drafters = tuple(k for k in args.drafters.split(",") if k)
    bad = [k for k in drafters + ((args.kind,) if args.kind else ()) if k not in DRAFTERS]
    if bad:
        raise SpecpilotError(f"unknown tiny drafter {bad[0]!r}; choose from {', '.join(DRAFTERS)}")
    if args.stage == "assemble":
        stage_assemble(out, args.seed, recipe, drafters)
        return 0
    expected = drafter_recipe_hash(args.kind, recipe) if args.stage == "drafter" else target_recipe_hash(recipe)
    if args.recipe_hash and args.recipe_hash != expected:
        raise SpecpilotError(f"--recipe-hash {args.recipe_hash} is not this package's {args.stage} recipe "
                             f"({expected}): the workflow and the installed specpilot differ")
    data_dir = check_data_id(args.data_dir, args.data_id)
    if args.stage == "target":
        stage_target(out, data_dir, args.seed, recipe, args.target_kind)
    elif args.stage == "teacher":
        stage_teacher(out, data_dir, args.seed, recipe, drafters, args.threads or os.cpu_count() or 1)
    else:
        if not args.kind:
            raise SpecpilotError("tiny-stage drafter needs --kind (dflash, dflash2 or dspark)")
        stage_drafter(out, data_dir, args.seed, recipe, args.kind)
    return 0

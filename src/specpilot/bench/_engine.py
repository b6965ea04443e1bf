"""The one place the benchmark suite reaches into engine internals.

Every engine name a benchmark uses is imported here and nowhere else in :mod:`specpilot.bench`,
so a move inside the engine is one edit in this file. Besides the names, a few helpers that build
what the benchmarks run: the random models of a dry run (tiny shapes cut to a few layers, so Triton's
interpreter takes about a second per step), and the step functions of a target or drafter
that run the same kernels with or without CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..drafters.dflash import DFlashProposer
from ..drafters.lattice_profile import lattice_of, shape_parents
from ..drafters.proposal import spine_tree_parents
from ..drafters.replay import AcceptanceProfile, ReplayProposer, expected_tau, expected_tau_tree, load_profile
from ..drafters.static_tree import optimal_tree
from ..engine.backend import Backend, choose_backend
from ..engine.loop import generate, generate_ar
from ..engine.config import EngineSpec
from ..engine.proposers import make_engine_proposer, make_proposer
from ..engine.runner import TargetRunner
from ..engine.scheduler import Request, Scheduler
from ..engine.verify import compact_path_, tree_inputs
from ..fastpath import graphs
from ..fastpath.tables import DECODE_CONFIGS, DEFAULT_CONFIGS, config_tiers, role_layout, row_tile, tier_for
from ..fastpath.w12 import ROLES as W12_ROLES
from ..fastpath.w12 import choice_json, parse_choice, w12_bytes
from ..fastpath.w12 import every_role as every_w12_role
from ..tuning import w12 as _tuning_w12
from ..forcing.teacher import teacher_forced
from ..kernels_build import engine_tables
from ..tuning.w12 import plant_escapes, tune_w12_choice
from ..kernels import inspect as _kernel_inspect
from ..models.dflash import DFlashDrafter
from ..models.dflash2 import DFlash2Drafter
from ..models.layers import chain_ancestors
from ..models.loading import load_drafter, load_target
from ..models.random_checkpoint import build_drafter, build_target, drafter_config, fill_random_, hf_config, target_config
from ..models.target import Transformer

__all__ = [
    "AcceptanceProfile", "Backend", "backend", "expected_tau_tree", "load_drafter", "make_proposer", "parse_choice",
    "hf_config", "plant_escapes", "triton_step", "tune_w12_choice", "w12_runner", "W12_ROLES", "choice_json",
    "every_w12_role", "w12_bytes", "config_tiers", "role_layout", "row_tile", "tier_for", "kernel_inspect",
    "tuning_w12",
    "DECODE_CONFIGS", "DEFAULT_CONFIGS", "DFlashProposer", "fastpath",
    "ReplayProposer", "TargetRunner", "runner", "build_drafter", "build_target",
    "chain_ancestors", "compact_path_", "dry_drafter", "dry_target", "drafter_config", "expected_tau",
    "draft_step", "fast_runner", "generate", "generate_ar", "kv_bytes_per_step", "load_profile", "load_target", "optimal_tree",
    "replay_generate", "spine_tree_parents", "step_graphs", "target_config", "tree_inputs", "weight_bytes_per_step",
    "EngineSpec", "make_engine_proposer", "Request", "Scheduler", "target_and_drafter",
    "engine_tables", "tuning_matmul", "release", "teacher_forced", "lattice_of", "shape_parents",
]

def triton_step():
    """The Triton step's kernel module (imports Triton, so only when asked)."""
    from ..kernels import step as module

    return module


def fastpath():
    """The fast path's step modules (dense, family, drafter, graphs; they import Triton, so only when asked)."""
    from ..fastpath import dense, drafter, family  # Triton: an optional dependency

    return dense, family, drafter, graphs


def weight_bytes_per_step(model, rows: int) -> int:
    """Bytes of weights one step of ``rows`` rows reads (:func:`specpilot.fastpath.dense.weight_bytes_per_step`)."""
    return fastpath()[0].weight_bytes_per_step(model, rows)


def kv_bytes_per_step(model, rows: int, context: int, T: int = 1) -> int:
    """KV-cache bytes one step reads (:func:`specpilot.fastpath.dense.kv_bytes_per_step`)."""
    return fastpath()[0].kv_bytes_per_step(model, rows, context, T)


# Each benchmark's backends, one per (model, graphs, kernels), so runners built one after the other
# share captured graphs as a deployment's do (weakly keyed: nothing outlives the benchmark's model).
_BACKENDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def backend(model, graphs: bool | None = None, kernels: str | None = "auto", w12_choice: dict | None = None) -> Backend:
    """The benchmark's backend of ``model`` (:func:`choose_backend`, built once per graphs x kernels;
    a ``w12_choice`` builds it anew with those roles)."""
    per = _BACKENDS.setdefault(model, {})
    key = (graphs, kernels or "auto")
    if w12_choice is not None or key not in per:
        per[key] = choose_backend(model, graphs, kernels, w12_choice)
    return per[key]


def release(model) -> None:
    """Drop the benchmark's backends of ``model`` (their graphs, workspaces and draft steps): a backend
    holds its model, so the weakly keyed entry alone would keep the weights alive past the benchmark's
    last use of them (a benchmark that builds shape after shape)."""
    _BACKENDS.pop(model, None)


def step_graphs(model, kernels: str = "triton", configs: dict | None = None):
    """The captured steps of ``model`` under CUDA graphs with ``kernels``, ``configs`` installed."""
    b = backend(model, True, kernels)
    if configs:
        b.install_tables(configs, strict=True)
    return b.step_graphs


def w12_runner(model, max_seq: int, choice: dict | None, graphs: bool = True) -> TargetRunner:
    """A batch-1 :class:`TargetRunner` of ``model`` on the Triton fast path (under CUDA graphs on
    the GPU with ``graphs``, uncaptured under the interpreter), with the w12 ``choice`` (parsed,
    :func:`parse_choice`) installed when given: the model converted in place (lossless, one-way),
    a fresh backend (the benchmark's earlier ones dropped)."""
    if not choice:
        return fast_runner(model, 1, max_seq, graphs=graphs)
    _BACKENDS.pop(model, None)
    if model.lm_head.weight.is_cuda and graphs:
        _BACKENDS.setdefault(model, {})[(True, "triton")] = b = choose_backend(model, True, "triton", choice)
        return TargetRunner(model, 1, max_seq, (), b)
    r = fast_runner(model, 1, max_seq, graphs=False)
    r.backend.w12_stats = r.backend.fast.use_w12(choice)
    r.backend.w12 = choice_json(choice)
    return r


def tuning_matmul():
    """The matmul table tuner's module (:mod:`specpilot.tuning.matmul`; it imports Triton)."""
    from ..tuning import matmul as module

    return module


def tuning_w12():
    """The w12 choice tuner's module (:mod:`specpilot.tuning.w12`)."""
    return _tuning_w12


def kernel_inspect():
    """The machine-code reader of the matmul kernel (:mod:`specpilot.kernels.inspect`; it imports
    Triton when it compiles)."""
    return _kernel_inspect


DRY_LAYERS = 2  # target layers of a dry run's dense model under the interpreter
# a dry run's dense target is smaller still: Triton's interpreter runs every program in Python
DRY_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, vocab_size=256)


def dry_target(shape: str = "tiny", layers: int | None = None, dtype: torch.dtype = torch.float32,
               seed: int = 0, sizes: dict | None = None) -> Transformer:
    """The random target of a dry run, on the CPU: ``shape`` cut to its first ``layers`` layers
    (default: :data:`DRY_LAYERS` for ``tiny``, shrunk to :data:`DRY_SIZES`; one group of 4 layers
    for the hybrid and Muse shapes). ``sizes``: config fields to replace (e.g. a small hidden size
    and vocabulary under a real shape's head geometry)."""
    cfg = target_config(shape)
    layers = layers or (DRY_LAYERS if cfg.is_dense else 4)
    sizes = sizes if sizes is not None else DRY_SIZES if shape == "tiny" else {}
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=list(cfg.layer_types[:layers]), **sizes)
    with torch.device("meta"):
        model = Transformer(cfg)
    return fill_random_(model.to(dtype).to_empty(device="cpu"), seed).eval()


def dry_drafter(target: Transformer, shape: str = "tiny", block_size: int = 16, dtype: torch.dtype = torch.float32,
                seed: int = 0, kind: str = "dflash") -> DFlashDrafter:
    """The random DFlash (or, ``kind`` "dflash2", DFlash2: convolutions of kernel 2 and group 16, a
    selector of rank 8 and top 4) drafter of ``shape`` for a :func:`dry_target` (its sizes, its
    first and last layers captured)."""
    t, n = target.config, target.config.num_hidden_layers
    sizes = {k: getattr(t, k) for k in DRY_SIZES} if shape == "tiny" else {}
    if sizes:
        sizes["mask_token_id"] = t.vocab_size - 1
    cfg = dataclasses.replace(drafter_config(shape, block_size), num_target_layers=n,
                              target_layer_ids=sorted({0, n - 1}), **sizes)
    if kind == "dflash2":
        cfg = dataclasses.replace(cfg, architecture="DFlash2DraftModel", extra=dict(
            conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4))
    with torch.device("meta"):
        model = DFlash2Drafter(cfg) if kind == "dflash2" else DFlashDrafter(cfg)
    return fill_random_(model.to(dtype).to_empty(device="cpu"), seed + 1).eval()


def target_and_drafter(run, shape: str, block: int, seed: int):
    """(target, DFlash drafter) of ``shape`` for a benchmark :class:`~specpilot.bench._common.Run`:
    random weights drawn on its device in its dtype, or on a dry run the tiny CPU models
    (:func:`dry_target`, :func:`dry_drafter`); the device synchronized after."""
    if run.dry:
        model = dry_target(shape, seed=seed)
        drafter = dry_drafter(model, shape, block, seed=seed)
    else:
        model = build_target(shape, run.device, run.dtype, seed)
        drafter = build_drafter(shape, run.device, run.dtype, seed, block)
    run.sync()
    return model, drafter


def runner(model: Transformer, batch: int, max_seq: int, capture: tuple[int, ...] = (), graphs: bool | None = None,
           kernels: str | None = "auto", verify_width: int = 1) -> TargetRunner:
    """A :class:`TargetRunner` over the benchmark's backend of ``model`` (see :func:`backend`), its
    rings sized for blocks of ``verify_width`` tokens."""
    return TargetRunner(model, batch, max_seq, capture, backend(model, graphs, kernels), verify_width)


def fast_runner(model: Transformer, batch: int, max_seq: int, capture: tuple[int, ...] = (),
                graphs: bool = True, verify_width: int = 1) -> TargetRunner:
    """A :class:`TargetRunner` on the Triton fast path: under CUDA graphs on the GPU (``graphs``),
    uncaptured otherwise (the CPU under the interpreter: decode, verify and row prefill still go
    through the Triton step)."""
    if model.lm_head.weight.is_cuda and graphs:
        return runner(model, batch, max_seq, capture, True, "triton", verify_width)
    dense, family, _, graphs_mod = fastpath()

    class Uncaptured(graphs_mod.StepGraphs):
        def run(self, tokens, start, capture=(), tree=None, write=False):
            return self.step(tokens, start, capture, tree, write)

    step = dense.FastTarget(model) if model.config.is_dense else family.FastFamilyTarget(model)
    b = Backend(model, "triton-dense" if model.config.is_dense else "triton-family", "uncaptured (interpreter)",
                False, "triton", Uncaptured(model, step))
    return TargetRunner(model, batch, max_seq, capture, b, verify_width)


def step_fast(r: TargetRunner):
    """The runner's Triton step (None when it runs none)."""
    return r.backend.fast


def replay_generate(runner: TargetRunner, reference: list[int], prompt: list[int], profile, vocab: int,
                    network, new_tokens: int, block: int, seed: int, profile_phases: bool = False):
    """Stock with the replay drafter on one prompt: the speculative loop (:func:`generate`) whose
    proposer drafts ``reference`` (AR's output) with profile-drawn wrong tokens and runs
    ``network`` (a :class:`DFlashProposer`) each step for its cost. Returns the :class:`RowResult`."""
    prop = ReplayProposer([reference], profile, vocab, network, seed=seed, block_size=block)
    return generate(runner, prop, [prompt], new_tokens, profile=profile_phases)[0]


def draft_step(drafter: DFlashDrafter, embed: torch.nn.Embedding, head: torch.nn.Linear, impl: str, block: int,
               graphs: bool):
    """(add_context(features [B, T, F], start [B]), draft(anchor [B], start [B]) -> drafts [B, block - 1])
    of ``drafter`` with implementation ``impl``: ``"triton"`` = the Triton draft step
    (:class:`FastDrafter`), ``"torch"`` = the eager network (cuBLAS, SDPA); each as CUDA graphs
    (:class:`DrafterGraphs`, as the engine runs it) when ``graphs``, else called directly."""
    fd = fastpath()[2]
    if graphs:
        dg = fd.DrafterGraphs(drafter, embed, head, impl)
        return dg.add_context, lambda a, s: dg.draft(a, s, block)
    if impl == "triton":
        fast = fd.FastDrafter(drafter, embed.weight, head.weight)
        return fast.add_context, lambda a, s: fast.draft(a, s, block)
    return drafter.add_context, lambda a, s: drafter.draft(a, s, embed, head, block)[0]

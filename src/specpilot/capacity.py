"""What a deployment can hold: an engine's verify width against the target's positions and the
device's memory, checked before any work (``specpilot run``) and when the workflow is planned
(``snakemake -n``). Only ``config.json`` files are read.

An engine verifies blocks of up to W tokens (:attr:`~specpilot.engine.config.EngineSpec.verify_width`:
block + 1, a static tree's N + 1, a spine tree's side leaves, the second level; a load-aware
verify budget only narrows it). W sizes two things per request (row):

- the KV cache: ``prompt + max_new_tokens - 2 + W`` slots (+ 1 with several rows;
  :func:`specpilot.engine.serve.kv_slots_needed`), never more than the target's
  ``max_position_embeddings`` (the positions it was trained for);
- the sliding-window rings: ``min(window + reserve, max_seq) + 1`` slots per sliding layer, reserve
  = :func:`~specpilot.models.target.ring_reserve` (W, at least 64).

A width **cannot fit** when (1) the KV slots exceed ``max_position_embeddings``, or (2) the
memory the engine allocates exceeds the device's: the weights (every linear and embedding of the
target, in its dtype) + per row the state (full-attention KV cache at max_seq slots, the rings,
the Gated DeltaNet conv states in the dtype and recurrent states in fp32) x the rows served at
once + the verify step's transient (the logits of rows x W positions, in the dtype and in fp32).
The device's memory: a CUDA device's total memory, or the host's physical memory on the CPU;
when planning, :data:`GPU_MEMORY_GIB` by the ``{gpu}`` name (an unlisted GPU: positions only).
At planning time the prompts are not tokenized yet, so the bound takes a one-token prompt: a plan
is refused only when no prompt could fit; ``specpilot run`` checks the real prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .agent.directions import REGISTRY
from .models.config import TargetConfig
from .models.random_checkpoint import target_config as shape_target_config
from .models.target import ring_reserve
from .regimes import resolve
from .validate import locate

GIB = 1024 ** 3
# memory of the GPUs the study names ({gpu} wildcard values), GiB (vendor figures)
GPU_MEMORY_GIB = {"h100": 80, "h200": 141, "a100": 80, "b200": 180, "l40s": 48, "rtx_pro_6000": 96, "gh200": 96}


def ring_slots(cfg: TargetConfig, max_seq: int, width: int) -> int:
    """Slots of one sliding layer's ring for an engine of verify ``width`` (sink included; 0 without
    sliding layers): as :class:`~specpilot.models.state.RingKV` allocates them."""
    if "sliding_attention" not in cfg.layer_types:
        return 0
    return min(cfg.sliding_window + ring_reserve(width), max_seq) + 1


def state_bytes(cfg: TargetConfig, max_seq: int, width: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes of state one request (row) holds, by kind (``kv``, ``ring``, ``gdn``): what
    :meth:`~specpilot.models.target.Transformer.setup_cache` allocates for ``max_seq`` KV slots
    and an engine of verify ``width``, weights in ``dtype_bytes`` bytes per value."""
    n = {t: cfg.layer_types.count(t) for t in ("full_attention", "sliding_attention", "linear_attention")}
    per_slot = 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # k and v
    gdn = 0
    if n["linear_attention"]:
        h, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim)
        conv = (2 * h * dk + hv * dv) * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes
        gdn = n["linear_attention"] * (conv + hv * dk * dv * 4)
    return {"kv": n["full_attention"] * max_seq * per_slot,
            "ring": n["sliding_attention"] * ring_slots(cfg, max_seq, width) * per_slot, "gdn": gdn}


def weight_bytes(cfg: TargetConfig, dtype_bytes: int) -> int:
    """Bytes of the target's weights (embeddings, LM head unless tied, every layer's projections
    and MLP; norms and small vectors left out), in ``dtype_bytes`` bytes per value."""
    H = cfg.hidden_size
    n = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2)
    for kind in cfg.layer_types:
        n += 3 * H * cfg.intermediate_size
        if kind == "linear_attention":
            hv_dv = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            conv = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + hv_dv
            n += H * (conv + hv_dv + 2 * cfg.linear_num_value_heads) + hv_dv * H + conv * cfg.linear_conv_kernel_dim
        else:
            q = cfg.num_attention_heads * cfg.head_dim
            gate = q if cfg.attn_gate in ("interleaved", "proj") else 0
            n += H * (q + gate + 2 * cfg.num_key_value_heads * cfg.head_dim) + q * H
    return n * dtype_bytes


def needed_bytes(cfg: TargetConfig, width: int, max_seq: int, rows: int, dtype_bytes: int,
                 weight_scale: float = 1.0) -> int:
    """Device bytes an engine of verify ``width`` needs for ``rows`` requests at once with
    ``max_seq`` KV slots each: weights (x ``weight_scale``: 0.75 for 12-bit weights) + rows x
    state + the verify step's logits (model dtype and fp32) of rows x width positions (see the
    module docstring)."""
    state = sum(state_bytes(cfg, max_seq, width, dtype_bytes).values())
    logits = rows * width * cfg.vocab_size * (dtype_bytes + 4)
    return int(weight_bytes(cfg, dtype_bytes) * weight_scale) + rows * state + logits


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def host_memory_bytes() -> int | None:
    """The host's physical memory [bytes], or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def gpu_memory_bytes(gpu: str) -> int | None:
    """Memory of the ``{gpu}`` device by name (``cpu``: the host's), None when unknown."""
    if gpu == "cpu":
        return host_memory_bytes()
    gib = GPU_MEMORY_GIB.get(gpu)
    return gib * GIB if gib else None


def width_problem(cfg: TargetConfig, width: int, what: str, slots: int, rows: int, dtype_bytes: int,
                  device_bytes: int | None, device: str, weight_scale: float = 1.0) -> str | None:
    """Why an engine cannot hold its verify width, in one line, or None.

    Args:
        cfg: the target's config; width: the engine's verify width W [tokens].
        what: the settings that give W (e.g. ``"tree_nodes 127"``), named in the line.
        slots: KV-cache slots the longest request needs (prompt + budget - 2 + W, + 1 batched).
        rows: requests served at once; dtype_bytes: 2 (bf16) or 4 (fp32).
        device_bytes: the device's memory (None: not checked); device: its name for the line.
        weight_scale: bytes of a weight relative to ``dtype_bytes`` (0.75: 12-bit weights).
    """
    limit = int(cfg.max_position_embeddings)
    if slots > limit:
        return (f"verify width {width} ({what}) needs {slots} KV cache positions per request, more than the "
                f"target's max_position_embeddings {limit}")
    if device_bytes is None:
        return None
    need = needed_bytes(cfg, width, slots, rows, dtype_bytes, weight_scale)
    if need > device_bytes:
        weights = weight_bytes(cfg, dtype_bytes) * weight_scale
        return (f"verify width {width} ({what}) at {rows} request(s) x {slots} KV cache slots needs "
                f"{_size(need)} (weights {_size(weights)}), more than the {_size(device_bytes)} of {device}")
    return None


def widest_engine(config: dict) -> tuple[int, str]:
    """The widest verify width an engine config dict can reach and the settings that give it:
    a static tree (``tree_nodes`` N: N + 1) or block + 1 + ``tree_branch`` x min(``tree_depth``,
    block) + ``second_level`` (:meth:`specpilot.engine.config.EngineConfig.verify_width`)."""
    block = int(config.get("block_size") or 2)
    nodes = int(config.get("tree_nodes") or 0)
    branch, depth = int(config.get("tree_branch") or 0), int(config.get("tree_depth") or 1)
    second = int(config.get("second_level") or 0)
    spine = block + 1 + branch * min(depth, block) + second
    if nodes + 1 > spine:
        return nodes + 1, f"tree_nodes {nodes}"
    parts = [f"block_size {block}"] + ([f"tree_branch {branch} x tree_depth {depth}"] if branch else []) \
        + ([f"second_level {second}"] if second else [])
    return spine, ", ".join(parts)


def rounds_widest(block: int) -> tuple[int, str]:
    """The widest engine the agent rounds may try for a deployment of stock ``block``: the largest
    value of every width-setting key over the registered directions' grids
    (:mod:`specpilot.agent.directions`), combined as the rounds may merge winners."""
    top: dict[str, int] = {"block_size": block}
    for d in REGISTRY.values():
        for key in ("block_size", "tree_nodes", "tree_branch", "tree_depth", "second_level"):
            vals = [v for v in d.space.get(key, []) if isinstance(v, int) and not isinstance(v, bool)]
            if vals:
                top[key] = max(top.get(key, 0), max(vals))
    chain = widest_engine({k: v for k, v in top.items() if k != "tree_nodes"})
    static = widest_engine({"block_size": top["block_size"], "tree_nodes": top.get("tree_nodes", 0)})
    w, what = max(chain, static)
    return w, f"the rounds' widest candidate: {what}"


def _target_config(dep: dict, base: Path, tiny_target: str, tiny_dir: Path | None) -> TargetConfig | None:
    """The deployment's target config when its config.json is at hand (else None: the plan's
    other checks report a missing one; an unbuilt tiny target is checked by ``specpilot run``).
    A random target (``target: random``) has its named shape's config."""
    if dep["target"] == "random":
        try:
            return shape_target_config(dep.get("shape"))
        except Exception:  # noqa: BLE001 - an unknown shape is the deployment check's to report
            return None
    if dep["target"] == tiny_target:
        path = tiny_dir / "target" / "config.json" if tiny_dir is not None else None
    else:
        path, problem = locate(dep["target"], base)
        if problem:
            return None
    try:
        return TargetConfig.from_hf_dict(json.loads(path.read_text()), str(path)) if path and path.is_file() else None
    except Exception:  # noqa: BLE001 - a broken config.json is the deployment check's to report
        return None


def _stock_block(dep: dict, base: Path) -> int | None:
    """The deployment's stock block (``auto``: the drafter config's, when at hand)."""
    block = dep.get("block_size")
    if isinstance(block, int) and not isinstance(block, bool):
        return block
    if block == "auto" and dep.get("drafter_id"):
        path, problem = locate(dep["drafter_id"], base)
        if path is not None and not problem:
            try:
                return int(json.loads(path.read_text()).get("block_size") or 0) or None
            except (OSError, ValueError):
                return None
    return None


def plan_problems(deployments: dict[str, dict], config: dict, base: Path, gpus: list[str], tiny_target: str = "tiny",
                  tiny_dirs: dict[str, Path] | None = None) -> list[str]:
    """One line per deployment whose widest engine cannot fit (module docstring), for the plan.

    The engines of the workflow: stock at the deployment's block; specpilot (when it runs and
    ``rounds.count`` > 0) up to the rounds' widest candidate (:func:`rounds_widest`). Budgets:
    the larger of ``max_new_tokens`` and the regime's rounds tokens (``regimes.<name>.max_new_tokens``,
    else ``rounds.max_new_tokens``); rows: per serving regime
    (config ``regimes``, :mod:`specpilot.regimes`) the largest of its tuned and cell
    concurrencies, the line naming the regime; a one-token prompt; weights in bf16 on a GPU,
    fp32 on the CPU.
    """
    rounds = config.get("rounds") or {}
    regimes = resolve(config)
    specpilot = "specpilot" in config.get("engines", []) and int(rounds.get("count", 2)) > 0
    out = []
    for name, dep in deployments.items():
        cfg = _target_config(dep, base, tiny_target, (tiny_dirs or {}).get(name))
        block = _stock_block(dep, base)
        if cfg is None or block is None:
            continue
        engines = [(block + 1, f"stock block_size {block}")] + ([rounds_widest(block)] if specpilot else [])
        width, what = max(engines)
        problem = None
        for regime, r in regimes.items():
            rows = max(r["cells"] + [r["tune"]])
            new = max(int(config["max_new_tokens"]), int(r.get("max_new_tokens") or rounds.get("max_new_tokens") or 0))
            slots = 1 + new - 2 + width + (1 if rows > 1 else 0)
            for gpu in gpus:
                dtype_bytes = 4 if gpu == "cpu" else 2
                problem = width_problem(cfg, width, what, slots, rows, dtype_bytes, gpu_memory_bytes(gpu), gpu)
                if problem:
                    out.append(f"deployment {name}: {problem} (max_new_tokens {new}, regimes.{regime}: tune "
                               f"{r['tune']}, cells {r['cells']})")
                    break
            if problem:
                break
    return out

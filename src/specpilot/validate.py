"""Deployments checked when the workflow's DAG is built, before any job runs.

A deployment that cannot run must stop ``snakemake -n`` already, not a job an hour later after
other jobs wrote files under ``results/``. :func:`check_deployments` returns one line per problem,
each naming the deployment, the config key and the value:

- ``target`` / ``drafter_id``: a local folder must exist and hold a ``config.json`` the engine can
  build (the target through :meth:`specpilot.models.config.TargetConfig.from_hf_dict`: a supported
  family and layer types; the drafter through :func:`specpilot.models.loading.drafter_config`: an
  architecture of :data:`specpilot.drafters.ARCHITECTURES` and the layer types its network
  supports); anything else must be a well-formed Hugging Face Hub id (``owner/name``, checked with
  ``huggingface_hub.utils.validate_repo_id``; nothing is downloaded: a Hub checkpoint already in the
  local Hub cache has its ``config.json`` checked as a local one, others are checked when
  ``link_deployment`` downloads them, see :mod:`specpilot.deployment_link`);
- ``drafter``: the drafter folder's architecture is that kind (a DSpark checkpoint is not a
  ``dflash`` deployment), and a tiny target pairs only with the drafters a tiny build trains (and
  takes no ``drafter_id``: its drafter is built, not linked);
- ``block_size``: at least the drafter kind's smallest block (DFlash/DFlash2 count the anchor, so
  2; DSpark counts drafts, so 1: :class:`specpilot.drafters.dflash.DFlashProposer`,
  :class:`specpilot.drafters.dspark.DSparkProposer`) and at most the block the drafter was trained
  for (``block_size`` of its ``config.json``: the stock system runs the drafter as released);
- tiny deployments sharing one build agree on ``quick`` (one build, one recipe);
- ``target: random`` (a synthetic deployment, :mod:`specpilot.deployment_random`): ``shape`` names
  a shape of :data:`specpilot.models.shapes.SHAPES`, the drafter is ``dflash`` (the lazy random
  drafters are DFlash networks), ``block_size`` is an integer (it is written into the drafter's
  config), ``weight_format`` bf16 or fp32, and ``replay_profile`` names an acceptance profile (a
  random target's drafter cannot draft meaningful tokens: the replay drafter stands in for it);
- ``replay_profile`` (any deployment): a packaged profile's name or a profile file that reads
  (:func:`specpilot.drafters.replay.load_profile`).

Only ``config.json`` files are read; torch is imported only to check a drafter config that exists
(:mod:`specpilot.models.loading`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .deployment_random import RANDOM_DRAFTER, RANDOM_TARGET
from .drafters import ARCHITECTURES
from .drafters.replay import load_profile
from .errors import SpecpilotError
from .models.config import TargetConfig
from .models.loading import drafter_config
from .models.shapes import SHAPES

# smallest block_size per drafter kind, in the kind's own counting (see the module docstring)
MIN_BLOCK = {"dflash": 2, "dflash2": 2, "dspark": 1}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # the workflow's {deployment} wildcard


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def hub_id_problem(value: str) -> str | None:
    """Why ``value`` is not a Hugging Face Hub model id of the form ``owner/name``, or None.

    Uses ``huggingface_hub.utils.validate_repo_id`` (the Hub's own rules: characters, ``--``/``..``,
    length) after the ``owner/name`` shape.
    """
    if value.count("/") != 1:
        return "not a Hugging Face Hub id (owner/name)"
    try:
        validate_repo_id(value)
    except HFValidationError as e:
        return f"not a well-formed Hugging Face Hub id: {str(e).splitlines()[0]}"
    return None


def cached_hub_config(repo_id: str) -> Path | None:
    """The ``config.json`` of a Hub checkpoint if it is in the local Hub cache (no network), else None."""
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed cache entry is the download's business, not the plan's
        return None
    return Path(found) if isinstance(found, str) else None


def locate(value: str, base: Path) -> tuple[Path | None, str | None]:
    """(config.json to check or None, problem or None) for a target or drafter source ``value``.

    A local folder (relative to ``base``, the workflow's directory) must hold ``config.json``; a Hub
    id must be well formed, and its config is returned only when the Hub cache holds it.
    """
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base / p
    if p.is_dir():
        cfg = p / "config.json"
        return (cfg, None) if cfg.is_file() else (None, f"folder {p} holds no config.json")
    if p.exists():
        return None, f"{p} is a file, not a checkpoint folder"
    if value.startswith(("/", ".", "~")) or "\\" in value:  # a path, not an id
        return None, f"no such folder {p}"
    problem = hub_id_problem(value)
    if problem:
        return None, f"no such folder {p}, and {problem}"
    return cached_hub_config(value), None


def _read(cfg: Path) -> dict:
    try:
        d = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecpilotError(f"{cfg} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise SpecpilotError(f"{cfg} holds {type(d).__name__}, not a JSON object")
    return d


def target_problem(cfg: Path) -> str | None:
    """Why the engine cannot build the target of ``config.json`` (family, layer types, keys), or None."""
    try:
        TargetConfig.from_hf_dict(_read(cfg), str(cfg))
    except SpecpilotError as e:
        return str(e)
    return None


def drafter_problems(cfg: Path, kind: str, block, reason: str | None = None) -> list[str]:
    """Problems of a drafter ``config.json`` for a deployment of drafter ``kind`` and ``block`` size
    (``reason``: the deployment's ``block_reason``, needed when an integer block is not the trained one)."""
    try:
        d = _read(cfg)
    except SpecpilotError as e:
        return [str(e)]
    arch = (d.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        return [f"{cfg}: unsupported drafter architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"]
    if ARCHITECTURES[arch] != kind:
        return [f"{cfg} holds a {ARCHITECTURES[arch]} drafter ({arch}), but the deployment's drafter is {kind!r}"]
    try:
        trained = drafter_config(d, str(cfg)).block_size
    except SpecpilotError as e:
        return [str(e)]
    if isinstance(block, int) and block > trained:
        return [f"block_size {block} exceeds the block the drafter was trained for ({trained}, {cfg})"]
    if isinstance(block, int) and block != trained and not reason:
        return [f"block_size {block} is not the block the drafter was trained for ({trained}, {cfg}): stock runs "
                f"the drafter as released, so use block_size auto, or say why in block_reason"]
    if reason and block in ("auto", trained):
        return [f"block_reason is set, but stock runs at the drafter's trained block {trained}: drop block_reason"]
    return []


def _tiny_problems(name: str, dep: dict, tiny_drafters) -> list[str]:
    if dep.get("drafter_id"):  # a tiny deployment's drafter is the one its build trains: never silently ignored
        return [f"deployment {name}: drafter_id {_show(dep['drafter_id'])}: a tiny target's drafter is built with "
                f"it (resources/deployments/.../drafter-{dep['drafter']}), not linked: drop drafter_id, or give "
                f"target a real checkpoint"]
    if dep["drafter"] not in tiny_drafters:
        return [f"deployment {name}: drafter {dep['drafter']!r}: a tiny build trains only "
                f"{', '.join(tiny_drafters)}"]
    return []


def _replay_problems(name: str, dep: dict) -> list[str]:
    profile = dep.get("replay_profile")
    if profile is None:
        return []
    try:
        load_profile(profile)
    except SpecpilotError as e:
        return [f"deployment {name}: replay_profile {_show(profile)}: {e}"]
    return []


def _random_problems(name: str, dep: dict) -> list[str]:
    """Problems of a synthetic deployment (``target: random``; see the module docstring)."""
    out = []
    shape = dep.get("shape")
    if shape not in SHAPES:
        out.append(f"deployment {name}: shape {_show(shape)}: a random target needs shape, one of {', '.join(SHAPES)}")
    if dep["drafter"] != RANDOM_DRAFTER:
        out.append(f"deployment {name}: drafter {dep['drafter']!r}: a random target's drafter is a random "
                   f"{RANDOM_DRAFTER} network (drafter: {RANDOM_DRAFTER})")
    if not isinstance(dep["block_size"], int):
        out.append(f"deployment {name}: block_size {_show(dep['block_size'])}: a random target needs an integer "
                   f"(it is written into the random drafter's config)")
    if dep["weight_format"] not in ("bf16", "fp32"):
        out.append(f"deployment {name}: weight_format {dep['weight_format']!r}: a random target is drawn in bf16 or fp32")
    if not dep.get("replay_profile"):
        out.append(f"deployment {name}: replay_profile missing: a random target writes meaningless text, so its "
                   f"drafter cannot draft for it; name an acceptance profile (e.g. study_stock)")
    return out


def deployment_problems(name: str, dep: dict, base: Path, tiny_target: str = "tiny",
                        tiny_drafters=("dflash", "dflash2", "dspark"), tiny_dir: Path | None = None) -> list[str]:
    """Every problem of one available deployment (settings as in config ``deployments``).

    Args:
        base: folder relative local paths are read from (the workflow's working directory).
        tiny_dir: the tiny build folder of this deployment; its drafter's config.json is checked
            when the build is finished (``build.json`` present).
    Returns:
        One line per problem: ``deployment NAME: KEY VALUE: what is wrong``; empty when it can run.
    """
    out = []
    if not NAME.match(name):
        out.append(f"deployment {name!r}: the name must match {NAME.pattern} (it is a path component)")
    kind, block, reason = dep["drafter"], dep["block_size"], dep.get("block_reason")
    if block != "auto" and (isinstance(block, bool) or not isinstance(block, int) or block < MIN_BLOCK[kind]):
        out.append(f"deployment {name}: block_size {_show(block)}: a {kind} drafter needs at least "
                   f"{MIN_BLOCK[kind]} ({'anchor included' if kind != 'dspark' else 'drafts per step'})")
        block = None
    out += _replay_problems(name, dep)
    if dep["target"] == RANDOM_TARGET:
        return out + _random_problems(name, dep)
    if dep["target"] == tiny_target:
        out += _tiny_problems(name, dep, tiny_drafters)
        cfg = None if tiny_dir is None else tiny_dir / f"drafter-{kind}" / "config.json"
        if not out and cfg is not None and (tiny_dir / "build.json").is_file() and cfg.is_file():
            out += [f"deployment {name}: drafter {kind!r}: {p}" for p in drafter_problems(cfg, kind, block, reason)]
        return out
    cfg, problem = locate(dep["target"], base)
    if problem:
        out.append(f"deployment {name}: target {_show(dep['target'])}: {problem}")
    elif cfg is not None and (problem := target_problem(cfg)):
        out.append(f"deployment {name}: target {_show(dep['target'])}: {problem}")
    drafter_id = dep.get("drafter_id")
    if not drafter_id:
        out.append(f"deployment {name}: drafter_id {_show(drafter_id)}: a real target needs drafter_id "
                   f"(a local folder or Hugging Face Hub id of the drafter)")
        return out
    cfg, problem = locate(drafter_id, base)
    if problem:
        out.append(f"deployment {name}: drafter_id {_show(drafter_id)}: {problem}")
    elif cfg is not None:
        out += [f"deployment {name}: drafter_id {_show(drafter_id)}: {p}"
                for p in drafter_problems(cfg, kind, block, reason)]
    return out


def check_deployments(deployments: dict[str, dict], base: Path, tiny_target: str = "tiny",
                      tiny_drafters=("dflash", "dflash2", "dspark"), tiny_dirs: dict[str, Path] | None = None,
                      ) -> list[str]:
    """Problems of every available deployment (see :func:`deployment_problems`), plus tiny
    deployments sharing a build (``tiny_dirs``: name -> build folder) but not its ``quick`` recipe."""
    tiny_dirs = tiny_dirs or {}
    out = []
    for name, dep in deployments.items():
        out += deployment_problems(name, dep, base, tiny_target, tiny_drafters, tiny_dirs.get(name))
    builds: dict[Path, dict[bool, list[str]]] = {}
    for name, d in tiny_dirs.items():
        builds.setdefault(d, {}).setdefault(bool(deployments[name].get("quick")), []).append(name)
    for d, by_quick in builds.items():
        if len(by_quick) > 1:
            out.append(f"deployments {', '.join(by_quick[True])} (quick: true) and {', '.join(by_quick[False])} "
                       f"(quick: false) share the tiny build {d}: give them the same quick")
    return out

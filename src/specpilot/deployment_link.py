"""Link a real (not locally built) deployment into ``resources/deployments/{deployment}/``.

``python -m specpilot.deployment_link --name D --target T --drafter-name N --drafter P --out DIR``
resolves the target and the drafter, each either a local checkpoint folder or a Hugging Face Hub
id (downloaded with ``huggingface_hub.snapshot_download`` into the usual Hub cache, honouring
``HF_HOME`` / ``HF_HUB_CACHE``), makes ``DIR/target`` and ``DIR/drafter-{N}`` symlinks to them, and
writes ``DIR/build.json`` last: the workflow's marker that the deployment is ready.

Before linking, both checkpoints' ``config.json`` are checked as at planning time
(:mod:`specpilot.validate`: a target the engine can build, a drafter of the deployment's kind with
a supported architecture, a block size that fits it), so a Hub download that turns out unusable
stops here, with one line, before any job that loads it.

So every later step finds any deployment at the same two paths, whether built (tiny) or linked.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import sys
from pathlib import Path

from .errors import SpecpilotError, module_main
from .io import write_json

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", required=True, help="deployment name")
    parser.add_argument("--target", required=True, help="target checkpoint: local folder or Hub id")
    parser.add_argument("--drafter-name", required=True, help="drafter kind: dflash, dflash2, dspark")
    parser.add_argument("--drafter", required=True, help="drafter checkpoint: local folder or Hub id")
    parser.add_argument("--out", required=True, help="resources/deployments/{deployment}")
    parser.add_argument("--weight-format", default=None, help="recorded in build.json")
    parser.add_argument("--block-size", default=None,
                        help="the deployment's block_size (an integer or 'auto'): checked against the drafter, "
                             "recorded in build.json")
    parser.add_argument("--block-reason", default=None,
                        help="the deployment's block_reason: why an integer block_size is not the drafter's trained one")
    parser.add_argument("--revision", default=None, help="Hub revision for both downloads")


def resolve(source: str, revision: str | None = None) -> tuple[Path, str]:
    """(local folder, how it was found) for a local folder or a Hub id.

    Raises:
        SpecpilotError: neither an existing folder nor a valid Hub id, or the download failed.
    """
    p = Path(source).expanduser()
    if p.is_dir():
        return p.resolve(), "local"
    if not _HUB_ID.match(source):
        raise SpecpilotError(f"{source!r} is neither a local folder nor a Hugging Face Hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download  # lazy: only real deployments need it
    except ImportError:
        raise SpecpilotError(f"huggingface_hub is not installed; cannot download {source}") from None
    try:
        path = snapshot_download(repo_id=source, revision=revision)
    except Exception as e:  # network, auth, missing repo: one line naming the id
        raise SpecpilotError(f"could not download {source} from the Hugging Face Hub: "
                             f"{type(e).__name__}: {e}") from None
    return Path(path).resolve(), "hub"


def _link(link: Path, to: Path) -> None:
    """Point ``link`` at ``to``, replacing an old link atomically (never a real folder)."""
    if link.exists() and not link.is_symlink():
        raise SpecpilotError(f"{link} exists and is not a symlink; remove it to relink")
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(to, target_is_directory=True)
    os.replace(tmp, link)


def check(name: str, target: Path, drafter: Path, drafter_name: str, block_size: str | int | None,
          block_reason: str | None = None) -> None:
    """The planning-time checks of :mod:`specpilot.validate` on the resolved folders.

    Raises:
        SpecpilotError: the first problem, naming the deployment and the folder.
    """
    from .validate import drafter_problems, target_problem

    problems = []
    for what, folder in (("target", target), ("drafter", drafter)):
        if not (folder / "config.json").is_file():
            problems.append(f"{what} {folder} holds no config.json")
    if not problems:
        problems = ([p for p in [target_problem(target / "config.json")] if p]
                    + drafter_problems(drafter / "config.json", drafter_name, block_size, block_reason))
    if problems:
        raise SpecpilotError(f"deployment {name}: {problems[0]}")


def _block(value: str | None) -> int | str | None:
    """--block-size as an int, or "auto" / None as given."""
    if value in (None, "auto"):
        return value
    try:
        return int(value)
    except ValueError:
        raise SpecpilotError(f"--block-size must be an integer or 'auto', got {value!r}") from None


def run(args: argparse.Namespace) -> int:
    args.block_size = _block(args.block_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, target_how = resolve(args.target, args.revision)
    drafter, drafter_how = resolve(args.drafter, args.revision)
    check(args.name, target, drafter, args.drafter_name, args.block_size, args.block_reason)
    _link(out / "target", target)
    _link(out / f"drafter-{args.drafter_name}", drafter)
    write_json(out / "build.json", {
        "deployment": args.name,
        "kind": "linked",
        "target": args.target,
        "target_path": str(target),
        "target_source": target_how,
        "drafter": args.drafter_name,
        "drafter_id": args.drafter,
        "drafter_path": str(drafter),
        "drafter_source": drafter_how,
        "weight_format": args.weight_format,
        "block_size": args.block_size,
        "revision": args.revision,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    })
    print(f"{args.name}: target {target} ({target_how}), drafter {drafter} ({drafter_how})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m specpilot.deployment_link``: see the module docstring."""
    return module_main("python -m specpilot.deployment_link", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())

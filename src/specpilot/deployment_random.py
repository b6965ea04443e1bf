"""A synthetic deployment: a lazy random checkpoint of a named shape, as the workflow's deployment.

``python -m specpilot.deployment_random --name D --shape S --seed N --block-size B --out DIR`` writes

- ``DIR/target``: the target's ``config.json`` only, marked lazy (``specpilot random-checkpoint
  --lazy``, :func:`specpilot.models.random_checkpoint.write_random_checkpoint`): every job that loads
  it draws the same weights from the seed on its own device, so a 30B shape costs kilobytes of disk
  and seconds of device time instead of 60 GB; and a byte-level tokenizer (the 256 bytes plus the
  chat template's four special tokens, ids 0..259: :func:`specpilot.tiny.tokenizer.build_tokenizer`
  with no merges), so ``specpilot prompts`` formats the benchmarks' real text for it. A random
  target has no tokenizer of its own; any text is meaningless to it, and byte-level ids fit every
  vocabulary;
- ``DIR/drafter-dflash``: the random DFlash drafter of the shape (lazy too), its config's block the
  deployment's ``block_size`` (so ``block_size: auto`` means that block);
- ``DIR/build.json`` last: the workflow's marker that the deployment is ready.

A random target writes meaningless text, so its deployments run the replay drafter (config key
``replay_profile``; :mod:`specpilot.drafters.replay`): acceptance from a published profile, the
drafter network run each step for its cost only, every record marked ``synthetic``. The workflow
(:mod:`specpilot.validate`) refuses a random target without one.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

from .errors import SpecpilotError, module_main
from .io import write_json
from .models.shapes import SHAPES
from .tiny.tokenizer import build_tokenizer

RANDOM_TARGET = "random"  # config deployments.<name>.target of a synthetic deployment
RANDOM_DRAFTER = "dflash"  # the lazy random drafters are DFlash networks
BYTE_VOCAB = 260  # 256 bytes + the tiny tokenizer's 4 special tokens: a byte-level BPE without merges


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", required=True, help="deployment name (recorded in build.json)")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="named shape of the target")
    parser.add_argument("--seed", type=int, default=0, help="weight seed of the target (the drafter's is seed + 1)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the drafter's block (DFlash counting: anchor included), written in its config.json")
    parser.add_argument("--weight-format", default="bf16", choices=("bf16", "fp32"),
                        help="dtype named in the config.json files (the loading job's --dtype decides)")
    parser.add_argument("--replay-profile", default=None, help="recorded in build.json")
    parser.add_argument("--out", required=True, help="resources/deployments/{deployment}")


def write_random_deployment(out: str | Path, shape: str, seed: int = 0, block_size: int = 16,
                            weight_format: str = "bf16", name: str | None = None,
                            replay_profile: str | None = None) -> dict:
    """Write the synthetic deployment folder (see the module docstring); returns build.json's content.

    Args:
        out: the deployment folder (``resources/deployments/{deployment}``).
        shape: a name of :data:`specpilot.models.shapes.SHAPES`; seed: the target's weight seed.
        block_size: the drafter's block, DFlash counting (>= 2).
    Raises:
        SpecpilotError: an unknown shape, a block size below 2.
    """
    import torch  # the checkpoint writer needs it; the workflow's planning imports this module's names only

    from .models.random_checkpoint import write_random_checkpoint

    if shape not in SHAPES:
        raise SpecpilotError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if block_size < 2:
        raise SpecpilotError(f"block_size must be >= 2 for a DFlash drafter (anchor included), got {block_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "build.json").unlink(missing_ok=True)  # a rebuild is not ready until its marker is written again
    dtype = torch.float32 if weight_format == "fp32" else torch.bfloat16
    target, drafter = write_random_checkpoint(shape, out / "target", out / f"drafter-{RANDOM_DRAFTER}", dtype=dtype,
                                              seed=seed, lazy=True, drafter_block=block_size)
    build_tokenizer(["a"], BYTE_VOCAB, target)  # one text of one byte: no merges, the byte alphabet only
    build = {"deployment": name, "kind": "random", "shape": shape, "seed": seed, "drafter": RANDOM_DRAFTER,
             "block_size": block_size, "weight_format": weight_format, "replay_profile": replay_profile,
             "target_path": str(target), "drafter_path": str(drafter), "tokenizer": f"byte-level ({BYTE_VOCAB} ids)",
             "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    write_json(out / "build.json", build)
    return build


def run(args: argparse.Namespace) -> int:
    b = write_random_deployment(args.out, args.shape, args.seed, args.block_size, args.weight_format, args.name,
                                args.replay_profile)
    print(f"{args.name}: lazy random {b['shape']} (seed {b['seed']}) + DFlash drafter (block {b['block_size']}), "
          f"byte-level tokenizer, in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m specpilot.deployment_random``: see the module docstring."""
    return module_main("python -m specpilot.deployment_random", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())

"""``specpilot prompts``: write one benchmark's formatted, tokenized prompt file (several in one job)."""

from __future__ import annotations

import argparse

from ..io import comma_list, one_out_each
from .files import write_prompt_file
from .sources import BENCHMARKS, DATA_DIR_ENV, check_data_id
from .subsets import ROLES, calibration_pool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``specpilot prompts``."""
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (or Hub id) of the target model")
    parser.add_argument("--benchmark", required=True, type=comma_list,
                        help=f"one of: {', '.join(BENCHMARKS)}; several comma-separated, one --out each")
    parser.add_argument("--n-prompts", required=True, help="number of prompts; 0 or 'all' = every row (eval only)")
    parser.add_argument("--seed", type=int, default=0, help="subset permutation seed (default 0)")
    parser.add_argument("--role", choices=ROLES, default="eval",
                        help="eval: evaluation rows; calibration: the rows reserved for the agent rounds (a train "
                             "split where the benchmark has one), disjoint from every evaluation row")
    parser.add_argument("--at-least", type=int, default=None,
                        help="calibration: --n-prompts is a cap (the rounds' last rung): a benchmark whose reserve "
                             "holds fewer writes all of it, refusing only when it holds fewer than this (rung 0)")
    parser.add_argument("--n-eval", default=None, help="ignored (calibration no longer depends on the eval count)")
    parser.add_argument("--data-dir", default=None, help=f"local benchmark folder (default ${DATA_DIR_ENV}, else "
                        "shared/data/benchmarks beside the repository, else the HF Hub)")
    parser.add_argument("--data-id", default=None,
                        help="expected checksum of the data (the workflow passes it): refuse other data")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="fail if a prompt is longer than this")
    parser.add_argument("--out", required=True, type=comma_list,
                        help="output .jsonl file; comma-separated, one per --benchmark")


def run(args: argparse.Namespace) -> int:
    """Run ``specpilot prompts``: write the prompt files; returns 0.

    Raises:
        SpecpilotError: as :func:`~specpilot.prompts.files.write_prompt_file`; a ``--data-id`` the
            data found does not have; a different number of ``--out`` and ``--benchmark`` entries.
    """
    pairs = one_out_each(args.out, args.benchmark, "benchmark(s)")
    data_dir = check_data_id(args.data_dir, args.data_id)
    for benchmark, out in pairs:
        n = args.n_prompts
        if args.at_least is not None and args.role == "calibration":
            n = max(args.at_least, min(int(n), len(calibration_pool(benchmark, data_dir))))
        rows = write_prompt_file(
            benchmark, args.tokenizer, out, n, seed=args.seed, role=args.role,
            data_dir=data_dir, max_prompt_tokens=args.max_prompt_tokens, n_eval=args.n_eval,
        )
        print(f"wrote {len(rows)} {benchmark} prompts to {out}")
    return 0

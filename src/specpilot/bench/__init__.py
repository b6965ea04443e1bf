"""The maintained benchmark suite: ``specpilot bench NAME [options]``.

Each benchmark is one module of this package with ``add_arguments(parser)``
and ``run(args) -> int``; all time with :mod:`specpilot.tuning.timing`, write one JSON result
(default ``results/{gpu}/bench/NAME.json``, atomically) and print a short table last. Each has a
``--dry-run``: tiny shapes on the CPU (Triton under its interpreter where it runs Triton kernels)
that exercises the benchmark's code and checks in seconds and measures nothing
(``tests/test_bench_suite.py`` runs every one). ``specpilot bench`` (or ``--list``) lists them.

Only the chosen benchmark's module is imported, after ``--dry-run`` has set ``TRITON_INTERPRET``
(Triton reads it when it is first imported).
"""

from __future__ import annotations

import argparse
import importlib
import os

from ..errors import SpecpilotError

# name -> (module under specpilot.bench, one line: what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "engine": ("engine", "AR decode step and MBU by batch and context, verify width as a multiple of the AR "
                         "step, stock end to end with the replay drafter against tau x AR / (verify + draft)"),
    "batched": ("batched", "the c16 speculative step per shape (verify, draft, commit, the rest) against its "
                           "floors, the AR c16 and c1 steps, per kernel group and the host's Python per step"),
    "verify": ("verify", "batched verify steps (B x T) and token trees against the AR step, with the "
                         "bit-exact batch-invariance and tree-against-chain checks"),
    "draft": ("draft", "the DFlash draft step (context injection + draft) against its byte floor: the "
                       "Triton draft step and the eager network"),
    "serving": ("serving", "AR and stock (and engine-config variants) through the product CLI at c1 and "
                           "c16-24: per-request speedup, tau, throughput, token forcing"),
    "targets": ("targets", "hybrid (Gated DeltaNet) and Muse-Glimmer targets: AR MBU, verify-16 and commit "
                           "against AR, stock with the replay drafter, state memory per request"),
    "w12": ("w12", "12-bit weights: the fast path's per-role w12 choice and its engine step against bf16, "
                   "and the eager W12Linear kernel against bf16 per shape"),
    "ranks": ("ranks", "per-position rank recall of a built drafter against its target, written as a replay "
                       "profile with rank_recall, and trees' measured tau against the tau it predicts (CPU)"),
    "trees": ("trees", "tau against node budget of static, spine and DFlash2 lattice trees on a built deployment's "
                       "drafters (every output against AR and the teacher-forced pass), the lattice bound, and the "
                       "measured lattice behaviour as a replay profile (CPU)"),
    "families": ("families", "hybrid and Muse-Glimmer targets with static trees: AR, stock and trees at c1 and "
                             "c16, every cell equal to AR and token-forced, and the teacher-forced pass against "
                             "the engine layer by layer"),
    "tree-bound": ("tree_bound", "the largest tau any tree of N nodes reaches under a replay profile, and the "
                                 "speedup over stock it bounds (CPU, seconds)"),
    "client": ("client", "an OpenAI-compatible endpoint (specpilot serve, SGLang, vLLM) at given concurrencies "
                         "through the openai package: throughput, TTFT, per-chunk ITL p50/p99, tokens per request"),
    "serve-vs-run": ("serve_vs_run", "specpilot serve against specpilot run on the same prompts and engine, "
                                     "alternating: c1 throughput ratio, c4 over c1, the found engine served "
                                     "against stock served (per-request ratio, bootstrap interval)"),
    "host": ("host", "the engine's host work per step with a stand-in target (no model): AR, chain and lattice "
                     "tree cells at c1 / c16, acceptance driven by replay profiles, split into its parts (CPU)"),
    "cpu-step": ("cpu_step", "the CPU step paths of a built deployment: plain, fused (aten / oneDNN matmuls) and "
                             "optionally torch.compile, verify, decode, draft and context injection, interleaved"),
}


def listing() -> str:
    """One line per benchmark: its name and what it measures."""
    lines = ["benchmarks (specpilot bench NAME [--dry-run] [--out FILE] [options]; NAME --help for its options):"]
    lines += [f"  {name:<11} {summary}" for name, (_, summary) in BENCHMARKS.items()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``specpilot bench [NAME [options]] [--list]``: the benchmark's own options follow its name."""
    parser.add_argument("--list", action="store_true", help="list the benchmarks, one line each")
    parser.add_argument("name", nargs="?", help="the benchmark to run (none: list them)")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options (NAME --help)")


def module(name: str):
    """The module of benchmark ``name``. Raises SpecpilotError naming an unknown benchmark."""
    if name not in BENCHMARKS:
        raise SpecpilotError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"{__name__}.{BENCHMARKS[name][0]}")


def main(name: str, options: list[str]) -> int:
    """Parse ``options`` for benchmark ``name`` and run it; returns its exit status (0: no phase
    failed; 1: a phase recorded an error in the result)."""
    if "--dry-run" in options:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    mod = module(name)
    parser = argparse.ArgumentParser(prog=f"specpilot bench {name}", description=BENCHMARKS[name][1])
    mod.add_arguments(parser)
    args = parser.parse_args(options)
    args.argv = [name, *options]
    return int(mod.run(args) or 0)


def run(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand: list the benchmarks, or run one."""
    if args.list or not args.name:
        print(listing())
        return 0
    return main(args.name, list(args.options or []))

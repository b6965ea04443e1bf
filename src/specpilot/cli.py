"""The ``specpilot`` command line: one subcommand per workflow step.

Each subcommand lives in the module that owns its job; that module defines
``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen module is imported, so
``specpilot --help`` stays fast. Any :class:`SpecpilotError` becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import SpecpilotError

# one row a subcommand: its name, the module under ``specpilot`` that owns it, its one-line help
_TABLE = """
build-tiny         tiny.build                build the embedded tiny deployment (tokenizer, target, drafter) on CPU
tiny-stage         tiny.stages               one stage of the tiny build as a workflow job: target, teacher, drafter, assemble
prompts            prompts.cli               write one benchmark's formatted, tokenized prompts
run                engine.cli                run one engine over a prompt file into a records file
serve              server.cli                serve a deployment's engine behind an OpenAI-compatible HTTP API
force              forcing.cli               token forcing: check a candidate's records against reference records
ceilings           ceilings                  measure a device's memory bandwidth and matmul rate
kernels            kernels_build             build / tune the per-GPU kernels (records that none apply on CPU)
table              aggregate                 aggregate records into the study table (geometric means)
figures            figures                   draw the study figures from the table
round              agent.rounds              agent rounds: references, plan, one direction's agent, integrate
final              agent.final               the specpilot engine config of a deployment: its last round's integrated config
memory             agent.memory              merge structured-memory snapshots into one file
convert-w12        w12.convert               convert a bf16 checkpoint to the lossless 12-bit format
random-checkpoint  models.random_checkpoint  write a random-weight checkpoint of a named shape
wheels             wheels                    write the wheels that install the workflow where no package registry is
bench              bench                     the maintained benchmark suite: specpilot bench NAME [--dry-run] (no NAME: the list)
"""
# name -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    name: (f"specpilot.{module}", help_)
    for name, module, help_ in (row.split(None, 2) for row in _TABLE.strip().splitlines())
}


def _usage() -> str:
    lines = ["usage: specpilot <command> [options]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'specpilot <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specpilot`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"specpilot: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    for stream in (sys.stdout, sys.stderr):  # progress reaches a redirected log file as it happens
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"specpilot {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except SpecpilotError as e:
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specpilot: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

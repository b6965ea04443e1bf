"""The one error type users see: a single line naming the bad value."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


class SpecpilotError(Exception):
    """Bad input or an unusable resource.

    The CLI prints ``specpilot: error: <message>`` and exits with status 2; no traceback.
    Raise it with a message that names the offending value (path, key, number).
    """


def module_main(prog: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """The entry of a ``python -m specpilot.MODULE`` step (the workflow's shell commands): the
    options ``add_arguments`` declares, parsed from ``argv`` (default ``sys.argv``), then
    ``run(args)``'s status; a :class:`SpecpilotError` is printed as one line
    (``specpilot: error: ...``) and gives status 2. ``doc``: the module docstring (its first line
    is the help's description)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SpecpilotError as e:
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2

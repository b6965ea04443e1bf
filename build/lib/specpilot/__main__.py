"""``python -m specpilot <command> ...``: the same as the ``specpilot`` console script.

The workflow calls the CLI this way so that it also works where the package is only on
``PYTHONPATH`` (per-rule conda environments) rather than installed.
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

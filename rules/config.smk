# The config, checked before anything else reads it (specpilot.configcheck): values given with
# --config parsed to the schema's types (nested ones arrive as strings), one short message naming
# the key for a mistake, derived defaults filled in (rounds.max_new_tokens = max_new_tokens).

import sys
from pathlib import Path

_SRC_DIR = Path(workflow.basedir) / "src"
if _SRC_DIR.is_dir() and str(_SRC_DIR) not in sys.path:
    sys.path.insert(0, str(_SRC_DIR))  # the workflow's own package, also without an install

from specpilot.configcheck import check_config

check_config(config, Path(workflow.basedir) / "config" / "schema.yaml")
validate(config, "../config/schema.yaml")  # passes after check_config; fills the schema's defaults

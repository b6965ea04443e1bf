"""Compatibility names: the drafter plug-ins now live in :mod:`specpilot.drafters`."""

from ..drafters.dflash import DFlashProposer  # noqa: F401
from ..drafters.lookup import LookupProposer  # noqa: F401

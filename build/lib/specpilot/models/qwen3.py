"""Compatibility module: the target model now lives in :mod:`specpilot.models.target` (built by
layer type); ``Transformer`` and ``KVCache`` stay importable from here."""

from .state import KVCache  # noqa: F401
from .target import Backbone, DecoderLayer, Transformer  # noqa: F401
from .attention import Attention  # noqa: F401

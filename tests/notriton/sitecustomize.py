"""Hide triton as if it were not installed: every meta-path finder answers None for it."""
import sys

class _Hide:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, k):
        return getattr(self.inner, k)

sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
sys.modules.pop("triton", None)

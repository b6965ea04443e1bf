"""Shared set-up for Triton interpreter subprocesses (imported before triton compiles anything)."""

import triton.runtime.interpreter as interp


def patch_interpreter() -> None:
    """triton 3.6 + numpy >= 2.3: give interpreted tensors ``__index__`` (int() of a 1-element array)."""
    if not hasattr(interp, "_patch_lang_tensor"):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched

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


def fast_runner(model, batch: int, max_seq: int, capture: tuple[int, ...] = ()):
    """A :class:`~specpilot.engine.runner.TargetRunner` on the Triton fast path without CUDA graphs
    (the CPU under the interpreter): its step graphs run :class:`~specpilot.engine.graphs.FastTarget`
    directly instead of replaying a capture, so decode / verify go through the Triton step and
    :meth:`~specpilot.engine.runner.TargetRunner.prefill` through ``prefill_row``, as on the GPU."""
    from specpilot.engine.graphs import StepGraphs
    from specpilot.engine.runner import TargetRunner

    class Uncaptured(StepGraphs):
        def run(self, tokens, start, capture=(), tree=None):
            return self.step(tokens, start, capture, tree)

    runner = TargetRunner(model, batch, max_seq, capture, graphs=False)
    runner.graphs = Uncaptured(model, "triton")
    return runner

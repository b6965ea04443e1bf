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
    (the CPU under the interpreter): its backend's step graphs run the Triton step
    (:class:`~specpilot.fastpath.dense.FastTarget`, or the family step) directly instead of
    replaying a capture, so decode / verify go through the Triton step and
    :meth:`~specpilot.engine.runner.TargetRunner.prefill` through ``prefill_row``, as on the GPU."""
    from specpilot.engine.backend import Backend
    from specpilot.engine.runner import TargetRunner
    from specpilot.fastpath.dense import FastTarget
    from specpilot.fastpath.family import FastFamilyTarget
    from specpilot.fastpath.graphs import StepGraphs

    class Uncaptured(StepGraphs):
        def run(self, tokens, start, capture=(), tree=None, write=False):
            return self.step(tokens, start, capture, tree, write)

    dense = model.config.is_dense
    step = FastTarget(model) if dense else FastFamilyTarget(model)
    backend = Backend(model, "triton-dense" if dense else "triton-family", "Triton step under the interpreter",
                      False, "triton", Uncaptured(model, step))
    return TargetRunner(model, batch, max_seq, capture, backend=backend)


# The opening of every check script run under the interpreter (tests/test_gpu_path.py,
# tests/test_forcing_triton.py): argv[1] = the repository; src/ and tests/ importable, the
# interpreter patched, one torch thread.
PREAMBLE = """import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [os.path.join(sys.argv[1], "src"), os.path.join(sys.argv[1], "tests")]
from triton_interp import fast_runner, patch_interpreter
patch_interpreter()
import torch
torch.set_num_threads(1)
"""


def run_interpreted(script, body: str, repo, timeout: int = 900, args: tuple = ()) -> dict:
    """Write PREAMBLE + ``body`` to ``script`` (a Path), run it under Triton's CPU interpreter in a
    subprocess with ``repo`` as argv[1] (``args`` after it), and return its ``RESULT {json}`` line as a dict (the test
    fails with the script's stderr when it exits non-zero)."""
    import json
    import os
    import subprocess
    import sys

    script.write_text(PREAMBLE + body)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), str(repo), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])

"""The GPU fast path: the target's Triton steps (dense :mod:`.dense`, hybrid / sliding-window
:mod:`.family`), the drafter's step (:mod:`.drafter`), their CUDA graphs (:mod:`.graphs`), the matmul
tables (:mod:`.tables`), the 12-bit roles (:mod:`.w12`) and what the path can run (:mod:`.support`).
The modules that launch Triton kernels import Triton; :func:`specpilot.engine.backend.choose_backend`
enters them only where it chooses a Triton path."""

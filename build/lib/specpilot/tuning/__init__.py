"""Every tuner of the engine (checked-cuBLAS selection, matmul tables, the w12 choice) and the
one timing helper (:mod:`specpilot.tuning.timing`) they and the benchmarks share."""

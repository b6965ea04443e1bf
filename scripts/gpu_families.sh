#!/usr/bin/env bash
# Issue 44 on one GPU (<= 10 min on an H100 / H200): the Qwen3.8-27B hybrid and Muse-Glimmer-30B
# shapes (random weights drawn on the GPU, as a lazy random checkpoint's are at load), AR, stock and
# static trees of 31 and 63 nodes at c1 and c16 (replay drafter study_stock, block 16; AR in the same
# run as the baseline), token forcing on every cell, one line per cell (speedup over AR and over
# stock, tau, outputs equal to AR, forcing verdict), then the teacher-forced pass against the engine
# layer by layer on each shape (`specpilot bench families`); first the CUDA tests of the family step
# (chains and trees, forcing). Raw outputs under $OUT (default results/gpu_families).
#   scripts/gpu_families.sh            on the GPU
#   DRY=1 scripts/gpu_families.sh      the same plumbing on the CPU: tiny shapes, Triton interpreter
# Sizes: REQUESTS (16, the c16 cell), REQUESTS_C1 (3), PROMPT (512), NEW (256), TREES ("31 63").
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu_families}; mkdir -p "$OUT"
t0=$(date +%s)
if [ "${DRY:-0}" = 1 ]; then
    python3 -m specpilot bench families --dry-run --out "$OUT/families.json" 2>"$OUT/families.log" | tail -40
    rc=${PIPESTATUS[0]}
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_family_fast.py tests/test_forcing_family.py \
        tests/test_family_trees.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -6
    python3 -m specpilot bench families --shapes ${SHAPES:-qwen3.8-27b muse-glimmer-30b} \
        --concurrency 1 16 --requests "${REQUESTS:-16}" --requests-c1 "${REQUESTS_C1:-3}" \
        --prompt-len "${PROMPT:-512}" --new "${NEW:-256}" --trees ${TREES:-31 63} \
        --out "$OUT/families.json" 2>"$OUT/families.log" | tail -40
    rc=${PIPESTATUS[0]}
fi
echo "gpu_families: exit $rc, $(( $(date +%s) - t0 )) s, result $OUT/families.json"
exit "$rc"

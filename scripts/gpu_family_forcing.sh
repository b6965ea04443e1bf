#!/usr/bin/env bash
# Issue 35 item 0 on the GPU: AR and stock (replay drafter study_stock, block 16) on the Qwen3.8-27B
# hybrid and Muse-Glimmer-30B shapes (lazy random checkpoints: weights drawn from the seed on the GPU
# at load) at c16 and c1 through the product CLI, each cell token-forced (the Triton family step's
# teacher-forced pass); and the family CUDA tests. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_family_fast.py tests/test_forcing_family.py 2>&1 \
    | tee "$OUT/family_tests.log" | tail -8
for shape in ${SHAPES:-qwen3.8-27b muse-glimmer-30b}; do
    python3 -m specpilot random-checkpoint --shape $shape --out /tmp/lz_$shape --lazy > /dev/null
    python3 -m specpilot bench serving --target /tmp/lz_$shape --drafter /tmp/lz_$shape-drafter --requests ${REQUESTS:-16} \
        --requests-c1 ${REQUESTS_C1:-3} --new ${NEW:-192} --prompt-len 512 --concurrency 16 1 --ar-force 1 \
        --work /tmp/work_$shape --out "$OUT/family_$shape.json" 2>&1 | tail -6
done

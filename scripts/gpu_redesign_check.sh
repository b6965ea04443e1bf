#!/usr/bin/env bash
# Issue 33 on the GPU: (1) the CUDA tests of the redesigned engine; (2) serving at c16 and c1 of the
# pre-redesign commit's code (.old/src, carried beside the checkout) and of this checkout, in one run
# on one machine, through the same benchmark driver (`specpilot bench serving --code`), on one
# random Qwen3-8B-shape checkpoint (replay drafter study_stock, block 16). Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_gpu_path.py tests/test_family_fast.py \
    tests/test_forcing_triton.py tests/test_w12_fast.py tests/test_forcing_family.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
CK=/tmp/ck8
[ -f $CK/config.json ] || python3 -m specpilot random-checkpoint --shape qwen3-8b --out $CK --drafter-out $CK-drafter
COMMON="--target $CK --drafter $CK-drafter --requests ${REQUESTS:-32} --requests-c1 ${REQUESTS_C1:-6} --new ${NEW:-512} --concurrency 16 1"
for v in ${VERSIONS:-old new}; do
    code=""; [ "$v" = old ] && code="--code .old"
    python3 -m specpilot bench serving $COMMON $code --work /tmp/work_$v --out "$OUT/serving_$v.json" 2>&1 | tail -12
done

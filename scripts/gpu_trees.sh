#!/usr/bin/env bash
# Issue 47 on one GPU (H100 or H200), one call of <= 10 minutes, lazy random checkpoints (weights
# drawn from the seed on the GPU at load):
#  1. verify of lattice-shaped trees of 63 / 127 / 255 nodes (the measured tiny_dflash2_lattice
#     geometry, the path form the engine runs) against an AR step in the same run, and every tree's
#     checked nodes bit for bit against their root-to-node paths verified as chains
#     (`specpilot bench verify --part trees`);
#  2. Qwen3-8B shape, replay drafter study_stock, block 16: AR and stock at c16 and c1, static trees
#     of 31 / 63 / 127 / 255 nodes at c1 (the best tree against stock), host time per step of stock
#     at c1 and c16;
#  3. Qwen3-8B shape, replay drafter tiny_dflash2_lattice (the lattice trees measured on the tiny
#     DFlash2 drafter), block 12, c1: its own chain (stock) against lattice trees of 31 / 63 / 127 / 255;
#  4. the Qwen3.8-27B hybrid shape under the lattice profile, c1: chain against lattice trees 63 / 127;
# every cell against AR of the same run, token-forced through the Triton teacher pass
# (`specpilot bench serving`). One line per figure at the end; raw results under $OUT.
# CPU plumbing check: DRY=1 bash scripts/gpu_trees.sh (tiny shapes, a few tokens, CPU).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu_trees}; mkdir -p "$OUT"
# every stage under one deadline (DEADLINE seconds from the start, default 560): a stage gets at
# most the time left and is skipped, saying so, when less than its need is left
T0=$(date +%s); DEADLINE=${DEADLINE:-560}
guard() {  # guard NEED_S CMD...: run CMD within the time left, or skip it
    local need=$1 l; shift
    l=$(( DEADLINE - ($(date +%s) - T0) ))
    if [ "$l" -lt "$need" ]; then echo "SKIPPED ($l s left, needs $need): $*" | cut -c1-200; return; fi
    timeout "$l" "$@"; local rc=$?; [ $rc -ne 0 ] && echo "rc=$rc: $*" | cut -c1-200; return 0
}
if [ "${DRY:-0}" = 1 ]; then
    S8=tiny; S27=tiny-hybrid; VERIFY="--dry-run"; REQ=2; REQ1=2; NEW=24; PLEN=16; C16=2
else
    S8=qwen3-8b; S27=qwen3.8-27b; VERIFY=""; REQ=${REQUESTS:-32}; REQ1=${REQUESTS_C1:-4}; NEW=${NEW:-256}
    PLEN=${PROMPT_LEN:-512}; C16=16
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
guard 30 python3 -m specpilot bench verify --part trees $VERIFY --out "$OUT/verify_trees.json" 2>&1 | tail -20
for s in $S8 $S27; do
    [ -f /tmp/lz_$s/config.json ] || python3 -m specpilot random-checkpoint --shape $s --out /tmp/lz_$s \
        --drafter-out /tmp/lz_$s-drafter --lazy > /dev/null
done
COMMON8="--target /tmp/lz_$S8 --drafter /tmp/lz_$S8-drafter --prompt-len $PLEN --new $NEW"
guard 120 python3 -m specpilot bench serving $COMMON8 --requests $REQ --requests-c1 $REQ1 --concurrency $C16 1 \
    --profile study_stock --block 16 --work /tmp/work_study --out "$OUT/serving_study.json" \
    --variant 'tn31@1={"tree_nodes": 31}' --variant 'tn63@1={"tree_nodes": 63}' \
    --variant 'tn127@1={"tree_nodes": 127}' --variant 'tn255@1={"tree_nodes": 255}' 2>&1 | tail -12
guard 90 python3 -m specpilot bench serving $COMMON8 --requests $REQ1 --requests-c1 $REQ1 --concurrency 1 \
    --profile tiny_dflash2_lattice --block 12 --work /tmp/work_lat8 --out "$OUT/serving_lattice_8b.json" \
    --variant 'lat31@1={"tree_lattice": 31}' --variant 'lat63@1={"tree_lattice": 63}' \
    --variant 'lat127@1={"tree_lattice": 127}' --variant 'lat255@1={"tree_lattice": 255}' 2>&1 | tail -10
guard 90 python3 -m specpilot bench serving --target /tmp/lz_$S27 --drafter /tmp/lz_$S27-drafter --prompt-len $PLEN \
    --new $NEW --requests $REQ1 --requests-c1 $REQ1 --concurrency 1 --profile tiny_dflash2_lattice --block 12 \
    --work /tmp/work_lat27 --out "$OUT/serving_lattice_27b.json" \
    --variant 'lat63@1={"tree_lattice": 63}' --variant 'lat127@1={"tree_lattice": 127}' 2>&1 | tail -8
python3 scripts/gpu_trees_summary.py "$OUT"

#!/usr/bin/env bash
# Issue 63 (and 54, 47) on one GPU (H100 or H200), most important first, lazy random checkpoints
# (weights drawn from the seed on the GPU at load). Every Qwen3-8B bar of issue 63 in CALL=1
# (default, <= 9 minutes), the Qwen3.8-27B half in CALL=2:
# CALL=1
#  1. `specpilot bench verify --part trees`: lattice trees of 63 / 127 / 255 nodes (the measured
#     tiny_dflash2_lattice geometry, the path form the engine runs) against chains of 64 / 128 / 256
#     tokens and the AR step in the same run (bars: tree <= 1.02x / 1.03x / 1.06x its chain),
#     per-kernel device time of each tree and its chain, the tree's work outside the step (tree
#     inputs, acceptance) against the chain's, every checked node bit for bit against its path
#     verified as a chain;
#  2. `specpilot bench verify --part widths`: chains of 1 / 16 / 64 / 128 / 256 tokens, each
#     checked to run the tokens it names (bars: 64 / 128 / 256 <= 1.08x / 1.20x / 1.45x the
#     16-token chain) with the AR step, bit-exact checks;
#  3. Qwen3-8B shape, replay drafter tiny_dflash2_lattice, block 12, c1: its own chain (stock)
#     against lattice trees of 31 / 63 / 127 / 255 (bar: best >= 1.20x stock; the rest of the step,
#     decode - draft - verify, <= 0.40 ms for every lattice tree), every output = AR, forcing;
#  4. scripts/gpu_tree_attention.py: the attention kernels alone, each lattice tree against its
#     chain, and every node against a decode at its position bit for bit (bf16);
# CALL=2
#  5. the Qwen3.8-27B hybrid shape under the lattice profile, c1: chain against lattice trees 63 / 127
#     (bar >= 1.10x);
#  6. Qwen3-8B shape, study_stock, block 16: AR and stock at c16 and c1, static trees 63 / 127 at c1,
#     host time per step of each cell;
#  7. `specpilot bench host --clock wall` on the GPU machine's CPU (the engine's host work per step
#     with a stand-in target: chain c1, 63-node lattice tree c1, chain c16; AR baseline first).
# Every serving cell against AR of the same run, token-forced through the Triton teacher pass
# (`specpilot bench serving`). One line per bar at the end (scripts/gpu_trees_summary.py, both
# calls' results when present); raw JSON under $OUT.
# CPU plumbing check: DRY=1 CALL=1 bash scripts/gpu_trees.sh; DRY=1 CALL=2 bash scripts/gpu_trees.sh.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu_trees}; mkdir -p "$OUT"
CALL=${CALL:-1}
# every stage under one deadline (DEADLINE seconds from the start, default 560): a stage gets at
# most the time left and is skipped, saying so, when less than its need is left
DEADLINE_DEFAULT=560; . "$(dirname "$0")/deadline.sh"
if [ "${DRY:-0}" = 1 ]; then
    S8=tiny; S27=tiny-hybrid; VERIFY="--dry-run"; WIDTHS="--dry-run"; REQ=2; REQ1=2; NEW=24; PLEN=16; C16=2
    HOST="--dry-run"
else
    S8=qwen3-8b; S27=qwen3.8-27b; VERIFY="--max-leaves 8"; REQ=${REQUESTS:-32}; REQ1=${REQUESTS_C1:-4}
    NEW=${NEW:-256}; PLEN=${PROMPT_LEN:-512}; C16=16; HOST="--repeats 5"
    WIDTHS="--shapes 1x1 1x16 1x64 1x128 1x256"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
ckpt() {  # ckpt SHAPE: the lazy random target and drafter of SHAPE under /tmp
    [ -f /tmp/lz_$1/config.json ] || python3 -m specpilot random-checkpoint --shape $1 --out /tmp/lz_$1 \
        --drafter-out /tmp/lz_$1-drafter --lazy > /dev/null
}
if [ "$CALL" = 1 ]; then
    guard 60 python3 -m specpilot bench verify --part trees $VERIFY --out "$OUT/verify_trees.json" 2>&1 | tail -30
    guard 40 python3 -m specpilot bench verify --part widths $WIDTHS --out "$OUT/verify_widths.json" 2>&1 | tail -6
    ckpt $S8
    guard 90 python3 -m specpilot bench serving --target /tmp/lz_$S8 --drafter /tmp/lz_$S8-drafter --prompt-len $PLEN \
        --new $NEW --requests $REQ1 --requests-c1 $REQ1 --concurrency 1 --profile tiny_dflash2_lattice --block 12 \
        --work /tmp/work_lat8 --out "$OUT/serving_lattice_8b.json" \
        --variant 'lat31@1={"tree_lattice": 31}' --variant 'lat63@1={"tree_lattice": 63}' \
        --variant 'lat127@1={"tree_lattice": 127}' --variant 'lat255@1={"tree_lattice": 255}' 2>&1 | tail -10
    if [ "${DRY:-0}" = 1 ]; then echo "gpu_tree_attention.py: CUDA only (skipped in a dry run)"
    else guard 40 python3 scripts/gpu_tree_attention.py 2>&1 | tail -8 | tee "$OUT/tree_attention.txt"; fi
else
    ckpt $S27
    guard 90 python3 -m specpilot bench serving --target /tmp/lz_$S27 --drafter /tmp/lz_$S27-drafter --prompt-len $PLEN \
        --new $NEW --requests $REQ1 --requests-c1 $REQ1 --concurrency 1 --profile tiny_dflash2_lattice --block 12 \
        --work /tmp/work_lat27 --out "$OUT/serving_lattice_27b.json" \
        --variant 'lat63@1={"tree_lattice": 63}' --variant 'lat127@1={"tree_lattice": 127}' 2>&1 | tail -8
    ckpt $S8
    guard 120 python3 -m specpilot bench serving --target /tmp/lz_$S8 --drafter /tmp/lz_$S8-drafter --prompt-len $PLEN \
        --new $NEW --requests $REQ --requests-c1 $REQ1 --concurrency $C16 1 \
        --profile study_stock --block 16 --work /tmp/work_study --out "$OUT/serving_study.json" \
        --variant 'tn63@1={"tree_nodes": 63}' --variant 'tn127@1={"tree_nodes": 127}' 2>&1 | tail -12
    guard 30 python3 -m specpilot bench host $HOST --clock wall --out "$OUT/host.json" 2>&1 | tail -7
fi
python3 scripts/gpu_trees_summary.py "$OUT"

#!/usr/bin/env bash
# Issue 62 on one GPU (H100 or H200), one call of <= 9 minutes, lazy random checkpoints (weights drawn
# from the seed on the GPU at load), most important first:
#  1. `specpilot bench batched` (the profile first): per shape (Qwen3-8B, the Qwen3.8-27B hybrid,
#     Muse-Glimmer-30B) the c16 speculative step (16 requests of 336 tokens, block 16): verify, draft
#     and commit alone against the cost model's floors, against the AR c16 step and the c1 step of the
#     same run; the scheduler's loop at c16 (replay drafter study_stock over AR's outputs) split into
#     verify, draft and the rest (bar <= 0.60 ms); the hybrid's commit state traffic against its
#     floor; per-kernel device time grouped (GEMM, attention, GDN recurrence / conv, norms, copies)
#     with each verify group against the AR c16 step's; the engine's Python per step (cProfile);
#  2. serving at c16 per shape (`specpilot bench serving`: 32 requests x 512 new tokens, study_stock,
#     block 16): stock against AR of the same run, every output = AR, token forcing on the stock cell
#     (bars: stock >= 2.0x AR on the 8B, >= 1.6x on the 27B and the 30B).
# One line per figure; raw JSON under $OUT (default results/gpu_batched).
# CPU plumbing check: DRY=1 bash scripts/gpu_batched.sh (tiny shapes, Triton's interpreter).
# Sizes: REQUESTS (32), NEW (512), PROMPT_LEN (128: with 512 new tokens the mean context ~384, the
# study's batched rounds' ~336), SHAPES (the three), DEADLINE (530 s for the whole call).
# TUNE=1 (a second call, "after"): bench batched first tunes each shape's target and draft-step matmul
# tables at 16 and 256 rows (--tune-rows, TUNE_CONFIGS candidates each, default 8) and measures with
# them; serving then runs the target's tuned tables (--kernel-configs, forcing included).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu_batched}; mkdir -p "$OUT"
# every stage under one deadline (DEADLINE seconds from the start): a stage gets at most the time
# left and is skipped, saying so, when less than its need is left
DEADLINE_DEFAULT=530; . "$(dirname "$0")/deadline.sh"
if [ "${DRY:-0}" = 1 ]; then
    SHAPES=${SHAPES:-tiny tiny-hybrid tiny-muse}; BATCHED="--dry-run"; REQ=4; NEW=12; PLEN=16; C=2
else
    SHAPES=${SHAPES:-qwen3-8b qwen3.8-27b muse-glimmer-30b}; BATCHED=""; REQ=${REQUESTS:-32}; NEW=${NEW:-512}
    PLEN=${PROMPT_LEN:-128}; C=16
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# 1. the profile, one shape at a time (each shape's weights freed with its process): the timings,
# then the kernel profiles in a process of their own (once torch.profiler ran in a process every
# later call is slower)
for S in $SHAPES; do
    TABLES=""; TUNED=""
    if [ "${TUNE:-0}" = 1 ] && [ "${DRY:-0}" != 1 ]; then
        TUNED="--tune-rows 16 256 --tune-configs ${TUNE_CONFIGS:-8}"; TABLES="--tables-from $OUT/batched_$S.json"
    fi
    guard 60 python3 -m specpilot bench batched $BATCHED $TUNED --part timings --shapes $S --out "$OUT/batched_$S.json" \
        2>"$OUT/batched_$S.log" | sed -n '/^batched (/,$p' | tail -n +2
    [ "${DRY:-0}" = 1 ] || guard 40 python3 -m specpilot bench batched --part kernels $TABLES --shapes $S \
        --out "$OUT/batched_kernels_$S.json" 2>"$OUT/batched_kernels_$S.log" | grep -E " kernels | GEMM |^errors"
done
# 2. serving at c16, one shape at a time (each checkpoint freed before the next)
for S in $SHAPES; do
    [ -f /tmp/lz_$S/config.json ] || python3 -m specpilot random-checkpoint --shape $S --out /tmp/lz_$S \
        --drafter-out /tmp/lz_$S-drafter --lazy > /dev/null
    KC=""; [ -f "$OUT/batched_${S}_tables_$S.json" ] && [ "${TUNE:-0}" = 1 ] && KC="--kernel-configs $OUT/batched_${S}_tables_$S.json"
    guard 60 python3 -m specpilot bench serving $KC --target /tmp/lz_$S --drafter /tmp/lz_$S-drafter --prompt-len $PLEN \
        --new $NEW --requests $REQ --concurrency $C --ar-force --profile study_stock --block 16 \
        --work /tmp/work_batched_$S --out "$OUT/serving_$S.json" 2>"$OUT/serving_$S.log" \
        | grep -E "^c$C |^AR |^errors" | sed "s/^/$S serving /"
done
echo "gpu_batched: $(( $(date +%s) - T0 )) s, results under $OUT"

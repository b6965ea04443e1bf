#!/usr/bin/env bash
# The GPU study through the workflow, on a GPU machine that has Python, torch, triton, transformers,
# pandas and matplotlib but no Snakemake and no package registry: only the working tree and a wheel
# folder written elsewhere by `specpilot wheels` (default .whl/, its benchmark data in .whl/data):
#
#   python -m specpilot wheels --python 3.12 --platform manylinux_2_28_x86_64 --out .whl \
#       --data ../shared/data/benchmarks          # on a machine that reaches PyPI
#   bash scripts/gpu_study.sh                     # on the GPU machine, from the repository root
#
# It installs the wheels offline into a --target folder (the image's torch is left alone), runs
#   snakemake --cores all --max-threads N --configfile config/gpu.yaml results/<gpu>/table.csv
# (gpu detected) under a time guard, and prints the table, the wall time, the forcing verdicts and
# what the rounds tried and kept. Table, summary, logs and results go under $OUT when it is set.
# Environment: WHEELS (wheel folder, default .whl), CONFIG (default config/gpu.yaml; more
# --configfile overlays in EXTRA_CONFIGS), GPU_STUDY_LIMIT (seconds Snakemake may run, default
# 505: with the install, the report and the archives a call stays within 9 minutes), GPU (the {gpu}
# name; default: detected), SITE (install folder, default /tmp/specpilot-site).
# CPU check of the same plumbing: GPU=cpu EXTRA_CONFIGS=.test/config/gpu-tiny.yaml bash scripts/gpu_study.sh
#
# Three calls (issue 61: both serving regimes of the three shapes with 512-token cells; docs/gpu-study.md
# has the estimate): every call ends by writing $OUT/resume.tar.gz, the state a later call resumes from -- results/ (figures
# excepted), resources/deployments/ (the random deployments' config files, kilobytes), logs/ and
# Snakemake's .snakemake/metadata and .snakemake/incomplete (which jobs finished, with which
# params and code; a job the time guard killed is rerun: --rerun-incomplete). Calls 2 and 3 are
#   RESUME=path/to/resume.tar.gz bash scripts/gpu_study.sh
# with the previous call's archive (it holds every earlier call's state; the device tool: carry the
# archive's folder); it unpacks the archive (mtimes kept) before Snakemake starts, so every
# finished job of the earlier calls is skipped. Every call prints (and keeps in logs/gpu-seconds.tsv,
# which the archive carries on) each GPU job's device-held seconds, also of a job the guard stopped. Rebuilt on the new
# machine: nothing of the workflow's outputs (the kernels rule's w12 library is in results/); only
# Triton's JIT cache (TRITON_CACHE_DIR, not carried) recompiles the kernels each job loads.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
WHEELS=${WHEELS:-.whl}
CONFIG=${CONFIG:-config/gpu.yaml}
LIMIT=${GPU_STUDY_LIMIT:-505}
SITE=${SITE:-/tmp/specpilot-site}
OUTDIR=${OUT:-results/gpu-study}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}

say() { echo "gpu_study: $*"; }

# ---- offline install (no index; the image's packages stay as they are) ----
if "$PY" -c "import snakemake" 2>/dev/null && [ -z "${FORCE_INSTALL:-}" ]; then
    say "snakemake already importable: nothing installed"
else
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { say "no wheels in $WHEELS (write them with: python -m specpilot wheels --out $WHEELS ...)"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl || { say "offline install from $WHEELS failed"; exit 2; }
    export PATH="$SITE/bin:$PATH"
    say "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE in $((SECONDS - T0)) s"
fi
export PYTHONPATH="$PWD/src${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -z "${SPECPILOT_DATA_DIR:-}" ] && [ -f "$WHEELS/data/MANIFEST.json" ]; then
    export SPECPILOT_DATA_DIR="$PWD/$WHEELS/data"
fi
# one Triton cache for every job: a kernel compiled by one job is loaded by the next
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/specpilot-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"

# the device's name and the versions in one interpreter (each start imports torch: seconds of the budget)
DETECTED=$("$PY" -c 'import sys, torch, snakemake; from specpilot.device import detect_gpu
print("torch", torch.__version__, "snakemake", snakemake.__version__, file=sys.stderr); print(detect_gpu())')
GPU=${GPU:-$DETECTED}
[ -n "$GPU" ] || { say "could not detect the device"; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
say "device $GPU, config $CONFIG ${EXTRA_CONFIGS:-}, data ${SPECPILOT_DATA_DIR:-(config data_dir / shared/)}"

# ---- resume: the archive of an earlier call (its finished jobs are not rerun) ----
if [ -n "${RESUME:-}" ]; then
    [ -f "$RESUME" ] || { say "RESUME=$RESUME: no such archive"; exit 2; }
    tar xzf "$RESUME" || { say "RESUME=$RESUME: could not unpack"; exit 2; }
    say "resumed from $RESUME: $(find results -type f | wc -l) result files, $(ls .snakemake/metadata 2>/dev/null | wc -l) job records"
fi

# ---- the workflow, stopped at LIMIT seconds (then what finished is reported) ----
CORES=$(nproc)
THREADS=$(( CORES > 2 ? CORES / 2 : 1 ))  # a GPU job's threads: half the cores, the rest for the CPU jobs beside it
# a lock left by an interrupted run (a fresh box has none: no second parse of the workflow then)
if [ -n "$(ls -A .snakemake/locks 2>/dev/null)" ]; then
    "$PY" -m snakemake --unlock --configfile $CONFIG ${EXTRA_CONFIGS:-} --config gpu=$GPU >/dev/null 2>&1
fi
S0=$SECONDS
timeout -s INT -k 30 "$LIMIT" "$PY" -m snakemake --cores all --max-threads $THREADS --keep-going --rerun-incomplete \
    --configfile $CONFIG ${EXTRA_CONFIGS:-} --config gpu=$GPU -- "results/$GPU/table.csv" > "$OUTDIR/snakemake.log" 2>&1
RC=$?
WALL=$((SECONDS - S0))
grep -E "^specpilot:|Error in rule|Exiting because" "$OUTDIR/snakemake.log" | tail -20
grep -E "[0-9]+ of [0-9]+ steps" "$OUTDIR/snakemake.log" | tail -1
[ $RC -eq 124 ] && say "Snakemake stopped by the time guard after ${LIMIT} s"
say "snakemake exit $RC, wall time ${WALL} s (script ${SECONDS} s so far)"

# ---- the table (or what finished), forcing verdicts, rounds ----
GPU=$GPU CONFIG_FILES="$CONFIG ${EXTRA_CONFIGS:-}" OUTDIR=$OUTDIR WALL=$WALL RC=$RC "$PY" scripts/gpu_study_report.py \
    | tee "$OUTDIR/summary.txt"
REPORT_RC=${PIPESTATUS[0]}

tar czf "$OUTDIR/results.tar.gz" --exclude='*.png' "results/$GPU" results/memory.jsonl results/prompts logs \
    .snakemake/log 2>/dev/null
# the state the next call resumes from (RESUME=...): under the 64 MB a carried path may hold
tar czf "$OUTDIR/resume.tar.gz" --exclude='*.png' --exclude='resources/deployments/tiny*' results resources/deployments logs .snakemake/metadata \
    .snakemake/incomplete 2>/dev/null
say "resume archive $OUTDIR/resume.tar.gz: $(( $(stat -c %s "$OUTDIR/resume.tar.gz") / 1024 )) KiB"
say "outputs in $OUTDIR: $(ls "$OUTDIR" | tr '\n' ' ')"
say "total ${SECONDS} s"
[ $RC -eq 0 ] && [ "$REPORT_RC" -eq 0 ] && exit 0
exit 1

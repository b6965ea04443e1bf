#!/usr/bin/env bash
# Issue 48 on one H100 / H200 in one call (<= 10 min): lossless 12-bit weights as the bf16 Triton
# kernel with a 12-bit loader, on the Qwen3-8B and Qwen3.8-27B hybrid shapes (random weights; bf16
# measured in the same run). Stages, most important first, each under its own time limit and all
# under a deadline (DEADLINE seconds from the start, default 570): a stage with too little time
# left is skipped and says so.
#   1. bench w12 --part roles: every role x shape x M in 1 4 16 64, bf16 loader vs 12-bit loader
#      bit for bit, device times, bytes and achieved bandwidth;
#   2. bench w12 --part step: the engine step (prefill 1024 tokens, verify of M), bf16 first, then
#      the model converted in place (every role, no bf16 copy): logits bit-equal, step over bf16,
#      weight bytes per step and bandwidth;
#   3. bench serving at c1 (replay drafter study_stock, block 16, lazy random checkpoints): AR, stock
#      and stock with weight_format w12, each token-forced against AR with the bf16 teacher pass
#      (27B hybrid first, then 8B);
#   4. TUNE=1 (a call of its own, e.g. TUNE=1 PARTS=none): the tuner's per role and M choice on each
#      shape, then the step with that choice.
# Order: roles and step of each shape (27B hybrid first), then serving of each shape; PARTS (default
# "roles step serving") and SHAPES select, e.g. a second call PARTS=serving SHAPES=qwen3-8b for what
# a first call skipped. Prints one "FIGURE ..." line per figure last; raw JSON under $OUT (default results/gpu_w12).
# CPU plumbing check: scripts/gpu_w12.sh --dry-run (tiny shapes, Triton's interpreter, minutes).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu_w12}; mkdir -p "$OUT"
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
DRY=""; SHAPES=${SHAPES:-"qwen3.8-27b qwen3-8b"}; MS=${MS:-"1 4 16 64"}; PARTS=${PARTS:-"roles step serving"}
REQ_C1=${REQUESTS_C1:-3}; NEW=${NEW:-192}
if [ "${1:-}" = "--dry-run" ]; then
    DRY="--dry-run"; SHAPES=${DRY_SHAPES:-"tiny"}; DEADLINE=${DEADLINE_DRY:-3000}
fi
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
stage() {  # stage NAME NEED_S LIMIT_S CMD...: run CMD (at most LIMIT_S, and not past the deadline) when NEED_S are left
    local name=$1 need=$2 limit=$3; shift 3
    local l; l=$(left)
    if [ "$l" -lt "$need" ]; then echo "SKIPPED $name: $l s left, needs $need" | tee -a "$OUT/skipped.txt"; return; fi
    [ "$l" -lt "$limit" ] && limit=$l
    echo "== $name ($l s left, limit $limit s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name" | tee -a "$OUT/rc.txt"; tail -4 "$OUT/$name.log"
}
python3 -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" | tee "$OUT/device.txt"

has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
for s in $SHAPES; do  # bit-identity and the step of every shape first (the bars), then end to end
    has roles && stage "roles_$s" 60 150 python3 -m specpilot bench w12 $DRY --part roles --shape "$s" --ms $MS \
        --out "$OUT/roles_$s.json"
    has step && stage "step_$s" 120 240 python3 -m specpilot bench w12 $DRY --part step --choice every --shape "$s" \
        --ms $MS --rounds 5 --out "$OUT/step_$s.json"
done
for s in $SHAPES; do
    has serving || continue
    if [ -n "$DRY" ]; then
        tgt="$OUT/ckpt_$s"
        python3 -m specpilot random-checkpoint --shape "$s" --out "$tgt" --drafter-out "$tgt-drafter" > /dev/null
        extra=(--dtype bf16)
    else
        tgt="/tmp/lz_$s"
        python3 -m specpilot random-checkpoint --shape "$s" --out "$tgt" --drafter-out "$tgt-drafter" --lazy > /dev/null
        extra=(--concurrency 1 --requests 8 --requests-c1 "$REQ_C1" --new "$NEW" --prompt-len 512)
    fi
    stage "serving_$s" 200 360 python3 -m specpilot bench serving $DRY --target "$tgt" --drafter "$tgt-drafter" "${extra[@]}" \
        --variant 'w12={"weight_format": "w12"}' --work "$OUT/work_$s" --out "$OUT/serving_$s.json"
done
if [ "${TUNE:-0}" = "1" ] && [ -z "$DRY" ]; then  # a call of its own: the tuner compiles ~100 configs per shape
    for s in $SHAPES; do
        stage "choice_$s" 300 420 python3 -m specpilot bench w12 --part choice step --choice tuned --shape "$s" --ms $MS \
            --out "$OUT/choice_$s.json"
    done
fi

python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None
print("FIGURE device " + open(os.path.join(out, "device.txt")).read().strip())
for p in sorted(glob.glob(os.path.join(out, "roles_*.json"))):
    r, s = load(p), os.path.basename(p)[6:-5]
    rows = (r or {}).get("roles", {}).get("rows", [])
    print(f"FIGURE {s} roles: {sum(d['bit_equal'] for d in rows)}/{len(rows)} (role x shape x M) bit-equal to bf16")
    for d in rows:
        if "speedup" in d:
            print(f"FIGURE {s} role {d['role']} {d['N']}x{d['K']} M={d['M']} ({d['config']}): bf16 {d['bf16_us']:.1f} us "
                  f"({d['bf16_bw_frac']:.2f} of copy bw), w12 {d['w12_us']:.1f} us ({d['w12_bw_frac']:.2f}; "
                  f"{d['bytes_w12'] / d['bytes_bf16']:.3f} of the bytes), {d['speedup']:.3f}x")
for p in sorted(glob.glob(os.path.join(out, "step_*.json"))):
    r, s = load(p), os.path.basename(p)[5:-5]
    st = (r or {}).get("step") or {}
    if not st.get("steps"):
        print(f"FIGURE {s} step: no result ({(r or {}).get('errors')})")
        continue
    print(f"FIGURE {s} step prefill logits bit-equal: {st['prefill_bit_equal']}; weight bytes per step "
          f"bf16 {st['weight_bytes_bf16'] / 1e9:.2f} GB, w12 {st['weight_bytes_w12'] / 1e9:.2f} GB")
    for d in st["steps"]:
        print(f"FIGURE {s} step M={d['M']}: bit-equal {d['bit_equal']}, bf16 {d['bf16_ms']:.3f} ms, w12 {d['w12_ms']:.3f} ms, "
              f"{d.get('speedup', float('nan')):.3f}x over bf16; weights {d.get('bf16_weight_tb_s', float('nan')):.2f} / "
              f"{d.get('w12_weight_tb_s', float('nan')):.2f} TB/s")
for p in sorted(glob.glob(os.path.join(out, "serving_*.json"))):
    r, s = load(p), os.path.basename(p)[8:-5]
    for c, cell in ((r or {}).get("cells") or {}).items():
        st, w = cell.get("stock") or {}, cell.get("w12") or {}
        for name, v in (("stock bf16", st), ("stock w12", w)):
            f = v.get("forcing") or {}
            print(f"FIGURE {s} e2e {c} {name}: {v.get('speedup_geomean') or float('nan'):.3f}x AR, tau "
                  f"{v.get('tau') or float('nan'):.2f}, = AR {v.get('equal_outputs')}/{v.get('n_requests')}, forcing "
                  f"{'pass' if f.get('passed') else 'FAIL'} ({f.get('violations')} violations, {f.get('near_ties')} near ties, "
                  f"{f.get('teacher_forced_path')} teacher), step {v.get('step_ms') or float('nan'):.2f} ms")
        if st.get("speedup_geomean") and w.get("speedup_geomean"):
            print(f"FIGURE {s} e2e {c} stock w12 / stock bf16: {w['speedup_geomean'] / st['speedup_geomean']:.3f}x "
                  f"(step {st['step_ms'] / w['step_ms']:.3f}x)")
for p in sorted(glob.glob(os.path.join(out, "choice_*.json"))):
    r, s = load(p), os.path.basename(p)[7:-5]
    ch = (r or {}).get("choice") or {}
    print(f"FIGURE {s} tuned choice: {ch.get('w12_choice')} (lean {ch.get('w12_choice_lean')})")
    for d in ((r or {}).get("step") or {}).get("steps", []):
        print(f"FIGURE {s} step with the tuned choice M={d['M']}: bit-equal {d['bit_equal']}, "
              f"{d.get('speedup', float('nan')):.3f}x over bf16 ({d['bf16_ms']:.3f} / {d['w12_ms']:.3f} ms)")
for p in (os.path.join(out, "skipped.txt"),):
    if os.path.exists(p):
        for ln in open(p):
            print("FIGURE " + ln.strip())
EOF
echo "total $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# Behaviour unchanged across a refactor (issue 33): run AR, stock and specpilot with two versions of
# the package on one deployment and the same prompt files, then compare every record's output_ids
# and committed_per_step (the timings differ; nothing else may).
#   scripts/compare_behaviour.sh OLD_SRC NEW_SRC DEPLOYMENT_DIR OUT_DIR [DRAFTER]
# OLD_SRC / NEW_SRC: the src/ folders of the two checkouts (e.g. a `git worktree` of the old commit).
set -euo pipefail
old=$1 new=$2 dep=$3 out=$4 drafter=${5:-dflash}
mkdir -p "$out"
for b in gsm8k humaneval math500 mbpp mt-bench; do
    [ -s "$out/$b.jsonl" ] || PYTHONPATH=$new python -m specpilot.cli prompts --tokenizer "$dep/target" \
        --benchmark "$b" --n-prompts 2 --out "$out/$b.jsonl" >/dev/null
done
cat "$out"/{gsm8k,humaneval,math500,mbpp,mt-bench}.jsonl > "$out/prompts.jsonl"
echo '{"tree_nodes": 12, "tree_profile": "tiny_dflash_ranks"}' > "$out/tree.json"
for v in old new; do
    src=$old; [ $v = new ] && src=$new
    for c in 1 3; do
        PYTHONPATH=$src python -m specpilot.cli run --engine ar,stock,specpilot --target "$dep/target" \
            --drafter "$dep/drafter-$drafter" --drafter-name "$drafter" --prompts "$out/prompts.jsonl" \
            --out "$out/$v-c$c-ar.jsonl,$out/$v-c$c-stock.jsonl,$out/$v-c$c-specpilot.jsonl" \
            --max-new-tokens 48 --concurrency $c --block-size auto --engine-config "$out/tree.json" \
            --threads 1 --timing-repeats 1 --deployment cmp >"$out/$v-c$c.log" 2>&1
    done
    for cmd in run force table round prompts build-tiny bench; do
        PYTHONPATH=$src python -m specpilot.cli $cmd --help 2>/dev/null | grep -oE '^ +--?[a-z][a-z0-9-]*' | sort -u > "$out/$v-help-$cmd.txt" || true
    done
done
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); bad = 0; n = 0
for f in sorted(out.glob("old-c*-*.jsonl")):
    g = out / f.name.replace("old-", "new-", 1)
    a = {r["request_id"]: r for r in map(json.loads, f.read_text().splitlines())}
    b = {r["request_id"]: r for r in map(json.loads, g.read_text().splitlines())}
    if a.keys() != b.keys():
        print(f"{f.name}: different requests"); bad += 1; continue
    for k in a:
        n += 1
        for field in ("output_ids", "committed_per_step", "verify_steps", "engine_config"):
            if a[k][field] != b[k][field]:
                print(f"{f.name} {k}: {field} differs"); bad += 1
for f in sorted(out.glob("old-help-*.txt")):
    g = out / f.name.replace("old-", "new-", 1)
    if f.read_text() != g.read_text():
        print(f"{f.name}: options differ: -{sorted(set(f.read_text().split()) - set(g.read_text().split()))} "
              f"+{sorted(set(g.read_text().split()) - set(f.read_text().split()))}"); bad += 1
print(f"{n} records compared, {bad} differences")
sys.exit(1 if bad else 0)
PY

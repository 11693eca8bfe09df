#!/usr/bin/env bash
# Same-run A/B of the persistent scorer: an older tree (e.g. `git archive 78b5ab1 | tar -x -C base`)
# against this one, on the 78 shapes at both precisions.
# Usage: bash bench/ab_run.sh BASE_TREE OUT_DIR NEW_BUILD_DIR [ROUNDS]
# Each round runs old, new, new, old (ABBA): compute-bound shapes draw the board to its power limit,
# and whichever binary runs first on a cooler GPU gains up to ~10 %, so a fixed order is biased.
# Writes OUT_DIR/ab_{old,new}_{exact,fp8}_<round><a|b>.json; bench/ab_compare.py summarises them.
# The base's CLI spells FP8 accumulation `--fast-accumulation` (before config.precision) and is
# exact by default; this tree's default is FP8 accumulation and `--precision exact` is exact.
set -u
base=$1 out=$2 new=$3 rounds=${4:-2}
mkdir -p "$out"
cmake -S "$base" -B /tmp/ab-old -DCMAKE_BUILD_TYPE=Release >/dev/null 2>&1 &&
    cmake --build /tmp/ab-old -j"$(nproc)" --target msaidx_cli >/dev/null 2>&1 ||
    { echo "ab: the base build failed"; exit 1; }
common=(bench --backend persistent --no-ceilings)
run_old() { # precision, file
    local flag=()
    [ "$1" = fp8 ] && flag=(--fast-accumulation)
    (cd "$base" && /tmp/ab-old/msaidx "${common[@]}" "${flag[@]}" --shapes bench/shapes/prefill78.tsv \
        --json "$2" >/dev/null 2>&1)
}
run_new() {
    local flag=()
    [ "$1" = exact ] && flag=(--precision exact)
    "$new/msaidx" "${common[@]}" "${flag[@]}" --json "$2" >/dev/null 2>&1
}
for round in $(seq "$rounds"); do
    for precision in exact fp8; do
        run_old $precision "$out/ab_old_${precision}_${round}a.json"
        run_new $precision "$out/ab_new_${precision}_${round}a.json"
        run_new $precision "$out/ab_new_${precision}_${round}b.json"
        run_old $precision "$out/ab_old_${precision}_${round}b.json"
    done
    echo "ab: round $round done"
done
